"""`MetadataStore` on etcd v3, through aetcd's gRPC stubs (``aetcd.rpc``).

Why the stubs and not ``aetcd.Client``: we need per-call deadlines, paged ranges (``limit``), txn failure
branches, ``ignore_lease`` and a watch stream we can resume ourselves; the stubs give all of that with
aetcd's generated protobufs, and nothing else of aetcd's client state is involved.

Rules:
- Every operation has a budget (`EtcdConfig.op_timeout_s`) covering connect, retries and the RPC.
- Endpoints are tried in turn: one lazily created gRPC channel per endpoint, kept for the store's life
  (gRPC reconnects a channel by itself); on a connection failure we move to the next endpoint and
  back off (capped, jittered) until the budget is spent, then raise `MetadataUnavailable`.
- Reads retry freely. A mutation is retried only when it provably was not applied (channel not ready,
  "no leader"); once sent, a lost answer is `CasResultUnknown`, never success or failure.
- Versions are mod_revisions: create = txn ``If(create_revision == 0)``, CAS = txn ``If(mod_revision == v)``
  with a failure branch that reads the key so `BadVersion` and `NoNode` are told apart; each guard
  of a guarded write adds ``mod_revision(guard) == its version`` to the same txn (and a read of it
  to the failure branch: `GuardFailed`).
- Watches resume from the last delivered revision on a new stream (any endpoint); etcd's
  "require leader" metadata makes a member that lost its leader end the stream instead of going quiet.
  A watch etcd cancels for want of a valid token (it expired, or etcd restarted and forgot it)
  logs in again before the new stream: a watch-only process makes no other call that would.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog
from aetcd import rpc

from bookkeeper_aio.common.backoff import Backoff
from bookkeeper_aio.common.log_limit import LogLimiter
from metadata.errors import (
    BadVersion,
    CasResultUnknown,
    GuardFailed,
    LeaseExpired,
    MetadataError,
    MetadataUnavailable,
    NodeExists,
    NoNode,
    WatchCompacted,
)
from metadata.store import (
    LIST_REPLY_BYTES_MAX,
    EventKind,
    Guards,
    KeyValue,
    MetadataStore,
    Page,
    WatchEvent,
    validate_list_limit,
    validate_ttl,
)

log = structlog.get_logger("metadata.etcd")
T = TypeVar("T")

# "Require leader": a member without a leader refuses requests at once ("no leader": nothing was
# proposed, so even a mutation is safe to retry elsewhere) and cancels our watches instead of going
# quiet. Without it, a request to a member cut off from the majority waits until its deadline.
_REQUIRE_LEADER: tuple[tuple[str, str], ...] = (("hasleader", "true"),)
# Errors whose text proves that the server did not apply a mutation (safe to retry elsewhere).
_NOT_APPLIED_MARKERS = ("no leader", "failed to connect", "connection refused", "not capable")
# Server-side timeouts etcd reports with code UNKNOWN (a read may simply be retried).
_SERVER_TIMEOUT_MARKERS = ("deadline exceeded", "timed out", "leader changed")
# Why etcd cancels a watch whose token it does not take (expired, or etcd restarted and forgot
# it): the stream opens, then the watch is canceled with a reason, not a gRPC error.
_WATCH_AUTH_MARKERS = ("permission denied", "invalid auth token", "auth store is old")
# One watch's reconnect warnings (an outage: one per attempt) at most this often; the rest: debug.
_WATCH_WARNING_INTERVAL_S = 30.0


@dataclass(frozen=True, slots=True)
class EtcdConfig:
    """Connection settings. ``endpoints``: (host, port) pairs of the cluster's client URLs."""

    endpoints: tuple[tuple[str, int], ...]
    op_timeout_s: float = 5.0
    # How long to wait for one endpoint's channel to connect before trying the next.
    connect_timeout_s: float = 1.0
    # The first attempt of a read on one endpoint may take this long before the read moves to the
    # next endpoint (each later attempt twice as long, all within ``op_timeout_s``): a member that
    # is stuck (SIGSTOP, disk stall) keeps its TCP connection "ready" but never answers.
    attempt_timeout_s: float = 1.5
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 1.0
    # gRPC keepalive detects a dead peer on an idle watch; etcd rejects pings more often than 5 s.
    keepalive_time_ms: int = 10_000
    keepalive_timeout_ms: int = 5_000
    # The largest reply taken (gRPC's receive limit, 4 MiB unless raised). A listing whose reply
    # would pass it is asked again for half the keys (a short page), down to one key.
    reply_bytes_max: int = LIST_REPLY_BYTES_MAX
    # TLS toward etcd (docs/security.md): on when ``tls`` or any file is set; the server's
    # certificate is verified against ``ca_file`` (else gRPC's default roots); ``cert_file`` and
    # ``key_file`` present a client certificate (etcd's --client-cert-auth).
    tls: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    # etcd's own authentication: ``user`` and the password read from ``password_file`` get a token
    # (Authenticate) that every call carries; an expired token is renewed and the call retried.
    user: str = ""
    password_file: str = ""

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("EtcdConfig needs at least one endpoint")
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("an etcd client certificate needs both cert_file and key_file")
        if bool(self.user) != bool(self.password_file):
            raise ValueError("etcd credentials need both user and password_file")
        if self.op_timeout_s <= 0 or self.connect_timeout_s <= 0 or self.attempt_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if self.reply_bytes_max < 1024 * 1024:
            raise ValueError("reply_bytes_max must be at least 1 MiB (one etcd value's default limit)")

    @property
    def secure(self) -> bool:
        return self.tls or bool(self.ca_file or self.cert_file or self.key_file)


