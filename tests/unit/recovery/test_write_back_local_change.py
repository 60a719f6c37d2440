"""Recovery write-back with a local ensemble change (bookkeeper_aio/client/recovery_writeback.py)."""

from __future__ import annotations

from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import AddFlag
from tests.harness.fake_bookie import Reply
from tests.unit.recovery.conftest import PASSWORD, World


async def test_write_back_ensemble_change_replicates_done_entries_above_fragment_start(world: World) -> None:
    """E=3 Qw=2 Qa=2, one fragment (b0, b1, b2); write sets: e0 -> (b0, b1), e1 -> (b1, b2).

    1. The writer died with e0 on b0, b1 and e1 on b1, b2 (header LACs -1): recovery finds both and
       e2 absent (QC = 1), so it closes at 1.
    2. Write-back: b1 acks the recovery add of e1 (e1 is done: b1 and b2 acked) but never answers
       the one of e0 (lost; add timeout).
    3. b1 is replaced by bX in a local fragment starting at min(pending) = 0, persisted by the close.
       Only e0 is re-sent to bX. e1 now lives in that fragment too, with write set (bX, b2), but bX
       never received it.

    Consequence (before the fix): after recovery, e1 (part of the closed ledger) is on 1 bookie of
    its write set while Qa = 2: one more disk loss (b2) and a readable, recovered entry is gone.
    Now e1 stays held while e0 is unfinished, is reopened by the change and written to bX too.
    """
    v = await world.ledger([(0, [0, 1, 2])], 2, 2, {0: [0], 1: [0, 1], 2: [1]}, in_flight_from=0)
    b1 = world.cluster.bookies[1]

    def script(req: m.Request) -> Reply | None:
        if isinstance(req, m.AddEntryRequest) and req.flags & AddFlag.RECOVERY_ADD and req.entry_id == 0:
            return Reply.drop()
        return None

    b1.script = script
    rh = await world.client().open_ledger(v.ledger_id, password=PASSWORD, recovery=True)
    assert rh.last_add_confirmed == 1
    md = rh.metadata
    assert b1.id not in md.ensemble_for(1)  # b1 was replaced for the entries of the new fragment
    for entry_id in range(md.last_entry_id + 1):
        ensemble = md.ensemble_for(entry_id)
        write_set = [ensemble[(entry_id + i) % md.ensemble_size] for i in range(md.write_quorum)]
        holders = [b for b in write_set if world.cluster.by_id(b).entry(v.ledger_id, entry_id) is not None]
        assert len(holders) >= md.ack_quorum, (entry_id, write_set, holders)
