"""Power: each planted bug (a ``bug.*`` switch in the production code, off unless a test sets it,
bookkeeper_aio/common/failpoints.py) is found within a few seeds.

The same seeds run clean with the real code (test_seeds.py sweeps them), so what finds the planted
bug is the bug, not noise. The seeds are tried in order; the first that reports a problem ends the
search, and it must report the kind of problem the bug causes. Where each is found today (the
scenario decides, so a change to it moves these; the bound is what must hold):

- ``bug.ack_before_fdatasync`` (a bookie acks before its fdatasync): general seed 0, a power cut
  loses acked entries (AllCommittedEntriesReachAckQuorum; a process kill keeps them in the page cache).
- ``bug.recovery_read_without_fence`` (#2614): race seed 3 (3, 26, 54 and 83 of the first 150
  find it; 83 alone did when first measured: a slow test, 150 seeds at most). A member's fence is lost (its
  connection resets), the writer's add to it is stalled, and the recovery read of that entry is
  answered "no such entry" by the unfenced member before the replica that has it answers: the
  recovery closes below the entry, then the stalled add lands and completes. An acked entry is lost
  (NoDivergenceBetweenClientAndMetaData, the history's "LOST").
- ``bug.recovery_from_fenced_lac`` (#2615): general seed 2, race seed 21. Recovery starts at the
  fenced LAC below the last fragment's first entry, reads earlier entries from the last fragment's
  bookies, and proposes either a close below that fragment or a fragment before it: invalid
  metadata (OnlyValidFragments), refused by the model, so the recovery fails every time it runs
  into it (BookKeeper's symptom: a ledger that cannot be recovered).
- ``bug.copy_trusts_short_batch`` (rereplication copies a fragment from a survivor that lacks some
  of its entries, and skips what the survivor's batch read did not return): autorecovery seed 65
  (about one seed in 25 heals a fragment from a survivor that lacks an entry).
  The replacement is published without those entries (RereplicatedCopiesComplete), and with the
  lost bookie gone they are below their ack quorum (AllCommittedEntriesReachAckQuorum).
"""

from __future__ import annotations

from typing import Any

import pytest

from bookie.journal import Journal
from bookie.storage import EntryCorrupt, NoEntry, Storage
from bookkeeper_aio.common import failpoints
from tests.simulation.autorecovery import AutorecoveryScenario
from tests.simulation.race import RaceScenario
from tests.simulation.scenario import Scenario, run_seed

PLANTED = [
    pytest.param(
        failpoints.BUG_ACK_BEFORE_SYNC,
        Scenario,
        20,
        ("AllCommittedEntriesReachAckQuorum",),
        id="ack-before-fdatasync",
    ),
    pytest.param(  # race seed 3 today, but up to 150 seeds (a minute of CPU) as seeds move: make test-slow
        failpoints.BUG_RECOVERY_READ_WITHOUT_FENCE,
        RaceScenario,
        150,
        ("NoDivergenceBetweenClientAndMetaData", "LOST"),
        id="2614-recovery-read-without-fence",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        failpoints.BUG_RECOVERY_FROM_FENCED_LAC,
        Scenario,
        20,
        ("OnlyValidFragments",),
        id="2615-recovery-from-fenced-lac",
    ),
    pytest.param(
        failpoints.BUG_RECOVERY_FROM_FENCED_LAC,
        RaceScenario,
        40,
        ("OnlyValidFragments",),
        id="2615-recovery-from-fenced-lac-race",
    ),
    pytest.param(
        failpoints.BUG_COPY_TRUSTS_SHORT_BATCH,
        AutorecoveryScenario,
        100,
        ("RereplicatedCopiesComplete",),
        id="rereplication-copy-trusts-short-batch",
    ),
]


@pytest.mark.parametrize(("bug", "profile", "seeds_max", "expected"), PLANTED)
def test_a_planted_bug_is_found_within_a_few_seeds(
    bug: str, profile: type[Scenario], seeds_max: int, expected: tuple[str, ...], replaying: bool
) -> None:
    if replaying:
        pytest.skip("replaying one seed")
    for seed in range(seeds_max):
        outcome = run_seed(seed, (bug,), profile)
        if outcome.problems:
            break
    else:
        pytest.fail(f"{bug} was not found in {seeds_max} seeds")
    for kind in expected:
        assert any(kind in problem for problem in outcome.problems), (seed, outcome.problems)


def test_a_journal_that_acknowledges_a_failed_write_is_found(
    monkeypatch: pytest.MonkeyPatch, replaying: bool
) -> None:
    """The race profile's disk faults (a journal write or fdatasync fails with EIO or ENOSPC) have
    power too: a journal that acknowledged the records of a group whose write or sync failed (a
    mutant of Journal._on_group_done, patched here) is found at race seed 0: the bookies restart
    from their power-cut disks onto a journal with a hole before later synced groups."""
    if replaying:
        pytest.skip("replaying one seed")
    original = Journal._on_group_done

    def acknowledged_anyway(self: Journal, group: Any, error: BaseException | None) -> None:
        original(self, group, None)

    monkeypatch.setattr(Journal, "_on_group_done", acknowledged_anyway)
    for seed in range(20):
        outcome = run_seed(seed, (), RaceScenario)
        if outcome.problems:
            break
    else:
        pytest.fail("an acknowledged failed journal write was not found in 20 race seeds")
    assert any("restart" in p or "AllCommittedEntriesReachAckQuorum" in p for p in outcome.problems), (
        seed,
        outcome.problems,
    )


def test_a_bookie_answering_no_entry_for_a_corrupt_record_is_found(
    monkeypatch: pytest.MonkeyPatch, replaying: bool
) -> None:
    """Bit rot in the race profile has power: a bookie that answers "no such entry" for a record
    failing its checksum (make mutants' corrupt-record-as-no-entry, patched here) is found at race
    seed 1 (CorruptIsNeverAbsent; a recovery may then count the damaged replica as absent)."""
    if replaying:
        pytest.skip("replaying one seed")
    original = Storage._read_run

    async def corrupt_as_absent(self: Storage, ledger_id: int, *args: Any) -> Any:
        try:
            return await original(self, ledger_id, *args)
        except EntryCorrupt as error:
            raise NoEntry(str(error)) from error

    monkeypatch.setattr(Storage, "_read_run", corrupt_as_absent)
    for seed in range(20):
        outcome = run_seed(seed, (), RaceScenario)
        if outcome.problems:
            break
    else:
        pytest.fail("a bookie answering 'no such entry' for a corrupt record was not found in 20 race seeds")
    assert any("CorruptIsNeverAbsent" in p for p in outcome.problems), (seed, outcome.problems)
