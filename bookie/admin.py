"""The bookie's admin HTTP endpoint: ``/health``, ``/ready``, ``/metrics``, ``/state``, ``/readonly``.

A tiny HTTP/1.1 server on asyncio streams (no web framework: four read-only GETs do not justify a
dependency, and the admin port must stay cheap and predictable next to the data path):

- ``GET /health`` 200 ``{"healthy": true, ...}`` or 503 with the reasons: the journal failed after an
  I/O error, or the data dir is read-only, unusable or nearly full. Starting and stopping are healthy
  (a liveness probe must not restart a bookie for replaying its journal).
- ``GET /ready`` 200 once the bookie serves (and is registered, when ``metadata`` is set); 503 while
  starting or stopping.
- ``GET /metrics`` the Prometheus text exposition (:mod:`bookie.metrics`).
- ``GET /state`` a JSON summary for people and scripts (id, address, state, counters, disk).
- ``GET /readonly`` the read-only mode as JSON (``mode``, ``manual``, ``reason``, ...);
  ``POST /readonly?set=1`` puts the bookie in read-only mode by hand (it sticks until
  ``?set=0``, even if the disk frees up), ``?set=0`` clears the manual flag (the disk may still hold
  the bookie read-only: the answer says why). Any other ``set`` value is 400. It exists only when
  the server was given a ``read_only`` action.
- ``GET /gc`` garbage collection as JSON (the pass running with its phase and progress, the last
  one's report, totals); ``POST /gc`` starts a pass now (``started`` false when one is already
  running) and answers at once: poll ``GET /gc`` to follow it (``bkaio bookie gc`` does). It exists
  only when the server was given a ``gc`` action.

State changes are POSTs carrying the admin token (``Authorization: Bearer TOKEN``, compared in
constant time): without it 401, with a wrong one 403, and a GET that asks for a change (``?set=``,
``?start=1``) is 405 and changes nothing — a GET can be triggered cross-site by any web page a
browser on the host opens, a POST with an ``Authorization`` header cannot (it needs a CORS
preflight this server never approves). A server given no token refuses every state change (403).
The endpoint listens on loopback unless ``admin_host`` says otherwise.

``HEAD`` is accepted wherever ``GET`` is. Every response closes its connection (``Connection:
close``): scrapers reconnect, and there is no keep-alive state to bound. Bounds, each against a peer
that misbehaves: :data:`REQUEST_HEAD_BYTES_MAX` (431, then close), :data:`REQUEST_TIMEOUT_S` for the
request head and the response (408, then close: slow loris), :data:`CONNECTIONS_MAX` (closed at
accept). A malformed request line is 400, an unknown path 404, another method 405. Nothing a peer
sends can raise out of the handler or touch the data path.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import structlog

from bookie.metrics import CONTENT_TYPE_LATEST, Snapshot, health_problems, make_registry, render, state_json

log = structlog.get_logger(__name__)

CONNECTIONS_MAX = 16
"""Concurrent admin connections: a scraper, a probe and an operator's curl need a handful; more are
closed at accept so the admin port can never cost the bookie memory or file descriptors."""
REQUEST_HEAD_BYTES_MAX = 8192
"""Request line + headers (curl and Prometheus send ~200 bytes); the stream buffer is capped there."""
REQUEST_TIMEOUT_S = 5.0
"""Budget for reading the request head and, separately, for writing the response (slow loris)."""
CLOSE_TIMEOUT_S = 1.0

_JSON = "application/json"
_TEXT = "text/plain; charset=utf-8"
_SET_VALUES = {"1": True, "true": True, "0": False, "false": False}
_INDEX = b"bookie admin: /health /ready /metrics /state /readonly /gc\n"


def _token_digest(token: bytes) -> bytes:
    return hashlib.sha256(b"bookkeeper-aio/admin-token\x00" + token).digest()


class BadRequest(Exception):
    """A request the server answers with ``status`` and then closes."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_request_line(line: bytes) -> tuple[str, str]:
    """``b"GET /metrics?x=1 HTTP/1.1\\r\\n"`` -> ``("GET", "/metrics")``; raises :class:`BadRequest`."""
    try:
        text = line.decode("ascii").rstrip("\r\n")
    except UnicodeDecodeError:
        raise BadRequest(HTTPStatus.BAD_REQUEST, "request line is not ASCII") from None
    parts = text.split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[0].isupper():
        raise BadRequest(HTTPStatus.BAD_REQUEST, "malformed request line")
    method, target, version = parts
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise BadRequest(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, f"unsupported version {version!r}")
    if not target.startswith("/"):
        raise BadRequest(HTTPStatus.BAD_REQUEST, "request target must be a path")
    return method, target.split("?", 1)[0]


