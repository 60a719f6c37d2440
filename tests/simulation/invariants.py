"""Invariants on the true global state of a simulated world (after the TLA+ spec's, by name).

Read straight from the nodes (the metadata twin's keys, the bookies' in-memory index and their
disks), never through a client, so checking perturbs nothing.

After every fault step (cheap):
- **NoDivergenceBetweenClientAndMetaData**: a ledger CLOSED in metadata has no entry acked to its
  writer above its last entry; a writer whose close succeeded closed it at its own LAC.
- **OnlyValidFragments**: fragments start at 0 and their first entries strictly increase; each
  ensemble has E distinct bookies; a closed ledger's fragments all start at or below last + 1. The
  metadata model refuses such a value before it is written, so the recoverers and writers also
  report any failure caused by metadata their own client proposed and the model refused
  (:func:`invalid_proposal`: BOOKKEEPER-2615's symptom, a recovery that keeps failing).

At the end, after the heal (every bookie up, every ledger closed):
- **LedgersClosed** (liveness): every ledger is CLOSED.
- **AllCommittedEntriesReachAckQuorum**: each entry up to a closed ledger's last entry is held
  durably (indexed after fdatasync) by at least Qa bookies of its write set.
- **NoDivergentReplicas** (our NoOutOfOrderEntries): every replica of an entry holds the same bytes.
- **ReadsAreStable**: every LAC a tailer saw while the writers wrote is at most the closed last
  entry, and every entry it read is the one the final readers read.
The writers check NoOutOfOrderEntries on the client side (acks complete in entry order), and the
history checker (tests/faults/history.py) checks AllAckedEntriesAreReadable and the rest.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from typing import TYPE_CHECKING

from bookie.journal_format import segment_name
from bookie.storage import EntryCorrupt, NoEntry, Storage
from bookkeeper_aio.client.quorum import schedule_of
from metadata import log_metadata
from metadata.errors import InvalidMetadata, MetadataFormatError
from metadata.keys import ClusterKeys
from metadata.ledger_metadata import LedgerMetadata, LedgerState
from metadata.log_metadata import LogMetadata
from tests.simulation.world import ROOT

if TYPE_CHECKING:
    from tests.simulation.scenario import Scenario

KEYS = ClusterKeys(ROOT)
_CLOSED = LedgerState.CLOSED  # once: an enum member is a slow lookup on Python 3.11


def metadata_of(scenario: Scenario, ledger_id: int) -> LedgerMetadata | None:
    key = KEYS.ledger(ledger_id)
    kv = scenario.world.store._data.get(key)
    if kv is None:
        return None
    md = scenario.world.store.ledger(key, kv.value)
    if md.ledger_id != ledger_id:  # as decode(..., ledger_id=) checks
        raise MetadataFormatError(key, f"ledger {ledger_id}: value names ledger {md.ledger_id}")
    return md


def log_metadata_of(scenario: Scenario) -> LogMetadata | None:
    from tests.simulation.scenario import LOG

    key = KEYS.log(LOG)
    kv = scenario.world.store._data.get(key)
    return None if kv is None else log_metadata.decode(kv.value, key=key, name=LOG)


def fragment_problems(md: LedgerMetadata) -> list[str]:
    where = f"OnlyValidFragments: ledger {md.ledger_id}"
    firsts = [first for first, _ in md.ensembles]
    problems = []
    if not firsts or firsts[0] != 0:
        problems.append(f"{where}: first fragment starts at {firsts[:1]}")
    if any(b <= a for a, b in itertools.pairwise(firsts)):
        problems.append(f"{where}: fragment first entries not increasing: {firsts}")
    for first, ensemble in md.ensembles:
        if len(ensemble) != md.ensemble_size or len(set(ensemble)) != len(ensemble):
            problems.append(f"{where}: fragment {first} has ensemble {list(ensemble)}")
    if md.state is _CLOSED and md.last_entry_id is not None and firsts[-1] > md.last_entry_id + 1:
        problems.append(f"{where}: closed at {md.last_entry_id} but a fragment starts at {firsts[-1]}")
    return problems


def invalid_proposal(error: BaseException, what: str) -> list[str]:
    """OnlyValidFragments at the source: ``error`` (a failed recovery or add) was caused by metadata
    the client itself proposed and the model refused (a fragment before the last one, a close
    below the last fragment: BOOKKEEPER-2615). The store never holds it, but the client built it."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, InvalidMetadata):
            return [f"OnlyValidFragments: {what} proposed invalid metadata: {cause}"]
        cause = cause.__cause__ or cause.__context__
    return []


