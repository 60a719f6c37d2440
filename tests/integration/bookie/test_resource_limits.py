"""A single client cannot hurt a bookie (issue: security and resource limits): answers it does not
read are bounded, idle connections are closed, one address cannot take every connection slot, and
log lines about bad input are bounded. Each attack runs beside a canary client that must keep
working."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from pathlib import Path
from typing import Any, cast

import msgpack
import pytest

from bookie.connection_handler import address_key
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import OpCode, ReadFlag, StatusCode
from tests.harness.admin_http import get_json
from tests.harness.bookie_proc import BookieProcess

from .wire import KEY, WireClient, entry_body

MIB = 1024 * 1024


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _bookie(tmp_path: Path, *args: str) -> BookieProcess:
    proc = BookieProcess(tmp_path / "bookie", bookie_id="bookie-1", extra_args=list(args))
    proc.start()
    return proc


def _throttled(bookie: BookieProcess) -> list[str]:
    """The bookie's log lines about a throttled connection."""
    return [
        line
        for line in bookie.log_path.read_text(errors="replace").splitlines()
        if "connection.throttled" in line
    ]


async def _canary(bookie: BookieProcess, ledger_id: int) -> None:
    """A well-behaved client: an add and a read answered at once."""
    canary = await WireClient.connect(*bookie.address)
    try:
        added = await asyncio.wait_for(canary.add(ledger_id, 0, b"canary"), 5)
        assert added.status == StatusCode.EOK
        read = await asyncio.wait_for(canary.read(ledger_id, 0), 5)
        assert (read.status, read.body) == (StatusCode.EOK, entry_body(ledger_id, 0, b"canary"))
    finally:
        canary.close()


async def test_answers_a_client_does_not_read_are_bounded(tmp_path: Path) -> None:
    bookie = _bookie(
        tmp_path, "--answer-bytes-buffered-max", str(MIB), "--reads-in-flight-per-connection-max", "4"
    )
    try:
        writer = await WireClient.connect(*bookie.address)
        big = os.urandom(MIB)
        assert (await writer.add(1, 0, big)).status == StatusCode.EOK
        writer.close()
        assert bookie.proc is not None
        baseline = _rss_bytes(bookie.proc.pid)
        # Two connections: reads of an entry in the page cache answer without yielding, so many
        # could queue their answers within one turn of the loop, before the transport can say it
        # is over its limit (two connections of 1,024 such reads once queued a GiB on one).
        attackers = [await WireClient.connect(*bookie.address) for _ in range(2)]
        answers = []
        for attacker in attackers:
            assert attacker.transport is not None
            attacker.transport.pause_reading()  # asks for 300 MiB of answers and reads none
            answers += [attacker.read(1, 0) for _ in range(300)]
        await asyncio.sleep(3)
        grown = _rss_bytes(bookie.proc.pid) - baseline
        assert grown < 64 * MIB, f"bookie RSS grew {grown / MIB:.0f} MiB for unread answers"
        await _canary(bookie, 2)
        for attacker in attackers:
            assert attacker.transport is not None
            attacker.transport.resume_reading()  # once it reads, it gets every answer
        done = await asyncio.wait_for(asyncio.gather(*answers), 60)
        assert {r.status for r in done} == {StatusCode.EOK}
        assert all(r.body == entry_body(1, 0, big) for r in done)
        for attacker in attackers:
            attacker.close()
    finally:
        bookie.cleanup()


async def test_idle_connections_are_closed_but_not_long_polls(tmp_path: Path) -> None:
    bookie = _bookie(tmp_path, "--idle-timeout-s", "1")
    try:
        idle = await WireClient.connect(*bookie.address)
        polling = await WireClient.connect(*bookie.address)
        assert (await polling.add(5, 0, b"x")).status == StatusCode.EOK  # a known ledger, LAC still -1
        poll = polling.read(5, 1, flags=ReadFlag.LONG_POLL, previous_lac=-1, timeout_ms=4000)  # parks
        await asyncio.wait_for(asyncio.shield(idle.closed), 4)  # closed by the bookie
        assert not polling.closed.done()  # a long poll in flight is not idle
        assert (await asyncio.wait_for(poll, 6)).status in {
            StatusCode.EOK,
            StatusCode.ENOENTRY,
            StatusCode.ENOLEDGER,
        }
        await _canary(bookie, 3)
        polling.close()
    finally:
        bookie.cleanup()


