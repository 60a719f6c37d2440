"""Limbo ledgers (bookie/limbo.py): the marker is durable before the cut, survives restarts, makes
reads of what the bookie lacks "unknown", and the resolver settles it against metadata."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

import metadata
from bookie import gc as bookie_gc
from bookie import journal_format as fmt
from bookie import limbo, replay
from bookie.fileio import FileIO
from bookie.ledger_keys import KeyInfo, KeyVerifier, NotOpen
from bookie.limbo import Limbo, LimboResolver
from bookie.storage import NoEntry, NoLedger, Storage, Unknown
from bookkeeper_aio.client.quorum import DistributionSchedule
from bookkeeper_aio.protocol.digest import key_check
from metadata.ledger_metadata import LedgerMetadata
from metadata.underreplication import UnderReplicationManager

from .test_gc import CLUSTER, memory_catalog
from .test_storage import KEY, _journal_file, add, config

BOOKIE = "bookie-1"


async def _journal_with_torn_tail(path: Path, entries: int = 10) -> int:
    """A journal of ledger 1's ``entries`` entries whose last record is torn (its last byte gone);
    returns the offset the cut starts at."""
    storage = await Storage.open(config(path))
    for i in range(entries):
        await add(storage, 1, i)
    location = storage.ledger(1).index.get(entries - 1)
    assert location is not None
    storage.abort()
    os.truncate(_journal_file(path), location.offset + location.length - 1)
    return location.offset


async def _starts_with_every_ledger_in_limbo(path: Path) -> None:
    storage = await Storage.open(config(path))
    try:
        assert storage.limbo is not None
        assert storage.limbo.every_ledger
    finally:
        storage.abort()


# ---------------------------------------------------------------------------------- the marker
def test_marker_round_trip_and_damage() -> None:
    for every, ids in ((True, ()), (False, (3, 1, 2**63 - 1)), (False, ())):
        decoded = limbo.decode(limbo.encode(every, ids))
        assert decoded.every_ledger is every
        assert decoded.ledgers == set(ids)
    data = bytearray(limbo.encode(False, (5, 6)))
    data[12] ^= 1
    with pytest.raises(limbo.MarkerCorrupt):
        limbo.decode(bytes(data))
    with pytest.raises(limbo.MarkerCorrupt):
        limbo.decode(b"short")


def test_a_damaged_marker_is_read_as_every_ledger(tmp_path: Path) -> None:
    (tmp_path / limbo.MARKER_FILE).write_bytes(b"garbage that is not a marker at all")
    loaded = limbo.load_blocking(FileIO(), str(tmp_path))
    assert loaded is not None
    assert loaded.every_ledger


class _CrashAtCut(FileIO):
    """The disk of a bookie that loses power as replay zeroes the torn tail."""

    class Crash(Exception):
        pass

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> None:
        raise self.Crash


async def test_the_marker_is_durable_before_the_cut(tmp_path: Path) -> None:
    await _journal_with_torn_tail(tmp_path)
    journal_before = _journal_file(tmp_path).read_bytes()
    with pytest.raises(_CrashAtCut.Crash):
        replay.recover(_CrashAtCut(), str(tmp_path))
    assert _journal_file(tmp_path).read_bytes() == journal_before, "the crash came before the cut"
    loaded = limbo.load_blocking(FileIO(), str(tmp_path))
    assert loaded is not None, "no marker before the cut"
    assert loaded.every_ledger
    # the next start cuts, under the marker that is already there
    await _starts_with_every_ledger_in_limbo(tmp_path)


# ------------------------------------------------------------------------- the synced mark
class _Rebooted(FileIO):
    """The same disk after a reboot or a power cut: another boot id."""

    def boot_id(self) -> bytes:
        return b"another boot"


class _MarkUnwritable(FileIO):
    """A disk that refuses the synced mark's writes (ENOSPC), and only those."""

    def __init__(self) -> None:
        self.mark_fds: set[int] = set()

    def open_append(self, path: str) -> int:
        fd = super().open_append(path)
        if path.endswith(fmt.SYNCED_MARK_FILE):
            self.mark_fds.add(fd)
        return fd

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> None:
        if fd in self.mark_fds:
            raise OSError(errno.ENOSPC, "no space left (test)")
        super().pwrite(fd, data, offset)


