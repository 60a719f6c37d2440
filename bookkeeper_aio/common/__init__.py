"""The ground floor beside the wire codec: failpoints, logging set-up, backoff, the clock seam.

Nothing here imports anything of ours but :mod:`bookkeeper_aio.errors` and
:mod:`bookkeeper_aio.protocol` (the same floor), so the bookie, the metadata package and the client
all stand on it without loading each other (docs/internals.md, the layers).
"""
