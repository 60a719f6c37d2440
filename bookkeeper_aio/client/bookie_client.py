"""The pool of bookie connections: one multiplexed connection per bookie, reconnect with backoff.

- :meth:`BookiePool.connection` is synchronous (hot path): it returns the live connection, starts
  a new one (requests queue until the TCP connect completes), or, while a bookie is in reconnect
  backoff, a closed connection whose requests fail at once with ``BookieConnectionLost``. A dead
  bookie therefore costs one failed connect per backoff period, not a timeout per request.
- Request ids come from one counter per pool, so one encoded frame can be sent to every bookie of
  a write set (ids are unique per connection because they are unique per pool).
- The pool owns every connect task; :meth:`close` (graceful) and :meth:`abort` end them all.
- Addresses: a bookie id is resolved by an :class:`AddressResolver` (the registration in metadata
  in production); the default treats the id as ``host:port``.
"""

from __future__ import annotations

import asyncio
import itertools
import ssl
from collections.abc import Callable
from typing import Any, Protocol

import structlog

from bookkeeper_aio.client.auth import provider_for
from bookkeeper_aio.client.config import ClientConfig
from bookkeeper_aio.client.connection import BookieConnection, ConnectionState, Result
from bookkeeper_aio.common.backoff import Backoff
from bookkeeper_aio.common.tls import TlsConfigError, client_context
from bookkeeper_aio.errors import BKError, BKInterfaceError, Unauthorized, error_for_status
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import REQUEST_ID_MAX, StatusCode
from metadata.errors import MetadataError

log = structlog.get_logger(__name__)
_CLOSED = ConnectionState.CLOSED


class AddressResolver(Protocol):
    async def resolve(self, bookie_id: str) -> tuple[str, int]:
        """The (host, port) where ``bookie_id`` listens. Raises BKError when unknown."""
        ...


def parse_address(bookie_id: str) -> tuple[str, int]:
    """``host:port`` (IPv6 as ``[::1]:port``)."""
    host, sep, port = bookie_id.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise BKInterfaceError(f"bookie id {bookie_id!r} is not host:port and no resolver knows it")
    return host.strip("[]"), int(port)


class HostPortResolver:
    """Bookie ids are addresses (``host:port``)."""

    async def resolve(self, bookie_id: str) -> tuple[str, int]:
        return parse_address(bookie_id)


class StaticResolver:
    """A fixed map from bookie id to address (tests, fake bookies), falling back to ``host:port``."""

    def __init__(self, addresses: dict[str, tuple[str, int]] | None = None) -> None:
        self.addresses = dict(addresses or {})

    async def resolve(self, bookie_id: str) -> tuple[str, int]:
        found = self.addresses.get(bookie_id)
        return found if found is not None else parse_address(bookie_id)


def check(response: m.Response) -> m.Response:
    """``response`` if its status is EOK, else raise the status's exception."""
    if response.status != StatusCode.EOK:
        raise error_for_status(response.status, response.message)
    return response


def request_ids(first: int = 1, last: int = REQUEST_ID_MAX) -> Callable[[], int]:
    """A counter of request ids: ``first`` .. ``last``, then from ``first`` again (2^64 requests
    are not in a process's lifetime), each call the next; in C, no Python frame per add."""
    return itertools.chain.from_iterable(itertools.repeat(range(first, last + 1))).__next__


def _set_future(future: asyncio.Future[Result], bookie_id: str, result: Result) -> None:
    if not future.done():
        future.set_result(result)