def _mark_file(path: Path) -> Path:
    return path / fmt.SYNCED_MARK_FILE


def test_synced_mark_round_trip_and_damage() -> None:
    boot = fmt.boot_digest(b"a boot")
    data = fmt.encode_synced_mark(boot, fmt.Position(3, 4096))
    assert fmt.decode_synced_mark(data) == fmt.SyncedMark(boot, fmt.Position(3, 4096))
    for at in range(len(data)):  # any damaged byte, or a torn mark, proves nothing
        damaged = bytearray(data)
        damaged[at] ^= 0x04
        assert fmt.decode_synced_mark(bytes(damaged)) is None, at
    assert fmt.decode_synced_mark(data[:-1]) is None


async def _journal_torn_in_flight(path: Path, entries: int = 10) -> None:
    """A journal whose final group (entry ``entries - 1``, alone) was torn while in flight: its
    fdatasync never returned, so the synced mark still says where the group before it ended."""
    storage = await Storage.open(config(path))
    for i in range(entries - 1):
        await add(storage, 1, i)
    before_last = _mark_file(path).read_bytes()
    await add(storage, 1, entries - 1)
    location = storage.ledger(1).index.get(entries - 1)
    assert location is not None
    storage.abort()
    mark = fmt.decode_synced_mark(_mark_file(path).read_bytes())
    assert mark is not None
    assert mark.position == fmt.Position(1, location.offset + location.length)
    _mark_file(path).write_bytes(before_last)  # the mark of the group before: the last one never synced
    os.truncate(_journal_file(path), location.offset + location.length - 1)


async def test_a_write_torn_in_flight_by_a_process_crash_is_cut_without_limbo(tmp_path: Path) -> None:
    await _journal_torn_in_flight(tmp_path)
    storage = await Storage.open(config(tmp_path))
    try:
        assert storage.limbo is None, "the cut bytes were never synced, so never acknowledged"
        assert (await storage.read_entry(1, 8))[0] == 8
        with pytest.raises(NoEntry):
            await storage.read_entry(1, 9)  # the torn one: never acknowledged, so absent
        await add(storage, 1, 9)  # the journal goes on over the cut
    finally:
        storage.abort()
    assert not (tmp_path / limbo.MARKER_FILE).exists()


async def test_the_same_tear_after_a_reboot_goes_into_limbo(tmp_path: Path) -> None:
    """After a power cut the mark may be older than what was synced: it proves nothing."""
    await _journal_torn_in_flight(tmp_path)
    storage = await Storage.open(config(tmp_path), fileio=_Rebooted())
    try:
        assert storage.limbo is not None
        assert storage.limbo.every_ledger
        with pytest.raises(Unknown):
            await storage.read_entry(1, 9)
    finally:
        storage.abort()


@pytest.mark.parametrize("mark", ["missing", "damaged"])
async def test_the_same_tear_without_a_whole_mark_goes_into_limbo(tmp_path: Path, mark: str) -> None:
    await _journal_torn_in_flight(tmp_path)
    if mark == "missing":
        _mark_file(tmp_path).unlink()
    else:
        data = bytearray(_mark_file(tmp_path).read_bytes())
        data[-1] ^= 1
        _mark_file(tmp_path).write_bytes(bytes(data))
    await _starts_with_every_ledger_in_limbo(tmp_path)