def acked_maxima(scenario: Scenario) -> dict[int, int]:
    """Ledger id -> the highest entry id acked to its writer, for every ledger with an ack: the
    history keeps it as acks come (a pass over every add at each step grew with the run)."""
    return scenario.world.history.acked_max


def check_step(scenario: Scenario) -> list[str]:
    problems: list[str] = []
    maxima: dict[int, int] | None = None
    checked = scenario.fragments_checked
    for lid in scenario.ledgers:
        md = metadata_of(scenario, lid)
        if md is None:
            continue
        last = checked.get(lid)
        if last is None or last[0] is not md:  # the store hands back one object per stored value
            last = checked[lid] = (md, fragment_problems(md))
        problems += last[1]
        if md.state is _CLOSED:
            assert md.last_entry_id is not None
            if maxima is None:
                maxima = acked_maxima(scenario)
            acked = maxima.get(lid, -1)
            if acked > md.last_entry_id:
                problems.append(
                    f"NoDivergenceBetweenClientAndMetaData: ledger {lid} closed at {md.last_entry_id} "
                    f"but entry {acked} was acked"
                )
            closed_at = scenario.closed_by_writer.get(lid)
            if closed_at is not None and closed_at != md.last_entry_id:
                problems.append(
                    f"NoDivergenceBetweenClientAndMetaData: ledger {lid}'s writer closed it at {closed_at}, "
                    f"metadata says {md.last_entry_id}"
                )
    return problems


async def check_final(scenario: Scenario) -> list[str]:
    problems = check_step(scenario)
    with contextlib.ExitStack() as at_once:  # see read_at_once
        for bookie in scenario.world.bookies:
            if bookie.threads is not None:
                at_once.enter_context(bookie.threads.at_once())
        problems += replica_problems(scenario)
    return problems + stable_read_problems(scenario)


def replica_problems(scenario: Scenario) -> list[str]:
    """AllCommittedEntriesReachAckQuorum, NoDivergentReplicas and CorruptIsNeverAbsent over every
    replica of every entry of the closed ledgers, read with :func:`read_at_once`."""
    problems: list[str] = []
    servers = {b.name: b.server for b in scenario.world.bookies}
    held_rotten: set[tuple[int, int, str]] = set()
    for lid in sorted(scenario.ledgers):
        md = metadata_of(scenario, lid)
        if md is None:
            problems.append(f"ledger {lid} has no metadata")
            continue
        if md.state is not _CLOSED:
            problems.append(f"liveness: ledger {lid} is {md.state.name} after the heal")
            continue
        assert md.last_entry_id is not None
        schedule = schedule_of(md.ensemble_size, md.write_quorum, md.ack_quorum)
        for entry_id in range(md.last_entry_id + 1):
            ensemble = md.ensemble_for(entry_id)
            bodies: dict[str, bytes] = {}
            for position in schedule.write_set(entry_id):
                bookie = ensemble[position]
                server = servers.get(bookie)
                if server is None or server.storage is None:
                    continue
                state = server.storage.ledgers.get(lid)
                if state is None or state.index.get(entry_id) is None:
                    continue
                try:
                    body = read_at_once(server.storage, lid, entry_id)
                except EntryCorrupt:  # injected bit rot (the race profile): held, unreadable here
                    held_rotten.add((lid, entry_id, bookie))
                    continue
                except NoEntry:
                    problems.append(
                        f"CorruptIsNeverAbsent: {bookie} indexes ledger {lid} entry {entry_id} "
                        "but answers that it is absent"
                    )
                    continue
                bodies[bookie] = body
            rotten = sum(1 for b in ensemble if (lid, entry_id, b) in held_rotten)
            if len(bodies) + rotten < md.ack_quorum:
                problems.append(
                    f"AllCommittedEntriesReachAckQuorum: ledger {lid} entry {entry_id} is on "
                    f"{sorted(bodies)} only (Qa={md.ack_quorum}, write set "
                    f"{[ensemble[p] for p in schedule.write_set(entry_id)]})"
                )
            if len(set(bodies.values())) > 1:
                problems.append(
                    f"NoDivergentReplicas: ledger {lid} entry {entry_id} differs across {sorted(bodies)}"
                )
    return problems


