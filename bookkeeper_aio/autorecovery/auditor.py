"""The auditor: exactly one active in a cluster (elected on ``R/auditor``), it finds what needs
re-replication and marks it; workers do the copying.

While it leads:

- **Lost bookies.** It watches the bookie registrations and, at each change and every
  ``audit_interval_s``, compares the bookies it knows (cookies, every
  bookie a ledger lists, every bookie seen registered) with those registered now (writable or
  read-only). A bookie unregistered for ``lost_bookie_recovery_delay_s`` is lost: every ledger with
  a fragment on it is marked under-replicated with it (reason ``lost``), once per absence (again if
  it comes back and goes again). The delay counts from when *this* auditor first saw it missing: a
  new auditor after a failover waits a full delay again (later, never sooner).
- **Replaced bookies.** A bookie registered with another data dir instance than the one recorded
  in metadata (``R/replication/instances/``: any auditor, a new leader too, compares with it) lost
  what it held: its ledgers are marked (reason ``replaced``) at once, then the new one recorded.
  Only the ledgers that list it in a fragment whose copies may have been written before the new
  instance registered (:func:`mark_replaced`: a fragment that existed then, or any fragment of a
  ledger that was under recovery then): a ledger a writer placed on the new instance has its
  copies there, and a mark would fence its writer.
- **Periodic check.** Every ``check_interval_s`` every ledger is checked: for each fragment and each
  registered bookie of it, the first and the last entry that bookie should hold (its write sets) are
  read from it; a bookie that answers "no such entry/ledger", or returns a body that fails its
  digest, is marked for that ledger (reason ``check``). An open ledger's last fragment is skipped
  (its writer is still adding to it), and timeouts or errors mark nothing (a down bookie is the
  lost-bookie rule's business). Every probe carries the ledger's key, so a ledger none of the
  daemon's passwords opens is skipped (``autorecovery.check_skipped_no_password``: bookies answer no
  read without the key; its lost bookies are still found by registration).

When the election's lease is lost the auditor stops at once (another may already lead) and
campaigns again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass

import structlog

from bookkeeper_aio.autorecovery.config import AutorecoveryConfig
from bookkeeper_aio.autorecovery.errors import NoPasswordForLedger
from bookkeeper_aio.autorecovery.metrics import AutorecoveryMetrics
from bookkeeper_aio.autorecovery.worker import fragment_ranges, password_for
from bookkeeper_aio.client.context import ClientContext
from bookkeeper_aio.client.keys import codec_for
from bookkeeper_aio.client.quorum import DistributionSchedule
from bookkeeper_aio.errors import BKError
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import StatusCode
from bookkeeper_aio.protocol.digest import EntryCodec
from bookkeeper_aio.protocol.errors import DigestMismatch
from metadata.bookies import BookieInfo, BookieSet, BookieState, list_bookies, watch_bookies
from metadata.election import Election
from metadata.errors import MetadataError, MetadataFormatError, NoSuchLedger, WatchCompacted
from metadata.ledger_manager import LedgerManager
from metadata.ledger_metadata import LedgerMetadata, LedgerState
from metadata.store import list_all
from metadata.underreplication import UnderReplicationManager

log = structlog.get_logger("bookkeeper_aio.autorecovery.auditor")

DUE_SLACK_S = 0.001
"""A missing bookie whose delay runs out within this is due now: the round that its timer starts
must find it due (``since + delay - now`` and ``now - since`` differ in their last bit, and asyncio
runs timers up to its clock resolution early), or the next round's timeout is ~0 and the leader
spins without time moving until it is (a simulated clock never moves: autorecovery seed 0)."""

SCAN_WINDOW = 32
"""Ledger metadata reads in flight while scanning every ledger."""

Progress = Callable[[int, int], None]
"""``progress(ledgers_scanned, ledgers_marked)``."""
Keep = Callable[[LedgerMetadata, set[str]], Awaitable[set[str]]]
"""``keep(metadata, listed)``: which of the bookies to mark that the ledger lists to mark it with."""


async def _scan(
    ledgers: LedgerManager, visit: Callable[[LedgerMetadata], Awaitable[None]], *, window: int = SCAN_WINDOW
) -> int:
    """Read every ledger's metadata (``window`` at a time) and await ``visit`` on each; returns the
    number scanned. Ledgers deleted meanwhile are skipped, and so are ledgers whose metadata cannot
    be decoded (logged: an operator must look at them); any other error stops the scan."""
    slots = asyncio.Semaphore(window)
    scanned = 0
    failure: BaseException | None = None
    undecodable: list[int] = []
    tasks: set[asyncio.Task[None]] = set()

    async def one(ledger_id: int) -> None:
        nonlocal scanned, failure
        try:
            current = await ledgers.read(ledger_id)
            await visit(current.metadata)
            scanned += 1
        except NoSuchLedger:
            pass  # deleted meanwhile
        except MetadataFormatError as error:  # one corrupt record must not hide every other ledger
            undecodable.append(ledger_id)
            log.error("auditor.ledger_undecodable", ledger_id=ledger_id, error=str(error)[:200])  # noqa: TRY400
        except Exception as error:  # noqa: BLE001 - store down, or a bug: stop, say so, retry later
            failure = failure or error
        finally:
            slots.release()

    try:
        async for ledger_id in ledgers.iter_ledger_ids():
            await slots.acquire()
            if failure is not None:
                slots.release()
                break
            task = asyncio.create_task(one(ledger_id))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    if failure is not None:
        raise failure
    if undecodable:
        log.warning("auditor.scan_skipped_undecodable", count=len(undecodable), ledger_ids=undecodable[:20])
    return scanned


async def mark_ledgers_on(
    ledgers: LedgerManager,
    urm: UnderReplicationManager,
    bookies: Collection[str],
    *,
    reason: str,
    progress: Progress | None = None,
    keep: Keep | None = None,
) -> list[int]:
    """Mark every ledger with a fragment on one of ``bookies`` (with those of them it lists; with
    ``keep``, those of them it keeps). Returns the marked ledger ids, sorted."""
    wanted = set(bookies)
    marked: list[int] = []
    scanned = 0

    async def visit(md: LedgerMetadata) -> None:
        nonlocal scanned
        listed = wanted & {b for _, ensemble in md.ensembles for b in ensemble}
        if listed and keep is not None:
            listed = await keep(md, listed)
        if listed:
            await urm.mark(md.ledger_id, listed, reason=reason)
            marked.append(md.ledger_id)
        scanned += 1
        if progress is not None:
            progress(scanned, len(marked))

    await _scan(ledgers, visit)
    return sorted(marked)


@dataclass(frozen=True)
class _Before:
    """A ledger's fragments at the revision before a bookie's new registration (mark_replaced)."""

    firsts: frozenset[int]
    """The first entries of its fragments then."""
    recovering_from: int | None
    """IN_RECOVERY then: its last fragment's first entry (recovery's write-back may have written
    every fragment from there on to the old data dir before its closing CAS listed them)."""

    def existed(self, first: int) -> bool:
        """Whether copies of the fragment starting at ``first`` may predate the registration."""
        recovered = self.recovering_from is not None and first >= self.recovering_from
        return first in self.firsts or recovered


async def mark_replaced(
    ledgers: LedgerManager,
    urm: UnderReplicationManager,
    registered_at: Mapping[str, int | None],
) -> list[int]:
    """Mark (reason ``replaced``) every ledger that may have held entries on the old data dir of a
    bookie now registered with a new one: those that list it in a fragment that may have had
    copies written to it before ``registered_at[bookie]`` (the store revision its new instance's
    registration was created at; a fragment is known by its first entry). Each path that writes
    entries to a bookie, and when its fragment reaches metadata:

    - a writer's ensemble change: after its CAS lists the new fragment. A ledger created after that
      revision, or one that lists the bookie only in fragments a writer added since, has every copy
      on the new data dir: marking it would fence its live writer after the grace for nothing;
    - a worker's re-replication: *before* its CAS lists the replacement in a fragment that already
      existed. A fragment that existed before counts even if the bookie joined it since;
    - recovery's write-back: *before* its closing CAS adds its fragments. A ledger IN_RECOVERY at
      the revision before counts every fragment from its then-last fragment's first entry on as
      existing before (its recovery may have written them to the old data dir).

    When unsure it is marked: the revision is unknown (None), or the store's history before it is
    compacted. Returns the marked ledger ids, sorted."""

    async def fragments_then(ledger_id: int, revision: int) -> _Before | None:
        """The ledger's fragments at ``revision`` (none: it did not exist yet); None: unknown."""
        try:  # NoSuchLedger (deleted meanwhile) goes up: the scan skips the ledger
            then = await ledgers.read_at(ledger_id, revision)
        except (WatchCompacted, MetadataFormatError) as error:
            log.info(
                "autorecovery.replaced_history_unknown",
                ledger_id=ledger_id,
                revision=revision,
                error=repr(error),
                hint="marked: it may have held entries on the old data dir",
            )
            return None
        if then is None:
            return _Before(frozenset(), None)
        md = then.metadata
        recovering = md.ensembles[-1][0] if md.state is LedgerState.IN_RECOVERY else None
        return _Before(frozenset(first for first, _ in md.ensembles), recovering)

    async def keep(md: LedgerMetadata, listed: set[str]) -> set[str]:
        kept: set[str] = set()
        known: dict[int, _Before | None] = {}
        for bookie in sorted(listed):
            revision = registered_at[bookie]
            if revision is None or revision <= 1:
                kept.add(bookie)
                continue
            if revision not in known:
                known[revision] = await fragments_then(md.ledger_id, revision - 1)
            then = known[revision]
            holding = [first for first, ensemble in md.ensembles if bookie in ensemble]
            if then is None or any(then.existed(first) for first in holding):
                kept.add(bookie)
        return kept

    return await mark_ledgers_on(ledgers, urm, registered_at.keys(), reason="replaced", keep=keep)