class BookiePool:
    def __init__(self, config: ClientConfig, resolver: AddressResolver | None = None) -> None:
        self._config = config
        self._resolver: AddressResolver = resolver or HostPortResolver()
        self._loop = asyncio.get_running_loop()
        self._connections: dict[str, BookieConnection] = {}
        self._backoff: dict[str, Backoff] = {}
        self._retry_at_s: dict[str, float] = {}
        self._refused: dict[str, Unauthorized] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.next_request_id = request_ids()
        """A new request id (unique per pool, hence per connection) per call."""
        self._closed = False
        self._auth = provider_for(config)
        self._tls = None
        if config.tls_enabled:
            try:
                self._tls = client_context(
                    config.tls_ca_file,
                    config.tls_cert_file,
                    config.tls_key_file,
                    check_hostname=config.tls_check_hostname,
                )
            except TlsConfigError as error:
                raise BKInterfaceError(str(error)) from error

    @property
    def resolver(self) -> AddressResolver:
        return self._resolver

    def connection(self, bookie_id: str) -> BookieConnection:
        conn = self._connections.get(bookie_id)
        if conn is not None and conn.state is not _CLOSED:  # hot path: no property call
            return conn
        if self._closed:
            return self._dead_connection(bookie_id, BKInterfaceError("the client is closed"))
        if self._loop.time() < self._retry_at_s.get(bookie_id, 0.0):
            return self._dead_connection(
                bookie_id, ConnectionRefusedError(f"{bookie_id} is in reconnect backoff")
            )
        conn = self._new_connection(bookie_id, on_close=self._on_connection_closed)
        conn.start_hello(self.next_request_id())  # first frame on the wire, before any request
        self._connections[bookie_id] = conn
        task = self._loop.create_task(self._connect(conn), name=f"connect {bookie_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return conn

    def refusal(self, bookie_id: str) -> Unauthorized | None:
        """Why the last connection to ``bookie_id`` was refused at its handshake (a token the bookie
        refused, a TLS handshake that failed, a bookie that hung up before answering HELLO as a
        TLS-only one does to a plaintext client), with what to check; None when it was not (or a
        connection succeeded since)."""
        return self._refused.get(bookie_id)

    def reconnect_delay_s(self, bookie_id: str) -> float:
        """Seconds until a connection to ``bookie_id`` may be tried again: 0 unless it is in
        reconnect backoff (its requests fail at once until then)."""
        return max(0.0, self._retry_at_s.get(bookie_id, 0.0) - self._loop.time())

    def request_with_callback(
        self,
        bookie_id: str,
        make: Callable[[int], m.Request],
        callback: Callable[[Any, str, Result], None],
        context: Any,
        timeout_s: float,
    ) -> int:
        rid = self.next_request_id()
        self.connection(bookie_id).request(rid, m.encode(make(rid)), callback, context, timeout_s)
        return rid

    async def request(self, bookie_id: str, make: Callable[[int], m.Request], timeout_s: float) -> m.Response:
        """One request/response (cold paths). Returns the response whatever its status (use
        :func:`check`); raises BKTimeout / BookieConnectionLost. Cancellation forgets the request."""
        rid = self.next_request_id()
        future: asyncio.Future[Result] = self._loop.create_future()
        conn = self.connection(bookie_id)
        conn.request(rid, m.encode(make(rid)), _set_future, future, timeout_s)
        try:
            result = await future
        except asyncio.CancelledError:
            conn.forget(rid)
            raise
        if isinstance(result, BKError):
            raise result
        return result

    async def close(self) -> None:
        """Graceful: queued frames are flushed; pending requests fail; connect tasks end."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for conn in list(self._connections.values()):
            conn.close()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._connections.clear()

    def abort(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for conn in list(self._connections.values()):
            conn.abort()
        self._connections.clear()

    # ------------------------------------------------------------------ internals
    def _dead_connection(self, bookie_id: str, cause: BaseException) -> BookieConnection:
        conn = self._new_connection(bookie_id, on_close=None)
        conn.fail(cause)
        return conn

    def _new_connection(
        self, bookie_id: str, on_close: Callable[[BookieConnection], None] | None
    ) -> BookieConnection:
        return BookieConnection(
            bookie_id,
            standard_timeout_s=self._config.add_timeout_s,
            pending_max=self._config.connection_pending_max,
            frame_bytes_max=self._config.frame_bytes_max,
            write_eager_bytes=self._config.write_eager_bytes,
            write_eager_frames=self._config.write_eager_frames,
            loop=self._loop,
            on_close=on_close,
            auth=self._auth,
            next_request_id=self.next_request_id,
        )

    async def _connect(self, conn: BookieConnection) -> None:
        bookie_id = conn.bookie_id
        try:
            async with asyncio.timeout(self._config.connect_timeout_s):
                host, port = await self._resolver.resolve(bookie_id)
                if self._tls is None:
                    await self._loop.create_connection(lambda: conn, host, port)
                else:
                    await self._loop.create_connection(
                        lambda: conn, host, port, ssl=self._tls, server_hostname=host
                    )
        except ssl.SSLError as error:
            log.warning(
                "bookie.tls_failed",
                bookie=bookie_id,
                error=repr(error),
                hint="check tls_ca_file (the CA that signed the bookie's certificate), that the certificate "
                "names the address connected to (tls_check_hostname), and the client certificate when "
                "the bookie requires one",
            )
            conn.fail(error)
            return
        except (OSError, TimeoutError, BKError, MetadataError) as error:
            log.info("bookie.connect_failed", bookie=bookie_id, error=repr(error))
            conn.fail(error)
            return
        except asyncio.CancelledError:
            conn.abort()
            raise
        if conn.is_usable:
            self._backoff.pop(bookie_id, None)
            self._retry_at_s.pop(bookie_id, None)
            self._refused.pop(bookie_id, None)

    def _on_connection_closed(self, conn: BookieConnection) -> None:
        # Called synchronously as the connection closes, before its pending requests fail, so a
        # request made from one of those failure callbacks already sees the backoff.
        if self._connections.get(conn.bookie_id) is conn:
            del self._connections[conn.bookie_id]
        if conn.error is None or self._closed:
            return
        if conn.ever_ready:
            log.info("bookie.connection_lost", bookie=conn.bookie_id, error=repr(conn.error.__cause__))
        refused = self._handshake_refusal(conn)
        if refused is not None:
            self._refused[conn.bookie_id] = refused
        self._note_failure(conn.bookie_id)

    def _handshake_refusal(self, conn: BookieConnection) -> Unauthorized | None:
        cause = conn.error.__cause__ if conn.error is not None else None
        bookie_id = conn.bookie_id
        if isinstance(cause, Unauthorized):
            return cause
        if conn.hello_answered:
            return None  # past the handshake: a lost connection, not a refusal
        tls_reset = self._tls is not None and isinstance(cause, ConnectionResetError)
        if isinstance(cause, ssl.SSLError) or tls_reset:
            what = str(cause) if isinstance(cause, ssl.SSLError) and str(cause) else "the bookie hung up"
            return Unauthorized(
                f"{bookie_id}: TLS handshake failed: {what} (check tls_ca_file: the CA that signed the "
                "bookie's certificate; tls_check_hostname; the client certificate when the bookie requires "
                "one; and that the bookie has TLS on at all)"
            )
        if self._tls is None and isinstance(cause, ConnectionResetError):
            return Unauthorized(
                f"{bookie_id} closed the connection before answering HELLO: it may require TLS (set "
                "tls_enabled and tls_ca_file in the client's config) or refuse this client"
            )
        return None

    def _note_failure(self, bookie_id: str) -> None:
        backoff = self._backoff.get(bookie_id)
        if backoff is None:
            backoff = self._backoff[bookie_id] = Backoff(
                initial_s=self._config.reconnect_backoff_initial_s, max_s=self._config.reconnect_backoff_max_s
            )
        self._retry_at_s[bookie_id] = self._loop.time() + backoff.next_delay_s()
