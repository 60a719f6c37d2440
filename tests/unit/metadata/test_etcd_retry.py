"""The etcd driver's retry loop (`EtcdStore._call`) without an etcd: endpoints and answers faked."""

from __future__ import annotations

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
