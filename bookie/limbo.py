"""Limbo ledgers: what a journal cut may have lost is answered "unknown" until metadata settles it.

Replay cuts a damaged final journal group as a torn tail (:mod:`bookie.replay`). It cannot tell a
group torn by a crash (never synced, never acknowledged) from bit rot in a group that was synced
and acknowledged. After such a cut the bookie may lack entries it acknowledged, and a fence it
answered. Answering "no such entry" for them would let recovery count a lost copy as absent (with
``Qw = Qa`` one such answer truncates the ledger before an acknowledged entry), so the ledgers the
cut may have touched go into *limbo*:

- **Entering.** Before replay cuts a non-empty tail it writes the marker file ``limbo`` in the
  data dir, durably (temp file, fsync, rename, directory fsync), saying "every ledger" (the cut
  bytes cannot say which ledgers they held: the damaged record's own header is untrusted). A crash
  between the marker and the cut leaves the marker and the uncut journal: the next start cuts
  again, under the marker. A cut that finds a marker already narrowed to a set widens it back.
- **Which ledgers.** While the marker says "every ledger", every ledger, held or not, is in limbo.
  The resolver (:class:`LimboResolver`, with metadata) then lists the ledgers in metadata whose
  ensembles include this bookie, *after* the restart, and narrows the marker to that set and the
  ledgers this bookie holds (durably, before it is used; a held ledger metadata no longer lists
  here may have lost a fence a recovery made before it replaced this bookie in the last fragment:
  settling it fences it again). It is a superset of what matters: the cut lost only records this
  bookie had acknowledged or made; an acknowledged add or a fence of ledger ``L`` on this bookie
  came from a writer, a recoverer or a worker whose metadata listed this bookie in ``L``'s
  ensemble (a writer CASes an ensemble change before it sends to the replacement); such a listing
  was durable in metadata before the ack, so before the crash, so before the listing. The one
  exception is a copy acknowledged before the crash whose CAS lands after the listing (a
  re-replication worker's copy, a recovery's write-back to a replacement): that CAS closes the
  ledger or settles a non-last fragment, and a closed ledger is never truncated by recovery (its
  readers fail over). A ledger this bookie holds that metadata does not list with it is deleted
  or an orphan copy: no client asks this bookie for it. One the cut took whole that metadata no
  longer lists here leaves limbo, yet a stale writer cannot add to it: a writer's add or WRITE_LAC
  of a ledger the bookie holds no record of reads its metadata first (:mod:`bookie.ledger_keys`),
  and not OPEN -> EFENCED, no record. A ledger created after the restart is
  not in the cut; one created during the listing may or may not be listed (either is fine).
- **While in limbo** (:class:`~bookie.storage.Storage`): a read of an entry the bookie does not
  hold, of a ledger it does not hold, a LAC read or long poll of a ledger it does not hold, and an
  entry list, answer ``EUNKNOWNLEDGERSTATE`` (:class:`bookie.storage.Unknown`), never ENOENTRY / ENOLEDGER.
  A fencing read still fences (durably) before it answers; its answer is the last entry held, or
  unknown. A LAC read of a held ledger answers the bookie's LAC, maybe lower than it was: a lower
  LAC is always safe (a reader sees less, recovery takes none from it). A writer's add or
  WRITE_LAC waits for one metadata read of the ledger (:mod:`bookie.ledger_keys`): not OPEN ->
  EFENCED (its fence here may have been cut; a recovery CASes IN_RECOVERY before it fences, and a
  ledger never goes back to OPEN). Once metadata showed it OPEN after the restart, its writes go on
  as usual: any fence since lands here durably. Recovery adds pass (they restore copies).
- **Resolution** (:class:`LimboResolver`, a background task like GC, paged metadata reads, yields
  the loop): per limbo ledger, deleted in metadata -> out of limbo; not closed -> stays (until its
  writer or a recovery closes it); closed -> the entries this bookie should hold (its positions'
  write sets in each fragment listing it, up to the last entry) are checked in the index: all
  present -> fenced here (a lost fence comes back) and out of limbo; some missing -> the ledger is
  marked under-replicated for this bookie (the autorecovery workers move its copy elsewhere) and
  stays until its fragments no longer list the bookie or the entries are back. The marker is
  rewritten with what is left after each pass, and removed when nothing is (then the directory
  is fsynced): clearing is durable, and a crash before it keeps the ledgers in limbo (safe).

Without metadata (a standalone bookie) nothing narrows or settles limbo: every ledger stays in it,
and writers' adds are not checked (nothing to check them against): remove the marker by hand only
after checking the bookie's ledgers yourself (docs/bookie.md).

Limbo is entered only when the cut is not proven harmless: the journal's synced mark
(:mod:`bookie.journal_format`) shows a cut made after a process crash, in the same boot, starting
exactly at the synced end (or at the next segment's start), to be a write torn in flight (never
synced, never acknowledged); such a cut enters no limbo.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import crc32c
import structlog

from bookie.fileio import FileIO
from metadata.ledger_metadata import LedgerMetadata, LedgerState

if TYPE_CHECKING:
    from bookie.storage import Storage

log = structlog.get_logger(__name__)

MARKER_FILE = "limbo"
"""The marker's name in the data dir."""
_MAGIC = b"BKLIMBO1"
_HEADER = struct.Struct(">8sBQ")  # magic, flags, count of ledger ids
_FLAG_EVERY_LEDGER = 1
_ID = struct.Struct(">Q")
_CRC = struct.Struct(">I")
LOOP_SLICE_S = 0.005
"""Loop time the resolver takes at most in one go while it checks a ledger's entries."""
CHECK_INTERVAL_S = 30.0
"""Seconds between resolution passes while ledgers are in limbo."""


