"""Real bookie processes + real etcd (the client fixtures), and the check every autorecovery test
ends with: every entry read back from every replica that metadata lists, and compared."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from bookkeeper_aio import BookKeeper
from bookkeeper_aio.client.keys import codec_for
from bookkeeper_aio.client.quorum import DistributionSchedule
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import StatusCode
from metadata.ledger_metadata import LedgerState
from tests.integration.client.conftest import CONFIG, Cluster, bk, cluster

__all__ = ["CONFIG", "Cluster", "bk", "cluster", "verify_every_replica"]


async def verify_every_replica(
    bk: BookKeeper, ledger_id: int, password: bytes, expected: Sequence[bytes], *, absent: Sequence[str] = ()
) -> int:
    """Read every entry of the (closed) ledger from every bookie of its write set as metadata lists
    it and compare it with ``expected``; no fragment may list a bookie of ``absent``. Returns the
    number of replica reads."""
    md = (await bk.context.ledgers.read(ledger_id)).metadata
    assert md.state is LedgerState.CLOSED, md
    assert md.last_entry_id == len(expected) - 1, (md.last_entry_id, len(expected))
    for _, ensemble in md.ensembles:
        assert not set(absent) & set(ensemble), (ledger_id, md.ensembles)
    codec = codec_for(md, password)
    schedule = DistributionSchedule(md.ensemble_size, md.write_quorum, md.ack_quorum)
    reads = 0
    for entry_id, payload in enumerate(expected):
        ensemble = md.ensemble_for(entry_id)
        for position in schedule.write_set(entry_id):
            bookie_id = ensemble[position]
            response = await bk.context.pool.request(
                bookie_id, _read(ledger_id, entry_id, codec.master_key), 5.0
            )
            assert response.status == StatusCode.EOK, (ledger_id, entry_id, bookie_id, response)
            body = getattr(response, "body", None)
            assert body is not None, (ledger_id, entry_id, bookie_id)
            entry = codec.decode(body, ledger_id, entry_id)
            assert entry.payload == payload, (ledger_id, entry_id, bookie_id)
            reads += 1
    return reads


def _read(ledger_id: int, entry_id: int, key: bytes) -> Callable[[int], m.Request]:
    return lambda rid: m.ReadEntryRequest(rid, ledger_id, entry_id, 0, key)