def parse_query(line: bytes) -> dict[str, str]:
    """The query of a request line already accepted by :func:`parse_request_line` (``a=1&b=2``;
    no percent-decoding: the admin API needs none)."""
    target = line.decode("ascii").split(" ")[1]
    _, _, query = target.partition("?")
    out: dict[str, str] = {}
    for pair in query.split("&"):
        if pair:
            name, _, value = pair.partition("=")
            out[name] = value
    return out


def response_bytes(
    status: HTTPStatus, body: bytes, content_type: str, *, head_only: bool = False, allow: str | None = None
) -> bytes:
    lines = [
        f"HTTP/1.1 {status.value} {status.phrase}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Cache-Control: no-store",
        "Connection: close",
    ]
    if allow is not None:
        lines.append(f"Allow: {allow}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")
    return head if head_only else head + body


def _json(status: HTTPStatus, value: Any, head_only: bool) -> bytes:
    body = (json.dumps(value, sort_keys=True) + "\n").encode()
    return response_bytes(status, body, _JSON, head_only=head_only)


class AdminServer:
    """Owner of the admin listener and its connection tasks; ``close()`` graceful, ``abort()`` now.

    ``source()`` returns the snapshot to report; it is called on the loop, once per request.
    """

    def __init__(
        self,
        source: Callable[[], Snapshot],
        host: str,
        port: int,
        read_only: Callable[[bool | None], dict[str, Any]] | None = None,
        gc: Callable[[bool], dict[str, Any]] | None = None,
        token: bytes | None = None,
    ) -> None:
        self._source = source
        self._token_digest = _token_digest(token) if token else None
        self._read_only = read_only
        self._gc = gc
        self._host = host
        self._port = port
        self._registry = make_registry(source)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.address: tuple[str, int] | None = None
        self.requests = 0
        self.refused = 0

    def set_token(self, token: bytes | None) -> None:
        """The token state changes must carry (None: no state changes at all)."""
        self._token_digest = _token_digest(token) if token else None

    async def start(self) -> None:
        """Bind; raises ``OSError`` when the address is taken."""
        self._server = await asyncio.start_server(
            self._on_connection, self._host, self._port, limit=REQUEST_HEAD_BYTES_MAX, backlog=64
        )
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = (host, port)
        log.info("admin.listening", host=host, port=port)

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._writers) >= CONNECTIONS_MAX:
            self.refused += 1
            writer.transport.abort()
            return
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        try:
            await self._serve_one(reader, writer)
        except (ConnectionError, TimeoutError):
            pass  # the peer went away or stalled while we were writing: nothing more to say
        except Exception:  # a bug in a handler must not leave the loop's exception handler to log it
            log.exception("admin.request_failed")
        finally:
            self._tasks.discard(task)
            self._writers.discard(writer)
            if writer.transport.get_write_buffer_size():
                writer.transport.abort()  # a peer that does not read: do not wait for it
            else:
                writer.close()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                head = await _read_head(reader)
            if head is None:
                return  # closed before a complete request line: nothing to answer
            response = self._respond(*head)
        except TimeoutError:
            response = response_bytes(HTTPStatus.REQUEST_TIMEOUT, b"request timeout\n", _TEXT)
        except BadRequest as exc:
            response = response_bytes(exc.status, f"{exc}\n".encode(), _TEXT)
        self.requests += 1
        writer.write(response)
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        await _linger(reader)

    def _respond(self, request_line: bytes, authorization: bytes | None = None) -> bytes:
        method, path = parse_request_line(request_line)
        if path == "/readonly" and self._read_only is not None:
            return self._readonly(method, request_line, authorization)
        if path == "/gc" and self._gc is not None:
            return self._gc_route(method, request_line, authorization)
        if method not in ("GET", "HEAD"):
            return response_bytes(HTTPStatus.METHOD_NOT_ALLOWED, b"use GET\n", _TEXT, allow="GET, HEAD")
        head_only = method == "HEAD"
        if path == "/metrics":
            return response_bytes(
                HTTPStatus.OK, render(self._registry), CONTENT_TYPE_LATEST, head_only=head_only
            )
        if path not in ("/health", "/ready", "/state", "/"):
            return response_bytes(HTTPStatus.NOT_FOUND, b"not found: try /\n", _TEXT, head_only=head_only)
        if path == "/":
            return response_bytes(HTTPStatus.OK, _INDEX, _TEXT, head_only=head_only)
        snap = self._source()
        if path == "/health":
            problems = health_problems(snap)
            status = HTTPStatus.SERVICE_UNAVAILABLE if problems else HTTPStatus.OK
            value = {"healthy": not problems, "state": snap.state.value, "problems": problems}
            return _json(status, value, head_only)
        if path == "/ready":
            status = HTTPStatus.OK if snap.ready else HTTPStatus.SERVICE_UNAVAILABLE
            return _json(status, {"ready": snap.ready, "state": snap.state.value}, head_only)
        return _json(HTTPStatus.OK, state_json(snap), head_only)

    def _refuse_change(self, method: str, authorization: bytes | None) -> bytes | None:
        """The answer refusing a state change (None: allowed). Only a POST with the token changes."""
        if method != "POST":
            return response_bytes(
                HTTPStatus.METHOD_NOT_ALLOWED,
                b"state changes are POSTs with the admin token (Authorization: Bearer TOKEN)\n",
                _TEXT,
                allow="GET, HEAD, POST",
            )
        if self._token_digest is None:
            return response_bytes(
                HTTPStatus.FORBIDDEN, b"this admin endpoint has no token: no changes\n", _TEXT
            )
        scheme, _, offered = (authorization or b"").strip().partition(b" ")
        if scheme.lower() != b"bearer" or not offered.strip():
            log.warning("admin.unauthorised", reason="no bearer token")
            return response_bytes(
                HTTPStatus.UNAUTHORIZED,
                b"send the admin token: Authorization: Bearer TOKEN (the bookie's admin_token_file, or "
                b"<data_dir>/admin.token)\n",
                _TEXT,
            )
        if not hmac.compare_digest(_token_digest(offered.strip()), self._token_digest):
            log.warning("admin.unauthorised", reason="wrong token")
            return response_bytes(HTTPStatus.FORBIDDEN, b"wrong admin token\n", _TEXT)
        return None

    def _readonly(self, method: str, request_line: bytes, authorization: bytes | None) -> bytes:
        assert self._read_only is not None
        if method not in ("GET", "HEAD", "POST"):
            return response_bytes(
                HTTPStatus.METHOD_NOT_ALLOWED, b"use GET or POST\n", _TEXT, allow="GET, HEAD, POST"
            )
        value = parse_query(request_line).get("set")
        if value is not None and value not in _SET_VALUES:
            return response_bytes(HTTPStatus.BAD_REQUEST, b"set must be 1 or 0\n", _TEXT)
        wanted = None if value is None or method == "HEAD" else _SET_VALUES[value]  # HEAD only looks
        if wanted is not None or method == "POST":
            refused = self._refuse_change(method, authorization)
            if refused is not None:
                return refused
        if wanted is not None:
            log.info("admin.readonly_set", read_only=wanted)
        return _json(HTTPStatus.OK, self._read_only(wanted), method == "HEAD")

    def _gc_route(self, method: str, request_line: bytes, authorization: bytes | None) -> bytes:
        assert self._gc is not None
        if method not in ("GET", "HEAD", "POST"):
            return response_bytes(
                HTTPStatus.METHOD_NOT_ALLOWED, b"use GET or POST\n", _TEXT, allow="GET, HEAD, POST"
            )
        value = parse_query(request_line).get("start")
        if value is not None and value not in _SET_VALUES:
            return response_bytes(HTTPStatus.BAD_REQUEST, b"start must be 1 or 0\n", _TEXT)
        start = method == "POST" or (method == "GET" and value is not None and _SET_VALUES[value])
        if start:
            refused = self._refuse_change(method, authorization)
            if refused is not None:
                return refused
            log.info("admin.gc_requested")
        return _json(HTTPStatus.OK, self._gc(start), method == "HEAD")

    async def close(self) -> None:
        """Stop accepting, end open admin connections, wait (bounded) for the listener to close."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for task in list(self._tasks):
            task.cancel()
        for writer in list(self._writers):
            writer.transport.abort()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=CLOSE_TIMEOUT_S)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), CLOSE_TIMEOUT_S)

    def abort(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        for writer in list(self._writers):
            writer.transport.abort()


ADMIN_TOKEN_FILE = "admin.token"


class AdminTokenError(ValueError):
    """The admin token file is empty."""


def load_or_create_token(token_file: str, data_dir: str) -> bytes:
    """The admin token: the first line of ``token_file`` when set, else ``<data_dir>/admin.token``,
    created with a random token (mode 0600) the first time and kept across restarts. Raises
    ``OSError`` (with the path) when it cannot be read or written, :class:`AdminTokenError` when empty."""
    path = token_file or os.path.join(data_dir, ADMIN_TOKEN_FILE)
    if not token_file and not os.path.exists(path):
        os.makedirs(data_dir, mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(32) + "\n")
    with open(path, "rb") as handle:
        token = handle.readline().strip()
    if not token:
        raise AdminTokenError(f"admin token file {path} is empty: put a token on its first line")
    return token


LINGER_S = 1.0
LINGER_BYTES_MAX = 256 * 1024
"""Lingering close: after answering (maybe early, e.g. 431 on an oversized head) the server reads and
drops what the peer is still sending, up to these bounds, before closing. Closing with unread bytes
makes the kernel send a reset, which can destroy the response before the peer reads it."""


async def _linger(reader: asyncio.StreamReader) -> None:
    remaining = LINGER_BYTES_MAX
    try:
        async with asyncio.timeout(LINGER_S):
            while remaining > 0:
                chunk = await reader.read(min(65536, remaining))
                if not chunk:
                    return
                remaining -= len(chunk)
    except TimeoutError:
        return


async def _read_head(reader: asyncio.StreamReader) -> tuple[bytes, bytes | None] | None:
    """Read the request head (bounded); return its request line and its ``Authorization`` header's
    value (None without one), None on EOF before a request line.

    Raises :class:`BadRequest` (431) when the head exceeds :data:`REQUEST_HEAD_BYTES_MAX`.
    """
    request_line: bytes | None = None
    authorization: bytes | None = None
    total = 0
    while True:
        try:
            line = await reader.readline()
        except ValueError:  # a line over the stream's limit (LimitOverrunError, re-raised by readline)
            raise BadRequest(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request head too large") from None
        total += len(line)
        if total > REQUEST_HEAD_BYTES_MAX:
            raise BadRequest(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request head too large")
        if not line.endswith(b"\n"):
            if request_line is None:
                return None  # EOF before a whole request line
            raise BadRequest(HTTPStatus.BAD_REQUEST, "connection closed inside the request head")
        if request_line is None:
            if line in (b"\r\n", b"\n"):
                continue  # RFC 9112 §2.2: ignore empty lines before the request line
            request_line = line
        elif line in (b"\r\n", b"\n"):
            return request_line, authorization
        else:
            name, sep, value = line.partition(b":")
            if sep and name.strip().lower() == b"authorization":
                authorization = value.strip()
