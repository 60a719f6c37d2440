"""Bookie garbage collection: forget ledgers deleted from metadata, then return their disk space.

Deleting a ledger (``BookKeeper.delete_ledger``) removes only its metadata; each bookie finds out by
itself. A GC pass (periodic, every ``gc_interval_s``, or on demand through the admin endpoint's
``/gc`` and ``bkaio bookie gc``) does, in order (docs/bookie.md, *Garbage collection*):

1. **Deleted ledgers.** Snapshot the ids of the ledgers this bookie holds, *then* list the ledger
   ids in metadata and read the id counter. A local ledger is collected only when it is absent
   from that listing and was already absent from a listing at least ``gc_deleted_ledger_grace_s``
   earlier (so anything racing a create survives), or ``gc_future_ledger_grace_s`` for an id at or
   above the counter: no client was ever handed it, so its record came from a fence or an add of
   an id nobody allocated (a squatter, a stray tool); legitimate data never lies there, since
   clients allocate the id, create the metadata, then write. A listing that fails, times out,
   finds no cluster or no id counter at the root collects nothing. A root that no longer holds
   the cluster the bookie's COOKIE names (:class:`ForeignCluster`: the metadata store was wiped,
   re-initialised or replaced under the running bookie) stops every metadata step for good: the
   bookie turns read-only and unhealthy, saying what to do, until a restart. Collected ledgers
   leave the index at once (:meth:`bookie.storage.Storage.forget_ledger`) and a checkpoint is
   written, so a restart does not bring them back.
2. **Compaction** (:mod:`bookie.compaction`): segments whose live fraction fell under
   ``compaction_threshold`` get their live entries copied to the journal head, throttled, the
   index switched once the copies are durable; fully dead segments are deleted after a checkpoint
   that no longer needs them. The journal's current segment is first rolled when enough of it is
   dead (``compaction_roll_dead_bytes``), so it is judged too.

Without metadata (a standalone bookie) step 1 is skipped: nothing says which ledgers were deleted.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import itertools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import structlog

import metadata
from bookie.compaction import Compactor, Progress
from bookie.ledger_keys import KeyInfo
from bookie.storage import Storage
from bookie.threads import OS_THREADS, Threads
from bookkeeper_aio.common.log_limit import LogLimiter
from metadata.keys import NAME_CHARS_MAX
from metadata.store import LIST_PAGE_LIMIT_MAX
from metadata.underreplication import UnderReplicationManager

log = structlog.get_logger(__name__)

REPLICATION_LOCK_TTL_S = 30
"""Lease of the replication lock the over-replication check holds while it judges one ledger; the
ledger is forgotten only within the first half of it (from before the lease was asked for)."""
REPLICA_CHECK_RETRY_S = 600.0
"""A check that could not read some ledgers runs again this soon (not a whole interval later)."""
METADATA_PAGE = 1000
"""Ledgers per metadata listing of a pass (each page is decoded in one go on the event loop)."""
LOOP_SLICE = 20_000
"""Ledger ids a pass puts in (or checks against) a set between two turns of the event loop: with
a million ledgers, a set built or walked in one go holds the loop for a tenth of a second or more."""
FORGET_SLICE = 2_000
"""Ledgers forgotten between two turns of the event loop (each costs a few microseconds)."""
SORT_CHUNK = 16_384
"""Ledger ids :func:`sorted_ids` sorts in one go (~1 ms, ~3 ms when the ids lie scattered in
memory); a million sorted in one call held the loop for 16 ms, and a pass sorted them twice."""


@dataclass(frozen=True)
class GcConfig:
    interval_s: float = 900.0
    """Seconds between periodic passes; 0 = only on demand (admin ``/gc``, ``bkaio bookie gc``)."""
    deleted_ledger_grace_s: float = 60.0
    """A ledger must be missing from metadata for this long (two listings) before it is collected."""
    future_ledger_grace_s: float = 3600.0
    """The same for a ledger id at or above the id counter (never handed out to a client)."""
    compaction_threshold: float = 0.5
    """Segments whose live bytes are below this fraction of their size are compacted; 0 = never."""
    compaction_rate_bytes_per_s: int = 32 * 1024 * 1024
    """Throttle of the copies compaction makes, so foreground adds keep their latency."""
    compaction_roll_dead_bytes: int = 16 * 1024 * 1024
    """The journal's current segment is rolled (so it can be compacted) once this many of its
    bytes are dead and its live fraction is under ``compaction_threshold``; 0 = never."""
    metadata_timeout_s: float = 60.0
    """Bound on one metadata listing; a pass whose listing takes longer collects nothing."""
    over_replicated_interval_s: float = 86400.0
    """Seconds between checks for over-replicated ledgers (held here, placed elsewhere); 0 = never."""


class MetadataView(NamedTuple):
    """What metadata says, as read by one pass."""

    ledger_pages: AsyncIterator[Sequence[int]]
    """The ledger ids, page by page in increasing order (a listing's order), read as the pass walks
    them: a million ids held at once would be built, and freed, on the event loop in one go."""
    id_counter: int
    """The id generator's next unallocated id: ledger ids at or above it were never handed out."""


class LedgerCatalog(Protocol):
    """The ledgers metadata knows (the etcd one is :class:`MetadataCatalog`; tests pass twins)."""

    async def view(self) -> MetadataView:
        """Raise (here or from the pages) when the listing cannot be trusted whole (store down, no
        cluster at the root)."""
        ...

    async def close(self) -> None: ...


class ReplicaState(NamedTuple):
    """What a ledger's metadata says about this bookie's copy of it."""

    closed: bool
    listed: bool
    """This bookie is in one of the ledger's ensembles (its copy is needed)."""
    marked: bool
    """An under-replication mark exists: a worker may be copying the ledger, maybe to this bookie."""
    replaced: bool = False
    """The ledger's history records this bookie replaced in one of its fragments: its copy was
    moved elsewhere. Without it, a copy of a closed ledger that lists this bookie nowhere is an
    *orphan* (a copy whose CAS never happened: a worker's copy whose metadata update failed, or
    that was retried to another replacement); both are collected alike, counted apart."""


class ReplicaCatalog(Protocol):
    """What the over-replication check needs from metadata (:class:`MetadataCatalog` on etcd)."""

    async def replica_state(self, ledger_id: int, bookie_id: str) -> ReplicaState | None:
        """None: metadata does not hold the ledger (the deleted-ledger step judges it)."""
        ...

    def replica_states(
        self, ledger_ids: Sequence[int], bookie_id: str
    ) -> AsyncGenerator[list[tuple[int, ReplicaState]], None]:
        """The first look at many ledgers (``ledger_ids`` in increasing order), a page at a time:
        the states of those whose metadata may leave ``bookie_id`` out of every ensemble; the
        others (surely listing it, or no metadata) cannot be over-replicated and may be left out.
        The judgement of a ledger found so is made again from :meth:`replica_state` under its lock."""
        ...

    def replication_lock(self, ledger_id: int, owner: str) -> contextlib.AbstractAsyncContextManager[bool]:
        """Hold the ledger's replication lock (the one workers take before copying): True when taken."""
        ...


class MetadataUnusable(RuntimeError):
    """The metadata cannot tell which ledgers exist (no cluster at the root, a bad id counter)."""


class ForeignCluster(MetadataUnusable):
    """The metadata root no longer holds the cluster this bookie's data belongs to (none, or
    another): none of this bookie's ledgers is in it, and a new ledger there may reuse one's id."""


CLUSTER_RECHECK_S = 1.0
"""A key lookup (:meth:`MetadataCatalog.key_info`) checks the cluster again when the last check is
older than this: at most one more metadata read a second on the path of new ledgers' first adds."""


KEY_INFOS_SPAN_MAX = 4
""":meth:`MetadataCatalog.key_infos` lists an id range at most this many times as long as the ids
asked for (else they are read one by one): ledgers created together have dense ids."""


def _key_info_of(md: metadata.LedgerMetadata) -> KeyInfo:
    return KeyInfo(
        exists=True,
        check=md.password_hash if md.key_salt else None,
        writable=md.state is metadata.LedgerState.OPEN,
    )


class MetadataCatalog:
    """:class:`LedgerCatalog` over the cluster's metadata store (its own connection).

    ``cluster_id`` says which cluster this bookie's data belongs to (the instance id its COOKIE
    names: :func:`bookie.cookie.read_cluster_binding`; None before its first registration). Every
    judgement made against metadata first checks that the root still holds that cluster (a key
    lookup, within :data:`CLUSTER_RECHECK_S`): GC's listings, the over-replication check, limbo's,
    and key lookups (a new ledger of another cluster, under the id of one held here, would have its
    key confirmed and the held ledger's record dropped as a squatter's). The start's check
    (:mod:`bookie.registration`) does not cover a store wiped and re-initialised under a running
    bookie: its GC would find none of its ledgers and collect them all. Once a check finds another
    cluster, or none, every later one raises :class:`ForeignCluster` without looking: the only way
    back to its own cluster is a restored backup, which a bookie must not judge against with GC on
    (docs/operations.md, *Backing up metadata*); a restart checks afresh."""

    def __init__(
        self,
        url: str,
        connect: Callable[[str], Any] = metadata.connect,
        *,
        cluster_id: Callable[[], str | None],
        scan_ledgers_per_s: float = 0.0,
    ) -> None:
        self._url = url
        self._cluster_id = cluster_id
        self._scan_ledgers_per_s = scan_ledgers_per_s
        """Pace of :meth:`replica_states`' listings (whole values): unpaced, three bookies started
        together scanned 700,000 ledgers at once, and etcd, busy with them, kept new ledgers' key
        lookups (their first adds) past the clients' add timeout. 0 = unpaced."""
        self._connect = connect  # tests pass the in-memory store's
        self._connection: Any = None
        self._manager: metadata.LedgerManager | None = None
        self.foreign_cluster: str | None = None
        """Set (for good) by the first check that found another cluster at the root, or none."""
        self._cluster_checked_at = -CLUSTER_RECHECK_S

    async def key_info(self, ledger_id: int) -> KeyInfo:
        """What metadata says of ``ledger_id``'s key (:class:`bookie.ledger_keys.KeySource`)."""
        await self._recheck_cluster()
        try:
            versioned = await self._ledgers().read(ledger_id)
        except metadata.NoSuchLedger:
            return KeyInfo(exists=False, check=None)
        return _key_info_of(versioned.metadata)

    async def key_infos(self, ledger_ids: Sequence[int]) -> dict[int, KeyInfo]:
        """:meth:`key_info` of many ledgers in one listing of their id range, when they are dense
        (a bookie's first adds of ledgers a client created together: at 100,000 new ledgers a read
        each was a third of the bookie's loop); ids left out (spread out, undecodable) are for the
        caller to read one by one (:class:`bookie.ledger_keys.KeySource`)."""
        ids = sorted(set(ledger_ids))
        first, span = ids[0], ids[-1] - ids[0] + 1
        if span > len(ids) * KEY_INFOS_SPAN_MAX or span > LIST_PAGE_LIMIT_MAX:
            return {}
        await self._recheck_cluster()
        undecodable: set[int] = set()
        # Ledger keys are fixed-width, so the ``span`` keys listed from ``first`` hold every ledger
        # of [first, first + span) that exists: an id of that range not listed does not exist.
        try:
            page = await self._ledgers().read_page(
                start_after=first - 1 if first else None,
                limit=span,
                on_undecodable=lambda ledger_id, error: undecodable.add(ledger_id),
            )
        except metadata.InvalidMetadata:  # a foreign key under the ledgers: read them one by one
            return {}
        infos: dict[int, KeyInfo] = {}
        # A short page (large metadata) says nothing of the ids after its last one: read one by one.
        listed_upto = page.ledger_ids[-1] if page.more and page.ledger_ids else ids[-1]
        for ledger_id in ids:
            if ledger_id > listed_upto:
                break
            versioned = page.ledgers.get(ledger_id)
            if versioned is not None:
                infos[ledger_id] = _key_info_of(versioned.metadata)
            elif ledger_id not in undecodable:
                infos[ledger_id] = KeyInfo(exists=False, check=None)
        return infos

    def _ledgers(self) -> metadata.LedgerManager:
        """One manager over the connection (a manager per read seeded a random generator from the
        OS each time)."""
        conn = self._connected()
        if self._manager is None or self._manager.store is not conn.store:
            self._manager = metadata.LedgerManager(conn.store, conn.root)
        return self._manager

    async def _check_cluster(self, conn: Any) -> None:
        """Raise :class:`MetadataUnusable` unless the root holds this bookie's own cluster
        (:class:`ForeignCluster` when it holds another, or none, and from then on)."""
        if self.foreign_cluster is None:
            cluster = await metadata.read_cluster_info(conn.store, conn.root)
            ours = self._cluster_id()
            if ours is None:  # never registered: nothing to compare with (and nothing collected)
                found = f"no cluster at {self._url}" if cluster is None else "the COOKIE names no cluster yet"
                raise MetadataUnusable(f"{found}: judging nothing against the metadata")
            if cluster is not None and cluster.instance_id == ours:
                self._cluster_checked_at = asyncio.get_running_loop().time()
                return
            found = "no cluster" if cluster is None else f"cluster {cluster.instance_id}"
            self.foreign_cluster = (
                f"{self._url} holds {found}, but this bookie's data belongs to cluster {ours} (its "
                "COOKIE): the metadata store was wiped, re-initialised or replaced while the bookie "
                "ran. It judges nothing against it any more (GC collects nothing, limbo stays, keys "
                "of new ledgers are not checked: their adds fail) and stays read-only. Bring back "
                "this cluster's metadata (restoring a backup: docs/operations.md, *Backing up "
                "metadata*, with gc_interval_s = 0 first) and restart the bookie. If that metadata "
                "is lost for good, nothing can read this bookie's ledgers: stop it, and wipe its "
                "data dir only once its data is not wanted (it then joins the new cluster as a new "
                "bookie; a restart against the new cluster with this data dir is refused)"
            )
            log.error("bookie.foreign_cluster", problem=self.foreign_cluster)
        raise ForeignCluster(self.foreign_cluster)

    async def _recheck_cluster(self) -> None:
        """:meth:`_check_cluster` unless one passed within :data:`CLUSTER_RECHECK_S`."""
        if (
            self.foreign_cluster is not None
            or asyncio.get_running_loop().time() - self._cluster_checked_at >= CLUSTER_RECHECK_S
        ):
            await self._check_cluster(self._connected())

    async def view(self) -> MetadataView:
        conn = self._connected()
        await self._check_cluster(conn)
        manager = metadata.LedgerManager(conn.store, conn.root)
        counter = await conn.store.get(manager.keys.idgen)
        if counter is None:  # no ledger was ever created here, or the metadata lost its counter
            raise MetadataUnusable(f"no id counter at {manager.keys.idgen}: collecting nothing")
        if not counter.value.isdigit():
            raise MetadataUnusable(f"id counter {manager.keys.idgen} holds {counter.value[:32]!r}")
        return MetadataView(self._ledger_pages(manager), int(counter.value))

    @staticmethod
    async def _ledger_pages(manager: metadata.LedgerManager) -> AsyncIterator[Sequence[int]]:
        start_after: int | None = None
        while True:
            page = await manager.list_page(start_after=start_after, limit=METADATA_PAGE)
            yield page.ledger_ids
            if not page.more or not page.ledger_ids:
                return
            start_after = page.ledger_ids[-1]

    async def replica_state(self, ledger_id: int, bookie_id: str) -> ReplicaState | None:
        conn = self._connected()
        # a cluster re-initialised since the scan may hold a ledger of this id: not ours to judge
        await self._check_cluster(conn)
        urm = UnderReplicationManager(conn.store, conn.root)
        # The mark before the metadata: a mark removed after this read was removed after the CAS
        # that listed a copy, and the metadata read next sees that CAS.
        marked = await urm.get(ledger_id) is not None
        try:
            current = await metadata.LedgerManager(conn.store, conn.root).read(ledger_id)
        except metadata.NoSuchLedger:
            return None
        return _replica_state(current.metadata, bookie_id, marked)

    async def replica_states(
        self, ledger_ids: Sequence[int], bookie_id: str
    ) -> AsyncGenerator[list[tuple[int, ReplicaState]], None]:
        conn = self._connected()
        await self._check_cluster(conn)
        urm = UnderReplicationManager(conn.store, conn.root)
        # Every mark before any metadata, as replica_state reads them (and they are few); one that
        # cannot be decoded counts as a mark (its ledger keeps its replicas here).
        marked: set[int] = set()
        async for mark in urm.iter_marks(on_undecodable=lambda ledger_id, _: marked.add(ledger_id)):
            marked.add(mark.ledger_id)
        manager = metadata.LedgerManager(conn.store, conn.root)
        i, count = 0, len(ledger_ids)
        loop, pace = asyncio.get_running_loop(), self._scan_ledgers_per_s
        started, listed = loop.time(), 0
        while i < count:
            if pace > 0 and (ahead := started + listed / pace - loop.time()) > 0:
                await asyncio.sleep(ahead)
            listed += METADATA_PAGE
            # A listing from the next ledger held here: where they are dense (they mostly are),
            # one listing covers a page of them; where sparse, one per ledger at worst.
            first = ledger_ids[i]
            page = await manager.read_page(
                start_after=first - 1 if first > 0 else None,
                limit=METADATA_PAGE,
                not_holding=bookie_id,
                on_undecodable=_undecodable,  # left out: its copies here are kept
            )
            states = [
                (ledger_id, _replica_state(versioned.metadata, bookie_id, ledger_id in marked))
                for ledger_id, versioned in page.ledgers.items()
                if _holds(ledger_ids, ledger_id)
            ]
            if states:
                yield states
            if not page.more or not page.ledger_ids:
                return  # the ledgers held after the last one listed have no metadata
            i = bisect.bisect_right(ledger_ids, page.ledger_ids[-1], lo=i)

    async def ledgers_on(self, bookie_id: str) -> AsyncIterator[Sequence[int]]:
        """The ledgers whose ensembles list ``bookie_id``, page by page (:class:`bookie.limbo.LimboCatalog`).
        Raises :class:`MetadataUnusable` without this bookie's cluster at the root (an empty listing
        of the wrong root would take every ledger out of limbo)."""
        conn = self._connected()
        await self._check_cluster(conn)
        manager = metadata.LedgerManager(conn.store, conn.root)
        start_after: int | None = None
        while True:
            undecodable: list[int] = []  # counted as listed: they stay in limbo
            page = await manager.read_page(
                start_after=start_after,
                limit=METADATA_PAGE,
                on_undecodable=functools.partial(_undecodable, into=undecodable),
            )
            yield [
                ledger_id
                for ledger_id, versioned in page.ledgers.items()
                if any(bookie_id in ensemble for _, ensemble in versioned.metadata.ensembles)
            ] + undecodable
            if not page.more or not page.ledger_ids:
                return
            start_after = page.ledger_ids[-1]

    async def ledgers_metadata(
        self, ledger_ids: Sequence[int]
    ) -> AsyncIterator[list[tuple[int, metadata.LedgerMetadata | None]]]:
        """The metadata of ``ledger_ids`` (increasing), None for one metadata does not hold, a
        listing page at a time (:class:`bookie.limbo.LimboCatalog`)."""
        conn = self._connected()
        await self._check_cluster(conn)  # another cluster's "no such ledger" would clear limbo
        manager = metadata.LedgerManager(conn.store, conn.root)
        i, count = 0, len(ledger_ids)
        loop, pace = asyncio.get_running_loop(), self._scan_ledgers_per_s
        started, listed = loop.time(), 0
        while i < count:
            if pace > 0 and (ahead := started + listed / pace - loop.time()) > 0:
                await asyncio.sleep(ahead)
            listed += METADATA_PAGE
            first = ledger_ids[i]
            undecodable: list[int] = []  # left out: neither deleted nor settled
            page = await manager.read_page(
                start_after=first - 1 if first > 0 else None,
                limit=METADATA_PAGE,
                on_undecodable=functools.partial(_undecodable, into=undecodable),
            )
            last = page.ledger_ids[-1] if page.ledger_ids else first
            out = []
            while i < count and (not page.more or ledger_ids[i] <= last):
                ledger_id = ledger_ids[i]
                i += 1
                if ledger_id in undecodable:
                    continue
                versioned = page.ledgers.get(ledger_id)
                out.append((ledger_id, None if versioned is None else versioned.metadata))
            yield out

    async def mark_under_replicated(self, ledger_id: int, bookie_id: str, reason: str) -> None:
        conn = self._connected()
        await UnderReplicationManager(conn.store, conn.root).mark(ledger_id, [bookie_id], reason=reason)

    @contextlib.asynccontextmanager
    async def replication_lock(self, ledger_id: int, owner: str) -> AsyncIterator[bool]:
        conn = self._connected()
        urm = UnderReplicationManager(conn.store, conn.root)
        lease = await conn.store.grant_lease(REPLICATION_LOCK_TTL_S)
        try:
            yield await urm.try_lock(ledger_id, owner, lease)
        finally:
            with contextlib.suppress(metadata.MetadataError):
                await conn.store.revoke_lease(lease)  # releases the lock with it

    def _connected(self) -> Any:
        if self._connection is None:
            self._connection = self._connect(self._url)
        return self._connection

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.close()


@dataclass
class GcReport:
    """What one pass did (the admin endpoint shows the last one, and the running one's progress)."""

    trigger: str
    started_at: float
    """Wall-clock seconds (the collector's ``wall_clock``: the bookie's clock seam)."""
    finished_at: float | None = None
    phase: str = "starting"
    error: str | None = None
    ledgers_local: int = 0
    ledgers_in_metadata: int | None = None
    ledgers_collected: int = 0
    ledgers_waiting_grace: int = 0
    ledgers_unallocated: int = 0
    """Missing from metadata and at or above the id counter (they wait ``future_ledger_grace_s``)."""
    replicas_checked: int = 0
    """Ledgers whose placement the over-replication check read (0: no check was due)."""
    over_replicated_collected: int = 0
    """Ledgers collected because metadata lists this bookie in none of their ensembles (of
    ``ledgers_collected``), orphans included."""
    orphans_collected: int = 0
    """Of ``over_replicated_collected``, those whose history does not record this bookie replaced:
    copies no metadata ever listed (a failed or retried autorecovery copy)."""
    over_replicated_waiting: int = 0
    over_replicated_busy: int = 0
    """Collectable at the first look, but a worker held the ledger's lock: judged again next time."""
    replica_errors: int = 0
    """Ledgers whose placement could not be read (the check runs again sooner)."""
    segments_compacted: int = 0
    segments_rolled: int = 0
    """The journal's current segment, rolled because it was mostly dead (0 or 1)."""
    segments_deleted: int = 0
    bytes_copied: int = 0
    bytes_freed: int = 0
    entries_copied: int = 0
    entries_corrupt: int = 0
    progress: Progress = field(default_factory=Progress)

    def as_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["progress"] = dict(self.progress.__dict__)
        return out


class GarbageCollector:
    """Owner of the GC task of one bookie: periodic passes, on-demand triggers, the last report."""

    def __init__(
        self,
        storage: Storage,
        config: GcConfig,
        catalog: LedgerCatalog | None,
        clock: Callable[[], float] | None = None,
        *,
        threads: Threads = OS_THREADS,
        copy_refused: Callable[[], str | None] = lambda: None,
        replicas: ReplicaCatalog | None = None,
        bookie_id: str = "",
        wall_clock: Callable[[], float] = time.time,
        on_foreign_cluster: Callable[[str], None] = lambda problem: None,
    ) -> None:
        """``on_foreign_cluster``: told the problem, once, when a pass finds the metadata root no
        longer holds this bookie's cluster (:class:`ForeignCluster`; the server then holds the
        bookie read-only and unhealthy)."""
        self.storage = storage
        self.foreign_cluster: str | None = None
        """The :class:`ForeignCluster` problem a pass met (for good: the catalog refuses from then on)."""
        self._on_foreign_cluster = on_foreign_cluster
        self._wall_clock = wall_clock
        self.replicas = replicas
        self.bookie_id = bookie_id
        self._over_replicated_since: dict[int, float] = {}
        self._held: list[int] | None = None
        self._replicas_due = 0.0  # the first pass checks
        self._executor = threads.executor("storage-gc")
        self._copy_refused = copy_refused
        self.config = config
        self.catalog = catalog
        self._loop = asyncio.get_running_loop()
        self._clock = clock or self._loop.time
        self._missing_since: dict[int, float] = {}
        self._wanted = asyncio.Event()
        self._wanted_by = "periodic"
        self._task: asyncio.Task[None] | None = None
        self.running: GcReport | None = None
        self.last: GcReport | None = None
        self.passes = 0
        self.ledgers_collected_total = 0
        self.over_replicated_collected_total = 0
        self.orphans_collected_total = 0
        self.bytes_freed_total = 0
        self.bytes_copied_total = 0
        self.segments_deleted_total = 0

    def start(self) -> None:
        self._task = self._loop.create_task(self._run_loop(), name="bookie-gc")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.catalog is not None:
            with contextlib.suppress(Exception):
                await self.catalog.close()
        self._executor.shutdown(wait=True)

    def abort(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._executor.shutdown(wait=False)

    def trigger(self, by: str = "admin") -> bool:
        """Ask for a pass now; False when one is already running (it is not queued twice)."""
        if self.running is not None:
            return False
        self._wanted_by = by
        self._wanted.set()
        return True

    def status(self) -> dict[str, Any]:
        return {
            "running": None if self.running is None else self.running.as_json(),
            "last": None if self.last is None else self.last.as_json(),
            "passes": self.passes,
            "ledgers_collected_total": self.ledgers_collected_total,
            "over_replicated_collected_total": self.over_replicated_collected_total,
            "orphans_collected_total": self.orphans_collected_total,
            "bytes_freed_total": self.bytes_freed_total,
            "bytes_copied_total": self.bytes_copied_total,
            "segments_deleted_total": self.segments_deleted_total,
            "interval_s": self.config.interval_s,
            "metadata": self.catalog is not None,
        }

    async def _run_loop(self) -> None:
        interval = self.config.interval_s
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval if interval > 0 else None):
                    await self._wanted.wait()
            by, self._wanted_by = self._wanted_by, "periodic"
            self._wanted.clear()
            await self.run_once(by)

    async def run_once(self, trigger: str = "manual") -> GcReport:
        """One whole pass. A step that fails is logged and named in the report (the next pass
        retries); a failed metadata listing still lets compaction run. Never raises but on cancel."""
        report = GcReport(trigger, self._wall_clock())
        self.running = report
        self._held = None
        log.info("gc.started", trigger=trigger)
        errors: list[str] = []
        try:
            for step in (self._collect_deleted, self._collect_over_replicated, self._compact):
                try:
                    await step(report)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 (metadata down, a disk error: retried next pass)
                    errors.append(f"{report.phase}: {type(exc).__name__}: {exc}")
                    log.warning("gc.failed", phase=report.phase, error=repr(exc))
                    if isinstance(exc, ForeignCluster) and self.foreign_cluster is None:
                        self.foreign_cluster = str(exc)
                        self._on_foreign_cluster(self.foreign_cluster)
                    if report.phase == "checkpoint":
                        break  # the checkpoint failed (a disk error): compact nothing this pass
            report.error = "; ".join(errors) or None
        finally:
            self._held = None
            report.phase = "done" if report.error is None else "failed"
            report.finished_at = self._wall_clock()
            self.running = None
            self.last = report
            self.passes += 1
            self.ledgers_collected_total += report.ledgers_collected
            self.over_replicated_collected_total += report.over_replicated_collected
            self.orphans_collected_total += report.orphans_collected
            self.bytes_freed_total += report.bytes_freed
            self.bytes_copied_total += report.bytes_copied
            self.segments_deleted_total += report.segments_deleted
        log.info(
            "gc.finished",
            trigger=trigger,
            seconds=round(report.finished_at - report.started_at, 3),
            ledgers_collected=report.ledgers_collected,
            ledgers_waiting_grace=report.ledgers_waiting_grace,
            over_replicated_collected=report.over_replicated_collected,
            orphans_collected=report.orphans_collected,
            segments_compacted=report.segments_compacted,
            segments_deleted=report.segments_deleted,
            bytes_copied=report.bytes_copied,
            bytes_freed=report.bytes_freed,
            error=report.error,
        )
        return report

    async def _held_ids(self) -> list[int]:
        """The ids of the ledgers held when the pass first asked, in increasing order: sorted once
        per pass (:func:`sorted_ids`), for both metadata steps. Ledgers forgotten since are judged
        harmlessly again (their metadata is gone, or ``forget_ledger`` finds nothing), and those
        made since wait for the next pass, as they would with a snapshot of their own."""
        if self._held is None:
            self._held = await sorted_ids(self.storage.ledgers)
        return self._held

    async def _collect_deleted(self, report: GcReport) -> None:
        storage = self.storage
        local = await self._held_ids()  # before the listing: a ledger made later is not judged now
        report.ledgers_local = len(local)
        if self.catalog is None:
            return
        report.phase = "listing metadata"
        async with asyncio.timeout(self.config.metadata_timeout_s):
            view = await self.catalog.view()
            missing = await self._missing(local, view.ledger_pages, report)
        report.phase = "collecting deleted ledgers"
        now = self._clock()
        grace = self.config.deleted_ledger_grace_s
        future_grace = max(grace, self.config.future_ledger_grace_s)
        since = self._missing_since
        back = list(since)
        step = LOOP_SLICE // 4  # a bisect each (~0.4 us): ~2 ms per turn
        for start in range(0, len(back), step):
            for ledger_id in back[start : start + step]:
                if not _holds(missing, ledger_id):  # (increasing: no set of them all is built)
                    del since[ledger_id]  # back in metadata, or gone from the bookie
            await asyncio.sleep(0)
        collected = []
        for n, ledger_id in enumerate(missing, 1):
            first_seen = since.setdefault(ledger_id, now)
            unallocated = ledger_id >= view.id_counter
            report.ledgers_unallocated += unallocated
            if now - first_seen >= (future_grace if unallocated else grace):
                if storage.forget_ledger(ledger_id):
                    collected.append(ledger_id)
                del since[ledger_id]
            else:
                report.ledgers_waiting_grace += 1
            if n % FORGET_SLICE == 0:
                await asyncio.sleep(0)
        report.ledgers_collected = len(collected)
        if collected:
            log.info("gc.ledgers_collected", count=len(collected), first=collected[:10])
            report.phase = "checkpoint"
            await storage.write_checkpoint()  # a restart must not bring them back

    @staticmethod
    async def _missing(local: list[int], pages: AsyncIterator[Sequence[int]], report: GcReport) -> list[int]:
        """The ids of ``local`` (increasing) absent from the listing's ``pages`` (increasing): both
        walked together, a loop turn every LOOP_SLICE local ids (a million of them, or a page that
        spans them all, must not hold the loop)."""
        missing: list[int] = []
        i, count, listed, walked = 0, len(local), 0, 0
        async for page in pages:
            listed += len(page)
            if not page:
                continue
            last, found_at = page[-1], 0
            while i < count and local[i] <= last:
                ledger_id = local[i]
                while page[found_at] < ledger_id:  # stops at ``last`` at the latest
                    found_at += 1
                if page[found_at] != ledger_id:
                    missing.append(ledger_id)
                i += 1
                walked += 1
                if walked % LOOP_SLICE == 0:
                    await asyncio.sleep(0)
        missing.extend(local[i:])  # above the last id listed
        report.ledgers_in_metadata = listed
        return missing

    async def _collect_over_replicated(self, report: GcReport) -> None:
        """Forget CLOSED ledgers whose metadata lists this bookie in none of their ensembles, every
        ``over_replicated_interval_s``: copies moved elsewhere (re-replicated while it was away:
        the history records it replaced) and orphans (copies no metadata ever listed: a worker's
        copy whose CAS failed, or that was retried to another replacement). A ledger is collected
        when checks at least ``deleted_ledger_grace_s`` apart found it so and, under its
        replication lock (the lock a worker holds from before its copy until after its CAS, and
        every write of its heal is guarded by it), a fresh read still does: no under-replication
        mark (a heal is done with it), CLOSED (only re-replication changes a closed ledger's
        ensembles), and this bookie in none of its ensembles. Why that is safe: docs/bookie.md
        (step 1b). The first look at every ledger is one scan of the metadata in pages
        (``replica_states``), not a read per ledger: with a million ledgers those took a round trip
        each."""
        replicas, interval = self.replicas, self.config.over_replicated_interval_s
        if replicas is None or interval <= 0 or not self.bookie_id:
            return
        now = self._clock()
        if now < self._replicas_due:
            return
        self._replicas_due = now + interval
        report.phase = "checking replicas"
        suspects = self._over_replicated_since
        held = await self._held_ids()  # a ledger made during the pass is judged next time
        found: dict[int, ReplicaState] = {}  # held here, collectable at the first look
        pages = replicas.replica_states(held, self.bookie_id)
        scanned = False
        try:
            while True:
                async with asyncio.timeout(self.config.metadata_timeout_s):
                    page = await anext(pages, None)
                if page is None:
                    break
                found.update(item for item in page if _over_replicated(item[1]))
            scanned = True
        except (metadata.MetadataError, TimeoutError) as exc:  # judge what was read; again sooner
            report.replica_errors += 1
            log.warning("gc.replica_scan_failed", error=repr(exc))
        finally:
            await pages.aclose()
        if scanned:
            # a ledger the whole scan did not find so is needed (or gone): its grace ends
            report.replicas_checked = len(held)
            for ledger_id in [i for i in suspects if not _over_replicated(found.get(i))]:
                del suspects[ledger_id]
        collected: list[int] = []
        for ledger_id, state in sorted(found.items()):
            try:
                gone = await self._judge_replica(replicas, ledger_id, state, now, report)
                if gone is not None:
                    collected.append(ledger_id)
                    if not gone.replaced:  # a line each: an orphan says a heal's copy failed here
                        report.orphans_collected += 1
                        log.info("gc.orphan_collected", ledger_id=ledger_id)
            except (metadata.MetadataError, TimeoutError) as exc:  # this ledger only: the rest go on
                report.replica_errors += 1
                log.warning("gc.replica_check_failed", ledger_id=ledger_id, error=repr(exc))
        if report.replica_errors:
            self._replicas_due = now + min(interval, REPLICA_CHECK_RETRY_S)
        report.over_replicated_collected = len(collected)
        report.ledgers_collected += len(collected)
        if collected:
            log.info(
                "gc.over_replicated_collected",
                count=len(collected),
                orphans=report.orphans_collected,
                first=collected[:10],
            )
            report.phase = "checkpoint"
            await self.storage.write_checkpoint()

    async def _judge_replica(
        self, replicas: ReplicaCatalog, ledger_id: int, state: ReplicaState, now: float, report: GcReport
    ) -> ReplicaState | None:
        """One ledger of :meth:`_collect_over_replicated` (``state``: the scan's first look at it):
        the state it was forgotten in (read under its lock), or None when it was kept."""
        suspects = self._over_replicated_since
        if not _over_replicated(state):
            suspects.pop(ledger_id, None)
            return None
        if now - suspects.setdefault(ledger_id, now) < self.config.deleted_ledger_grace_s:
            report.over_replicated_waiting += 1
            return None
        started = self._loop.time()  # before the lease is asked for: the lock is ours until TTL later
        async with (
            asyncio.timeout(REPLICATION_LOCK_TTL_S / 3),
            replicas.replication_lock(ledger_id, f"bookie-gc:{self.bookie_id}"[:NAME_CHARS_MAX]) as locked,
        ):
            if not locked:  # a worker heals it right now: judged again next time
                report.over_replicated_busy += 1
                return None
            fresh = await replicas.replica_state(ledger_id, self.bookie_id)
            del suspects[ledger_id]  # collected, or needed again (a heal began): judged anew
            in_time = self._loop.time() - started < REPLICATION_LOCK_TTL_S / 2
            # nothing awaits between this check and the forget: the lock still holds
            if in_time and _over_replicated(fresh) and self.storage.forget_ledger(ledger_id):
                return fresh
            return None

    async def _compact(self, report: GcReport) -> None:
        compactor = Compactor(
            self.storage,
            self._executor,
            threshold=self.config.compaction_threshold,
            rate_bytes_per_s=self.config.compaction_rate_bytes_per_s,
            copy_refused=self._copy_refused,
            progress=report.progress,
            roll_dead_bytes=self.config.compaction_roll_dead_bytes,
        )
        report.phase = "compacting"
        try:
            await compactor.compact()
        finally:
            progress = report.progress
            report.segments_compacted = progress.segments_done
            report.segments_rolled = int(progress.rolled is not None)
            report.bytes_copied = progress.bytes_copied
            report.entries_copied = progress.entries_copied
            report.entries_corrupt = progress.entries_corrupt
        report.phase = "deleting dead segments"
        report.segments_deleted, report.bytes_freed = await compactor.delete_dead()


async def sorted_ids(ids: Collection[int]) -> list[int]:
    """``ids`` in increasing order, sorted a bounded slice per event-loop turn. The snapshot of
    ``ids`` is taken at once (one C-level copy: ~3 ms at a million), so ``ids`` may change while
    this runs; the result is the ids as they were on entry.

    A sample sort: ``k`` chunks of :data:`SORT_CHUNK` ids sorted each in one go, then every
    ``step``-th id of every chunk taken as a sample, and the id range cut at every ``k``-th
    sample. Each range is gathered from every chunk (bisect) and sorted on its own: a chunk holds
    fewer than ``step`` ids between two of its samples, so a range holds at most ``2 * k * step``
    ids, whatever their order in ``ids``; ``step`` is chosen so that this is ``SORT_CHUNK`` (up to
    ~4 million ids; a few times more at ten million). In increasing order (as ledgers are mostly
    made) each range is mostly one slice of one chunk."""
    keys = list(ids)
    if len(keys) <= SORT_CHUNK:
        keys.sort()
        return keys
    chunks: list[list[int]] = []
    for start in range(0, len(keys), SORT_CHUNK):
        chunk = keys[start : start + SORT_CHUNK]
        chunk.sort()
        chunks.append(chunk)
        await asyncio.sleep(0)
    del keys
    k = len(chunks)
    step = max(32, SORT_CHUNK // (2 * k))
    samples = sorted(itertools.chain.from_iterable(c[step - 1 :: step] for c in chunks))
    await asyncio.sleep(0)
    bounds: list[int | None] = [*samples[k::k], None]
    out: list[int] = []
    at = [0] * len(chunks)
    for bound in bounds:  # the ids below ``bound`` (and at or above the previous one)
        part: list[int] = []
        for n, chunk in enumerate(chunks):
            end = len(chunk) if bound is None else bisect.bisect_left(chunk, bound, lo=at[n])
            part += chunk[at[n] : end]
            at[n] = end
        part.sort()
        out += part
        await asyncio.sleep(0)
    return out


def _replica_state(md: metadata.LedgerMetadata, bookie_id: str, marked: bool) -> ReplicaState:
    listed = any(bookie_id in ensemble for _, ensemble in md.ensembles)
    replaced = any(record.bookie == bookie_id for record in md.replaced_bookies)
    return ReplicaState(md.state is metadata.LedgerState.CLOSED, listed, marked, replaced)


_undecodable_logged = LogLimiter(300.0)


def _undecodable(ledger_id: int, error: metadata.MetadataFormatError, into: list[int] | None = None) -> None:
    """A ledger whose metadata does not decode (a newer writer's format, a stray tool): logged and
    left alone, never taken as deleted."""
    if _undecodable_logged.due(str(ledger_id)):
        log.warning("gc.metadata_undecodable", ledger_id=ledger_id, error=str(error))
    if into is not None:
        into.append(ledger_id)


def _holds(ledger_ids: Sequence[int], ledger_id: int) -> bool:
    """``ledger_id`` is in ``ledger_ids`` (increasing)."""
    i = bisect.bisect_left(ledger_ids, ledger_id)
    return i < len(ledger_ids) and ledger_ids[i] == ledger_id


def _over_replicated(state: ReplicaState | None) -> bool:
    """Collectable: CLOSED, unmarked, and this bookie in none of its ensembles (moved elsewhere,
    ``replaced``, or an orphan)."""
    return state is not None and state.closed and not state.listed and not state.marked
