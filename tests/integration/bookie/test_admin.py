"""The admin endpoint of a real bookie process: metrics move under load, /health turns 503 after a
journal I/O error, /state, and bad HTTP that must not hurt the bookie (issue 6, acceptance 2)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from bookkeeper_aio.protocol.codes import ReadFlag, StatusCode
from tests.harness.admin_http import get_json, http_raw, scrape
from tests.harness.bookie_proc import BookieProcess

from .wire import WireClient

ADDS = 300
PAYLOAD = b"x" * 1000


def admin_bookie(tmp_path: Path, env: dict[str, str] | None = None) -> BookieProcess:
    return BookieProcess(
        tmp_path / "bookie", bookie_id="bookie-admin", extra_args=["--admin-port", "0"], env=env
    )


@pytest.fixture
def bookie(tmp_path: Path) -> Iterator[BookieProcess]:
    proc = admin_bookie(tmp_path)
    proc.start()
    yield proc
    proc.cleanup()


async def add_many(client: WireClient, ledger_id: int, first: int, count: int) -> list[int]:
    responses = await asyncio.gather(
        *(client.add(ledger_id, entry_id, PAYLOAD) for entry_id in range(first, first + count))
    )
    return [r.status for r in responses]


async def test_metrics__counters_move_under_adds_and_reads(bookie: BookieProcess) -> None:
    host, port = bookie.admin_address()
    before = await scrape(host, port)
    assert before['bookie_requests_total{op="add_entry"}'] == 0
    assert before['bookie_state{state="writable"}'] == 1
    client = await WireClient.connect(*bookie.address)
    try:
        assert set(await add_many(client, 1, 0, ADDS)) == {StatusCode.EOK}
        reads = await asyncio.gather(*(client.read(1, entry_id) for entry_id in range(10)))
        assert {r.status for r in reads} == {StatusCode.EOK}
        assert (await client.add(1, ADDS, PAYLOAD, key=b"W" * 32)).status == StatusCode.EUA
        assert (await client.read(1, 10_000)).status == StatusCode.ENOENTRY
        # A tailing reader parked on the LAC (ADDS - 1 is not yet the LAC: it is piggybacked by the next).
        poll = client.read(1, ADDS, flags=ReadFlag.LONG_POLL, previous_lac=ADDS - 2, timeout_ms=10_000)
        await asyncio.sleep(0.2)
        during = await scrape(host, port)
        assert during["bookie_long_poll_waiters"] == 1
        assert during["bookie_connections"] == 1
        assert (await client.add(1, ADDS, PAYLOAD)).status == StatusCode.EOK  # wakes the poll
        assert (await poll).status == StatusCode.EOK
    finally:
        client.close()
    after = await scrape(host, port)
    assert after['bookie_requests_total{op="add_entry"}'] == ADDS + 2
    assert after['bookie_requests_total{op="read_entry"}'] == 12
    assert after["bookie_read_entries_total"] >= 10
    assert after['bookie_request_errors_total{status="EUA"}'] == 1
    assert after['bookie_request_errors_total{status="ENOENTRY"}'] == 1
    assert after["bookie_journal_records_total"] >= ADDS + 1
    assert after["bookie_journal_written_bytes_total"] > ADDS * len(PAYLOAD)
    groups = after["bookie_journal_groups_total"]
    assert 0 < groups <= ADDS + 1
    assert after["bookie_journal_fsync_seconds_count"] >= groups
    assert after["bookie_journal_fsync_seconds_sum"] > 0
    assert after["bookie_journal_group_records_count"] == groups
    assert after["bookie_journal_group_records_sum"] == after["bookie_journal_records_total"]
    assert after["bookie_ledgers"] == 1
    assert after["bookie_long_poll_waiters"] == 0
    assert after["bookie_in_flight_requests"] == 0
    assert after["bookie_disk_free_bytes"] > 0
    assert after["process_cpu_seconds_total"] > 0


async def test_health__503_after_a_journal_io_error(tmp_path: Path) -> None:
    # The 5th journal fdatasync fails with EIO, as a disk gone bad or read-only would.
    proc = admin_bookie(tmp_path, env={"BKAIO_FAILPOINTS": "journal.before_fdatasync=count:5:eio"})
    with proc:
        proc.start()
        host, port = proc.admin_address()
        assert await get_json(host, port, "/health") == (
            200,
            {"healthy": True, "problems": [], "state": "writable"},
        )
        client = await WireClient.connect(*proc.address)
        try:
            statuses: list[int] = []
            for batch in range(20):  # each batch is at least one group, so at least one fdatasync
                statuses += await add_many(client, 7, batch * 10, 10)
                if StatusCode.EIO in statuses:
                    break
            assert StatusCode.EIO in statuses
            status, body = await get_json(host, port, "/health")
            assert status == 503
            assert body["healthy"] is False
            assert body["state"] == "failed"
            assert body["problems"][0].startswith("journal failed")
            assert "EIO" in body["problems"][0] or "Errno 5" in body["problems"][0]
            # Reads of what was acknowledged still work, and the failure shows in the metrics.
            assert (await client.read(7, 0)).status == StatusCode.EOK
        finally:
            client.close()
        samples = await scrape(host, port)
        assert samples["bookie_journal_failed"] == 1
        assert samples['bookie_state{state="failed"}'] == 1
        assert samples["bookie_healthy"] == 0
        assert samples['bookie_request_errors_total{status="EIO"}'] >= 1
        status, state = await get_json(host, port, "/state")
        assert (status, state["state"], state["healthy"]) == (200, "failed", False)
        assert proc.stop() == 0


async def test_state_and_ready(bookie: BookieProcess) -> None:
    host, port = bookie.admin_address()
    assert await get_json(host, port, "/ready") == (200, {"ready": True, "state": "writable"})
    status, state = await get_json(host, port, "/state")
    assert status == 200
    assert state["bookie_id"] == "bookie-admin"
    assert state["address"] == "{}:{}".format(*bookie.address)
    assert state["admin_address"] == f"{host}:{port}"
    assert state["state"] == "writable"
    assert state["ready"] is True
    assert state["healthy"] is True
    assert bookie.proc is not None
    assert state["pid"] == bookie.proc.pid
    assert state["journal"]["failed"] is None
    assert state["disk"]["total_bytes"] > 0
    assert state["version"]


async def test_bad_http_does_not_hurt_the_bookie(bookie: BookieProcess) -> None:
    host, port = bookie.admin_address()
    assert (await http_raw(host, port, b"\x00\x01garbage\r\n\r\n"))[0] == 400
    assert (await http_raw(host, port, b"GET / HTTP/1.1\r\nX: " + b"a" * 65536 + b"\r\n\r\n"))[0] == 431
    assert (await http_raw(host, port, b"DELETE /state HTTP/1.1\r\n\r\n"))[0] == 405
    assert (await http_raw(host, port, b"GET /admin/shutdown HTTP/1.1\r\n\r\n"))[0] == 404
    # Slow loris: connections that never finish their request hold no more than their slots, and
    # neither the admin endpoint nor the data path waits for them.
    stalled = [await asyncio.open_connection(host, port) for _ in range(4)]
    for _, writer in stalled:
        writer.write(b"GET /metr")
    assert (await get_json(host, port, "/health"))[0] == 200
    client = await WireClient.connect(*bookie.address)
    try:
        assert set(await add_many(client, 3, 0, 50)) == {StatusCode.EOK}
    finally:
        client.close()
    for _, writer in stalled:
        writer.close()
    assert bookie.running
    assert bookie.stop() == 0


def test_admin_port_in_use__refuses_to_start(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = BookieProcess(tmp_path / "bookie", bookie_id="b", extra_args=["--admin-port", str(port)])
        with proc:
            assert proc.start_expect_failure() == 3
    # what is wrong and what to do (before: the raw "[Errno 98] error while attempting to bind")
    assert f"refusing to start: cannot listen on the admin endpoint 127.0.0.1:{port}" in proc.log_tail()
    assert "another --admin-port" in proc.log_tail()


def test_a_data_dir_that_is_a_file_refuses_to_start_saying_so(tmp_path: Path) -> None:
    data_dir = tmp_path / "a-file"
    data_dir.write_text("")
    proc = BookieProcess(data_dir, bookie_id="b")
    with proc:
        assert proc.start_expect_failure() == 3
    # before: "[Errno 17] File exists"
    assert f"refusing to start: data dir {data_dir} is a file, not a directory" in proc.log_tail()
