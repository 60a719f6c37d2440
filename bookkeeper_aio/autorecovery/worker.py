"""Replication workers: take an under-replicated ledger under a lease-bound lock and heal it.

Healing one ledger (:meth:`ReplicationWorker.heal`), for the bookies its mark lists as missing:

1. Read the ledger's metadata. Deleted: the mark goes (nothing to heal).
2. Find its password among the daemon's (the metadata stores a hash): the replacement bookie needs
   the master key, and an open ledger's fence too. None matches: NoPasswordForLedger, mark kept.
3. Every fragment that lists a missing bookie, oldest first, except the last fragment of a ledger
   that is not CLOSED: :class:`~bookkeeper_aio.client.ensemble_change.BookieReplacer` (the one
   replication primitive) chooses the replacements (placement policy over writable bookies, never a
   member of the fragment, never a bookie being decommissioned), :func:`copy_fragment` writes the
   fragment's entries to them, and only then the fragment's new ensemble is CASed. A fragment that
   changed during the copy (another worker, a writer) is refused and looked at again.
4. The last fragment of an OPEN (or IN_RECOVERY) ledger belongs to its writer, whose next add
   replaces a dead bookie itself (an ensemble change). It is touched only after
   ``open_ledger_grace_s`` from the first mark, only while a marked bookie of it is gone (this
   worker saw it unregistered at every look for ``lost_bookie_recovery_delay_s``, and its
   registration watch saw no return in between: a restart is no absence), being decommissioned,
   or was marked ``replaced`` (it came back with another disk: its copies are gone) — a bookie
   that came back with its disk serves its writer, which is not fenced for a restart that
   outlasted the lost-bookie delay: its mark's grace starts anew (``restamp``) — and only after
   the ledger was fenced and recovered (``open_ledger(recovery=True)``: from then on it is CLOSED
   and its last fragment fixed).
5. The mark loses the bookies no fragment lists any more (by CAS: a bookie marked meanwhile
   stays). Time to heal is counted from the first mark.

Safety: a fragment lists a replacement only after every entry it must hold was acknowledged by it
(durable). The lock avoids duplicate work, and every metadata write of a heal (the fragment's CAS,
the mark's update) is guarded by it in the same transaction: a worker paused past its lease (the
lock gone, or taken by another worker since) commits nothing, even when the fragment it copied has
changed and changed back meanwhile (an ABA the fragment comparison alone would miss, publishing a
copy its replacement may have collected since). Its heal ends with LockLost.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import structlog

from bookkeeper_aio.autorecovery.config import AutorecoveryConfig
from bookkeeper_aio.autorecovery.copier import CopyStats, FragmentCopy, RateLimiter, copy_fragment
from bookkeeper_aio.autorecovery.errors import (
    EntryUnavailable,
    LockLost,
    NoPasswordForLedger,
    ReplicationError,
)
from bookkeeper_aio.autorecovery.metrics import AutorecoveryMetrics
from bookkeeper_aio.client.bookkeeper import BookKeeper
from bookkeeper_aio.client.ensemble_change import BookieReplacer, Replacement
from bookkeeper_aio.client.keys import codec_for, password_matches
from bookkeeper_aio.common.backoff import Backoff
from bookkeeper_aio.errors import BKError, MetadataConflict
from bookkeeper_aio.protocol.digest import EntryCodec
from metadata.bookies import list_bookies, watch_bookies
from metadata.errors import GuardFailed, MetadataError, NoSuchLedger
from metadata.ledger_manager import VersionedLedger
from metadata.ledger_metadata import LedgerMetadata, LedgerState
from metadata.store import Guards
from metadata.underreplication import ReplicationLock, UnderReplicated, UnderReplicationManager

log = structlog.get_logger("bookkeeper_aio.autorecovery.worker")

NOT_RETRIABLE_FACTOR = 12
"""A ledger failing with a non-retriable error waits this many ``ledger_retry_s`` before a retry."""
BACKOFF_FACTOR_MAX = 64
"""A ledger failing again and again waits ``ledger_retry_s`` doubled for each failure in a row, up
to this many times it: a fragment no replica can complete is not copied (in part, to a new
replacement each time) every few seconds for ever."""
FRAGMENT_ATTEMPTS_MAX = 8
"""Times one fragment is looked at again after it changed during its copy."""
WATCH_RETRY_S_MIN = 0.1
WATCH_RETRY_S_MAX = 5.0
"""The registration watch set up again after a failure: backoff bounds (seconds)."""
COPIES_GONE = frozenset({"replaced"})
"""Reasons a bookie was marked that say its copies are gone even while it is registered: its
writer's fragment is fenced and healed past the grace (no "it is back" exemption)."""