async def referenced_bookies(ledgers: LedgerManager) -> set[str]:
    """Every bookie some ledger's fragment lists."""
    found: set[str] = set()

    async def visit(md: LedgerMetadata) -> None:
        for _, ensemble in md.ensembles:
            found.update(ensemble)

    await _scan(ledgers, visit)
    return found


def _instances(bookies: BookieSet) -> dict[str, str]:
    """Bookie id -> the data dir instance its registration names (bookies that name none left out)."""
    found: dict[str, str] = {}
    for infos in (bookies.writable, bookies.readonly):
        for bookie_id, info in infos.items():
            instance = info.attributes.get("instance_id")
            if isinstance(instance, str) and instance:
                found[bookie_id] = instance
    return found


def _holder_entries(md: LedgerMetadata, first: int, last: int, position: int) -> tuple[int, ...]:
    """The first and the last entry of ``first..last`` whose write set includes ``position``."""
    schedule = DistributionSchedule(md.ensemble_size, md.write_quorum, md.ack_quorum)
    span = md.ensemble_size

    def holds(entry_id: int) -> bool:
        return position in schedule.write_set(entry_id)

    head = next((e for e in range(first, min(last, first + span - 1) + 1) if holds(e)), None)
    tail = next((e for e in range(last, max(first, last - span + 1) - 1, -1) if holds(e)), None)
    return tuple(sorted({e for e in (head, tail) if e is not None}))