@dataclass(slots=True)
class _Endpoint:
    target: str
    channel: Any
    kv: Any
    lease: Any
    watch: Any
    auth: Any = None
    metadata: tuple[tuple[str, str], ...] = (("hasleader", "true"),)
    """Sent with every call: require a leader, and the auth token once authenticated."""
    authenticated: bool = False


def _read_file(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as error:
        raise MetadataError(f"etcd {what} {path}: {error}") from error


def _channel_credentials(config: EtcdConfig) -> Any:
    import grpc  # aetcd's dependency; imported here so a plaintext setup never needs it loaded

    return grpc.ssl_channel_credentials(
        root_certificates=_read_file(config.ca_file, "ca_file") if config.ca_file else None,
        private_key=_read_file(config.key_file, "key_file") if config.key_file else None,
        certificate_chain=_read_file(config.cert_file, "cert_file") if config.cert_file else None,
    )


def _auth_expired(error: Any) -> bool:
    """etcd refused the call's token (expired, revoked, or etcd restarted): authenticate again."""
    details = str(error.details() or "").lower()
    return _code_name(error) == "UNAUTHENTICATED" or "invalid auth token" in details


def _too_big(error: MetadataError) -> bool:
    """The reply passed the receive limit (`EtcdConfig.reply_bytes_max`)."""
    cause = error.__cause__
    return (
        isinstance(cause, rpc.AioRpcError)
        and _code_name(cause) == "RESOURCE_EXHAUSTED"
        and "larger than max" in str(cause.details() or "")
    )


def _key_end(prefix: bytes) -> bytes:
    """etcd's range_end for "every key starting with prefix"."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\x00"
    end[-1] += 1
    return bytes(end)


def _kv(kv: Any) -> KeyValue:
    return KeyValue(
        key=kv.key.decode("utf-8", "surrogateescape"),
        value=bytes(kv.value),
        version=kv.mod_revision,
        create_revision=kv.create_revision,
        lease_id=kv.lease,
    )


def _code_name(error: Any) -> str:
    return str(error.code().name)


def _retriable(error: Any, *, mutation: bool) -> bool:
    """Whether to try again (maybe on another endpoint) within the budget.

    Reads: any connection-level failure or server-side timeout. Mutations: only failures that prove
    the request was not applied (not connected, or the member had no leader).
    """
    code, details = _code_name(error), str(error.details() or "").lower()
    if mutation:
        return code == "UNAVAILABLE" and any(marker in details for marker in _NOT_APPLIED_MARKERS)
    if code == "UNAVAILABLE":
        return True
    return code == "UNKNOWN" and any(marker in details for marker in _SERVER_TIMEOUT_MARKERS)


class EtcdStore(MetadataStore):
    """The etcd driver. Create with `EtcdStore(EtcdConfig(...))`; ``close()`` when done."""

    def __init__(self, config: EtcdConfig) -> None:
        self._config = config
        self._endpoints: list[_Endpoint | None] = [None] * len(config.endpoints)
        self._current = 0
        self._closed = False
        self._plaintext_warned = False
        self._watch_warnings = LogLimiter(_WATCH_WARNING_INTERVAL_S)

    @property
    def config(self) -> EtcdConfig:
        return self._config

    # ---- connection management -------------------------------------------------------------------

    def _endpoint(self, index: int) -> _Endpoint:
        endpoint = self._endpoints[index]
        if endpoint is None:
            host, port = self._config.endpoints[index]
            options = [
                ("grpc.keepalive_time_ms", self._config.keepalive_time_ms),
                ("grpc.keepalive_timeout_ms", self._config.keepalive_timeout_ms),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.max_pings_without_data", 0),
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
                ("grpc.enable_retries", 0),
                ("grpc.max_receive_message_length", self._config.reply_bytes_max),
            ]
            if self._config.secure:
                credentials = _channel_credentials(self._config)
                channel = rpc.secure_channel(f"{host}:{port}", credentials, options=options)
            else:
                channel = rpc.insecure_channel(f"{host}:{port}", options=options)
            endpoint = _Endpoint(
                target=f"{host}:{port}",
                channel=channel,
                kv=rpc.KVStub(channel),
                lease=rpc.LeaseStub(channel),
                watch=rpc.WatchStub(channel),
                auth=rpc.AuthStub(channel),
            )
            self._endpoints[index] = endpoint
        return endpoint

    def _rotate(self, failed_index: int, reason: str) -> None:
        # With one endpoint there is nothing to switch to: each backoff would log a "switch" to itself.
        if self._current == failed_index and len(self._endpoints) > 1:
            self._current = (failed_index + 1) % len(self._endpoints)
            log.info(
                "metadata.etcd.endpoint_switched",
                failed=self._endpoint(failed_index).target,
                next=self._endpoint(self._current).target,
                reason=reason,
            )

    async def _ready(self, deadline: float) -> tuple[int, _Endpoint]:
        """A connected endpoint, trying each in turn until ``deadline``."""
        loop = asyncio.get_running_loop()
        backoff = Backoff(self._config.backoff_initial_s, self._config.backoff_max_s)
        while True:
            if self._closed:
                raise MetadataUnavailable("etcd store is closed")
            index = self._current
            endpoint = self._endpoint(index)
            if endpoint.channel.get_state(try_to_connect=True).name == "READY":
                # A connected endpoint may still need a (new) token: a failed login there is a
                # connect failure like any other (next endpoint, back off), never a bare TimeoutError.
                try:
                    await self._authenticate(endpoint, deadline)
                    return index, endpoint
                except TimeoutError:
                    self._rotate(index, "authentication unavailable")
                    if deadline - loop.time() <= 0:
                        raise MetadataUnavailable(
                            f"etcd authentication failed on every endpoint of {self._targets()} in time "
                            "(is etcd up and does it have a leader?)"
                        ) from None
                    await self._sleep_within(backoff.next_delay_s(), deadline)
                    continue
            remaining_s = deadline - loop.time()
            if remaining_s <= 0:
                raise MetadataUnavailable(f"no etcd endpoint reachable of {self._targets()} in time")
            try:
                async with asyncio.timeout(min(self._config.connect_timeout_s, remaining_s)):
                    await endpoint.channel.channel_ready()
                await self._authenticate(endpoint, deadline)
                return index, endpoint
            except TimeoutError:
                self._rotate(index, "connect timeout")
            await self._sleep_within(backoff.next_delay_s(), deadline)

    async def _authenticate(self, endpoint: _Endpoint, deadline: float) -> None:
        """With etcd credentials: a token for ``endpoint`` (once, and again after it expired)."""
        if not self._config.user or endpoint.authenticated:
            return
        if not self._config.secure and not self._plaintext_warned:
            self._plaintext_warned = True  # once per store: each endpoint authenticates in turn
            log.warning(
                "metadata.etcd.password_in_plaintext",
                user=self._config.user,
                endpoint=endpoint.target,
                why="etcd credentials without TLS: the password and the token every call carries "
                "cross the network readable by anyone on the path (who can then rewrite the cluster's "
                "metadata)",
                fix="add tls=1 and ca_file=CA.pem to the metadata URL (etcd serving TLS): docs/security.md",
            )
        password = _read_file(self._config.password_file, "password_file").decode().strip()
        request = rpc.AuthenticateRequest(name=self._config.user, password=password)
        timeout_s = max(0.001, deadline - asyncio.get_running_loop().time())
        try:
            response = await endpoint.auth.Authenticate(request, timeout=timeout_s)
        except rpc.AioRpcError as error:
            if _code_name(error) in {"UNAVAILABLE", "DEADLINE_EXCEEDED"}:
                raise TimeoutError from error  # like a connect failure: the next endpoint
            raise MetadataError(
                f"etcd refused the credentials of user {self._config.user!r}: {error.details()} (check "
                "the user and password_file of the metadata URL)"
            ) from error
        endpoint.metadata = (*_REQUIRE_LEADER, ("token", response.token))
        endpoint.authenticated = True

    async def _sleep_within(self, delay_s: float, deadline: float) -> None:
        remaining_s = deadline - asyncio.get_running_loop().time()
        await asyncio.sleep(max(0.0, min(delay_s, remaining_s)))

    def _targets(self) -> list[str]:
        return [f"{host}:{port}" for host, port in self._config.endpoints]

    async def _call(
        self, op: Callable[[_Endpoint, float], Awaitable[T]], *, mutation_key: str | None = None
    ) -> T:
        """Run ``op(endpoint, timeout_s)`` within the operation budget, retrying where it is safe.

        A read's attempt on one endpoint is capped (``attempt_timeout_s``, doubling per attempt), so
        a member that holds its connection but never answers costs one attempt, not the budget: the
        read times out there, the store moves to the next endpoint and retries. A mutation gets the
        whole remaining budget (it cannot be retried once sent); when its answer is lost the store
        still moves on, so the next call goes elsewhere, and the mutation raises `CasResultUnknown`.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._config.op_timeout_s
        backoff = Backoff(self._config.backoff_initial_s, self._config.backoff_max_s)
        attempt_cap_s = self._config.attempt_timeout_s
        while True:
            index, endpoint = await self._ready(deadline)
            remaining_s = deadline - loop.time()
            if remaining_s <= 0:
                raise MetadataUnavailable(f"etcd operation timed out after {self._config.op_timeout_s} s")
            # The last attempt (when less than another capped one would be left after it) gets
            # all that is left.
            capped = mutation_key is None and 2 * attempt_cap_s <= remaining_s
            try:
                return await op(endpoint, min(remaining_s, attempt_cap_s) if capped else remaining_s)
            except rpc.AioRpcError as error:
                details = str(error.details() or "")
                if self._config.user and _auth_expired(error):
                    endpoint.authenticated = False  # refused before it ran: safe to retry, even a CAS
                elif capped and _code_name(error) == "DEADLINE_EXCEEDED":
                    # Our own cap ran out on this endpoint (stuck or slow): a read tries the next,
                    # with a longer cap in case etcd is merely slow everywhere.
                    self._rotate(index, f"no answer within {attempt_cap_s:.2f} s")
                    attempt_cap_s *= 2
                elif not _retriable(error, mutation=mutation_key is not None):
                    translated = self._translate(error, mutation_key)
                    if isinstance(translated, (CasResultUnknown, MetadataUnavailable)):
                        self._rotate(index, details)  # this member may be stuck: the next call goes elsewhere
                    raise translated from error
                else:
                    self._rotate(index, details)
                if deadline - loop.time() <= 0:
                    raise MetadataUnavailable(f"etcd unavailable: {details}") from error
            await self._sleep_within(backoff.next_delay_s(), deadline)

    def _translate(self, error: Any, mutation_key: str | None) -> MetadataError:
        code, details = _code_name(error), str(error.details() or "")
        if mutation_key is not None and code in {"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "UNKNOWN"}:
            return CasResultUnknown(mutation_key, f"etcd {code}: {details}")
        if code in {"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"} or _retriable(error, mutation=False):
            return MetadataUnavailable(f"etcd {code}: {details}")
        if code == "OUT_OF_RANGE" and "compacted" in details:
            return WatchCompacted(mutation_key or "<range>", 0)
        if code == "UNIMPLEMENTED":  # an HTTP/2 (gRPC) server answered, but not with etcd's API
            return MetadataError(
                f"etcd {code}: {details}: the server at {', '.join(self._targets())} is not etcd (its "
                "v3 API); check the metadata URL's HOST:PORT, etcd's client port (2379 by default)"
            )
        return MetadataError(f"etcd {code}: {details}")

    # ---- key-value -------------------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        request = rpc.RangeRequest(key=key.encode())

        async def op(endpoint: _Endpoint, timeout_s: float) -> Any:
            return await endpoint.kv.Range(request, timeout=timeout_s, metadata=endpoint.metadata)

        response = await self._call(op)
        return _kv(response.kvs[0]) if response.kvs else None

    async def _txn(self, key: str, request: Any) -> Any:
        async def op(endpoint: _Endpoint, timeout_s: float) -> Any:
            return await endpoint.kv.Txn(request, timeout=timeout_s, metadata=endpoint.metadata)

        try:
            return await self._call(op, mutation_key=key)
        except MetadataError as error:
            cause = error.__cause__
            if isinstance(cause, rpc.AioRpcError) and "lease not found" in str(cause.details()):
                raise LeaseExpired(self._lease_of(request)) from error
            raise

    @staticmethod
    def _lease_of(request: Any) -> int:
        for op in request.success:
            if op.WhichOneof("request") == "request_put":
                return int(op.request_put.lease)
        return 0

    async def create(self, key: str, value: bytes, *, lease_id: int = 0) -> int:
        raw = key.encode()
        request = rpc.TxnRequest(
            compare=[
                rpc.Compare(key=raw, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL, create_revision=0)
            ],
            success=[rpc.RequestOp(request_put=rpc.PutRequest(key=raw, value=value, lease=lease_id))],
            failure=[],
        )
        response = await self._txn(key, request)
        if not response.succeeded:
            raise NodeExists(key)
        return int(response.header.revision)

    async def put(self, key: str, value: bytes, *, lease_id: int = 0) -> int:
        raw = key.encode()
        request = rpc.TxnRequest(
            compare=[],
            success=[rpc.RequestOp(request_put=rpc.PutRequest(key=raw, value=value, lease=lease_id))],
            failure=[],
        )
        response = await self._txn(key, request)
        return int(response.header.revision)

    @staticmethod
    def _mod_equals(raw: bytes, version: int) -> Any:
        return rpc.Compare(key=raw, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=version)

    def _guarded_txn(
        self, raw: bytes, expected_version: int | None, then: Any, guards: Guards, *, must_exist: bool = False
    ) -> Any:
        """``then`` if the key is at ``expected_version`` (None: no condition on it) and every guard
        key at its version; the failure branch reads the key and each guard key, to tell
        `GuardFailed` from `BadVersion` from `NoNode` (:meth:`_raise_conflict`). ``must_exist``:
        the key must exist too (a missing key's mod_revision is 0, so a CAS at version 0 would
        otherwise pass the compare and fail in the put: etcd's "key not found")."""
        compare = [] if expected_version is None else [self._mod_equals(raw, expected_version)]
        if must_exist:
            compare.append(
                rpc.Compare(key=raw, target=rpc.Compare.CREATE, result=rpc.Compare.GREATER, create_revision=0)
            )
        compare.extend(self._mod_equals(guard.key.encode(), guard.version) for guard in guards)
        reads = [raw, *(guard.key.encode() for guard in guards)]
        return rpc.TxnRequest(
            compare=compare,
            success=[then],
            failure=[rpc.RequestOp(request_range=rpc.RangeRequest(key=k)) for k in reads],
        )

    def _raise_conflict(self, key: str, expected_version: int | None, response: Any, guards: Guards) -> None:
        for i, guard in enumerate(guards, start=1):
            kvs = response.responses[i].response_range.kvs
            actual = int(kvs[0].mod_revision) if kvs else None
            if (actual or 0) != guard.version:  # a missing key's mod_revision is 0: Guard(k, 0) held
                raise GuardFailed(key, guard.key, guard.version, actual)
        kvs = response.responses[0].response_range.kvs
        if not kvs:
            raise NoNode(key)
        assert expected_version is not None  # only a versioned write fails on its own key
        raise BadVersion(key, expected_version, int(kvs[0].mod_revision))

    async def compare_and_set(
        self, key: str, value: bytes, expected_version: int, *, guards: Guards = ()
    ) -> int:
        raw = key.encode()
        put = rpc.RequestOp(request_put=rpc.PutRequest(key=raw, value=value, ignore_lease=True))
        txn = self._guarded_txn(raw, expected_version, put, guards, must_exist=expected_version == 0)
        response = await self._txn(key, txn)
        if not response.succeeded:
            self._raise_conflict(key, expected_version, response, guards)
        return int(response.header.revision)

    async def delete(self, key: str, expected_version: int | None = None, *, guards: Guards = ()) -> None:
        raw = key.encode()
        remove = rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=raw))
        response = await self._txn(key, self._guarded_txn(raw, expected_version, remove, guards))
        if not response.succeeded:
            self._raise_conflict(key, expected_version, response, guards)
        if response.responses[0].response_delete_range.deleted == 0:
            raise NoNode(key)

    async def list(
        self,
        prefix: str,
        *,
        start_after: str | None = None,
        limit: int = 1000,
        revision: int | None = None,
        keys_only: bool = False,
    ) -> Page:
        validate_list_limit(limit)
        raw_prefix = prefix.encode()
        start = raw_prefix
        if start_after is not None and start_after.encode() >= raw_prefix:
            start = start_after.encode() + b"\x00"
        while True:
            request = rpc.RangeRequest(
                key=start,
                range_end=_key_end(raw_prefix),
                limit=limit,
                revision=revision or 0,
                keys_only=keys_only,
            )

            async def op(endpoint: _Endpoint, timeout_s: float, request: Any = request) -> Any:
                return await endpoint.kv.Range(request, timeout=timeout_s, metadata=endpoint.metadata)

            try:
                response = await self._call(op)
            except MetadataError as error:
                if "compacted" in str(error):
                    raise WatchCompacted(prefix, revision or 0) from error
                if not _too_big(error):
                    raise
                if limit == 1:
                    raise MetadataError(
                        f"etcd: one value under {prefix!r} is larger than the reply limit "
                        f"({self._config.reply_bytes_max} bytes: reply_bytes_max)"
                    ) from error
                limit = max(1, limit // 2)  # a short page (more stays True): the caller pages on
                log.info("metadata.etcd.list_page_halved", prefix=prefix, limit=limit)
                continue
            items = tuple(_kv(kv) for kv in response.kvs)
            return Page(items, bool(response.more), int(response.header.revision))

    async def current_revision(self) -> int:
        request = rpc.RangeRequest(key=b"\x00", limit=1, count_only=True)

        async def op(endpoint: _Endpoint, timeout_s: float) -> Any:
            return await endpoint.kv.Range(request, timeout=timeout_s, metadata=endpoint.metadata)

        return int((await self._call(op)).header.revision)

    async def compact(self, revision: int) -> None:
        """Drop the history before ``revision`` (etcd's compaction; operators usually let etcd's
        ``--auto-compaction-retention`` do it). Watches that need older revisions get
        `WatchCompacted`. Compacting again at or below an earlier compaction is not an error."""

        async def op(endpoint: _Endpoint, timeout_s: float) -> None:
            request = rpc.CompactionRequest(revision=revision, physical=True)
            await endpoint.kv.Compact(request, timeout=timeout_s, metadata=endpoint.metadata)

        try:
            await self._call(op)
        except MetadataError as error:
            if "compacted" not in str(error):
                raise

    # ---- leases ----------------------------------------------------------------------------------

    async def grant_lease(self, ttl_s: int) -> int:
        validate_ttl(ttl_s)
        request = rpc.LeaseGrantRequest(TTL=ttl_s, ID=0)

        async def op(endpoint: _Endpoint, timeout_s: float) -> Any:
            return await endpoint.lease.LeaseGrant(request, timeout=timeout_s, metadata=endpoint.metadata)

        response = await self._call(op)
        if response.error:
            raise MetadataError(f"etcd lease grant failed: {response.error}")
        return int(response.ID)

    async def keepalive(self, lease_id: int) -> int:
        async def op(endpoint: _Endpoint, timeout_s: float) -> int:
            call = endpoint.lease.LeaseKeepAlive(
                iter([rpc.LeaseKeepAliveRequest(ID=lease_id)]), timeout=timeout_s, metadata=endpoint.metadata
            )
            try:
                async for response in call:
                    return int(response.TTL)
            finally:
                call.cancel()
            raise MetadataUnavailable("etcd keepalive stream ended without an answer")

        ttl_s = await self._call(op)
        if ttl_s <= 0:
            raise LeaseExpired(lease_id)
        return ttl_s

    async def revoke_lease(self, lease_id: int) -> None:
        request = rpc.LeaseRevokeRequest(ID=lease_id)

        async def op(endpoint: _Endpoint, timeout_s: float) -> None:
            await endpoint.lease.LeaseRevoke(request, timeout=timeout_s, metadata=endpoint.metadata)

        try:
            await self._call(op)
        except MetadataError as error:
            if "lease not found" not in str(error):
                raise

    # ---- watch -----------------------------------------------------------------------------------

    async def watch(
        self, key: str, *, prefix: bool = False, start_revision: int | None = None
    ) -> AsyncGenerator[WatchEvent, None]:
        raw = key.encode()
        cursor = _WatchCursor(start_revision)
        backoff = Backoff(self._config.backoff_initial_s, self._config.backoff_max_s)
        loop = asyncio.get_running_loop()
        while True:
            try:
                index, endpoint = await self._ready(loop.time() + self._config.op_timeout_s)
            except MetadataUnavailable:
                if self._closed:
                    raise
                self._watch_log("metadata.etcd.watch_waiting", key, next_revision=cursor.next_revision)
                await asyncio.sleep(backoff.next_delay_s())
                continue  # a watch outlives outages: only aclose() (or a closed store) ends it
            create = rpc.WatchCreateRequest(
                key=raw,
                range_end=_key_end(raw) if prefix else b"",
                start_revision=cursor.next_revision or 0,
                progress_notify=True,
            )
            call = endpoint.watch.Watch(
                iter([rpc.WatchRequest(create_request=create)]), metadata=endpoint.metadata
            )
            try:
                async for response in call:
                    for event in cursor.accept(key, response):
                        yield event
                    backoff.reset()
                raise MetadataUnavailable("etcd watch stream ended")  # noqa: TRY301 -- reconnect below
            except (rpc.AioRpcError, MetadataUnavailable) as error:
                if self._closed:
                    raise MetadataUnavailable("etcd store is closed") from error
                if isinstance(error, _WatchAuthRefused) or (
                    isinstance(error, rpc.AioRpcError) and _auth_expired(error)
                ):
                    endpoint.authenticated = False  # the next stream goes out with a new token
                reason = str(error.details()) if isinstance(error, rpc.AioRpcError) else str(error)
                self._rotate(index, reason)
                self._watch_log(
                    "metadata.etcd.watch_reconnect", key, next_revision=cursor.next_revision, reason=reason
                )
            finally:
                call.cancel()
            await asyncio.sleep(backoff.next_delay_s())

    def _watch_log(self, event: str, key: str, **fields: Any) -> None:
        """A watch's reconnect news: a warning at most every `_WATCH_WARNING_INTERVAL_S` per key
        and kind (an outage retries once a second), debug in between."""
        if self._watch_warnings.due(f"{event} {key}"):
            log.warning(event, key=key, **fields)
        else:
            log.debug(event, key=key, **fields)

    async def close(self) -> None:
        self._closed = True
        endpoints = [e for e in self._endpoints if e is not None]
        self._endpoints = [None] * len(self._endpoints)
        for endpoint in endpoints:
            await endpoint.channel.close()


class _WatchAuthRefused(MetadataUnavailable):
    """etcd canceled a watch for want of a valid token: authenticate again, then watch again."""


class _WatchCursor:
    """Turns watch responses into events and remembers where to resume (the next unseen revision)."""

    def __init__(self, start_revision: int | None) -> None:
        self.next_revision = start_revision

    def accept(self, key: str, response: Any) -> list[WatchEvent]:
        if response.compact_revision:
            raise WatchCompacted(key, int(response.compact_revision))
        if response.canceled:
            message = f"etcd canceled the watch on {key!r}: {response.cancel_reason}"
            if any(marker in response.cancel_reason.lower() for marker in _WATCH_AUTH_MARKERS):
                raise _WatchAuthRefused(message)
            raise MetadataUnavailable(message)
        if response.created:
            if self.next_revision is None:
                self.next_revision = int(response.header.revision) + 1
            return []
        events = []
        for event in response.events:
            kind = EventKind.DELETE if event.type == rpc.Event.DELETE else EventKind.PUT
            value = None if kind is EventKind.DELETE else bytes(event.kv.value)
            events.append(
                WatchEvent(
                    kind,
                    event.kv.key.decode("utf-8", "surrogateescape"),
                    value,
                    event.kv.mod_revision,
                    event.kv.lease,
                )
            )
            self.next_revision = int(event.kv.mod_revision) + 1
        if not response.events and response.header.revision:
            # A progress notification: everything up to header.revision has been delivered.
            self.next_revision = max(self.next_revision or 0, int(response.header.revision) + 1)
        return events
