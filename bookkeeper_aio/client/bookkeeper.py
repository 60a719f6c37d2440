"""``BookKeeper``: the client object. Owns the bookie connections and the metadata connection.

    async with BookKeeper.connect("etcd://127.0.0.1:2379/bookkeeper/default") as bk:
        async with await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2, password=b"pw") as lh:
            await lh.append(b"payload")
        rh = await bk.open_ledger(lh.id, password=b"pw", recovery=False)
        async for entry in rh.read():
            ...

Lifecycle: everything a client starts is closed by :meth:`BookKeeper.close`
(graceful: open write handles are closed, connections flushed) or :meth:`BookKeeper.abort`.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import Executor
from types import TracebackType
from typing import Any

import structlog

from bookkeeper_aio.client.bookie_client import AddressResolver, BookiePool
from bookkeeper_aio.client.config import ClientConfig
from bookkeeper_aio.client.context import BookieDirectory, ClientContext
from bookkeeper_aio.client.discovery import find_client_config, find_metadata_url
from bookkeeper_aio.client.keys import NewLedgerKeys, open_codec, password_hash
from bookkeeper_aio.client.ledger import LedgerHandle
from bookkeeper_aio.client.metrics import ClientMetrics
from bookkeeper_aio.client.placement import PlacementPolicy, RandomPlacement
from bookkeeper_aio.client.read_handle import ReadHandle, read_lac_with_coverage
from bookkeeper_aio.client.recovery import fence_ledger, recover_ledger
from bookkeeper_aio.common.backoff import Backoff
from bookkeeper_aio.errors import (
    BKError,
    BKInterfaceError,
    BookieConnectionLost,
    LedgerRecoveryError,
    NoSuchLedger,
)
from bookkeeper_aio.protocol.digest import DigestType
from metadata import errors as md_errors
from metadata.bookies import BookieInfo, list_bookies
from metadata.cluster import MetadataConnection
from metadata.cluster import connect as metadata_connect
from metadata.ledger_manager import LIST_PAGE_SIZE_DEFAULT, LedgerManager, VersionedLedger
from metadata.ledger_metadata import LEDGER_ID_MAX, LedgerState
from metadata.store import MetadataStore

log = structlog.get_logger(__name__)

__all__ = ["BookKeeper", "RegistryDirectory", "password_hash"]

_CLOSED = LedgerState.CLOSED  # a module name: an enum member is a slow lookup on Python 3.11

DELETE_ATTEMPTS_MAX = 5
"""Metadata changes (a live writer's ensemble change) a delete re-reads and re-fences after."""
CREATE_DISCARD_TIMEOUT_S = 300.0
"""How long a client tries to delete a ledger whose create's outcome stayed unknown
(`LedgerCreateUnknown`) while metadata does not answer."""


class RegistryDirectory:
    """Writable bookies and their addresses from the bookie registration in metadata.

    Callers share listings: a burst of ensemble changes, creates and address lookups (a client
    with 100,000 ledgers whose adds time out together) lists the registrations about once per
    metadata round trip, not once per caller. A caller never gets a listing that was sent before it
    asked (a bookie registered just before the call is in the answer): it joins the listing that
    has not been sent yet, or starts one, which waits for the listing in flight to finish first.
    """

    def __init__(self, store: MetadataStore, root: str) -> None:
        self._store = store
        self._root = root
        self._known: dict[str, BookieInfo] = {}
        self._sent: asyncio.Future[tuple[str, ...]] | None = None  # the listing in flight
        self._next: asyncio.Future[tuple[str, ...]] | None = None  # the one to send after it
        self.listings = 0
        """Listings sent (observability and tests)."""

    async def writable_bookies(self) -> Sequence[str]:
        listing = self._next
        if listing is None:
            listing = self._next = asyncio.ensure_future(self._list(self._sent))
            listing.add_done_callback(_retrieve)
        # Shielded: a cancelled caller leaves the listing to the others.
        return await asyncio.shield(listing)

    async def _list(self, previous: asyncio.Future[tuple[str, ...]] | None) -> tuple[str, ...]:
        if previous is not None:
            await asyncio.wait([previous])
        me = asyncio.current_task()
        if self._next is me:  # from now on callers wait for the next listing
            self._next = None
        self._sent = me
        try:
            self.listings += 1
            bookies = await list_bookies(self._store, self._root)
        finally:
            if self._sent is me:
                self._sent = None
        self._known.update(bookies.writable)
        self._known.update(bookies.readonly)
        return tuple(sorted(bookies.writable))

    async def resolve(self, bookie_id: str) -> tuple[str, int]:
        info = self._known.get(bookie_id)
        if info is None:
            try:
                await self.writable_bookies()
            except md_errors.MetadataError as error:
                raise BookieConnectionLost(f"cannot resolve {bookie_id}: {error!r}") from error
            info = self._known.get(bookie_id)
        if info is None:  # not registered (any more): resolved as a failed connect
            raise BookieConnectionLost(f"bookie {bookie_id} is not registered")
        return info.host, info.port


class BookKeeper:
    """The client. Build with :meth:`connect` (URL) or directly from parts (tests, embedding)."""

    def __init__(
        self,
        ledgers: LedgerManager,
        directory: BookieDirectory,
        *,
        config: ClientConfig | None = None,
        resolver: AddressResolver | None = None,
        placement: PlacementPolicy | None = None,
        metadata: MetadataConnection | None = None,
        metrics: ClientMetrics | None = None,
        key_executor: Executor | None = None,
    ) -> None:
        """``key_executor``: where ledger keys are derived (PBKDF2, ~5 ms; default: one worker
        thread shared by the process; a simulation passes one that runs them inline)."""
        config = config or ClientConfig.load(find_client_config(None))
        self._metadata = metadata
        self._key_executor = key_executor
        self._ctx = ClientContext(
            config=config,
            pool=BookiePool(config, resolver),
            ledgers=ledgers,
            directory=directory,
            placement=placement or RandomPlacement(),
            metrics=metrics,
        )
        self._writers: weakref.WeakSet[LedgerHandle] = weakref.WeakSet()
        self._discards: dict[asyncio.Task[None], int] = {}
        """Deletes of ledgers whose create's outcome stayed unknown (`_discard`)."""
        self._closed = False

    @classmethod
    def connect(
        cls,
        url: str | None = None,
        *,
        config: ClientConfig | None = None,
        placement: PlacementPolicy | None = None,
        metrics: ClientMetrics | None = None,
    ) -> _Connect:
        """``async with BookKeeper.connect(url) as bk`` (or ``bk = await BookKeeper.connect(url)``).

        Without ``url`` the cluster is found as ``bkaio`` finds it: ``$BKAIO_METADATA``, else the
        running sandbox (``$BKAIO_HOME/sandbox.json``; :mod:`bookkeeper_aio.client.discovery`);
        NoClusterFound (a BKInterfaceError) when neither is there. Without ``config``: the file
        ``$BKAIO_CLIENT_CONFIG`` names (else, for the running sandbox's URL, the one it wrote: its
        TLS CA and token), then ``BKAIO_CLIENT_<KEY>`` variables (``ClientConfig.load``).
        ``metrics``: hooks called as adds, reads and recoveries finish
        (:mod:`bookkeeper_aio.client.metrics`)."""
        return _Connect(url, config, placement, metrics)

    @property
    def context(self) -> ClientContext:
        """The shared parts (pool, metadata, placement, config): for the recovery and log layers."""
        return self._ctx

    # ------------------------------------------------------------------ ledgers
    async def create_ledger(
        self,
        ensemble: int = 3,
        write_quorum: int = 2,
        ack_quorum: int = 2,
        *,
        password: bytes = b"",
        digest: DigestType | str = DigestType.CRC32C,
        custom_metadata: Mapping[str, bytes] | None = None,
        after_ledger_id: int = 0,
    ) -> LedgerHandle:
        """A new ledger open for writing, with an id larger than ``after_ledger_id`` (logs use it so
        that ledger ids grow along their list; a client's id block below it is dropped).

        Raises BKInterfaceError (E >= Qw >= Qa >= 1 violated, bad digest, bad ``after_ledger_id``:
        nothing is written), NotEnoughBookies, MetadataUnavailable (nothing was created),
        LedgerCreateUnknown (a CasResultUnknown: the create's answer was lost and metadata stayed
        unreadable for ``metadata_timeout_s``, so ledger ``error.ledger_id`` may exist, OPEN with no
        writer; this client deletes it in the background once metadata answers, for up to
        `CREATE_DISCARD_TIMEOUT_S` or until it is closed, unless someone changed it meanwhile:
        creating again is safe and makes another ledger).
        """
        self._check_open()
        if not ensemble >= write_quorum >= ack_quorum >= 1:
            raise BKInterfaceError(
                "need ensemble >= write_quorum >= ack_quorum >= 1, "
                f"got {ensemble}/{write_quorum}/{ack_quorum}"
            )
        if not 0 <= after_ledger_id < LEDGER_ID_MAX:
            raise BKInterfaceError(f"after_ledger_id must be in [0, {LEDGER_ID_MAX}), got {after_ledger_id}")
        try:
            digest_type = DigestType(digest)
        except ValueError:
            raise BKInterfaceError(f"digest must be one of {[d.value for d in DigestType]}") from None
        ctx = self._ctx
        writable = await ctx.directory.writable_bookies()
        bookies = ctx.placement.new_ensemble(ensemble, writable)
        keys = await NewLedgerKeys.make(password, executor=self._key_executor)
        try:
            versioned = await ctx.ledgers.create(
                bookies,
                resolve_timeout_s=ctx.config.metadata_timeout_s,
                write_quorum=write_quorum,
                ack_quorum=ack_quorum,
                digest_type=digest_type.value,
                password_hash=keys.keys.key_check,
                custom_metadata=custom_metadata,
                after_ledger_id=after_ledger_id,
                key_salt=keys.salt,
                key_iterations=keys.iterations,
                key_ledger_salt=keys.ledger_salt,
                key_format=keys.key_format,
            )
        except md_errors.InvalidMetadata as error:
            raise BKInterfaceError(str(error)) from error
        except md_errors.LedgerCreateUnknown as unknown:
            task = asyncio.get_running_loop().create_task(self._discard(unknown))
            self._discards[task] = unknown.ledger_id
            task.add_done_callback(lambda done: self._discards.pop(done, None))
            raise
        handle = LedgerHandle(ctx, versioned, password, keys.keys.master_key)
        self._writers.add(handle)
        log.info("ledger.created", ledger_id=handle.id, ensemble=list(bookies))
        return handle

    async def _discard(self, unknown: md_errors.LedgerCreateUnknown) -> None:
        """Delete the ledger a create that raised ``unknown`` may have made, once metadata answers
        (`LedgerManager.discard_created`: only while nobody changed it)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CREATE_DISCARD_TIMEOUT_S
        backoff = Backoff(0.1, 5.0)
        while True:
            try:
                deleted = await self._ctx.ledgers.discard_created(unknown)
            except (md_errors.MetadataUnavailable, md_errors.CasResultUnknown) as error:
                if loop.time() >= deadline:
                    log.warning(
                        "ledger.create_unknown_left",
                        ledger_id=unknown.ledger_id,
                        error=repr(error),
                        hint="the ledger may exist, OPEN with no writer: delete it when metadata is back",
                    )
                    return
                await asyncio.sleep(backoff.next_delay_s())
                continue
            # A warning: a create failed, and a ledger it made may stay (deleted=False: someone
            # changed it since, so it is in use, or the create never applied).
            log.warning("ledger.create_unknown_resolved", ledger_id=unknown.ledger_id, deleted=deleted)
            return

    async def open_ledger(
        self, ledger_id: int, *, password: bytes = b"", recovery: bool = False
    ) -> ReadHandle:
        """Open for reading.

        ``recovery=False``: the writer is left alone; readable up to the LAC (a closed ledger: up to
        its last entry). ``recovery=True``: fence the ledger, find its last entry, replicate and close
        it (``bookkeeper_aio.client.recovery``); the old writer's adds then fail with LedgerFenced and the
        handle reads up to the closed last entry. Concurrent recoveries all end with the same last
        entry.

        Raises NoSuchLedger, Unauthorized (wrong password), BKInterfaceError, and with recovery
        LedgerRecoveryError (retriable: some entry could not be decided, or fencing could not reach
        enough bookies; the ledger stays IN_RECOVERY and opening again retries) or BKTimeout.
        """
        self._check_open()
        versioned = await self._read_metadata(ledger_id)
        md = versioned.metadata
        codec = await open_codec(md, password, self._key_executor)  # Unauthorized: a wrong password
        if recovery and md.state is not _CLOSED:
            result = await recover_ledger(self._ctx, ledger_id, codec, codec.master_key)
            versioned, md = result.versioned, result.versioned.metadata
        if md.state is _CLOSED:
            assert md.last_entry_id is not None
            lac = md.last_entry_id
        else:
            lac = await read_lac_with_coverage(self._ctx, md, codec.master_key)
        return ReadHandle(self._ctx, versioned, codec, lac)

    async def delete_ledger(self, ledger_id: int, *, password: bytes = b"", fence: bool = True) -> None:
        """Delete the ledger (its metadata; bookies reclaim the space at their next GC pass).

        Needs the ledger's password. A ledger that is not closed is fenced first (the last
        fragment, with the ledger's key, as recovery's first step): a writer still appending gets
        LedgerFenced from then on instead of acknowledgements for a ledger that is going away.
        The delete is a CAS on the metadata version fenced: a writer's ensemble change in between
        makes it re-read and fence the new fragment. ``fence=False`` skips the fence, for a caller
        that knows no writer is left (it aborted its own handle) and whose bookies may be out of
        reach: the ledger's metadata goes all the same.

        Raises NoSuchLedger, Unauthorized (wrong password), LedgerRecoveryError (retriable: the
        fence could not reach enough bookies of an open ledger; nothing was deleted),
        MetadataUnavailable.
        """
        self._check_open()
        outcome_unknown = False
        for _ in range(DELETE_ATTEMPTS_MAX):
            try:
                versioned = await self._read_metadata(ledger_id)
            except NoSuchLedger:
                if outcome_unknown:
                    return  # our delete whose answer was lost did apply
                raise
            md = versioned.metadata
            codec = await open_codec(md, password, self._key_executor)
            if fence and md.state is not _CLOSED:
                await fence_ledger(self._ctx, md, codec)
            try:
                await self._ctx.ledgers.delete(ledger_id, versioned.version)
            except md_errors.NoSuchLedger as error:
                raise NoSuchLedger(f"ledger {ledger_id} does not exist") from error
            except md_errors.BadVersion:
                continue  # changed meanwhile (ensemble change, close, recovery): decide again
            except md_errors.CasResultUnknown:
                outcome_unknown = True
                continue
            fenced = fence and md.state is not _CLOSED
            log.info("ledger.deleted", ledger_id=ledger_id, fenced=fenced)
            return
        raise LedgerRecoveryError(
            f"ledger {ledger_id}: its metadata changed {DELETE_ATTEMPTS_MAX} times while deleting; retry"
        )

    def list_ledgers(self, *, page_size: int = LIST_PAGE_SIZE_DEFAULT) -> AsyncIterator[int]:
        """Every ledger id in increasing order, read from metadata ``page_size`` ids at a time (as
        ``bkaio ledgers`` pages). Not a snapshot: ledgers created or deleted meanwhile may or may not
        show up. Raises BKInterfaceError (``page_size`` < 1), MetadataUnavailable."""
        self._check_open()
        if page_size < 1:
            raise BKInterfaceError(f"page_size must be >= 1, got {page_size}")
        return self._ctx.ledgers.iter_ledger_ids(page_size=page_size)

    async def _read_metadata(self, ledger_id: int) -> VersionedLedger:
        try:
            return await self._ctx.ledgers.read(ledger_id)
        except md_errors.NoSuchLedger as error:
            raise NoSuchLedger(f"ledger {ledger_id} does not exist") from error

    def _check_open(self) -> None:
        if self._closed:
            raise BKInterfaceError("the BookKeeper client is closed")

    # ------------------------------------------------------------------ lifecycle
    async def close(self) -> None:
        """Close open write handles (errors logged), then the connections and metadata."""
        if self._closed:
            return
        self._closed = True
        for handle in list(self._writers):
            try:
                await handle.close()
            except BKError as error:
                log.warning("client.close_ledger_failed", ledger_id=handle.id, error=repr(error))
        self._writers.clear()
        self._stop_discards()
        self._ctx.lac_timers.close()
        await self._ctx.pool.close()
        if self._metadata is not None:
            await self._metadata.close()

    def abort(self) -> None:
        self._closed = True
        for handle in self._writers:
            handle.abort()
        self._writers.clear()
        self._stop_discards()
        self._ctx.lac_timers.close()
        self._ctx.pool.abort()

    def _stop_discards(self) -> None:
        for task, ledger_id in self._discards.items():
            task.cancel()
            log.warning(
                "ledger.create_unknown_left",
                ledger_id=ledger_id,
                hint="client closed before metadata answered: the ledger may exist, OPEN with no writer",
            )
        self._discards.clear()

    async def __aenter__(self) -> BookKeeper:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class _Connect:
    """Awaitable and async context manager returned by :meth:`BookKeeper.connect`."""

    def __init__(
        self,
        url: str | None,
        config: ClientConfig | None,
        placement: PlacementPolicy | None,
        metrics: ClientMetrics | None = None,
    ) -> None:
        self._url = url
        self._config = config
        self._placement = placement
        self._metrics = metrics
        self._client: BookKeeper | None = None

    async def _make(self) -> BookKeeper:
        # No URL: $BKAIO_METADATA or the running sandbox (NoClusterFound when neither is there).
        url = find_metadata_url() if self._url is None else self._url
        try:
            conn = metadata_connect(url)
        except md_errors.InvalidUrl as error:
            raise BKInterfaceError(str(error)) from error
        directory = RegistryDirectory(conn.store, conn.root)
        try:
            config = self._config or ClientConfig.load(find_client_config(url))
        except BKInterfaceError:
            await conn.close()
            raise
        return BookKeeper(
            conn.ledger_manager(),
            directory,
            config=config,
            resolver=directory,
            placement=self._placement,
            metadata=conn,
            metrics=self._metrics,
        )

    def __await__(self) -> Any:
        return self._make().__await__()

    async def __aenter__(self) -> BookKeeper:
        self._client = await self._make()
        return self._client

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._client is not None:
            if exc_type is asyncio.CancelledError:
                self._client.abort()
                if self._client._metadata is not None:
                    await self._client._metadata.close()
            else:
                await self._client.close()


def _retrieve(listing: asyncio.Future[tuple[str, ...]]) -> None:
    """Each caller of a shared listing gets its error; none may be left to retrieve it."""
    if not listing.cancelled():
        listing.exception()