async def check_ledger(
    ctx: ClientContext,
    md: LedgerMetadata,
    registered: Collection[str],
    slots: asyncio.Semaphore,
    codec: EntryCodec,
) -> set[str]:
    """The registered bookies of ``md`` that answer "no such entry" for an entry they should hold,
    or return it corrupt (first/last of each fragment; an open ledger's last fragment skipped).
    The probes carry ``codec``'s master key: bookies answer no read without the ledger's key."""
    ranges = fragment_ranges(md)
    if md.state is not LedgerState.CLOSED:
        ranges = ranges[:-1]
    probes: list[tuple[str, int]] = []
    for first, last, ensemble in ranges:
        if last < first:
            continue
        for position, bookie_id in enumerate(ensemble):
            if bookie_id in registered:
                probes.extend((bookie_id, e) for e in _holder_entries(md, first, last, position))
    lacking: set[str] = set()

    async def probe(bookie_id: str, entry_id: int) -> None:
        async with slots:
            try:
                response = await ctx.pool.request(
                    bookie_id,
                    _read_request(md.ledger_id, entry_id, codec.master_key),
                    ctx.config.read_timeout_s,
                )
            except BKError:
                return  # unreachable: not evidence of loss
        body = getattr(response, "body", None)
        if response.status in (StatusCode.ENOENTRY, StatusCode.ENOLEDGER) or (
            response.status == StatusCode.EOK and body is None
        ):
            log.warning(
                "autorecovery.check_missing_entry",
                ledger_id=md.ledger_id,
                entry_id=entry_id,
                bookie=bookie_id,
            )
            lacking.add(bookie_id)
        elif response.status == StatusCode.EOK and body is not None:
            try:
                codec.decode(body, md.ledger_id, entry_id)
            except DigestMismatch as mismatch:
                log.warning(
                    "autorecovery.check_corrupt_entry",
                    ledger_id=md.ledger_id,
                    entry_id=entry_id,
                    bookie=bookie_id,
                    error=str(mismatch),
                )
                lacking.add(bookie_id)

    await asyncio.gather(*(probe(b, e) for b, e in probes))
    return lacking


