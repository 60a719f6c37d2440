"""A read's slot on its connection (bookie.connection_handler.ServerConnection.take_read_slot and
give_read_slot): at most ``reads_in_flight_max`` reads of a connection hold one, taken in the order
they asked; none is taken while the peer is not reading its answers; past half the bookie-wide
answer budget a connection's reads load one at a time; the answers a turn queues are counted as
they are queued and written at once past ``answer_bytes_buffered_max``; a read cancelled while it
waits, or one that fails, gives everything back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from bookie.connection_handler import ConnectionLimits, ServerConnection
from tests.unit.bookie.test_answer_budget import _connection


@contextlib.asynccontextmanager
async def _slot(conn: ServerConnection) -> AsyncIterator[None]:
    """What the processor's reads do around loading and answering an entry."""
    await conn.take_read_slot()
    answered = False
    try:
        yield
        answered = True
    finally:
        conn.give_read_slot(answered)


async def _turns(count: int = 5) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


class _Reads:
    """Reads of one connection, each holding its slot until it is let go."""

    def __init__(self, conn: ServerConnection) -> None:
        self.conn = conn
        self.entered: list[int] = []
        self.go: dict[int, asyncio.Event] = {}
        self.tasks: dict[int, asyncio.Task[None]] = {}

    def start(self, name: int, answer: bytes = b"") -> None:
        self.go[name] = asyncio.Event()
        self.tasks[name] = asyncio.create_task(self._read(name, answer))

    async def _read(self, name: int, answer: bytes) -> None:
        async with _slot(self.conn):
            self.entered.append(name)
            await self.go[name].wait()
            if answer:
                self.conn.complete(None, answer)

    async def finish(self, name: int) -> None:
        self.go[name].set()
        await self.tasks[name]


async def test_at_most_reads_in_flight_max_hold_a_slot_and_the_others_take_theirs_in_order() -> None:
    conn, _ = _connection(ConnectionLimits(1 << 20, 64, 30.0, reads_in_flight_max=2), set())
    reads = _Reads(conn)
    for name in range(4):
        reads.start(name)
    await _turns()
    assert reads.entered == [0, 1]
    await reads.finish(1)
    await _turns()
    assert reads.entered == [0, 1, 2]
    await reads.finish(0)
    await _turns()
    assert reads.entered == [0, 1, 2, 3]
    for name in (2, 3):
        await reads.finish(name)
    reads.start(4)
    await _turns()
    assert reads.entered[-1] == 4, "every slot was given back"


async def test_no_read_takes_a_slot_while_the_peer_is_not_reading_its_answers() -> None:
    conn, _ = _connection(ConnectionLimits(1 << 20, 64, 30.0, reads_in_flight_max=1), set())
    reads = _Reads(conn)
    conn.pause_writing()
    reads.start(0)
    await _turns()
    assert reads.entered == []
    reads.start(1)  # waits for the slot 0 holds while it waits for the peer
    conn.resume_writing()
    await _turns()
    assert reads.entered == [0]
    await reads.finish(0)
    await _turns()
    assert reads.entered == [0, 1]
    await reads.finish(1)


async def test_past_half_the_answer_budget_a_connections_reads_load_one_at_a_time() -> None:
    limits = ConnectionLimits(1 << 20, 64, 30.0, answer_bytes_total_max=1000)
    conn, _ = _connection(limits, set())
    other, _ = _connection(limits, set())
    reads, others = _Reads(conn), _Reads(other)
    reads.start(0)
    await _turns()
    assert limits.answers.loading == 1  # taken to hold the estimate (1000 bytes): past half the budget
    reads.start(1)
    others.start(0)  # another connection's first read is not held back by this one's
    await _turns()
    assert (reads.entered, others.entered) == ([0], [0])
    await reads.finish(0)
    await _turns()
    assert reads.entered == [0, 1]
    reads.start(2)  # waits again, for 1 this time
    await _turns()
    assert reads.entered == [0, 1]
    await reads.finish(1)
    await _turns()
    assert reads.entered == [0, 1, 2]
    for group in (reads, others):
        await group.finish(group.entered[-1])
    assert limits.answers.loading == 0


async def test_under_half_the_answer_budget_a_connections_reads_load_together() -> None:
    limits = ConnectionLimits(1 << 20, 64, 30.0, answer_bytes_total_max=1 << 30)
    conn, _ = _connection(limits, set())
    reads = _Reads(conn)
    for name in range(3):
        reads.start(name)
    await _turns()
    assert reads.entered == [0, 1, 2]
    assert limits.answers.loading == 3
    for name in range(3):
        await reads.finish(name)
    assert limits.answers.loading == 0


async def test_answers_queued_in_a_turn_are_counted_and_written_at_once_past_the_buffer_limit() -> None:
    limits = ConnectionLimits(1 << 20, 64, 30.0, answer_bytes_buffered_max=100)
    conn, transport = _connection(limits, set())
    async with _slot(conn):  # cached reads: nothing yields between them, one turn
        conn.complete(None, b"a" * 60)
    assert (transport.size, limits.answers.held) == (0, 60)
    async with _slot(conn):
        conn.complete(None, b"b" * 60)
    assert transport.size == 120, "past 100 bytes queued, the turn's answers are written at once"
    assert limits.answers.held == 120


async def test_answers_under_the_buffer_limit_wait_for_the_end_of_the_turn_but_are_counted() -> None:
    limits = ConnectionLimits(1 << 20, 64, 30.0, answer_bytes_buffered_max=1000)
    conn, transport = _connection(limits, set())
    async with _slot(conn):
        conn.complete(None, b"a" * 60)
    async with _slot(conn):
        conn.complete(None, b"b" * 60)
    assert transport.size == 0
    assert limits.answers.held == 120
    await _turns(1)
    assert transport.size == 120
    assert limits.answers.held == 120


async def test_a_read_cancelled_while_it_waits_gives_its_slot_back() -> None:
    limits = ConnectionLimits(1 << 20, 64, 30.0, reads_in_flight_max=1)
    conn, _ = _connection(limits, set())
    reads = _Reads(conn)
    conn.pause_writing()
    reads.start(0)  # holds the slot, waiting for the peer to read
    reads.start(1)  # waits for the slot
    reads.start(2)
    await _turns()
    reads.tasks[0].cancel()
    reads.tasks[1].cancel()
    await _turns()
    conn.resume_writing()
    await _turns()
    assert reads.entered == [2]
    assert limits.answers.loading == 1
    await reads.finish(2)
    assert limits.answers.loading == 0
    assert reads.tasks[0].cancelled()
    assert reads.tasks[1].cancelled()


async def test_a_read_that_fails_in_its_slot_counts_no_answer_and_gives_everything_back() -> None:
    limits = ConnectionLimits(1 << 20, 64, 30.0, reads_in_flight_max=1, answer_bytes_buffered_max=10)
    conn, transport = _connection(limits, set())
    conn.send(b"x" * 50)  # queued by something else in this turn
    try:
        async with _slot(conn):
            raise asyncio.CancelledError
    except asyncio.CancelledError:
        pass
    assert limits.answers.loading == 0
    assert (limits.answers.held, transport.size) == (0, 0), "nothing counted, nothing written early"
    async with _slot(conn):  # the slot is free again
        pass
    assert limits.answers.held == 50, "a read that answered counts the last answer queued"