async def test_one_address_cannot_take_every_connection(tmp_path: Path) -> None:
    bookie = _bookie(tmp_path, "--connections-per-address-max", "2")
    try:
        first = await WireClient.connect(*bookie.address)
        second = await WireClient.connect(*bookie.address)
        for client in (first, second):
            assert (await asyncio.wait_for(client.read_lac(1), 5)).status in {
                StatusCode.EOK,
                StatusCode.ENOLEDGER,
            }
        third = await WireClient.connect(*bookie.address)
        unanswered = third.read_lac(1)  # refused: held unread in the tarpit, then closed
        await asyncio.wait_for(asyncio.shield(third.closed), 10)
        with pytest.raises(ConnectionError):
            await unanswered
        first.close()
        await asyncio.sleep(0.2)
        await _canary(bookie, 4)  # a slot is free again
        second.close()
    finally:
        bookie.cleanup()


async def test_log_lines_about_bad_input_are_bounded(tmp_path: Path) -> None:
    bookie = _bookie(tmp_path)
    try:
        for _ in range(3):
            attacker = await WireClient.connect(*bookie.address)
            garbage = b"\xc1" * (4 * MIB)  # not msgpack: no request id to answer, the connection closes
            attacker.send_raw(struct.pack(">I", len(garbage)) + garbage)
            await asyncio.wait_for(asyncio.shield(attacker.closed), 10)
        await _canary(bookie, 5)
        lines = [
            line for line in bookie.log_path.read_text(errors="replace").splitlines() if "bad_frame" in line
        ]
        assert lines, "the bad frame was not logged at all"
        assert max(len(line) for line in lines) < 2000
    finally:
        bookie.cleanup()


@pytest.mark.parametrize("value", ["0", "-1"])
def test_bad_limits_are_refused_at_start(tmp_path: Path, value: str) -> None:
    proc = BookieProcess(tmp_path / "bookie", "b", extra_args=["--reads-in-flight-per-connection-max", value])
    assert proc.start_expect_failure() == 2
    assert "reads_in_flight_per_connection_max must be > 0" in proc.log_tail()


async def test_requests_of_a_closed_connection_give_their_permits_back(tmp_path: Path) -> None:
    """Long polls (never answered once their connection is gone) of connections that close hold no
    permit of the bookie-wide count: before, 3 x 100 of them left it at 300 of 256 for good and the
    bookie stopped reading every socket, a new client's request unanswered."""
    bookie = _bookie(tmp_path, "--in-flight-total-max", "256")
    try:
        writer = await WireClient.connect(*bookie.address)
        assert (await writer.add(5, 0, b"x")).status == StatusCode.EOK
        writer.close()
        for _ in range(3):
            poller = await WireClient.connect(*bookie.address)
            polls = [
                poller.read(5, 1, flags=ReadFlag.LONG_POLL, previous_lac=0, timeout_ms=60_000)
                for _ in range(100)
            ]
            await asyncio.sleep(0.5)  # parked at the bookie
            assert poller.transport is not None
            poller.transport.abort()
            await asyncio.gather(*polls, return_exceptions=True)
            await asyncio.sleep(0.2)
        await _canary(bookie, 6)
    finally:
        bookie.cleanup()