def read_at_once(storage: Storage, lid: int, entry_id: int) -> bytes:
    """The bookie's own read of an entry (``Storage.read_entry``: its index, its record checks, its
    errors), run to its end now: within the bookie's :meth:`SimThreads.at_once` its call on the
    reader executor is done at once, so the coroutine never yields. Awaited on the loop, each of
    the final check's reads took three loop callbacks (a tenth of a seed's), all at the instant
    the check runs; the first 150 general, 80 race and 60 autorecovery seeds kept their traces."""
    coro = storage.read_entry(lid, entry_id)
    try:
        coro.send(None)
    except StopIteration as done:
        return bytes(done.value[1])
    coro.close()
    raise AssertionError(f"reading ledger {lid} entry {entry_id} waited for more than its read")


async def rot_problems(scenario: Scenario, rotten: dict[tuple[int, int], tuple[str, str, int]]) -> list[str]:
    """CorruptIsNeverAbsent: a bookie asked for an entry whose stored bytes read back damaged says
    EIO (EntryCorrupt), never "no such entry" and never the damaged bytes."""
    problems = []
    bookies = {b.name: b for b in scenario.world.bookies}
    for (lid, entry_id), (name, path, at) in sorted(rotten.items()):
        server = bookies[name].server
        if server is None or server.storage is None or at not in bookies[name].disk.rot.get(path, ()):
            continue
        state = server.storage.ledgers.get(lid)
        location = state.index.get(entry_id) if state is not None else None
        if (
            location is None
            or os.path.basename(path) != segment_name(location.segment_id)
            or not location.offset <= at < location.offset + location.length
        ):  # the entry lives elsewhere now (written back, compacted: maybe at the same offset of
            continue  # a later segment, and the rotten segment deleted since)
        try:
            await server.storage.read_entry(lid, entry_id)
        except EntryCorrupt:
            continue
        except NoEntry:
            problems.append(f"CorruptIsNeverAbsent: {name} says ledger {lid} entry {entry_id} is absent")
            continue
        problems.append(f"CorruptIsNeverAbsent: {name} served ledger {lid} entry {entry_id} damaged")
    return problems


def stable_read_problems(scenario: Scenario) -> list[str]:
    problems = []
    final = {lid: dict(reads[0]) for lid, reads in scenario.world.history.reads.items() if reads}
    for lid, lac, entries in scenario.tail_reads:
        md = metadata_of(scenario, lid)
        if md is None or md.last_entry_id is None:
            continue
        if lac > md.last_entry_id:
            problems.append(
                f"ReadsAreStable: ledger {lid}: a reader saw LAC {lac}, closed at {md.last_entry_id}"
            )
        for entry_id, payload in entries:
            if final.get(lid, {}).get(entry_id) != payload:
                problems.append(
                    f"ReadsAreStable: ledger {lid} entry {entry_id} read as {payload!r} before the close"
                )
                break
    return problems