class Limbo:
    """The ledgers in limbo (in memory; the marker file holds the same). ``every_ledger`` until the
    resolver narrowed it to ``ledgers``."""

    __slots__ = ("every_ledger", "ledgers", "writes_checked")

    def __init__(self, every_ledger: bool, ledgers: Iterable[int] = ()) -> None:
        self.every_ledger = every_ledger
        self.ledgers: set[int] = set(ledgers)
        self.writes_checked: set[int] = set()
        """Ledgers metadata showed OPEN since this start: their writers' adds go on as usual."""

    def holds(self, ledger_id: int) -> bool:
        return self.every_ledger or ledger_id in self.ledgers

    def wants_write_check(self, ledger_id: int) -> bool:
        """Whether a writer's add or WRITE_LAC of ``ledger_id`` must first see metadata OPEN."""
        return (self.every_ledger or ledger_id in self.ledgers) and ledger_id not in self.writes_checked

    def count(self) -> int:
        """Ledgers in limbo (-1: every ledger, not narrowed yet)."""
        return -1 if self.every_ledger else len(self.ledgers)


# ---------------------------------------------------------------------------------- the marker
class MarkerCorrupt(ValueError):
    pass


def encode(every_ledger: bool, ledgers: Iterable[int]) -> bytes:
    ids = sorted(ledgers)
    body = _HEADER.pack(_MAGIC, _FLAG_EVERY_LEDGER if every_ledger else 0, len(ids))
    body += b"".join(_ID.pack(i) for i in ids)
    return body + _CRC.pack(crc32c.crc32c(body))


def decode(data: bytes) -> Limbo:
    """Raises :class:`MarkerCorrupt`."""
    if len(data) < _HEADER.size + _CRC.size:
        raise MarkerCorrupt(f"limbo marker of {len(data)} bytes is too short")
    body, (crc,) = data[: -_CRC.size], _CRC.unpack_from(data, len(data) - _CRC.size)
    if crc32c.crc32c(body) != crc:
        raise MarkerCorrupt("limbo marker fails its checksum")
    magic, flags, count = _HEADER.unpack_from(body)
    if magic != _MAGIC or len(body) != _HEADER.size + count * _ID.size:
        raise MarkerCorrupt("limbo marker has a bad header")
    ids = [_ID.unpack_from(body, _HEADER.size + i * _ID.size)[0] for i in range(count)]
    return Limbo(bool(flags & _FLAG_EVERY_LEDGER), ids)


def marker_path(data_dir: str) -> str:
    return os.path.join(data_dir, MARKER_FILE)