async def test_unread_answers_of_many_connections_are_bounded_bookie_wide(tmp_path: Path) -> None:
    """Each connection may hold ``answer_bytes_buffered_max`` of unread answers, but not all of them
    together: over ``answer_bytes_total_max`` the connections holding the most stop being read and
    their reads wait, while a client that reads its answers goes on. Before the bookie-wide budget,
    24 connections x 24 unread reads of a 1 MiB entry grew the bookie by about 400 MiB."""
    bookie = _bookie(tmp_path, "--answer-bytes-total-max", str(32 * MIB), "--admin-port", "0")
    clients: list[WireClient] = []
    try:
        writer = await WireClient.connect(*bookie.address)
        clients.append(writer)
        big = os.urandom(MIB)
        assert (await writer.add(1, 0, big)).status == StatusCode.EOK
        assert bookie.proc is not None
        baseline = _rss_bytes(bookie.proc.pid)
        attackers = [await WireClient.connect(*bookie.address) for _ in range(24)]
        clients.extend(attackers)
        answers = []
        for attacker in attackers:
            assert attacker.transport is not None
            attacker.transport.pause_reading()  # 24 MiB of answers asked for, none read
            answers.append([attacker.read(1, 0) for _ in range(24)])
        await asyncio.sleep(3)
        grown = _rss_bytes(bookie.proc.pid) - baseline
        _, state = await get_json(*bookie.admin_address(), "/state")
        # The budget, plus at most the free share and one answer of each connection.
        assert state["answer_bytes_held"] <= 32 * MIB + 24 * (2 * MIB + 4096), state
        assert state["answer_throttles"] > 0, state
        print(f"RSS +{grown / MIB:.0f} MiB, held {state['answer_bytes_held'] / MIB:.0f} MiB")
        assert grown < 200 * MIB, f"bookie RSS grew {grown / MIB:.0f} MiB for unread answers"  # ~2x held
        for _ in range(8):  # a client that reads its answers goes on, over the budget too
            read = await asyncio.wait_for(writer.read(1, 0), 5)
            assert (read.status, read.body) == (StatusCode.EOK, entry_body(1, 0, big))
        await _canary(bookie, 2)
        for attacker in attackers[4:]:
            attacker.close()
        for attacker in attackers[:4]:
            assert attacker.transport is not None
            attacker.transport.resume_reading()  # once they read, they get every answer
        done = await asyncio.wait_for(asyncio.gather(*(a for some in answers[:4] for a in some)), 60)
        assert {r.status for r in done} == {StatusCode.EOK}
        assert all(r.body == entry_body(1, 0, big) for r in done)
        await asyncio.gather(*(a for some in answers[4:] for a in some), return_exceptions=True)
        for client in (*attackers[:4], writer):
            client.close()
    finally:
        for client in clients:
            if client.transport is not None:
                client.transport.abort()
        bookie.cleanup()


