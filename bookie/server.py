"""The bookie server: storage + processor + the accept loop, with a clean start/close.

``BookieServer.start()`` opens storage (recovery), binds and listens (port 0 allowed: see
``address``; a port in use refuses with :class:`ListenError` naming it), and only then lets the
optional registration (the etcd one plugs in here) check or claim the id in metadata, starts serving
connections, and registers. So a bookie that cannot serve never claims its id, and one whose metadata
cookie refuses it never answers a request (connections made meanwhile wait in the listen backlog and
are dropped).
``close()`` is graceful and bounded: deregister, stop accepting, stop reading, let accepted adds
become durable and answered, close connections, flush and close the journal, checkpoint.
``abort()`` drops everything at once.

With ``admin_port >= 0`` an admin HTTP server (:mod:`bookie.admin`: ``/health``, ``/ready``,
``/metrics``, ``/state``, ``/readonly``) is started first, so probes and scrapes answer during a
long recovery too, and closed last, so they see the bookie stopping.

Read-only mode (:mod:`bookie.mode`): the server owns the :class:`~bookie.mode.ModeMachine`. A task
checks the data dir every ``disk_check_interval_s`` (statvfs in a worker thread: a hung filesystem
must not stall the loop) and the journal's failure; the operator toggles it through the admin
endpoint (:meth:`BookieServer.set_read_only`). On each transition the processor starts or stops
refusing normal adds at once, and a second task moves the registration between ``writable/`` and
``readonly/`` (retried with backoff while metadata is unreachable; the latest wanted state wins).

Seams (docs/internals.md §2): threads and executors come from a :class:`~bookie.threads.Threads`, time from a
:class:`~bookkeeper_aio.common.clock.Clock` (both passed down to the storage and journal), the disk
from a :class:`~bookie.fileio.FileIO` (and its free-space probe from ``disk_probe``); sockets from the
event loop (``create_server``), which a simulation replaces whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
import socket
import ssl
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import structlog

from bookie.admin import AdminServer, load_or_create_token
from bookie.config import BookieConfig
from bookie.connection_handler import (
    AnswerBudget,
    ConnectionLimits,
    ServerConnection,
    ServerLoad,
    address_key,
    tls_budget_key,
)
from bookie.cookie import read_instance_id
from bookie.fileio import OS_FILE_IO, FileIO
from bookie.gc import GarbageCollector, LedgerCatalog, ReplicaCatalog
from bookie.ledger_keys import KeySource, KeyVerifier
from bookie.limbo import LimboCatalog, LimboResolver
from bookie.metrics import DiskStatus, Snapshot, probe_disk, snapshot
from bookie.mode import Mode, ModeMachine
from bookie.processor import Processor
from bookie.storage import Storage
from bookie.tarpit import reset
from bookie.threads import OS_THREADS, Threads
from bookkeeper_aio.common.clock import SYSTEM_CLOCK, Clock

log = structlog.get_logger(__name__)


class Registration(Protocol):
    """What the server needs from a registration service (e.g. etcd with a lease)."""

    async def verify(self, bookie_id: str, instance_id: str, data_dir: str) -> None:
        """Check the data dir's identity against metadata before serving (raise to refuse)."""

    async def start(self, bookie_id: str, address: str, admin_address: str | None = None) -> None: ...

    async def set_read_only(self, read_only: bool) -> None:
        """Register under the read-only set (True) or the writable set; before ``start``: the
        state to register in. Raises on a metadata error (the server retries)."""

    async def close(self) -> None: ...

    @property
    def failure(self) -> BaseException | None:
        """Why the registration ended for good while the bookie runs (None: it is kept alive):
        the bookie then reports not ready and unhealthy (docs/bookie.md, *Registration*)."""


REGISTRATION_RETRY_S_MAX = 5.0
LISTEN_BACKLOG = 1024
ACCEPTS_PER_WAKEUP = 64
"""Connections accepted per readiness of a TLS listening socket before other callbacks run (a flood
of connections takes turns with the clients' requests)."""