async def test_a_start_moves_the_mark_past_the_groups_it_replayed(tmp_path: Path) -> None:
    """A process crash left the final group whole but unsynced (its fdatasync failed, or never
    ran): the mark still ends before it. The restart replays it, makes it durable, and may serve it
    (a recovery may take it), so the mark moves to the replay's end: damage found exactly at the old
    mark later is rot of served bytes, into limbo, not a tear in flight."""
    storage = await Storage.open(config(tmp_path))
    for i in range(5):
        await add(storage, 1, i)
    before_last = _mark_file(tmp_path).read_bytes()
    await add(storage, 1, 5)
    location = storage.ledger(1).index.get(5)
    assert location is not None
    storage.abort()
    end = fmt.Position(1, location.offset + location.length)
    _mark_file(tmp_path).write_bytes(before_last)  # the last group's fdatasync never returned
    storage = await Storage.open(config(tmp_path))
    try:
        assert storage.ledger(1).index.get(5) is not None  # replayed: served from now on
    finally:
        storage.abort()
    mark = fmt.decode_synced_mark(_mark_file(tmp_path).read_bytes())
    assert mark is not None
    assert mark.position == end, "the mark stayed before bytes the start served"
    # the start's checkpoint, if it came before the kill, is lost (it failed: say ENOSPC)
    (tmp_path / replay.INDEX_DIR / replay.CHECKPOINT_FILE).unlink(missing_ok=True)
    os.truncate(_journal_file(tmp_path), location.offset + location.length - 1)  # rot in them
    await _starts_with_every_ledger_in_limbo(tmp_path)  # not a tear in flight


class _NoBootId(FileIO):
    """A start that cannot read the boot id (``/proc`` hidden, out of file descriptors)."""

    def boot_id(self) -> None:
        return None


async def test_a_mark_behind_the_cut_proves_nothing(tmp_path: Path) -> None:
    """The one group in flight starts where the mark says the synced bytes end: a tear anywhere
    later (a mark left behind by a start that kept none, a mark's page lost to a failed writeback)
    lies in synced bytes."""
    storage = await Storage.open(config(tmp_path))
    for i in range(5):
        await add(storage, 1, i)
    storage.abort()
    old_mark = _mark_file(tmp_path).read_bytes()
    storage = await Storage.open(config(tmp_path), fileio=_NoBootId())
    try:
        assert not _mark_file(tmp_path).exists(), "a start that keeps no mark left the old one"
        for i in range(5, 10):
            await add(storage, 1, i)  # acknowledged
        location = storage.ledger(1).index.get(9)
        assert location is not None
    finally:
        storage.abort()
    _mark_file(tmp_path).write_bytes(old_mark)  # as if it had stayed: same boot, behind the cut
    os.truncate(_journal_file(tmp_path), location.offset + location.length - 1)  # rot in acked bytes
    storage = await Storage.open(config(tmp_path))
    try:
        assert storage.limbo is not None, "a stale mark passed acknowledged bytes off as never synced"
        with pytest.raises(Unknown):
            await storage.read_entry(1, 9)
    finally:
        storage.abort()


