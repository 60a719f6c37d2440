"""The bookie server: storage + processor + the accept loop, with a clean start/close.

``BookieServer.start()`` opens storage (recovery), binds the listener (port 0 allowed: see
``address``), then starts the optional registration (a metadata-side object with
``async start(bookie_id, address)`` and ``async close()``: the etcd registration plugs in here).
``close()`` is graceful and bounded: deregister, stop accepting, stop reading, let accepted adds
become durable and answered, close connections, flush and close the journal, checkpoint.
``abort()`` drops everything at once.

With ``admin_port >= 0`` an admin HTTP server (:mod:`bookie.admin`: ``/health``, ``/ready``,
``/metrics``, ``/state``) is started first, so probes and scrapes answer during a long recovery
too, and closed last, so they see the bookie stopping.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol

import structlog

from bookie.admin import AdminServer
from bookie.config import BookieConfig
from bookie.connection_handler import BookieConnection, ConnectionLimits, ServerLoad
from bookie.cookie import read_instance_id
from bookie.metrics import Snapshot, snapshot
from bookie.processor import Processor
from bookie.storage import Storage

log = structlog.get_logger(__name__)


class Registration(Protocol):
    """What the server needs from a registration service (e.g. etcd with a lease)."""

    async def verify(self, bookie_id: str, instance_id: str, data_dir: str) -> None:
        """Check the data dir's identity against metadata before serving (raise to refuse)."""

    async def start(self, bookie_id: str, address: str) -> None: ...

    async def close(self) -> None: ...


class BookieServer:
    def __init__(self, config: BookieConfig, registration: Registration | None = None) -> None:
        self.config = config
        self.registration = registration
        self.storage: Storage | None = None
        self.processor: Processor | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[BookieConnection] = set()
        self._load = ServerLoad(config.in_flight_total_max, self._on_load)
        self._journal_high = False
        self._limits = ConnectionLimits(
            config.frame_bytes_max,
            config.in_flight_per_connection_max,
            config.frame_read_timeout_s,
            self._load,
        )
        self.address: tuple[str, int] | None = None
        self.ready = False
        """Listening, and registered when there is a registration; False again once closing."""
        self.closing = False
        self.connections_refused = 0
        self.started_s = time.monotonic()
        self.admin: AdminServer | None = None
        if config.admin_port >= 0:
            self.admin = AdminServer(self.snapshot, config.admin_host, config.admin_port)

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    @property
    def load(self) -> ServerLoad:
        return self._load

    @property
    def admin_address(self) -> str | None:
        if self.admin is None or self.admin.address is None:
            return None
        return "{}:{}".format(*self.admin.address)

    def snapshot(self) -> Snapshot:
        """Counters, state and disk status for metrics and the admin endpoint (on the loop)."""
        return snapshot(self)

    async def start(self) -> None:
        """Recover storage, listen, register. Raises what Storage.open raises, or OSError (bind)."""
        if self.admin is not None:
            await self.admin.start()
        try:
            self.storage = await Storage.open(self.config.storage_config())
        except BaseException:
            if self.admin is not None:
                self.admin.abort()
            raise
        self.storage.journal.on_pressure = self._on_journal_pressure
        self.processor = Processor(self.storage, self.config.bookie_id, self.config.frame_bytes_max)
        loop = asyncio.get_running_loop()
        try:
            if self.registration is not None:
                # Before listening: a bookie whose data was wiped must never answer a single read.
                instance_id = read_instance_id(self.storage.fileio, self.config.data_dir)
                await self.registration.verify(self.config.bookie_id, instance_id, self.config.data_dir)
            self._server = await loop.create_server(
                self._new_connection, self.config.host, self.config.port, backlog=1024
            )
        except BaseException:
            self.storage.abort()
            if self.admin is not None:
                self.admin.abort()
            raise
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = (host, port)
        log.info("bookie.listening", host=host, port=port, bookie_id=self.config.bookie_id)
        if self.registration is not None:
            try:
                await self.registration.start(self.config.bookie_id, f"{host}:{port}")
            except BaseException:
                self.abort()
                raise
        self.ready = True

    def _new_connection(self) -> asyncio.Protocol:
        assert self.processor is not None
        if len(self._connections) >= self.config.connections_max:
            log.warning(
                "bookie.connection_refused", reason="connections_max", limit=self.config.connections_max
            )
            self.connections_refused += 1
            return _Refuse()
        return BookieConnection(self.processor, self._limits, self._connections)

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
        if self.registration is not None:
            with contextlib.suppress(Exception):
                await self.registration.close()
        if self._server is not None:
            self._server.close()
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
        if self.admin is not None:
            self.admin.abort()
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.abort()
        if self.storage is not None:
            self.storage.abort()


class _Refuse(asyncio.Protocol):
    """Accepts and immediately closes a connection over the limit."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()
