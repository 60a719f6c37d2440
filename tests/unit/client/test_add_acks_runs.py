"""An ADD_ACKS answer is delivered in runs (docs/protocol.md §3.9, client/connection.py): the adds of
one answer made with the same ``acks`` callback come in one call of it, in the answer's order; adds
made without one get their own callback; every request is answered exactly once, also when a later
id of the answer breaks the protocol."""

from __future__ import annotations

from typing import Any

from bookkeeper_aio import BookieConnectionLost
from bookkeeper_aio.client.connection import ADD_OK, BookieConnection, ConnectionState, Result
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.errors import ProtocolError


class _Transport:
    """Just enough of a transport for BookieConnection."""

    def get_extra_info(self, name: str) -> None:
        return None

    def write(self, data: bytes) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False

    def abort(self) -> None:
        pass


def _connection() -> BookieConnection:
    conn = BookieConnection("b", standard_timeout_s=5.0, pending_max=1000, frame_bytes_max=1 << 20)
    conn.connection_made(_Transport())  # type: ignore[arg-type]
    conn._add_acks = True  # as HELLO agreed on FEATURE_ADD_ACKS
    return conn


def _add(rid: int) -> bytes:
    return m.encode_add_request(rid, 7, rid, 0, b"k" * 32, b"body")


def _add_acks(rids: list[int]) -> bytes:
    return m.encode(m.AddAcksResponse(0, 0, None, rids))


async def test_runs_of_one_acks_callback_come_in_one_call_in_order() -> None:
    conn = _connection()
    calls: list[tuple[str, Any]] = []

    def acks_of(name: str) -> Any:
        return lambda contexts, bookie_id: calls.append((name, list(contexts)))

    def single(context: Any, bookie_id: str, result: Result) -> None:
        calls.append(("single", (context, result is ADD_OK)))

    a, b = acks_of("a"), acks_of("b")
    for rid, acks in ((1, a), (2, a), (3, None), (4, b), (5, b), (6, a)):
        conn.request(rid, _add(rid), single, f"c{rid}", 5.0, acks)
    conn.data_received(_add_acks([1, 2, 3, 4, 5, 6, 99]))  # 99: unknown (late), ignored
    assert calls == [
        ("a", ["c1", "c2"]),
        ("single", ("c3", True)),
        ("b", ["c4", "c5"]),
        ("a", ["c6"]),
    ]
    assert conn.pending_count == 0
    conn.data_received(_add_acks([1, 2]))  # answered already: nothing more
    assert len(calls) == 4
    conn.abort()


async def test_acks_counted_before_a_protocol_error_in_the_same_answer_are_delivered() -> None:
    """The run of adds before an id that names a read is delivered; the read fails with the
    connection (one answer each, none lost)."""
    conn = _connection()
    acked: list[list[Any]] = []
    results: dict[Any, Result] = {}

    def single(context: Any, bookie_id: str, result: Result) -> None:
        results[context] = result

    def acks(contexts: list[Any], bookie_id: str) -> None:
        acked.append(list(contexts))

    for rid in (1, 2):
        conn.request(rid, _add(rid), single, f"c{rid}", 5.0, acks)
    conn.request(3, m.encode(m.GetBookieInfoRequest(3)), single, "read", 5.0)
    conn.data_received(_add_acks([1, 2, 3]))
    assert acked == [["c1", "c2"]]
    assert conn.state is ConnectionState.CLOSED
    assert isinstance(conn.error, BookieConnectionLost)
    assert isinstance(conn.error.__cause__, ProtocolError)
    assert list(results) == ["read"]
    assert isinstance(results["read"], BookieConnectionLost)