async def test_a_mark_that_cannot_be_written_is_removed_and_the_journal_goes_on(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    await add(storage, 1, 0)
    storage.abort()
    assert _mark_file(tmp_path).exists()
    storage = await Storage.open(config(tmp_path), fileio=_MarkUnwritable())
    try:
        await add(storage, 1, 1)  # acknowledged: the group is synced; only its mark failed
        await add(storage, 1, 2)
        assert not _mark_file(tmp_path).exists(), "a stale mark would pass synced bytes off as unsynced"
    finally:
        storage.abort()
    storage = await Storage.open(config(tmp_path))
    try:
        entry = storage.ledger(1).index.get(2)
        assert entry is not None
    finally:
        storage.abort()
    os.truncate(_journal_file(tmp_path), entry.offset + entry.length - 1)
    storage = await Storage.open(config(tmp_path))  # no mark: a cut of the final group is doubted
    try:
        assert storage.limbo is not None
    finally:
        storage.abort()


async def test_a_clean_restart_makes_no_marker(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    await add(storage, 1, 0)
    storage.abort()
    storage = await Storage.open(config(tmp_path))
    try:
        assert storage.limbo is None
        with pytest.raises(NoEntry):
            await storage.read_entry(1, 1)
        with pytest.raises(NoLedger):
            await storage.read_entry(2, 0)
    finally:
        storage.abort()
    assert not (tmp_path / limbo.MARKER_FILE).exists()


async def test_limbo_answers_unknown_and_outlives_restarts(tmp_path: Path) -> None:
    await _journal_with_torn_tail(tmp_path)
    for _ in range(2):  # the cut, then a restart with nothing left to cut
        storage = await Storage.open(config(tmp_path))
        try:
            assert storage.limbo is not None
            assert (await storage.read_entry(1, 8))[0] == 8  # held: served
            with pytest.raises(Unknown):
                await storage.read_entry(1, 9)  # the torn one
            with pytest.raises(Unknown):
                await storage.read_entry(7, 0)  # a ledger the bookie holds nothing of
            with pytest.raises(Unknown):
                await storage.read_range(1, 9, 10, 1 << 20)
            with pytest.raises(Unknown):
                storage.ledger_for_read(7, b"k" * 32)
            assert storage.ledger(1).lac == 7  # a lower LAC is safe
        finally:
            storage.abort()


async def test_limbo_off_cuts_as_before(tmp_path: Path) -> None:
    await _journal_with_torn_tail(tmp_path)
    storage = await Storage.open(dataclasses.replace(config(tmp_path), limbo_after_cut=False))
    try:
        assert storage.limbo is None
        with pytest.raises(NoEntry):
            await storage.read_entry(1, 9)
    finally:
        storage.abort()


# ---------------------------------------------------------------------------------- what to hold
@pytest.mark.parametrize(("ensemble_size", "write_quorum"), [(1, 1), (3, 2), (3, 3), (5, 2), (4, 3)])
def test_holds_entry_is_the_clients_striping(ensemble_size: int, write_quorum: int) -> None:
    schedule = DistributionSchedule(ensemble_size, write_quorum, 1)
    for entry_id in range(3 * ensemble_size):
        for position in range(ensemble_size):
            expected = position in schedule.write_set(entry_id)
            assert limbo.holds_entry(position, entry_id, ensemble_size, write_quorum) is expected


def test_expected_entries_follow_fragments_to_the_last_entry() -> None:
    md = LedgerMetadata.new(1, ["a", BOOKIE, "c"], write_quorum=2, ack_quorum=2)
    md = md.with_ensemble_change(4, ["a", "d", "c"]).closed(6, 70)
    # fragment 0..3 on (a, bookie, c), Qw 2: position 1 holds entries e with e mod 3 in {0, 1}; the
    # fragment from 4 to the last entry (6) on (a, d, c): d at position 1 likewise
    assert list(limbo.expected_entries(md, BOOKIE)) == [0, 1, 3]
    assert list(limbo.expected_entries(md, "d")) == [4, 6]  # 4..6, the same stripes
    empty = LedgerMetadata.new(2, [BOOKIE], write_quorum=1, ack_quorum=1).closed(-1, 0)
    assert list(limbo.expected_entries(empty, BOOKIE)) == []


# ---------------------------------------------------------------------------------- resolution
class _Catalog:
    """Metadata as the resolver sees it: ledgers by id; marks recorded."""

    def __init__(self, ledgers: dict[int, LedgerMetadata]) -> None:
        self.ledgers = ledgers
        self.marked: list[tuple[int, str, str]] = []
        self.listings = 0

    async def ledgers_on(self, bookie_id: str) -> AsyncIterator[Sequence[int]]:
        self.listings += 1
        ids = sorted(i for i, md in self.ledgers.items() if any(bookie_id in e for _, e in md.ensembles))
        for start in range(0, len(ids), 2):
            yield ids[start : start + 2]

    async def ledgers_metadata(
        self, ledger_ids: Sequence[int]
    ) -> AsyncIterator[list[tuple[int, LedgerMetadata | None]]]:
        for start in range(0, len(ledger_ids), 2):
            yield [(i, self.ledgers.get(i)) for i in ledger_ids[start : start + 2]]

    async def mark_under_replicated(self, ledger_id: int, bookie_id: str, reason: str) -> None:
        self.marked.append((ledger_id, bookie_id, reason))


def _closed(ledger_id: int, ensemble: list[str], last: int) -> LedgerMetadata:
    return LedgerMetadata.new(ledger_id, ensemble, write_quorum=len(ensemble), ack_quorum=1).closed(last, 0)


async def test_resolver_narrows_then_settles_each_ledger(tmp_path: Path) -> None:
    await _journal_with_torn_tail(tmp_path)  # ledger 1: entries 0..8 held, 9 cut
    catalog = _Catalog(
        {
            1: _closed(1, [BOOKIE], 9),  # closed at 9: entry 9 is missing here
            2: LedgerMetadata.new(2, [BOOKIE, "b"], write_quorum=2, ack_quorum=2),  # open
            3: _closed(3, ["b"], 4),  # not on this bookie: never in limbo
            4: _closed(4, [BOOKIE], -1),  # closed empty: nothing to hold
        }
    )
    storage = await Storage.open(config(tmp_path))
    try:
        assert storage.limbo is not None
        resolver = LimboResolver(storage, catalog, BOOKIE)
        await resolver.run_once()
        assert storage.limbo is not None
        assert not storage.limbo.every_ledger
        assert storage.limbo.ledgers == {1, 2}  # 4 cleared at once, 3 never listed
        assert catalog.marked == [(1, BOOKIE, "limbo")]
        with pytest.raises(Unknown):
            await storage.read_entry(1, 9)
        with pytest.raises(NoLedger):
            await storage.read_entry(3, 0)  # narrowed: not on this bookie in metadata
        on_disk = limbo.load_blocking(FileIO(), str(tmp_path))
        assert on_disk is not None
        assert on_disk.ledgers == {1, 2}  # narrowed durably
        # the workers moved entry 9's copy elsewhere (the fragment no longer lists this bookie at 9)
        catalog.ledgers[1] = (
            LedgerMetadata.new(1, [BOOKIE], write_quorum=1, ack_quorum=1)
            .with_ensemble_change(9, ["b"])
            .closed(9, 0)
        )
        del catalog.ledgers[2]  # deleted
        await resolver.run_once()
        assert storage.limbo is None
        assert storage.ledger(1).fenced  # a closed ledger leaves limbo fenced here
        with pytest.raises(NoEntry):
            await storage.read_entry(1, 9)
        assert catalog.listings == 1
    finally:
        storage.abort()
    assert not (tmp_path / limbo.MARKER_FILE).exists()  # cleared durably
    storage = await Storage.open(config(tmp_path))
    try:
        assert storage.limbo is None
        assert storage.ledger(1).fenced
    finally:
        storage.abort()


async def test_a_held_ledger_no_longer_listed_here_is_fenced_before_it_leaves_limbo(tmp_path: Path) -> None:
    """A recovery fenced ledger 5 here, then closed it with this bookie replaced in its last
    fragment; the cut took the fence. Narrowing to metadata's listing alone would let a stale writer
    of 5 add here again: the held ledger stays in limbo until settling fences it."""
    storage = await Storage.open(config(tmp_path))
    for i in range(3):
        await add(storage, 5, i)
    storage.abort()
    await _journal_with_torn_tail(tmp_path)  # ledger 1: entries 0..8 held, 9 cut
    catalog = _Catalog({1: _closed(1, [BOOKIE], 8), 5: _closed(5, ["b"], 2)})
    storage = await Storage.open(config(tmp_path))
    try:
        assert not storage.ledger(5).fenced
        await LimboResolver(storage, catalog, BOOKIE).run_once()
        assert storage.ledger(5).fenced, "a held ledger left limbo without its fence"
        assert storage.limbo is None
    finally:
        storage.abort()


async def test_a_ledger_the_cut_took_whole_and_metadata_no_longer_lists_takes_no_stale_add(
    tmp_path: Path,
) -> None:
    """Every record of ledger 7 here was in the cut group (its fence too, say: a recovery fenced it
    here, then closed it with this bookie replaced). Narrowing lets 7 go (neither held nor listed),
    but a stale writer's add of a ledger the bookie holds no record of first reads its metadata
    (bookie/ledger_keys.py): closed -> EFENCED, and no record is made."""

    class Metadata:
        lookups = 0

        async def key_info(self, ledger_id: int) -> KeyInfo:
            self.lookups += 1
            return KeyInfo(exists=True, check=key_check(KEY), writable=ledger_id != 7)

    storage = await Storage.open(config(tmp_path))
    for i in range(5):
        await add(storage, 1, i)
    await add(storage, 7, 0)  # the final group: ledger 7's only record here
    location = storage.ledger(7).index.get(0)
    assert location is not None
    storage.abort()
    os.truncate(_journal_file(tmp_path), location.offset + location.length - 1)
    catalog = _Catalog({1: _closed(1, [BOOKIE], 4), 7: _closed(7, ["b"], 0)})
    md = Metadata()
    storage = await Storage.open(config(tmp_path))
    storage.keys = KeyVerifier(storage, md)
    try:
        assert 7 not in storage.ledgers
        await LimboResolver(storage, catalog, BOOKIE).run_once()
        assert storage.limbo is None  # 1 settled, 7 let go
        with pytest.raises(NotOpen):
            await add(storage, 7, 1)
        assert 7 not in storage.ledgers, "a stale writer's add made a record of a closed ledger"
        assert md.lookups == 1
    finally:
        storage.abort()


async def test_a_ledger_waiting_for_the_workers_is_not_walked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _journal_with_torn_tail(tmp_path)  # ledger 1: entries 0..8 held, 9 cut
    catalog = _Catalog({1: _closed(1, [BOOKIE], 9)})
    walks = []
    expected_entries = limbo.expected_entries

    def counted(md: LedgerMetadata, bookie_id: str) -> object:
        walks.append(md.ledger_id)
        return expected_entries(md, bookie_id)

    monkeypatch.setattr(limbo, "expected_entries", counted)
    storage = await Storage.open(config(tmp_path))
    try:
        resolver = LimboResolver(storage, catalog, BOOKIE)
        for _ in range(3):  # entry 9 missing each time: marked, not walked again
            await resolver.run_once()
        assert walks == [1]
        assert len(catalog.marked) == 3
        await add(storage, 1, 9, recovery=True)  # the entry is back: the index changed
        await resolver.run_once()
        assert walks == [1, 1]
        assert storage.limbo is None
    finally:
        storage.abort()


async def test_an_undecodable_ledger_anywhere_neither_stops_nor_clears_limbo(tmp_path: Path) -> None:
    """One ledger's metadata no longer decodes (a newer writer's format, a stray tool): the
    passes go on; that ledger stays in limbo (neither taken as deleted nor settled), the rest settle."""
    store = metadata.MemoryStore()
    await metadata.init_cluster(store, "/test", instance_id=CLUSTER)
    manager = metadata.LedgerManager(store, "/test")
    held = (await manager.create([BOOKIE], write_quorum=1, ack_quorum=1)).ledger_id
    garbled = (await manager.create([BOOKIE, "b"], write_quorum=2, ack_quorum=2)).ledger_id
    elsewhere = (await manager.create(["a", "b"], write_quorum=2, ack_quorum=2)).ledger_id
    for ledger_id in (garbled, elsewhere):
        await store.put(manager.keys.ledger(ledger_id), b"\x00not metadata")
    catalog = memory_catalog(store)
    await _journal_with_torn_tail(tmp_path)  # ledger 1 (= ``held``): entries 0..8 held, 9 cut
    assert held == 1
    storage = await Storage.open(config(tmp_path))
    try:
        resolver = LimboResolver(storage, catalog, BOOKIE)
        await resolver.run_once()
        assert storage.limbo is not None
        assert not storage.limbo.every_ledger, "one undecodable ledger kept every ledger in limbo"
        assert garbled in storage.limbo.ledgers  # listed: it may be on this bookie
        assert elsewhere in storage.limbo.ledgers  # the same: nothing says it is not
        await resolver.run_once()
        assert garbled in storage.limbo.ledgers, "an undecodable ledger was taken as deleted"
    finally:
        storage.abort()
        await catalog.close()


async def test_a_new_cut_widens_a_narrowed_marker(tmp_path: Path) -> None:
    await _journal_with_torn_tail(tmp_path)
    fileio = FileIO()
    limbo.save_blocking(fileio, str(tmp_path), Limbo(False, {42}))
    await _starts_with_every_ledger_in_limbo(tmp_path)


async def test_a_writers_add_in_limbo_waits_for_metadata_open(tmp_path: Path) -> None:
    """Without metadata nothing can show it; with it, see tests/integration/bookie/test_limbo.py.
    Here: a recovery add passes, and fills what the cut took."""
    await _journal_with_torn_tail(tmp_path)
    storage = await Storage.open(config(tmp_path))
    try:
        await add(storage, 1, 9, recovery=True)
        assert (await storage.read_entry(1, 9))[0] == 9
    finally:
        storage.abort()
    shutil.rmtree(tmp_path)


async def test_a_writers_add_in_limbo_is_refused_unless_metadata_shows_the_ledger_open(
    tmp_path: Path,
) -> None:
    """The cut may have taken a fence this bookie answered: a writer's add of a held ledger in limbo
    waits for one metadata read; closed -> EFENCED (NotOpen), nothing journaled; open -> it goes on
    and later adds skip the read. Recovery adds never wait."""

    class Metadata:
        def __init__(self) -> None:
            self.open = {1: False}
            self.lookups = 0

        async def key_info(self, ledger_id: int) -> KeyInfo:
            self.lookups += 1
            return KeyInfo(exists=True, check=key_check(KEY), writable=self.open.get(ledger_id, True))

    await _journal_with_torn_tail(tmp_path)
    md = Metadata()
    storage = await Storage.open(config(tmp_path))
    storage.keys = KeyVerifier(storage, md)
    try:
        assert storage.limbo is not None
        with pytest.raises(NotOpen):
            await add(storage, 1, 9)  # closed in metadata: its fence here may have been cut
        assert 9 not in storage.ledger(1).index
        assert md.lookups == 1
        await add(storage, 1, 9, recovery=True)  # recovery adds pass, without a lookup
        assert md.lookups == 1
        md.open[1] = True  # (a test's shortcut: metadata never goes back to OPEN)
        await add(storage, 1, 10)
        await add(storage, 1, 11)
        assert md.lookups == 2  # once seen OPEN, adds go on as usual
        assert 1 in storage.limbo.writes_checked
    finally:
        storage.abort()


async def test_a_bookie_no_ledger_lists_leaves_limbo_at_the_first_pass(tmp_path: Path) -> None:
    await _journal_with_torn_tail(tmp_path)
    storage = await Storage.open(config(tmp_path))
    try:
        assert storage.limbo is not None
        resolver = LimboResolver(storage, _Catalog({3: _closed(3, ["b"], 4)}), BOOKIE)
        await resolver.run_once()
        assert storage.limbo is None
        assert not resolver.pending()
        with pytest.raises(NoEntry):
            await storage.read_entry(1, 9)
    finally:
        storage.abort()
    assert not (tmp_path / limbo.MARKER_FILE).exists()


async def test_the_metadata_catalog_lists_and_reads_in_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """bookie/gc.py's MetadataCatalog on the metadata twin, pages of 2: the ledgers listing this
    bookie (no cluster: refused), and the metadata of sparse ids, deleted ones as None."""
    monkeypatch.setattr(bookie_gc, "METADATA_PAGE", 2)
    store = metadata.MemoryStore()
    with pytest.raises(bookie_gc.MetadataUnusable, match="no cluster"):
        _ = [page async for page in memory_catalog(store).ledgers_on(BOOKIE)]
    await metadata.init_cluster(store, "/test", instance_id=CLUSTER)
    catalog = memory_catalog(store)  # (the one that found no cluster refuses for good)
    manager = metadata.LedgerManager(store, "/test")
    ids = []
    for n in range(7):
        ensemble = [BOOKIE, "b"] if n % 2 == 0 else ["a", "b"]
        ids.append((await manager.create(ensemble, write_quorum=2, ack_quorum=2)).ledger_id)
    await manager.delete(ids[4])
    on = [i async for page in catalog.ledgers_on(BOOKIE) for i in page]
    assert on == [ids[0], ids[2], ids[6]]
    wanted = [ids[0], ids[3], ids[4], ids[6], ids[6] + 100]
    got = {i: md async for page in catalog.ledgers_metadata(wanted) for i, md in page}
    assert sorted(got) == wanted
    assert [i for i, md in got.items() if md is None] == [ids[4], ids[6] + 100]
    assert got[ids[3]] is not None
    assert got[ids[3]].ledger_id == ids[3]
    await catalog.mark_under_replicated(ids[0], BOOKIE, "limbo")
    mark = await UnderReplicationManager(store, "/test").get(ids[0])
    assert mark is not None
    assert mark.missing == (BOOKIE,)
    await catalog.close()