@dataclass(frozen=True, slots=True)
class HealResult:
    """What one :meth:`ReplicationWorker.heal` did: the bookies ``healed`` (no fragment lists them),
    those ``left`` (still listed: an open ledger's last fragment within its grace), the fragments
    re-replicated, and whether the ledger was fenced, deleted, or fully healed (mark gone)."""

    ledger_id: int
    healed: tuple[str, ...]
    left: tuple[str, ...]
    fragments: int
    copied: CopyStats
    fenced: bool = False
    deleted: bool = False
    resolved: bool = False
    wait_s: float = 0.0
    """With ``left``: when to look again (the grace's end; or its length, the bookie being back)."""


def fragment_ranges(md: LedgerMetadata) -> list[tuple[int, int, tuple[str, ...]]]:
    """``(first, last, ensemble)`` of every fragment; ``last`` of the last fragment is the closed
    ledger's last entry (or -1 for an open ledger: its end is unknown)."""
    ranges = []
    for index, (first, ensemble) in enumerate(md.ensembles):
        if index + 1 < len(md.ensembles):
            last = md.ensembles[index + 1][0] - 1
        elif md.state is LedgerState.CLOSED:
            assert md.last_entry_id is not None
            last = md.last_entry_id
        else:
            last = -1
        ranges.append((first, last, ensemble))
    return ranges


def password_for(md: LedgerMetadata, passwords: Sequence[bytes]) -> bytes:
    """The password among ``passwords`` that checks against the ledger's metadata (the first one
    when the ledger stores no check value). Raises NoPasswordForLedger."""
    if not md.password_hash:
        return passwords[0]
    for candidate in passwords:
        if password_matches(md, candidate):
            return candidate
    raise NoPasswordForLedger(
        f"ledger {md.ledger_id}: none of the autorecovery daemon's {len(passwords)} password(s) "
        "matches the ledger's; give it with --password (the mark stays until then)"
    )