class ListenError(OSError):
    """The bookie cannot listen on its address (port in use, not a local address, no permission)."""

    def __init__(self, host: str, port: int, cause: OSError) -> None:
        reason = os.strerror(cause.errno) if cause.errno else str(cause)
        if cause.errno == errno.EADDRINUSE:
            hint = (
                f"another process listens on port {port} (`ss -ltnp 'sport = :{port}'` shows which): "
                "stop it, or start this bookie with another --port"
            )
        elif cause.errno == errno.EADDRNOTAVAIL:
            hint = f"{host} is not an address of this machine: fix --host"
        elif cause.errno == errno.EACCES:
            hint = "ports below 1024 need privileges: use another --port"
        else:
            hint = "check --host and --port"
        super().__init__(cause.errno, f"cannot listen on {host}:{port}: {reason}; {hint}")
        self.host, self.port = host, port

    def __str__(self) -> str:
        return str(self.strerror)


class BookieServer:
    def __init__(
        self,
        config: BookieConfig,
        registration: Registration | None = None,
        threads: Threads = OS_THREADS,
        clock: Clock = SYSTEM_CLOCK,
        catalog: LedgerCatalog | None = None,
        replicas: ReplicaCatalog | None = None,
        fileio: FileIO = OS_FILE_IO,
        disk_probe: Callable[[str], DiskStatus] = probe_disk,
    ) -> None:
        self.config = config
        self.fileio = fileio
        self._probe_disk = disk_probe
        self.catalog = catalog
        self.replicas = replicas
        self.gc: GarbageCollector | None = None
        self.limbo: LimboResolver | None = None
        """Settles ledgers in limbo against metadata (only while some are, with metadata)."""
        self.threads = threads
        self.clock = clock
        self.registration = registration
        self.storage: Storage | None = None
        self.processor: Processor | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[ServerConnection] = set()
        self._load = ServerLoad(config.in_flight_total_max, self._on_load)
        self._journal_high = False
        self._limits = ConnectionLimits(
            config.frame_bytes_max,
            config.in_flight_per_connection_max,
            config.frame_read_timeout_s,
            self._load,
            answer_bytes_buffered_max=config.answer_bytes_buffered_max,
            answer_bytes_total_max=config.answer_bytes_total_max,
            reads_in_flight_max=config.reads_in_flight_per_connection_max,
            idle_timeout_s=config.idle_timeout_s,
            connections_per_address_max=config.connections_per_address_max,
            connections_max=config.connections_max,
            auth_providers=config.auth_providers_loaded(),
            auth_timeout_s=config.auth_timeout_s,
            bad_requests_per_address_per_s=config.bad_requests_per_address_per_s,
            clock=clock.monotonic,
        )
        self._tls = config.tls_context()
        self._tls_tasks: set[asyncio.Task[None]] = set()
        """With TLS: the handshakes under way."""
        self._listening: list[socket.socket] = []
        """With TLS: the listening sockets our accept reads (:meth:`_accept_tls`)."""
        self.tarpit = self._limits.tarpit
        """Connections over ``connections_per_address_max``, held unread, then reset."""
        self.address: tuple[str, int] | None = None
        self.ready = False
        """Listening, and registered when there is a registration; False again once closing."""
        self.closing = False
        self.started_s = clock.monotonic()
        self._disk_probe = threads.executor("disk-probe")  # its thread starts with the first probe
        self._lists = threads.executor("entry-lists")
        """GET_LIST_OF_ENTRIES builds its ranges there, off the loop."""
        self.mode = ModeMachine(config.disk_thresholds(), self._on_mode_change)
        self._mode_task: asyncio.Task[None] | None = None
        self._registration_task: asyncio.Task[None] | None = None
        self._registration_wanted = asyncio.Event()
        self.registered_read_only = False
        """The registration set the metadata holds us in (after the last successful move)."""
        self.admin: AdminServer | None = None
        if config.admin_port >= 0:
            self.admin = AdminServer(
                self.snapshot,
                config.admin_host,
                config.admin_port,
                read_only=self.set_read_only,
                gc=self.gc_request,
            )

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    @property
    def load(self) -> ServerLoad:
        return self._load

    @property
    def answers(self) -> AnswerBudget:
        """Unread answer bytes of every connection together (``answer_bytes_total_max``)."""
        return self._limits.answers

    @property
    def admin_address(self) -> str | None:
        if self.admin is None or self.admin.address is None:
            return None
        return "{}:{}".format(*self.admin.address)

    def snapshot(self) -> Snapshot:
        """Counters, state and disk status for metrics and the admin endpoint (on the loop)."""
        return snapshot(self)

    async def start(self) -> None:
        """Recover storage, listen, verify the id, serve, register.

        Raises what Storage.open raises, :class:`ListenError`, or what the registration raises."""
        if self.admin is not None:
            self.admin.set_token(load_or_create_token(self.config.admin_token_file, self.config.data_dir))
            await self.admin.start()
        try:
            self.storage = await Storage.open(
                self.config.storage_config(), self.fileio, threads=self.threads, clock=self.clock
            )
        except BaseException:
            if self.admin is not None:
                self.admin.abort()
            raise
        self.storage.journal.on_pressure = self._on_journal_pressure
        catalog: object = self.catalog
        # a protocol's isinstance inspects the object's attributes: not asked of a bookie without one
        if catalog is not None and isinstance(catalog, KeySource):  # metadata checks keys first
            self.storage.keys = KeyVerifier(self.storage, catalog, add_gate=self.mode.check_add)
        self.processor = Processor(
            self.storage,
            self.config.bookie_id,
            self.config.frame_bytes_max,
            mode=self.mode,
            list_executor=self._lists,
        )
        self.processor.read_only = self.mode.read_only  # the operator may have set it already
        initial_read_only = False
        loop = asyncio.get_running_loop()
        try:
            await self.check_mode()  # a bookie that starts with a full disk starts read-only
            # Hold the port before claiming the id in metadata: a bookie that cannot serve must not
            # leave a metadata cookie behind (its retry on a fresh data dir would be refused).
            self._server = await self._listen(loop)
            if self.registration is not None:
                # Before serving: a bookie whose data was wiped must never answer a single read.
                instance_id = read_instance_id(self.storage.fileio, self.config.data_dir)
                await self.registration.verify(self.config.bookie_id, instance_id, self.config.data_dir)
                initial_read_only = self.mode.read_only
                await self.registration.set_read_only(initial_read_only)  # the set start() uses
            await self._start_serving(loop)
        except BaseException:
            if self._server is not None:
                self._server.close()
                self._server = None
            self.storage.abort()
            if self.admin is not None:
                self.admin.abort()
            raise
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = (host, port)
        log.info(
            "bookie.listening",
            host=host,
            port=port,
            bookie_id=self.config.bookie_id,
            tls=self._tls is not None,
            client_auth=self.config.tls_client_auth if self._tls is not None else None,
            auth=sorted(self._limits.auth_providers) or None,
        )
        if self.registration is not None:
            try:
                await self.registration.start(
                    self.config.bookie_id, self.config.published_address(port), self.admin_address
                )
            except BaseException:
                self.abort()
                raise
            self.registered_read_only = initial_read_only
            self._registration_wanted.set()  # reconcile a transition that happened meanwhile
            self._registration_task = loop.create_task(self._registration_loop(), name="bookie-mode-reg")
        self._mode_task = loop.create_task(self._mode_loop(), name="bookie-disk-check")
        self.gc = GarbageCollector(
            self.storage,
            self.config.gc_config(),
            self.catalog,
            threads=self.threads,
            copy_refused=self._gc_copy_refused,
            replicas=self.replicas,
            bookie_id=self.config.bookie_id,
            wall_clock=self.clock.wall,
            on_foreign_cluster=self.mode.observe_foreign_cluster,
        )
        self.gc.start()
        if self.storage.limbo is not None:
            self._start_limbo(catalog)
        self.ready = True

    def _start_limbo(self, catalog: object) -> None:
        """Ledgers are in limbo (a journal cut, bookie/limbo.py): settle them against metadata."""
        assert self.storage is not None
        assert self.storage.limbo is not None
        log.warning(
            "bookie.limbo",
            ledgers=self.storage.limbo.count(),
            metadata=isinstance(catalog, LimboCatalog),
            hint="reads of what this bookie lacks answer EUNKNOWNLEDGERSTATE until settled (docs/bookie.md)",
        )
        if isinstance(catalog, LimboCatalog):
            self.limbo = LimboResolver(
                self.storage,
                catalog,
                self.config.bookie_id,
                self.config.limbo_check_interval_s,
                wall_clock=self.clock.wall,
            )
            self.limbo.start()

    async def _listen(self, loop: asyncio.AbstractEventLoop) -> asyncio.Server:
        """Bind and listen without accepting yet (``start_serving`` accepts); :class:`ListenError`."""
        host, port = self.config.host, self.config.port
        try:
            server = await loop.create_server(
                self._new_connection,
                host,
                port,
                backlog=LISTEN_BACKLOG,
                start_serving=False,
            )  # TLS: each connection starts its handshake once counted (ServerConnection._start_tls)
        except OSError as exc:
            raise ListenError(host, port, exc) from exc
        try:
            # asyncio binds now but listens only once serving starts: listen at once (through a
            # duplicate of each socket), so the port is ours before the id is claimed.
            for sock in server.sockets:
                with sock.dup() as listening:
                    listening.listen(LISTEN_BACKLOG)
        except OSError as exc:
            server.close()
            raise ListenError(host, port, exc) from exc
        return server

    async def _start_serving(self, loop: asyncio.AbstractEventLoop) -> None:
        """Accept connections: the server's own accept for plaintext; with TLS, an accept of ours
        (:meth:`_accept_tls`), so that a connection is counted before its handshake."""
        assert self._server is not None
        if self._tls is None:
            await self._server.start_serving()
            return
        for sock in self._server.sockets:
            listening = sock.dup()
            listening.setblocking(False)
            self._listening.append(listening)
            loop.add_reader(listening.fileno(), self._accept_tls, loop, listening, self._tls)

    def _accept_tls(
        self, loop: asyncio.AbstractEventLoop, listening: socket.socket, context: ssl.SSLContext
    ) -> None:
        """Accept what waits on ``listening`` (at most :data:`ACCEPTS_PER_WAKEUP`), count each
        connection (per address, ``connections_max``), then hand it to its handshake. One over a
        limit gets no TLS work nor any object of ours: over ``connections_per_address_max`` it is
        held in the :class:`~bookie.tarpit.Tarpit` (a peer reconnecting as soon as it is refused
        does so at the tarpit's pace), else, or when the tarpit is full, reset at once (an accept
        and a close: docs/benchmarks.md, *Refused connections*)."""
        limits, processor = self._limits, self.processor
        assert processor is not None
        for _ in range(ACCEPTS_PER_WAKEUP):
            try:
                sock, peer = listening.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors and the like: stop accepting shortly
                log.warning("bookie.accept_failed", error=repr(exc))
                fd = listening.fileno()
                loop.remove_reader(fd)
                loop.call_later(0.1, self._resume_accept, loop, listening, context)
                return
            address = address_key(peer[0])
            refused = limits.refusal(address, self._connections)
            if refused is not None:
                held = refused == "connections_per_address_max" and self.tarpit.hold(
                    address, functools.partial(reset, sock)
                )  # at the tarpit's pace
                if not held:
                    reset(sock)
                continue
            conn = ServerConnection(processor, limits, self._connections)
            conn.reserve(peer, admitted=True)
            self._spawn_tls(loop, self._handshake(loop, conn, sock, context))

    def _resume_accept(
        self, loop: asyncio.AbstractEventLoop, listening: socket.socket, context: ssl.SSLContext
    ) -> None:
        if listening in self._listening:  # not closed meanwhile
            loop.add_reader(listening.fileno(), self._accept_tls, loop, listening, context)

    def _spawn_tls(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]) -> None:
        task = loop.create_task(coro)
        self._tls_tasks.add(task)
        task.add_done_callback(self._tls_tasks.discard)

    async def _handshake(
        self,
        loop: asyncio.AbstractEventLoop,
        conn: ServerConnection,
        sock: socket.socket,
        context: ssl.SSLContext,
    ) -> None:
        """One TLS handshake, within ``frame_read_timeout_s``; it starts once the budget of failed
        handshakes of the peer's address is out of deficit and its turn comes
        (:meth:`ErrorBudget.turn <bookie.budgets.ErrorBudget.turn>`: one at a time;
        :func:`~bookie.connection_handler.tls_budget_key`). Then the
        connection is served (``connection_made``); a failure gives its slot back."""
        try:
            try:
                await self._limits.errors.turn(tls_budget_key(conn.peer_address))
            except BaseException:
                sock.close()
                raise
            await loop.connect_accepted_socket(
                lambda: conn, sock, ssl=context, ssl_handshake_timeout=self.config.frame_read_timeout_s
            )  # owns the socket from here: closes it on failure
        except BaseException as exc:
            conn.handshake_failed(exc)
            if not isinstance(exc, Exception):
                raise

    # ------------------------------------------------------------------ garbage collection
    def _gc_copy_refused(self) -> str | None:
        """Compaction copies need disk space: none while read-only (a full disk would fail the
        journal); deleting dead segments goes on."""
        return f"bookie is read-only: {self.mode.reason}" if self.mode.read_only else None

    def gc_request(self, start: bool) -> dict[str, object]:
        """The admin ``/gc`` action: start a pass when ``start`` (unless one runs), and report."""
        if self.gc is None:
            return {"started": False, "running": None, "last": None, "reason": "bookie is not serving"}
        started = self.gc.trigger("admin") if start else False
        return {"started": started, **self.gc.status()}

    # ------------------------------------------------------------------ read-only mode
    def set_read_only(self, read_only: bool | None) -> dict[str, object]:
        """The operator's toggle (admin ``/readonly``): True sets manual read-only (sticks until
        cleared), False clears it (the disk may still hold the bookie read-only), None only reports."""
        if read_only is not None:
            self.mode.set_manual(read_only)
        return self.mode_json()

    def mode_json(self) -> dict[str, object]:
        mode = self.mode
        return {
            "mode": mode.mode.value,
            "manual": mode.manual,
            "reason": mode.reason,
            "disk_free_bytes": mode.free_bytes,
            "registered_read_only": self.registered_read_only if self.registration is not None else None,
        }

    async def check_mode(self) -> None:
        """One disk + journal observation (the periodic task calls this; tests may too)."""
        loop = asyncio.get_running_loop()
        disk = await loop.run_in_executor(self._disk_probe, self._probe_disk, self.config.data_dir)
        free = None if disk.error else disk.free_bytes
        self.mode.observe_disk(free, _disk_mode_problem(disk), disk.total_bytes)
        if self.storage is not None:
            self.mode.observe_journal(self.storage.journal.failed)

    async def _mode_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.disk_check_interval_s)
            try:
                await self.check_mode()
            except Exception:  # never let the checker die silently: the next interval retries
                log.exception("bookie.disk_check_failed")

    def _on_mode_change(self, old: Mode, new: Mode, reason: str) -> None:
        if self.processor is not None:
            self.processor.read_only = new is Mode.READONLY
        self._registration_wanted.set()

    async def _registration_loop(self) -> None:
        assert self.registration is not None
        delay_s = 0.1
        while True:
            await self._registration_wanted.wait()
            self._registration_wanted.clear()
            wanted = self.mode.read_only
            if wanted == self.registered_read_only:
                continue
            try:
                await self.registration.set_read_only(wanted)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 (metadata down, a lease lost: retry, keep serving)
                log.warning("bookie.registration_move_failed", read_only=wanted, error=repr(exc))
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, REGISTRATION_RETRY_S_MAX)
                self._registration_wanted.set()
                continue
            delay_s = 0.1
            self.registered_read_only = wanted
            log.info("bookie.registration_moved", set="readonly" if wanted else "writable")

    def _stop_mode_tasks(self) -> None:
        for task in (self._mode_task, self._registration_task):
            if task is not None:
                task.cancel()
        self._mode_task = self._registration_task = None
        self._disk_probe.shutdown(wait=False)  # a probe stuck in a hung filesystem must not block
        self._lists.shutdown(wait=False)

    def _new_connection(self) -> asyncio.Protocol:
        assert self.processor is not None
        if len(self._connections) >= 2 * self.config.connections_max:  # far over: not even a look
            self._limits.refusals.note("connections_max", self.config.connections_max, "?")
            return _Refuse()
        return ServerConnection(self.processor, self._limits, self._connections)

    @property
    def connections_refused(self) -> int:
        """Connections closed at accept, over ``connections_max`` or ``connections_per_address_max``."""
        return self._limits.refusals.total

    def _stop_tls_tasks(self) -> None:
        """Stop accepting, and drop the handshakes under way (their connections were not served)."""
        listening, self._listening = self._listening, []
        for sock in listening:
            with contextlib.suppress(Exception):  # the loop may be closing
                asyncio.get_running_loop().remove_reader(sock.fileno())
            sock.close()
        for task in list(self._tls_tasks):
            task.cancel()
        self.tarpit.close()

    def _on_journal_pressure(self, high: bool) -> None:
        log.info("bookie.journal_pressure", high=high, connections=len(self._connections))
        self._journal_high = high
        self._update_pause()

    def _on_load(self, over: bool) -> None:
        log.info("bookie.in_flight_limit", over=over, in_flight=self._load.in_flight, limit=self._load.limit)
        self._update_pause()

    def _update_pause(self) -> None:
        paused = self._journal_high or self._load.over
        self._load.sockets_paused = paused
        for conn in list(self._connections):
            conn.pause_by_server(paused)

    async def close(self) -> None:
        self.closing = True
        self.ready = False
        self._stop_mode_tasks()
        if self.limbo is not None:
            await self.limbo.close()
        if self.gc is not None:
            await self.gc.close()  # a compaction in flight stops between batches
        if self.registration is not None:
            with contextlib.suppress(Exception):
                await self.registration.close()
        if self._server is not None:
            self._server.close()
        self._stop_tls_tasks()
        for conn in list(self._connections):
            conn.pause_by_server(True)
        if self.storage is not None:
            # Every add already accepted becomes durable and is answered before connections close.
            await self.storage.journal.close()
        await asyncio.sleep(0)  # let the responses queued by the last group be written
        for conn in list(self._connections):
            conn.close()
        if self.storage is not None:
            await self.storage.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        if self.admin is not None:
            await self.admin.close()
        log.info("bookie.closed", bookie_id=self.config.bookie_id)

    def abort(self) -> None:
        self.closing = True
        self.ready = False
        self._stop_mode_tasks()
        if self.limbo is not None:
            self.limbo.abort()
        if self.gc is not None:
            self.gc.abort()
        if self.admin is not None:
            self.admin.abort()
        if self._server is not None:
            self._server.close()
        self._stop_tls_tasks()
        for conn in list(self._connections):
            conn.abort()
        if self.storage is not None:
            self.storage.abort()


def _disk_mode_problem(disk: DiskStatus) -> str | None:
    """What about the data dir (besides free space) makes the bookie read-only."""
    if disk.error is not None:
        return f"data dir unusable: {disk.error}"
    if disk.read_only:
        return "data dir is read-only (filesystem mounted read-only or directory not writable)"
    return None


class _Refuse(asyncio.Protocol):
    """Accepts and immediately closes a connection over the limit."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()
