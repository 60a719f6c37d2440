"""Recovery benchmark: real bookie processes (fsync on), a writer that dies with ~1,000 entries in
flight, and the time a second client needs to fence, recover, replicate and close the ledger.

Shape (issue 5): 3 bookies, E3/Qw3/Qa2 (the default also used by the acceptance tests), 1 KiB
entries. Per run: the writer appends ``--acked`` entries and waits for them, then hands
``--in-flight`` more to the bookies and is aborted right after the frames left (the bookies see
exactly what a kill -9 of the writer process leaves behind: entries past the LAC that carry the old
LAC). After the bookies settled, a second client (connections already open, as a taking-over
leader's would be) times ``open_ledger(recovery=True)``. Prints one JSON line per run and a summary
(median over ``--reps``).

    python -m benchmarks.recovery --reps 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any

from benchmarks import _cluster
from bookkeeper_aio import BookKeeper, ClientConfig
from bookkeeper_aio.client.bookie_client import StaticResolver
from bookkeeper_aio.client.context import StaticDirectory
from bookkeeper_aio.client.recovery import recover_ledger
from bookkeeper_aio.protocol.digest import EntryCodec, master_key
from metadata.ledger_manager import LedgerManager
from metadata.ledger_metadata import LedgerState
from tests.harness.bookie_proc import BookieProcess


def _client(procs: list[BookieProcess], ledgers: LedgerManager, window: int) -> BookKeeper:
    return BookKeeper(
        ledgers,
        StaticDirectory([p.bookie_id for p in procs]),
        config=ClientConfig(add_window_max=window),
        resolver=StaticResolver({p.bookie_id: p.address for p in procs}),
    )


async def one_run(
    procs: list[BookieProcess], args: argparse.Namespace, ledgers: LedgerManager
) -> dict[str, Any]:
    writer = _client(procs, ledgers, args.acked + args.in_flight + 10)
    recoverer = _client(procs, ledgers, 1000)
    try:
        lh = await writer.create_ledger(args.ensemble, args.qw, args.qa, password=b"bench")
        payload = os.urandom(args.size)
        acked = [await lh.append_async(payload) for _ in range(args.acked)]
        await asyncio.gather(*acked)
        for _ in range(args.in_flight):
            await lh.append_async(payload)
        await asyncio.sleep(0)  # the frames are written in this tick...
        await asyncio.sleep(0)
        lac_at_death = lh.last_add_confirmed
        lh.abort()  # ...and the writer is gone
        await asyncio.sleep(args.settle_s)
        # warm the recoverer's connections (a taking-over leader talks to these bookies already)
        warm = await recoverer.create_ledger(args.ensemble, args.qw, args.qa, password=b"w")
        await warm.append(b"w")
        await warm.close()
        started = time.perf_counter()
        if args.window:  # the engine directly, with another window (1 = BookKeeper's one at a time)
            codec = EntryCodec(lh.metadata.digest_type, b"bench")
            await recover_ledger(recoverer.context, lh.id, codec, master_key(b"bench"), window=args.window)
        rh = await recoverer.open_ledger(lh.id, password=b"bench", recovery=True)
        elapsed_s = time.perf_counter() - started
        assert rh.metadata.state is LedgerState.CLOSED
        assert rh.last_add_confirmed >= lac_at_death
        return {
            "recovery_s": round(elapsed_s, 4),
            "lac_at_death": lac_at_death,
            "last_entry": rh.last_add_confirmed,
            "recovered_entries": rh.last_add_confirmed - lac_at_death,
        }
    finally:
        writer.abort()
        await recoverer.close()


def main() -> None:
    parser = _cluster.parser(__doc__)
    parser.add_argument("--acked", type=int, default=2000)
    parser.add_argument("--in-flight", type=int, default=1000)
    parser.add_argument("--settle-s", type=float, default=0.5)
    parser.add_argument("--window", type=int, default=0, help="recovery window (0: the default)")
    args = parser.parse_args()
    runs = _cluster.run_reps("recovery", args, one_run)
    times = [r["recovery_s"] for r in runs]
    summary = {
        "bench": "recovery",
        "shape": f"{_cluster.shape(args)}, {args.in_flight} in flight",
        "window": args.window or "default",
        "reps": len(runs),
        "recovery_s_median": round(statistics.median(times), 4),
        "recovery_s_min": min(times),
        "recovery_s_max": max(times),
        "recovered_entries_median": statistics.median(r["recovered_entries"] for r in runs),
        "loadavg": os.getloadavg(),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