class ReplicationWorker:
    """Heals marked ledgers one at a time (:meth:`run`), or one on demand (:meth:`heal`)."""

    def __init__(
        self,
        bk: BookKeeper,
        urm: UnderReplicationManager,
        config: AutorecoveryConfig,
        *,
        worker_id: str,
        metrics: AutorecoveryMetrics | None = None,
        now_ms: Callable[[], int] | None = None,
        monotonic_s: Callable[[], float] | None = None,
        limiter: RateLimiter | None = None,
    ) -> None:
        self._bk = bk
        self._ctx = bk.context
        self._urm = urm
        self._config = config
        self.worker_id = worker_id
        self.metrics = metrics or AutorecoveryMetrics()
        self._now_ms = now_ms or (lambda: time.time_ns() // 1_000_000)
        if monotonic_s is None:  # one clock for tests that set the time; the system's otherwise
            monotonic_s = time.monotonic if now_ms is None else (lambda: now_ms() / 1000)
        self._monotonic_s = monotonic_s
        self._grace_seen: dict[int, dict[int, float]] = {}
        """Marked ledger -> its mark's ``since_ms`` stamps -> when this worker first listed or healed
        it, on its own clock: a mark stamped by an auditor whose clock runs behind this one's never
        shortens the grace (a worker started after a mark waits the grace anew)."""
        self._absent_since: dict[str, float] = {}
        """Bookie of an open ledger's writer's fragment -> when this worker first saw it
        unregistered, on its own clock; forgotten when seen registered (each pass looks)."""
        self._retry_at: dict[int, float] = {}
        self._failures: dict[int, int] = {}
        """Heals of a ledger that failed in a row (backoff); gone once one succeeds."""
        self._undecodable: set[int] = set()
        """Ledgers whose mark could not be decoded (said once each)."""
        self.limiter = limiter or RateLimiter(config.copy_bytes_per_s)

    # ------------------------------------------------------------------ the loop
    async def run(self, lease_id: Callable[[], int], wakeup: asyncio.Event | None = None) -> None:
        """Take marked ledgers under a lock bound to ``lease_id()`` and heal them, forever: no error
        ends the loop (a worker that stopped would leave its daemon healing nothing, unseen).
        Beside it, a watch of the registrations (:meth:`_follow_registrations`)."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self._follow_registrations(), name=f"{self.worker_id} registrations")
            await self._passes(lease_id, wakeup)

    async def _follow_registrations(self) -> None:
        """Forget the absence of every bookie a registration watch shows registered: a bookie back
        between two looks of this worker (a restart that both looks fell out of; a busy pass looks
        minutes apart) is not gone, its absence starts anew at the next look. While the watch is
        down a return may go unseen: when it is set up again, every absence being timed starts
        anew (a fence comes later, never sooner). No error ends it (as the passes)."""
        backoff = Backoff(WATCH_RETRY_S_MIN, WATCH_RETRY_S_MAX)
        resumed = False
        while True:
            try:
                listings = 0
                async for bookies in watch_bookies(self._urm.store, self._urm.keys.root):
                    if bookies.listed:
                        listings += 1
                        if resumed or listings > 1:  # after a gap (the watch failed, or was
                            # compacted and listed again): what happened in it is unknown
                            self._absent_since.clear()
                        resumed = False
                    self._forget_absences(bookies.registered)
                    backoff.reset()
            except (MetadataError, TimeoutError) as error:
                log.info("autorecovery.worker_watch_failed", worker=self.worker_id, error=repr(error))
            except Exception:
                log.exception("autorecovery.worker_watch_crashed", worker=self.worker_id)
            resumed = True
            await asyncio.sleep(backoff.next_delay_s())

    async def _passes(self, lease_id: Callable[[], int], wakeup: asyncio.Event | None) -> None:
        loop = asyncio.get_running_loop()
        while True:
            worked = False
            try:
                if await self._urm.is_enabled():
                    worked = await self._one_pass(lease_id, loop)
            except (MetadataError, TimeoutError) as error:
                log.warning("autorecovery.worker_metadata_error", worker=self.worker_id, error=repr(error))
            except Exception:
                log.exception("autorecovery.worker_pass_failed", worker=self.worker_id)
            if not worked:
                await _wait(wakeup, self._config.worker_idle_poll_s)

    async def _one_pass(self, lease_id: Callable[[], int], loop: asyncio.AbstractEventLoop) -> bool:
        worked = False
        seen: set[int] = set()  # every marked ledger listed in this pass
        marked: set[str] = set()  # every bookie they list
        if self._absent_since:  # a bookie back between two looks at its ledger is not gone
            await self._observe_registrations()

        def undecodable(ledger_id: int, error: MetadataError) -> None:
            seen.add(ledger_id)
            self._undecodable_mark(ledger_id, error)

        async for mark in self._urm.iter_marks(on_undecodable=undecodable):
            seen.add(mark.ledger_id)
            marked.update(mark.missing)
            self._note_marks(mark)  # the grace's clock starts when a worker first lists a mark
            if self._retry_at.get(mark.ledger_id, 0.0) > loop.time():
                continue
            if not await self._urm.is_enabled():
                return worked
            lease = lease_id()
            if not lease:
                continue
            lock = await self._urm.acquire(mark.ledger_id, self.worker_id, lease)
            if lock is None:
                continue
            worked = True
            try:
                result = await self.heal_locked(lock)
                self._failures.pop(mark.ledger_id, None)
                if result.left:
                    self._retry_at[mark.ledger_id] = loop.time() + result.wait_s
                else:
                    self._retry_at.pop(mark.ledger_id, None)
            except (BKError, MetadataError, TimeoutError) as error:
                # what retrying cannot fix (a missing password) is retried less often: no log flood
                retriable = isinstance(error, TimeoutError) or error.retriable
                retry_s = self._back_off(mark.ledger_id, retriable, loop)
                log.warning(
                    "autorecovery.heal_failed",
                    ledger_id=mark.ledger_id,
                    worker=self.worker_id,
                    error=repr(error),
                    retry_in_s=retry_s,
                )
            except Exception:
                # a bug or an error nobody foresaw: the ledger backs off like any failure, or one
                # that keeps raising it would end every pass there and starve the marks after it
                retry_s = self._back_off(mark.ledger_id, True, loop)
                log.exception(
                    "autorecovery.heal_crashed",
                    ledger_id=mark.ledger_id,
                    worker=self.worker_id,
                    retry_in_s=retry_s,
                    hint="an unexpected error (a bug): report it with this traceback",
                )
        # a full pass: forget the ledgers no longer marked (healed elsewhere, deleted)
        for state in (self._retry_at, self._failures):
            for ledger_id in state.keys() - seen:
                del state[ledger_id]
        for ledger_id in self._grace_seen.keys() - seen:
            del self._grace_seen[ledger_id]
        for bookie in self._absent_since.keys() - marked:
            del self._absent_since[bookie]
        self._undecodable &= seen
        return worked

    def _back_off(self, ledger_id: int, retriable: bool, loop: asyncio.AbstractEventLoop) -> float:
        """Count a failed heal of ``ledger_id`` and set when to try it again; returns the pause."""
        self.metrics.heal_failures += 1
        failures = self._failures[ledger_id] = self._failures.get(ledger_id, 0) + 1
        backoff = min(BACKOFF_FACTOR_MAX, 2 ** (failures - 1))
        retry_s = self._config.ledger_retry_s * (backoff if retriable else NOT_RETRIABLE_FACTOR)
        self._retry_at[ledger_id] = loop.time() + retry_s
        return retry_s

    def _undecodable_mark(self, ledger_id: int, error: MetadataError) -> None:
        """A mark this daemon cannot read (a newer format, a damaged value) is skipped, not
        healed — the others are (said once per ledger)."""
        if ledger_id not in self._undecodable:
            self._undecodable.add(ledger_id)
            log.warning(
                "autorecovery.mark_undecodable",
                ledger_id=ledger_id,
                worker=self.worker_id,
                error=repr(error),
                hint="a daemon of a newer version wrote it, or it is damaged: left alone",
            )

    # ------------------------------------------------------------------ one ledger
    async def heal_locked(self, lock: ReplicationLock) -> HealResult:
        """Heal the mark of ``lock``'s ledger as it is now (it may have grown, or gone meanwhile:
        ``resolved`` with nothing healed) under the caller's ``lock``, then release it (a release
        that failed is taken up again by the next acquire). Raises what :meth:`heal` raises, and
        MetadataError or TimeoutError from metadata."""
        try:
            fresh = await self._urm.get(lock.ledger_id)
            if fresh is None:
                return HealResult(lock.ledger_id, (), (), 0, CopyStats(), resolved=True)
            return await self.heal(fresh, lock)
        finally:
            with contextlib.suppress(MetadataError, TimeoutError):
                await self._urm.unlock(lock.ledger_id, lock.lease_id)

    async def heal(self, mark: UnderReplicated, lock: ReplicationLock | None = None) -> HealResult:
        """Heal one marked ledger (see the module doc) under the caller's ``lock``: every metadata
        write is guarded by it (None: unguarded, for a caller that serialises heals itself).

        Raises LockLost (the lock was gone before a commit: nothing of it was written),
        NoPasswordForLedger, EntryUnavailable, ReplicationError, NotEnoughBookies (no
        replacement: add bookies), LedgerRecoveryError (the fence/recovery failed: retried),
        MetadataError."""
        try:
            return await self._heal(mark, lock)
        except GuardFailed as lost:
            self.metrics.locks_lost += 1
            log.warning(
                "autorecovery.lock_lost",
                ledger_id=mark.ledger_id,
                worker=self.worker_id,
                lock_version=None if lock is None else lock.version,
                found=lost.actual,
                hint="paused past the lease: nothing was committed; retried under a new lock",
            )
            raise LockLost(
                f"ledger {mark.ledger_id}: worker {self.worker_id}'s replication lock was gone at "
                "commit (its lease expired): nothing was committed"
            ) from lost

    async def _check_lock(self, lock: ReplicationLock | None) -> None:
        """Raise GuardFailed when ``lock`` is no longer held (before a step no guard covers)."""
        if lock is not None and not await self._urm.holds(lock):
            guard = self._urm.guard(lock)
            raise GuardFailed(guard.key, guard.key, guard.version, None)

    async def _heal(self, mark: UnderReplicated, lock: ReplicationLock | None) -> HealResult:
        guards: Guards = () if lock is None else (self._urm.guard(lock),)
        ledger_id = mark.ledger_id
        missing = set(mark.missing)
        try:
            current = await self._ctx.ledgers.read(ledger_id)
        except NoSuchLedger:
            await self._urm.resolve(ledger_id, mark.missing, lock=lock)
            log.info("autorecovery.ledger_deleted", ledger_id=ledger_id)
            return HealResult(ledger_id, mark.missing, (), 0, CopyStats(), deleted=True, resolved=True)
        password = password_for(current.metadata, self._config.passwords)
        stats = CopyStats()
        fragments = 0
        fenced = False
        md = current.metadata
        in_last = missing & set(md.current_ensemble)
        wait_s = 0.0
        if md.state is not LedgerState.CLOSED and in_last:
            # the grace counts from the latest first-mark of a bookie of the writer's fragment
            grace_s = self._config.open_ledger_grace_s
            poll_s = self._config.worker_idle_poll_s
            age_s = self._grace_age_s(mark, in_last)
            # a bookie back with another disk lost its copies: it does not serve its writer's
            # fragment, whose entries before its return now have a copy fewer for good
            copies_gone = sorted(b for b in in_last if COPIES_GONE & set(mark.reasons_of(b)))
            gone, away_s = await self._gone(in_last)  # looked at every time: absences are timed
            if age_s < grace_s:
                wait_s = max(grace_s - age_s, poll_s)
            elif copies_gone or gone:
                log.info(
                    "autorecovery.fencing_open_ledger",
                    ledger_id=ledger_id,
                    missing=sorted(in_last),
                    gone=sorted(gone),
                    copies_gone=copies_gone,
                    marked_s_ago=round(age_s, 1),
                )
                await self._check_lock(lock)  # recovery's own CASes are not guarded: check first
                await self._bk.open_ledger(ledger_id, password=password, recovery=True)
                self.metrics.ledgers_fenced += 1
                fenced = True
                current = await self._ctx.ledgers.read(ledger_id)
            elif away_s is not None:
                wait_s = max(away_s, poll_s)  # unregistered, not yet for the lost-bookie delay
                log.info(
                    "autorecovery.open_ledger_bookie_away",
                    ledger_id=ledger_id,
                    marked=sorted(in_last),
                    gone_in_s=round(away_s, 1),
                    hint="not fenced unless it stays unregistered for the lost-bookie delay",
                )
            else:
                # back: its writer goes on; a new absence waits a new grace, and the delay
                mark = await self._urm.restamp(ledger_id, in_last, lock=lock) or mark
                self._note_marks(mark)
                wait_s = max(grace_s, poll_s)
                log.info(
                    "autorecovery.open_ledger_bookies_back",
                    ledger_id=ledger_id,
                    marked=sorted(in_last),
                    hint="not fenced: its writer still writes to them; looked at again later",
                )
        codec = codec_for(current.metadata, password)
        key = codec.master_key
        replacer = BookieReplacer(self._ctx, ledger_id)
        attempts = 0
        unavailable: dict[int, EntryUnavailable] = {}  # fragments left for later: heal the others
        while True:
            target = _next_fragment(current.metadata, missing, unavailable)
            if target is None:
                break
            first, last, ensemble = target
            try:
                current = await self._replace(
                    current, replacer, first, last, ensemble, missing, codec, key, stats, guards
                )
                fragments += 1
                self.metrics.fragments_healed += 1
            except EntryUnavailable as error:
                log.warning("autorecovery.fragment_unavailable", ledger_id=ledger_id, first_entry=first)
                unavailable[first] = error
            except MetadataConflict as conflict:
                attempts += 1
                if attempts >= FRAGMENT_ATTEMPTS_MAX:
                    raise ReplicationError(
                        f"ledger {ledger_id}: fragment {first} kept changing during its copy"
                    ) from conflict
                log.info("autorecovery.fragment_changed", ledger_id=ledger_id, first_entry=first)
                current = await self._ctx.ledgers.read(ledger_id)
        listed = {b for _, bookies in current.metadata.ensembles for b in bookies}
        healed = tuple(sorted(missing - listed))
        left = tuple(sorted(missing & listed))
        resolved = False
        if healed:
            remaining = await self._urm.resolve(ledger_id, healed, lock=lock)
            resolved = remaining is None
            if resolved:
                self.metrics.healed(max(0.0, (self._now_ms() - mark.marked_ms) / 1000))
        log.info(
            "autorecovery.ledger_healed" if not left else "autorecovery.ledger_partly_healed",
            ledger_id=ledger_id,
            healed=list(healed),
            waiting_for_grace=list(left),
            fragments=fragments,
            entries=stats.entries,
            bytes=stats.bytes,
            fenced=fenced,
        )
        if unavailable:  # the other fragments are healed; these keep their mark, as before
            raise next(iter(unavailable.values()))
        return HealResult(
            ledger_id, healed, left, fragments, stats, fenced=fenced, resolved=resolved, wait_s=wait_s
        )

    def _grace_age_s(self, mark: UnderReplicated, in_last: Collection[str]) -> float:
        """How long the latest mark of a bookie of the writer's fragment has stood: by the mark's
        own stamp (the auditor's wall clock), but never more than this worker has seen it (clocks
        of two hosts may disagree by more than the grace)."""
        self._note_marks(mark)
        since_ms = max(mark.since_ms(b) for b in in_last)
        stamped_s = (self._now_ms() - since_ms) / 1000
        return min(stamped_s, self._monotonic_s() - self._grace_seen[mark.ledger_id][since_ms])

    def _note_marks(self, mark: UnderReplicated) -> None:
        """Note when this worker first saw each of ``mark``'s stamps (now, for new ones; those
        the mark no longer has are forgotten)."""
        now = self._monotonic_s()
        stamps = {mark.since_ms(bookie) for bookie in mark.missing}
        noted = self._grace_seen.setdefault(mark.ledger_id, {})
        for stale in noted.keys() - stamps:
            del noted[stale]
        for stamp in stamps:
            noted.setdefault(stamp, now)

    async def _gone(self, bookies: Collection[str]) -> tuple[set[str], float | None]:
        """Which of ``bookies`` are gone — being decommissioned, or unregistered at every look of
        this worker for ``lost_bookie_recovery_delay_s`` (a restart deregisters a bookie at once:
        one look must not take an idle writer's ledger for it) — and in how long the first of
        those unregistered but not yet for the delay would be (None: none is)."""
        registered = await self._observe_registrations()
        leaving = await self._urm.decommissioning()
        now = self._monotonic_s()
        delay_s = self._config.lost_bookie_recovery_delay_s
        gone = set(bookies) & leaving
        waits = []
        for bookie in set(bookies) - leaving - registered:
            away_s = now - self._absent_since.setdefault(bookie, now)
            if away_s >= delay_s:
                gone.add(bookie)
            else:
                waits.append(delay_s - away_s)
        return gone, min(waits, default=None)

    async def _observe_registrations(self) -> frozenset[str]:
        """The registered bookies now; forgets the absence of those among them."""
        registered = (await list_bookies(self._urm.store, self._urm.keys.root)).registered
        self._forget_absences(registered)
        return registered

    def _forget_absences(self, registered: Collection[str]) -> None:
        for bookie in self._absent_since.keys() & set(registered):
            del self._absent_since[bookie]

    async def _replace(
        self,
        current: VersionedLedger,
        replacer: BookieReplacer,
        first: int,
        last: int,
        ensemble: tuple[str, ...],
        missing: set[str],
        codec: EntryCodec,
        key: bytes,
        stats: CopyStats,
        guards: Guards,
    ) -> VersionedLedger:
        md = current.metadata
        failed = [b for b in ensemble if b in missing]

        async def copy(replacement: Replacement) -> None:
            await copy_fragment(
                self._ctx,
                FragmentCopy(md, first, last, ensemble, replacement.ensemble),
                codec,
                key,
                window=self._config.copy_window,
                stats=stats,
                limiter=self.limiter,
            )
            log.info(
                "autorecovery.fragment_copied",
                ledger_id=md.ledger_id,
                first_entry=first,
                last_entry=last,
                replaced=list(replacement.replaced),
                ensemble=list(replacement.ensemble),
            )

        def accept(now: LedgerMetadata) -> None:
            if now.state is not LedgerState.CLOSED and now.ensembles[-1][0] <= first:
                raise MetadataConflict(
                    f"ledger {now.ledger_id}: fragment {first} is the last of an open ledger: "
                    "left to its writer until fenced"
                )

        before = stats.entries, stats.bytes
        change = await replacer.replace(
            current,
            first,
            failed,
            accept=accept,
            copy=copy,
            attempts_max=self._ctx.config.ensemble_change_attempts_max,
            guards=guards,
        )
        self.metrics.entries_copied += stats.entries - before[0]
        self.metrics.bytes_copied += stats.bytes - before[1]
        assert change.stored is not None
        return change.stored


def _next_fragment(
    md: LedgerMetadata, missing: set[str], skip: Collection[int] = ()
) -> tuple[int, int, tuple[str, ...]] | None:
    """The oldest fragment listing a missing bookie that may be touched now (not the last fragment
    of a ledger that is not CLOSED), other than those starting at an entry in ``skip``."""
    ranges = fragment_ranges(md)
    for index, (first, last, ensemble) in enumerate(ranges):
        if md.state is not LedgerState.CLOSED and index == len(ranges) - 1:
            return None
        if first not in skip and missing & set(ensemble):
            return first, last, ensemble
    return None


async def _wait(event: asyncio.Event | None, timeout_s: float) -> None:
    if event is None:
        await asyncio.sleep(timeout_s)
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()
    event.clear()