def enter_blocking(fileio: FileIO, data_dir: str, why: str) -> None:
    """Put every ledger in limbo, durably, before whatever may lose acknowledged records (replay's
    cut). Blocking."""
    fileio.write_file_atomic(marker_path(data_dir), encode(True, ()))
    log.warning("limbo.entered", why=why, marker=MARKER_FILE)


def load_blocking(fileio: FileIO, data_dir: str) -> Limbo | None:
    """The limbo the marker holds, None without one. A marker that does not decode is taken as
    "every ledger" (the safe reading; the resolver narrows it again). Blocking."""
    path = marker_path(data_dir)
    if not fileio.exists(path):
        return None
    try:
        return decode(fileio.read_file(path))
    except MarkerCorrupt as exc:
        log.warning("limbo.marker_corrupt", error=str(exc), taken_as="every ledger")
        return Limbo(True)


def save_blocking(fileio: FileIO, data_dir: str, limbo: Limbo) -> None:
    """Make ``limbo`` the marker (removed, durably, when it holds no ledger). Blocking."""
    path = marker_path(data_dir)
    if limbo.every_ledger or limbo.ledgers:
        fileio.write_file_atomic(path, encode(limbo.every_ledger, limbo.ledgers))
        return
    if fileio.exists(path):
        fileio.remove(path)
        fileio.fsync_dir(data_dir)


# ---------------------------------------------------------------------------------- what to hold
def holds_entry(position: int, entry_id: int, ensemble_size: int, write_quorum: int) -> bool:
    """Whether the bookie at ``position`` of a fragment's ensemble is in ``entry_id``'s write set:
    positions ``entry_id mod E`` and the ``Qw - 1`` after it, round the ensemble (the striping of
    :class:`bookkeeper_aio.client.quorum.DistributionSchedule`, which a unit test pins this to)."""
    return (position - entry_id) % ensemble_size < write_quorum


def expected_entries(md: LedgerMetadata, bookie_id: str) -> Iterable[int]:
    """The entries a closed ledger's metadata says ``bookie_id`` holds, in increasing order."""
    last = md.last_entry_id if md.last_entry_id is not None else -1
    fragments = md.ensembles
    for i, (first, ensemble) in enumerate(fragments):
        end = min(fragments[i + 1][0] - 1 if i + 1 < len(fragments) else last, last)
        for position, member in enumerate(ensemble):
            if member != bookie_id:
                continue
            for entry_id in range(first, end + 1):
                if holds_entry(position, entry_id, md.ensemble_size, md.write_quorum):
                    yield entry_id


# ---------------------------------------------------------------------------------- resolution
@runtime_checkable
class LimboCatalog(Protocol):
    """What the resolver needs from metadata (:class:`bookie.gc.MetadataCatalog` on etcd)."""

    def ledgers_on(self, bookie_id: str) -> AsyncIterator[Sequence[int]]:
        """The ids of the ledgers whose ensembles list ``bookie_id``, page by page, in id order."""
        ...

    def ledgers_metadata(
        self, ledger_ids: Sequence[int]
    ) -> AsyncIterator[list[tuple[int, LedgerMetadata | None]]]:
        """The metadata of ``ledger_ids`` (increasing), a listing page at a time; None for a
        ledger metadata does not hold (deleted)."""
        ...

    async def mark_under_replicated(self, ledger_id: int, bookie_id: str, reason: str) -> None: ...


