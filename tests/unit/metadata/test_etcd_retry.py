"""The etcd driver's retry loop (`EtcdStore._call`) without an etcd: endpoints and answers faked."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from aetcd import rpc

from metadata.errors import CasResultUnknown, MetadataUnavailable
from metadata.etcd import EtcdConfig, EtcdStore, _Endpoint


def _error(code: grpc.StatusCode, details: str) -> Exception:
    error: Exception = rpc.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)
    return error


async def test_a_token_refused_again_and_again_is_renewed_with_backoff_not_in_a_hot_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = EtcdStore(
        EtcdConfig((("127.0.0.1", 1),), op_timeout_s=0.5, user="root", password_file="/nonexistent")
    )
    endpoint = _Endpoint(target="fake", channel=None, kv=None, lease=None, watch=None)

    async def ready(deadline: float) -> tuple[int, _Endpoint]:
        return 0, endpoint

    monkeypatch.setattr(store, "_ready", ready)
    calls = 0

    async def op(_: _Endpoint, timeout_s: float) -> Any:
        nonlocal calls
        calls += 1
        raise _error(grpc.StatusCode.UNAUTHENTICATED, "etcdserver: invalid auth token")

    with pytest.raises(MetadataUnavailable):
        await store._call(op)
    assert 2 <= calls <= 20  # renewed and retried, paced by the backoff (50 ms doubling), within the budget
    assert not endpoint.authenticated


def _two_endpoint_store(monkeypatch: pytest.MonkeyPatch) -> tuple[EtcdStore, list[_Endpoint]]:
    store = EtcdStore(
        EtcdConfig((("127.0.0.1", 1), ("127.0.0.1", 2)), op_timeout_s=5.0, attempt_timeout_s=1.0)
    )
    endpoints = [_Endpoint(target=f"m{i}", channel=None, kv=None, lease=None, watch=None) for i in range(2)]

    async def ready(deadline: float) -> tuple[int, _Endpoint]:
        return store._current, endpoints[store._current]

    monkeypatch.setattr(store, "_ready", ready)
    monkeypatch.setattr(store, "_endpoint", lambda index: endpoints[index])
    return store, endpoints


async def test_a_read_gives_a_silent_endpoint_one_capped_attempt_then_asks_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, endpoints = _two_endpoint_store(monkeypatch)
    attempts: list[tuple[str, float]] = []

    async def op(endpoint: _Endpoint, timeout_s: float) -> str:
        attempts.append((endpoint.target, timeout_s))
        if endpoint is endpoints[0]:  # stuck: its connection is up, no answer comes
            raise _error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        return "answer"

    assert await store._call(op) == "answer"
    assert [target for target, _ in attempts] == ["m0", "m1"]
    assert attempts[0][1] == 1.0  # capped, not the whole 5 s budget
    assert await store._call(op) == "answer"  # the store stays on the endpoint that answers
    assert attempts[-1][0] == "m1"


async def test_a_mutation_whose_answer_is_lost_is_not_resent_but_moves_the_store_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, _ = _two_endpoint_store(monkeypatch)
    attempts: list[tuple[str, float]] = []

    async def op(endpoint: _Endpoint, timeout_s: float) -> str:
        attempts.append((endpoint.target, timeout_s))
        raise _error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    with pytest.raises(CasResultUnknown):
        await store._call(op, mutation_key="/k")
    assert len(attempts) == 1  # it may have applied: never sent twice
    assert attempts[0][1] > 4.0  # the whole budget: it cannot be retried once sent
    assert store._current == 1  # the next call goes to the other member


class _ReadyChannel:
    """A channel gRPC reports as connected (its token may still need renewing)."""

    def get_state(self, try_to_connect: bool = False) -> Any:
        return grpc.ChannelConnectivity.READY

    async def channel_ready(self) -> None:
        return None

    async def close(self) -> None:
        return None


class _UnavailableAuth:
    def __init__(self) -> None:
        self.calls = 0

    async def Authenticate(self, request: Any, timeout: float | None = None) -> Any:  # noqa: ASYNC109
        self.calls += 1
        raise _error(grpc.StatusCode.UNAVAILABLE, "etcdserver: request timed out")


async def test_a_failed_login_on_a_connected_endpoint_is_metadata_unavailable_not_a_bare_timeout(
    tmp_path: Any,
) -> None:
    password = tmp_path / "password"
    password.write_text("secret\n")
    store = EtcdStore(
        EtcdConfig(
            (("127.0.0.1", 1), ("127.0.0.1", 2)),
            op_timeout_s=0.6,
            user="root",
            password_file=str(password),
        )
    )
    auths = [_UnavailableAuth(), _UnavailableAuth()]
    for index, auth in enumerate(auths):  # both were connected before; etcd refused their tokens
        store._endpoints[index] = _Endpoint(f"m{index}", _ReadyChannel(), None, None, None, auth=auth)
    with pytest.raises(MetadataUnavailable, match="authentication"):
        await store.get("/k")
    assert auths[0].calls >= 1
    assert auths[1].calls >= 1
    # A watch waits through the outage instead of ending with a TimeoutError.
    watch = store.watch("/k")
    waiter = asyncio.ensure_future(watch.__anext__())
    await asyncio.sleep(1.0)
    assert not waiter.done(), waiter.exception() if waiter.done() else None
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await watch.aclose()