def _read_request(ledger_id: int, entry_id: int, key: bytes) -> Callable[[int], m.Request]:
    return lambda rid: m.ReadEntryRequest(rid, ledger_id, entry_id, 0, key)


class Auditor:
    """One candidate for the auditor role (see the module doc). :meth:`run` campaigns and leads
    forever; :meth:`audit_once` and :meth:`check_all` are the leader's two jobs."""

    def __init__(
        self,
        ctx: ClientContext,
        urm: UnderReplicationManager,
        config: AutorecoveryConfig,
        *,
        candidate_id: str,
        metrics: AutorecoveryMetrics | None = None,
    ) -> None:
        self._ctx = ctx
        self._urm = urm
        self._config = config
        self.candidate_id = candidate_id
        self.metrics = metrics or AutorecoveryMetrics()
        self._known: set[str] = set()
        self._missing_since: dict[str, float] = {}
        self._marked: set[str] = set()
        self._registered: set[str] | None = None  # from the watch while it runs
        self._registered_instances: dict[str, str] = {}  # bookie id -> data dir instance, as registered
        self._instances: dict[str, str] = {}
        """The instance this auditor last read or recorded in metadata for each bookie (a cache of
        ``R/replication/instances/``, emptied when it starts leading)."""
        self.leading = asyncio.Event()

    @property
    def missing(self) -> dict[str, float]:
        """Bookies known but not registered, with the loop time this auditor first saw them so."""
        return dict(self._missing_since)

    async def run(self) -> None:
        """Campaign, lead until the lease is lost, campaign again; forever (cancel to stop)."""
        store = self._urm.store
        while True:
            election = Election(
                store, self._urm.keys.auditor, self.candidate_id, ttl_s=self._config.lease_ttl_s
            )
            try:
                await election.campaign()
            except MetadataError as error:
                log.warning("autorecovery.campaign_failed", candidate=self.candidate_id, error=repr(error))
                await asyncio.sleep(self._config.audit_interval_s)
                continue
            except Exception:
                log.exception("autorecovery.campaign_crashed", candidate=self.candidate_id)
                await election.resign()
                await asyncio.sleep(self._config.audit_interval_s)
                continue
            log.info("autorecovery.auditor_elected", candidate=self.candidate_id)
            self.metrics.is_auditor = True
            self.leading.set()
            lead = asyncio.create_task(self._lead(), name="auditor")
            lost = asyncio.create_task(election.lost.wait(), name="auditor-lease")
            failed = False
            try:
                await asyncio.wait({lead, lost}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                self.leading.clear()
                self.metrics.is_auditor = False
                for task in (lead, lost):
                    task.cancel()
                    try:
                        await task
                    except asyncio.CancelledError:
                        pass
                    except Exception as error:
                        # whatever ended the lead (a bug included) must not end this daemon's
                        # candidacy for good: it resigns and campaigns again
                        failed = True
                        log.exception(
                            "autorecovery.auditor_failed", candidate=self.candidate_id, error=repr(error)
                        )
                await election.resign()
            log.warning("autorecovery.auditor_stopped", candidate=self.candidate_id)
            if failed:  # not at once: a lead that fails on its first step would spin
                await asyncio.sleep(self._config.audit_interval_s)

    async def _lead(self) -> None:
        self._instances.clear()  # another auditor may have recorded instances since
        self._known.clear()
        self._missing_since.clear()
        self._marked.clear()
        self._registered = None
        changed = asyncio.Event()
        checker = asyncio.create_task(self._check_loop(), name="auditor-check")
        watcher = asyncio.create_task(self._watch_registrations(changed), name="auditor-watch")
        try:
            with contextlib.suppress(MetadataError):
                self._known |= await referenced_bookies(self._ctx.ledgers)
            while True:
                try:
                    await self.audit_once()
                except (MetadataError, BKError) as error:
                    log.warning("autorecovery.audit_failed", error=repr(error))
                # a registration change starts the next round at once; the delay needs the timer
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(self._config.audit_interval_s, self._next_due_s())):
                        await changed.wait()
                changed.clear()
        finally:
            for task in (checker, watcher):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def _next_due_s(self) -> float:
        """Seconds until the next missing bookie's delay runs out (inf: none is waiting)."""
        now = asyncio.get_running_loop().time()
        delay = self._config.lost_bookie_recovery_delay_s
        waiting = [since + delay - now for b, since in self._missing_since.items() if b not in self._marked]
        return max(0.0, min(waiting, default=float("inf")))

    async def _watch_registrations(self, changed: asyncio.Event) -> None:
        """Keep ``_registered`` current from the registration watch (metadata/bookies.py); while
        the watch is down, rounds list the registrations themselves."""
        store, root = self._urm.store, self._urm.keys.root
        while True:
            try:
                async with contextlib.aclosing(watch_bookies(store, root)) as updates:
                    async for bookies in updates:
                        self._registered = set(bookies.registered)
                        self._registered_instances = _instances(bookies)
                        changed.set()
            except MetadataError as error:
                log.warning("autorecovery.registration_watch_failed", error=repr(error))
            self._registered = None
            await asyncio.sleep(self._config.audit_interval_s)

    async def audit_once(self) -> list[int]:
        """One lost-bookie round; returns the ledgers it marked."""
        store, root = self._urm.store, self._urm.keys.root
        registered = self._registered
        instances = self._registered_instances
        if registered is None:
            bookies = await list_bookies(store, root)
            registered = set(bookies.registered)
            instances = _instances(bookies)
        replaced = await self._mark_replaced(instances)
        cookies, _ = await list_all(store, f"{root}/cookies/")
        self._known |= registered | {kv.key.rsplit("/", 1)[-1] for kv in cookies}
        now = asyncio.get_running_loop().time()
        # Sorted: a set of names iterates in an order that changes with the process's hash seed,
        # and what is logged (and the order of ``_missing_since``) would with it (a simulated seed
        # replayed in another process gave another trace).
        for bookie_id in sorted(registered):
            if self._missing_since.pop(bookie_id, None) is not None:
                log.info("autorecovery.bookie_back", bookie=bookie_id)
            self._marked.discard(bookie_id)
        for bookie_id in sorted(self._known - registered):
            if bookie_id not in self._missing_since:
                log.info(
                    "autorecovery.bookie_missing",
                    bookie=bookie_id,
                    lost_after_s=self._config.lost_bookie_recovery_delay_s,
                )
                self._missing_since[bookie_id] = now
        delay = self._config.lost_bookie_recovery_delay_s - DUE_SLACK_S
        due = {
            b for b, since in self._missing_since.items() if b not in self._marked and now - since >= delay
        }
        if not due:
            return replaced
        marked = await mark_ledgers_on(self._ctx.ledgers, self._urm, due, reason="lost")
        self._marked |= due
        self.metrics.ledgers_marked += len(marked)
        log.warning("autorecovery.bookies_lost", bookies=sorted(due), ledgers_marked=len(marked))
        return sorted(set(marked) | set(replaced))

    async def _mark_replaced(self, instances: dict[str, str]) -> list[int]:
        """A bookie registered with another data dir instance than before (its disk was replaced,
        `bkaio bookie format`) lost what the old one held, even if it came back within the delay:
        its "no such entry" answers must not stand for entries it had. Mark its ledgers now.

        "Before" is what metadata records (``R/replication/instances/``), not this process's
        memory: an auditor elected after the replacement (a failover, a daemon restart) tells it
        too. A bookie whose registered instance differs from the one this auditor last read or
        recorded is looked up there; its ledgers are marked, then the new instance is recorded."""
        changed = {b: i for b, i in instances.items() if self._instances.get(b) != i}
        if not changed:
            return []
        seen = {bookie_id: await self._urm.seen_instance(bookie_id) for bookie_id in sorted(changed)}
        replaced = {
            bookie_id
            for bookie_id, instance in changed.items()
            if (before := seen[bookie_id]) is not None and before.instance != instance
        }
        marked: list[int] = []
        if replaced:
            registered_at = {b: await self._registered_at(b, changed[b]) for b in sorted(replaced)}
            marked = await mark_replaced(self._ctx.ledgers, self._urm, registered_at)
            self.metrics.ledgers_marked += len(marked)
            log.warning("autorecovery.bookies_replaced", bookies=sorted(replaced), ledgers_marked=len(marked))
        # only once marked: a failed round tries again; a record that changed meanwhile (another
        # auditor's) is read again at the next round
        for bookie_id, instance in sorted(changed.items()):
            if await self._urm.record_instance(bookie_id, instance, seen[bookie_id]):
                self._instances[bookie_id] = instance
        return marked

    async def _registered_at(self, bookie_id: str, instance: str) -> int | None:
        """The store revision at which ``bookie_id``'s registration naming data dir ``instance``
        was created (the later one if both states hold one), or None when none does now. It may be
        a later registration than the instance's first (a re-registration, a move to read-only):
        ledgers placed on the new instance before it are marked all the same (safe, not lost)."""
        found: list[int] = []
        for state in BookieState:
            kv = await self._urm.store.get(self._urm.keys.bookie(state.value, bookie_id))
            if kv is None:
                continue
            try:
                info = BookieInfo.decode(kv.key, kv.value)
            except MetadataFormatError:
                continue
            if info.attributes.get("instance_id") == instance:
                found.append(kv.create_revision)
        return max(found, default=None)

    async def _check_loop(self) -> None:
        interval = self._config.check_interval_s
        if interval <= 0:
            return
        while True:
            await asyncio.sleep(interval)
            try:
                await self.check_all()
            except (MetadataError, BKError) as error:
                log.warning("autorecovery.check_failed", error=repr(error))

    def _codec_for(self, md: LedgerMetadata) -> EntryCodec | None:
        """The ledger's codec (its key, which every probe carries, and its digest) when the daemon
        has its password; None otherwise: bookies answer no read without the key, so the ledger's
        entries cannot be probed (its lost bookies are still found by registration)."""
        try:
            return codec_for(md, password_for(md, self._config.passwords))
        except NoPasswordForLedger:
            return None

    async def check_all(self) -> list[int]:
        """The periodic check of every ledger (module doc); returns the ledgers it marked."""
        bookies = await list_bookies(self._urm.store, self._urm.keys.root)
        registered = set(bookies.registered)
        slots = asyncio.Semaphore(self._config.check_window)
        marked: list[int] = []

        async def visit(md: LedgerMetadata) -> None:
            codec = self._codec_for(md)
            if codec is None:
                log.info("autorecovery.check_skipped_no_password", ledger_id=md.ledger_id)
                return
            lacking = await check_ledger(self._ctx, md, registered, slots, codec)
            if lacking:
                await self._urm.mark(md.ledger_id, lacking, reason="check")
                marked.append(md.ledger_id)

        scanned = await _scan(self._ctx.ledgers, visit)
        self.metrics.checks_run += 1
        self.metrics.ledgers_marked += len(marked)
        log.info("autorecovery.check_done", ledgers=scanned, marked=len(marked))
        return sorted(marked)