class LimboResolver:
    """The background task that narrows and settles this bookie's limbo (module doc)."""

    def __init__(
        self,
        storage: Storage,
        catalog: LimboCatalog,
        bookie_id: str,
        interval_s: float = CHECK_INTERVAL_S,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.storage = storage
        self.catalog = catalog
        self.bookie_id = bookie_id
        self.interval_s = interval_s
        self._wall_clock = wall_clock
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task[None] | None = None
        self.passes = 0
        self.cleared_total = 0
        self.marked_total = 0
        self._verdicts: dict[int, tuple[LedgerMetadata, int, int]] = {}
        """Ledger id -> (metadata, index count, entries missing) of its last check: a ledger that
        waits for the workers is not walked again each pass while neither changed."""

    def start(self) -> None:
        self._task = self._loop.create_task(self._run_loop(), name="bookie-limbo")

    def pending(self) -> bool:
        """Whether ledgers are still in limbo."""
        return self.storage.limbo is not None

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def abort(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run_loop(self) -> None:
        while self.pending():
            try:
                await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 (metadata down, a disk error: the next pass retries)
                log.warning("limbo.pass_failed", error=repr(exc))
            if not self.pending():
                return
            await asyncio.sleep(self.interval_s)

    async def run_once(self) -> None:
        """One pass: narrow "every ledger" to metadata's listing, then settle each ledger."""
        limbo = self.storage.limbo
        if limbo is None:
            return
        started = self._wall_clock()
        if limbo.every_ledger:
            # what metadata lists here, and what is held here: a ledger may hold a fence the cut took
            # though its metadata no longer lists this bookie (a recovery fenced here, then replaced
            # it in the last fragment when closing); settling brings such a fence back
            listed: set[int] = set(self.storage.ledgers)
            async for page in self.catalog.ledgers_on(self.bookie_id):
                listed.update(page)
                await asyncio.sleep(0)
            narrowed = Limbo(False, listed)
            narrowed.writes_checked = limbo.writes_checked
            await self._save(narrowed)  # durable before it is used (the marker goes when empty)
            self.storage.limbo = narrowed if listed else None
            log.info("limbo.narrowed", ledgers=len(listed))
            if not listed:
                self.passes += 1
                return
            limbo = narrowed
        cleared: list[int] = []
        marked = 0
        async for mds in self.catalog.ledgers_metadata(sorted(limbo.ledgers)):
            for ledger_id, md in mds:
                if md is None:
                    cleared.append(ledger_id)
                elif md.state is LedgerState.CLOSED:
                    missing = await self._missing(md)
                    if missing:
                        await self.catalog.mark_under_replicated(ledger_id, self.bookie_id, "limbo")
                        marked += 1
                        log.info("limbo.entries_missing", ledger_id=ledger_id, missing=missing)
                    else:
                        await self._fence(ledger_id)
                        cleared.append(ledger_id)
            await asyncio.sleep(0)
        for ledger_id in cleared:
            self._verdicts.pop(ledger_id, None)
        if cleared:
            left = Limbo(False, limbo.ledgers.difference(cleared))
            left.writes_checked = limbo.writes_checked.intersection(left.ledgers)
            await self._save(left)
            self.storage.limbo = left if left.ledgers else None
        self.passes += 1
        self.cleared_total += len(cleared)
        self.marked_total += marked
        current = self.storage.limbo
        log.info(
            "limbo.pass_finished",
            seconds=round(self._wall_clock() - started, 3),
            cleared=len(cleared),
            marked_under_replicated=marked,
            left=0 if current is None else current.count(),
        )

    async def _missing(self, md: LedgerMetadata) -> int:
        """How many entries ``md`` says this bookie holds that its index lacks (yields the loop)."""
        state = self.storage.ledgers.get(md.ledger_id)
        index = None if state is None else state.index
        count = -1 if index is None else index.count
        verdict = self._verdicts.get(md.ledger_id)
        if verdict is not None and verdict[1] == count and verdict[0] == md:
            return verdict[2]
        missing = 0
        clock = time.perf_counter
        deadline = clock() + LOOP_SLICE_S
        for n, entry_id in enumerate(expected_entries(md, self.bookie_id)):
            if index is None or entry_id not in index:
                missing += 1
            if n & 1023 == 1023 and clock() > deadline:
                await asyncio.sleep(0)
                deadline = clock() + LOOP_SLICE_S
        if missing:
            self._verdicts[md.ledger_id] = (md, count, missing)
        return missing

    async def _fence(self, ledger_id: int) -> None:
        """Fence a closed ledger held here, durably (its fence may have been cut)."""
        state = self.storage.ledgers.get(ledger_id)
        if state is None or (state.fenced and state.fence_durable):
            return
        done: asyncio.Future[None] = self._loop.create_future()

        def durable(error: BaseException | None) -> None:
            if not done.done():
                if error is None:
                    done.set_result(None)
                else:
                    done.set_exception(error)

        self.storage.fence(ledger_id, None, durable)
        await done

    async def _save(self, limbo: Limbo) -> None:
        await self.storage.save_limbo(limbo)