class _BadFrames(asyncio.Protocol):
    """Sends 1 MiB requests whose id is readable but which have trailing bytes (EBADREQ, the
    connection stays), a new one for each answer."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.rid = 0
        self.answers = 0
        for _ in range(2):
            self._send()

    def _send(self) -> None:
        self.rid += 1
        body = msgpack.packb([4, self.rid, 1]) + bytes(MIB)
        self.transport.write(struct.pack(">I", len(body)) + body)

    def data_received(self, data: bytes) -> None:
        self.answers += 1
        self._send()


async def _connect_from(bookie: BookieProcess, local: str) -> WireClient:
    _, client = await asyncio.get_running_loop().create_connection(
        WireClient, *bookie.address, local_addr=(local, 0)
    )
    return client


async def test_a_new_client_behind_an_erring_address_is_not_queued(tmp_path: Path) -> None:
    """Connections of an address in refusal deficit that did not err themselves (a client behind
    the same NAT as an attacker) are read at once; only the erring ones wait. Before, every new
    connection of the address waited in the address's queue behind the attacker's (16 s with 100
    attacker connections)."""
    bookie = _bookie(tmp_path)
    loop = asyncio.get_running_loop()
    flood = []
    try:
        for _ in range(20):
            _, protocol = await loop.create_connection(
                _BadFrames, *bookie.address, local_addr=("127.0.0.2", 0)
            )
            flood.append(protocol)
        await asyncio.sleep(2)  # 16 refusals a frame: the address is deep in deficit
        assert sum(p.answers for p in flood) < 20 * 40  # throttled: about 100 refusals/s
        honest = await _connect_from(bookie, "127.0.0.2")
        started = loop.time()
        added = await asyncio.wait_for(honest.add(7, 0, b"behind the NAT"), 5)
        assert added.status == StatusCode.EOK
        read = await asyncio.wait_for(honest.read(7, 0), 5)
        assert read.body == entry_body(7, 0, b"behind the NAT")
        assert loop.time() - started < 3, "the new client waited behind the attacker's connections"
        honest.close()
        # A new connection of that address that errs waits like the others: one whose first frame
        # is large is closed at its length prefix, unread.
        late = await _connect_from(bookie, "127.0.0.2")
        late.send_raw(struct.pack(">I", MIB) + bytes(1024))
        await asyncio.wait_for(asyncio.shield(late.closed), 15)
        await _canary(bookie, 8)
    finally:
        for protocol in flood:
            protocol.transport.abort()
        bookie.cleanup()
    lines = [
        line for line in bookie.log_path.read_text(errors="replace").splitlines() if "frame_too_large" in line
    ]
    assert any("65536" in line for line in lines), lines


async def test_addresses_holding_every_slot_make_room_for_a_newcomer(tmp_path: Path) -> None:
    """When two hosts hold every slot of ``connections_max``, a client from a third address still
    connects: an idle connection of the address holding the most is closed for it. Before, it was
    refused (two hosts at the default 512 per address took all 1,024 slots)."""
    bookie = _bookie(tmp_path, "--connections-max", "8", "--connections-per-address-max", "5")
    try:
        held = [await _connect_from(bookie, "127.0.0.2") for _ in range(5)]
        held += [await _connect_from(bookie, "127.0.0.3") for _ in range(3)]
        for client in held:  # all served, so all counted
            status = (await asyncio.wait_for(client.read_lac(1), 5)).status
            assert status == StatusCode.ENOLEDGER
        newcomer = await _connect_from(bookie, "127.0.0.1")
        assert (await asyncio.wait_for(newcomer.add(9, 0, b"x"), 5)).status == StatusCode.EOK
        await asyncio.sleep(0.2)
        closed = [client for client in held if client.closed.done()]
        assert len(closed) == 1, "one idle connection of the biggest holder makes room"
        assert closed[0] in held[:5]
        # Equal holders do not evict each other: a 4th connection of 127.0.0.3 (3 held, the
        # biggest holds 4 now) is refused.
        fourth = await _connect_from(bookie, "127.0.0.3")
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(fourth.read_lac(1), 5)
        for client in (*held, newcomer):
            client.close()
    finally:
        bookie.cleanup()


def test_ipv6_peers_are_counted_by_their_64() -> None:
    assert address_key("2001:db8::1") == address_key("2001:db8::ffff:1") == "2001:db8::/64"
    assert address_key("2001:db8:0:1::1") == "2001:db8:0:1::/64"
    assert address_key("::ffff:10.0.0.1") == "10.0.0.1"
    assert address_key("10.0.0.1") == "10.0.0.1"
    assert address_key("fe80::1%eth0") == "fe80::/64"


async def test_parked_long_polls_do_not_hold_request_permits(tmp_path: Path) -> None:
    """Long polls are counted apart (per address and in all), not in the bookie-wide count of
    requests in flight: before, 300 parked polls of one client (of ``in_flight_total_max`` 256)
    paused every socket of the bookie until they timed out, a new client's request unanswered."""
    bookie = _bookie(tmp_path, "--in-flight-total-max", "256")
    try:
        writer = await WireClient.connect(*bookie.address)
        assert (await writer.add(5, 0, b"x")).status == StatusCode.EOK
        assert (await writer.add(5, 1, b"y", lac=0)).status == StatusCode.EOK
        poller = await WireClient.connect(*bookie.address)
        polls = [
            poller.read(5, 1, flags=ReadFlag.LONG_POLL, previous_lac=0, timeout_ms=60_000) for _ in range(300)
        ]
        await asyncio.sleep(0.5)  # parked at the bookie
        assert not any(poll.done() for poll in polls)
        await _canary(bookie, 6)
        # They are answered as the LAC moves on, each taking a permit again for its answer.
        assert (await writer.add(5, 2, b"z", lac=1)).status == StatusCode.EOK
        answered = await asyncio.wait_for(asyncio.gather(*polls), 10)
        assert {r.status for r in answered} == {StatusCode.EOK}
        for client in (writer, poller):
            client.close()
    finally:
        bookie.cleanup()


async def test_unknown_ledgers_and_silent_connections_are_charged(tmp_path: Path) -> None:
    """ENOLEDGER answers are charged (a tenth of a refusal each) and so is a connection closed
    without a byte sent: before, a flood of either from one address was never throttled."""
    bookie = _bookie(tmp_path)
    try:
        flooder = await _connect_from(bookie, "127.0.0.2")
        reads = [flooder.read_lac(10**12 + i, key=None) for i in range(12_000)]  # 1,200 refusals' worth
        answered = await asyncio.wait_for(asyncio.gather(*reads), 60)
        assert {r.status for r in answered} == {StatusCode.ENOLEDGER}
        flooder.close()
        for _ in range(1_100):  # connect and close, nothing sent
            silent = await _connect_from(bookie, "127.0.0.3")
            silent.close()
            await asyncio.wait_for(asyncio.shield(silent.closed), 5)
        await asyncio.sleep(0.5)
        await _canary(bookie, 11)
    finally:
        bookie.cleanup()
    throttled = _throttled(bookie)
    assert any("127.0.0.2" in line for line in throttled), throttled
    assert any("127.0.0.3" in line for line in throttled), throttled


