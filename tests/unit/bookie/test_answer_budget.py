"""The bookie-wide answer budget's counts (bookie.connection_handler.AnswerBudget): stale counts of
quiet connections are taken again, and a connection the bookie is closing keeps what its transport
holds counted until it is gone."""

from __future__ import annotations

from typing import Any

from bookie.connection_handler import ConnectionLimits, ServerConnection


class Transport:
    """Holds ``size`` bytes unwritten (what the peer has not read)."""

    def __init__(self) -> None:
        self.size = 0
        self.closed = self.aborted = False

    def write(self, data: bytes) -> None:
        self.size += len(data)

    def get_write_buffer_size(self) -> int:
        return self.size

    def get_extra_info(self, name: str) -> None:
        return None

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...
    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None: ...

    def close(self) -> None:
        self.closed = True  # the real one waits for its buffer to drain: connection_lost comes later

    def abort(self) -> None:
        self.aborted = True


class Processor:
    def connection_lost(self, conn: Any) -> None: ...


def _connection(
    limits: ConnectionLimits, registry: set[ServerConnection]
) -> tuple[ServerConnection, Transport]:
    conn = ServerConnection(Processor(), limits, registry)  # type: ignore[arg-type]
    transport = Transport()
    assert conn.reserve(("127.0.0.2", 1))
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, transport


async def test_passing_half_the_budget_takes_stale_counts_again() -> None:
    limits = ConnectionLimits(1 << 20, 64, 30.0, answer_bytes_total_max=1000)
    quiet, quiet_transport = _connection(limits, set())
    busy, _ = _connection(limits, set())
    quiet.send(b"q" * 400)
    quiet._flush()
    assert limits.answers.held == 400
    quiet_transport.size = 0  # its client read them; nothing written to it since: its count is stale
    busy.send(b"b" * 200)
    busy._flush()  # 600 counted: past half, every holder is counted again
    assert (quiet.answers_held, busy.answers_held, limits.answers.held) == (0, 200, 200)
    assert not limits.answers.half  # under a quarter once counted again: the next pass recounts too


async def test_the_idle_check_takes_a_quiet_connections_count_again() -> None:
    limits = ConnectionLimits(1 << 20, 64, 30.0, idle_timeout_s=300.0)
    quiet, transport = _connection(limits, set())
    quiet.send(b"q" * 400)
    quiet._flush()
    transport.size = 0
    quiet._on_idle_check()
    assert (quiet.answers_held, limits.answers.held) == (0, 0)


async def test_a_closing_connection_is_counted_until_lost_and_evicted_first() -> None:
    registry: set[ServerConnection] = set()
    limits = ConnectionLimits(1 << 20, 64, 30.0, connections_max=2)
    closing, transport = _connection(limits, registry)
    _, other_transport = _connection(limits, registry)
    closing.send(b"c" * 400)
    closing.close()
    assert transport.closed
    assert closing.closing
    closing.recount_answers()
    assert limits.answers.held == 400, "a closing connection's unread answers are still held"
    # Full: a newcomer of another address gets the closing connection's slot, not another's.
    assert limits.refusal("127.0.0.3", registry) is None
    assert transport.aborted
    assert not other_transport.aborted
    closing.connection_lost(None)
    assert limits.answers.held == 0
    assert closing not in registry
    assert not closing.closing