async def test_with_auth_a_client_behind_an_erring_host_connects(tmp_path: Path) -> None:
    """A host whose authenticated connections flood 1 MiB bad frames falls deep into deficit; a
    client with a token behind the same address still authenticates and writes at once. Before,
    its new connection waited in the address's queue and ``auth_timeout_s`` closed it."""
    tokens = tmp_path / "tokens"
    tokens.write_text("alice:s3cret\n")
    bookie = _bookie(
        tmp_path, "--auth-providers", "token", "--auth-token-file", str(tokens), "--auth-timeout-s", "2"
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def flood() -> None:
        attacker = await _connect_from(bookie, "127.0.0.2")
        assert (await attacker.request(m.AuthRequest, "token", b"s3cret")).status == StatusCode.EOK
        rid = 1000
        while not stop.is_set():
            rid += 1
            answer: asyncio.Future[Any] = loop.create_future()
            attacker.pending[rid] = answer
            body = msgpack.packb([4, rid, 1]) + bytes(MIB)  # trailing bytes: EBADREQ, 16 refusals
            attacker.send_raw(struct.pack(">I", len(body)) + body)
            await asyncio.wait_for(answer, 30)
        attacker.close()

    floods = [asyncio.create_task(flood()) for _ in range(40)]
    try:
        await asyncio.sleep(3)  # past the 1,000 refusals at once: deep in deficit
        honest = await _connect_from(bookie, "127.0.0.2")
        started = asyncio.get_running_loop().time()
        hello = honest.request(m.HelloRequest, 1, "behind the NAT")
        auth = honest.request(m.AuthRequest, "token", b"s3cret")
        add = honest.add(12, 0, b"authenticated")
        assert (await asyncio.wait_for(hello, 5)).status == StatusCode.EOK
        assert (await asyncio.wait_for(auth, 5)).status == StatusCode.EOK
        assert (await asyncio.wait_for(add, 5)).status == StatusCode.EOK
        assert asyncio.get_running_loop().time() - started < 2
        await asyncio.sleep(2.5)  # past auth_timeout_s: authenticated, so still open
        assert not honest.closed.done()
        honest.close()
    finally:
        stop.set()
        await asyncio.gather(*floods, return_exceptions=True)
        bookie.cleanup()
    throttled = [
        line for line in bookie.log_path.read_text(errors="replace").splitlines() if "throttled" in line
    ]
    assert any("127.0.0.2" in line for line in throttled), "the flood never put its address in deficit"


def _silent_socket(bookie: BookieProcess, local: str, requests: bytes) -> socket.socket:
    """A peer that sends ``requests`` and never reads: a tiny receive window, so what the bookie
    answers past its kernel buffers stays in its transport."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.bind((local, 0))
    sock.connect(bookie.address)
    sock.sendall(requests)
    return sock


def _reads(count: int) -> bytes:
    return b"".join(m.encode(m.ReadEntryRequest(rid, 1, 0, 0, KEY, -1, 0)) for rid in range(1, count + 1))


async def _released(bookie: BookieProcess, what: str) -> None:
    """``what`` (the one connection left) is gone within 15 s, its slot and its unread answers
    freed, and the bookie still serves."""
    state = await _state_when(bookie, lambda s: s["connections"] == 0, 15)
    assert state["connections"] == 0, f"{what} kept its slot: {state}"
    assert state["answer_bytes_held"] == 0, state
    await _canary(bookie, 2)


async def _state_when(bookie: BookieProcess, check: Any, within_s: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        _, state = await get_json(*bookie.admin_address(), "/state")
        if check(state) or loop.time() > deadline:
            return cast(dict[str, Any], state)
        await asyncio.sleep(0.2)


async def _big_entry(bookie: BookieProcess) -> None:
    writer = await WireClient.connect(*bookie.address)
    assert (await writer.add(1, 0, os.urandom(MIB))).status == StatusCode.EOK
    writer.close()
    await asyncio.wait_for(asyncio.shield(writer.closed), 5)


async def test_a_closed_connection_whose_peer_reads_nothing_gives_its_slot_back(tmp_path: Path) -> None:
    """A connection the bookie closes (here for idleness) while its transport holds answers its
    peer never reads is aborted ``frame_read_timeout_s`` later. Before, the close waited for those
    answers to drain, with no limit: the connection kept its slot, its address's count and their
    memory for good (it could not be evicted, nor idle-closed again)."""
    bookie = _bookie(tmp_path, "--idle-timeout-s", "1", "--frame-read-timeout-s", "2", "--admin-port", "0")
    sock = None
    try:
        await _big_entry(bookie)
        sock = _silent_socket(bookie, "127.0.0.2", _reads(8))  # 8 MiB of answers: under its high water
        state = await _state_when(bookie, lambda s: s["connections"] == 1 and s["answer_bytes_held"], 5)
        assert state["connections"] == 1, state
        assert state["answer_bytes_held"] > MIB, state
        await _released(bookie, "a closed connection")
    finally:
        if sock is not None:
            sock.close()
        bookie.cleanup()
    log_text = bookie.log_path.read_text(errors="replace")
    assert "connection.idle_closed" in log_text
    assert "connection.close_stalled" in log_text


async def test_a_full_bookie_aborts_a_closing_connection_for_a_newcomer(tmp_path: Path) -> None:
    """Every slot is held by connections the bookie is closing whose peers read nothing: a newcomer
    from another address gets one of them (the closing connection is aborted), at once. Before, a
    closing connection could not be evicted and the newcomer was refused."""
    bookie = _bookie(
        tmp_path,
        *("--connections-max", "2", "--idle-timeout-s", "1", "--frame-read-timeout-s", "60"),
        *("--admin-port", "0"),
    )
    socks = []
    try:
        await _big_entry(bookie)
        socks = [_silent_socket(bookie, "127.0.0.2", _reads(8)) for _ in range(2)]
        await asyncio.sleep(3)  # both idle-closed, their answers unread
        _, state = await get_json(*bookie.admin_address(), "/state")
        assert state["connections"] == 2, state
        assert state["answer_bytes_held"] > MIB, "a closing connection's answers are still held"
        newcomer = await _connect_from(bookie, "127.0.0.1")
        assert (await asyncio.wait_for(newcomer.add(9, 0, b"x"), 5)).status == StatusCode.EOK
        newcomer.close()
    finally:
        for sock in socks:
            sock.close()
        bookie.cleanup()
    assert "evicted_closing" in bookie.log_path.read_text(errors="replace")


async def test_a_connection_whose_peer_stops_reading_mid_frame_is_aborted(tmp_path: Path) -> None:
    """A peer that asks for more answers than ``answer_bytes_buffered_max`` (its reading paused),
    leaves half a frame behind and never reads is aborted once its answers have not moved for
    ``frame_read_timeout_s``. Before, the frame deadline re-armed for good (the bookie being the
    slow side) and the idle check waited for an empty buffer: the connection stayed for good."""
    bookie = _bookie(tmp_path, "--frame-read-timeout-s", "2", "--admin-port", "0")
    sock = None
    try:
        await _big_entry(bookie)
        sock = _silent_socket(bookie, "127.0.0.2", _reads(16) + struct.pack(">I", 100) + bytes(10))
        await _released(bookie, "a stalled connection")
    finally:
        if sock is not None:
            sock.close()
        bookie.cleanup()
    assert "connection.write_stalled" in bookie.log_path.read_text(errors="replace")


async def test_hellos_before_auth_are_bounded(tmp_path: Path) -> None:
    """Before AUTH, a connection gets two HELLOs answered; a third is refused (EBADREQ) and the
    connection closed. Before, every HELLO was answered, synchronously and uncharged: a 2 MB burst
    of them held the loop for seconds (another client's round trip went from 1 ms to 5.7 s)."""
    tokens = tmp_path / "tokens"
    tokens.write_text("alice:s3cret\n")
    bookie = _bookie(tmp_path, "--auth-providers", "token", "--auth-token-file", str(tokens))
    try:
        client = await WireClient.connect(*bookie.address)
        hellos = [client.request(m.HelloRequest, 1, "x") for _ in range(3)]
        first, second = await asyncio.wait_for(asyncio.gather(*hellos[:2]), 5)
        assert first.status == second.status == StatusCode.EOK
        assert (await asyncio.wait_for(hellos[2], 5)).status == StatusCode.EBADREQ
        await asyncio.wait_for(asyncio.shield(client.closed), 5)
        # HELLO, HELLO, AUTH: a client that says HELLO twice still authenticates.
        honest = await WireClient.connect(*bookie.address)
        hellos = [honest.request(m.HelloRequest, 1, "x") for _ in range(2)]
        auth = honest.request(m.AuthRequest, "token", b"s3cret")
        assert {r.status for r in await asyncio.wait_for(asyncio.gather(*hellos, auth), 5)} == {
            StatusCode.EOK
        }
        assert (await asyncio.wait_for(honest.add(3, 0, b"x"), 5)).status == StatusCode.EOK
        honest.close()
    finally:
        bookie.cleanup()


async def test_a_burst_of_requests_answered_at_once_is_answered_in_order(tmp_path: Path) -> None:
    """A connection's frames beyond 256 answers in one turn of the loop wait for the next turn
    (so one socket read of 20,000 small requests does not hold the loop): every one is answered,
    in order, with or without the handshake phase (HELLOs) in front."""
    bookie = _bookie(tmp_path)
    try:
        client = await WireClient.connect(*bookie.address)
        assert client.transport is not None
        frames = [m.encode(m.HelloRequest(rid, 1, "x")) for rid in range(1, 5001)]
        frames += [m.encode(m.GetBookieInfoRequest(rid)) for rid in range(5001, 10001)]
        futures = []
        loop = asyncio.get_running_loop()
        for rid in range(1, 10001):
            futures.append(loop.create_future())
            client.pending[rid] = futures[-1]
        client.transport.write(b"".join(frames))  # one burst
        answers = await asyncio.wait_for(asyncio.gather(*futures), 30)
        assert {a.status for a in answers} == {StatusCode.EOK}
        assert not client.unmatched
        order = [a.request_id for a in answers]
        assert order == list(range(1, 10001))
        client.close()
    finally:
        bookie.cleanup()


def _nested_frame(op: int) -> bytes:
    """A 54 KB request frame shaped as ``op``'s whose last field is a tree of 50,625 empty arrays,
    each of them within REQUEST_ITEMS_MAX items (an ADD_ENTRY's: the add shortcut unpacks it first)."""

    def tree(depth: int) -> bytes:
        return b"\x90" if depth == 0 else b"\x9f" + tree(depth - 1) * 15

    if op == OpCode.ADD_ENTRY:  # [op, request id, ledger, entry, flags, key, <tree>]
        body = bytes([0x97, op, 7, 1, 0, 0, 0xC4, 1]) + b"k" + tree(4)
    else:  # [op, request id, ledger, <tree>]
        body = bytes([0x94, op, 7, 1]) + tree(4)
    return struct.pack(">I", len(body)) + body


async def test_a_frame_of_nested_arrays_is_refused_unbuilt_closed_and_charged_by_size(
    tmp_path: Path,
) -> None:
    """A READ_ENTRY frame of 54 KB whose last field is a tree of 50,000 empty arrays used to be
    built whole (6-8 ms of the event loop each) and answered EBADREQ on a connection kept open, one
    refusal's charge: a thousand held the loop for seconds. It is refused once it holds more than
    64 arrays (no request id: the connection closes, unanswered), and charged a refusal per 256
    bytes: five such frames shaped as adds (the add shortcut still unpacks those whole) put their
    address in deficit, where five bad frames of another kind do not."""
    bookie = _bookie(tmp_path)
    try:
        reader = await _connect_from(bookie, "127.0.0.2")
        reader.send_raw(_nested_frame(OpCode.READ_ENTRY))
        await asyncio.wait_for(asyncio.shield(reader.closed), 5)
        assert reader.unmatched == []
        for _ in range(4):  # 4 x 212 refusals of the 1,000 an address may earn at once
            adder = await _connect_from(bookie, "127.0.0.3")
            adder.send_raw(_nested_frame(OpCode.ADD_ENTRY))
            await asyncio.wait_for(asyncio.shield(adder.closed), 5)
        last = await _connect_from(bookie, "127.0.0.3")
        last.send_raw(_nested_frame(OpCode.ADD_ENTRY))  # into deficit: its close waits its turn
        await _canary(bookie, 11)
    finally:
        bookie.cleanup()
    throttled = _throttled(bookie)
    assert any("127.0.0.3" in line for line in throttled), throttled
    assert not any("127.0.0.2" in line for line in throttled), throttled
