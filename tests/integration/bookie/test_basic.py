"""A real bookie over TCP: every op, durability across kill -9, fencing, long poll, shutdown."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import pytest

from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import FEATURE_ADD_ACKS, PROTOCOL_VERSION, ReadFlag, StatusCode
from tests.harness.bookie_proc import BookieProcess

from .wire import KEY, WireClient, entry_body


async def test_hello_and_bookie_info(client: WireClient) -> None:
    hello = await client.request(m.HelloRequest, PROTOCOL_VERSION, "test")
    assert hello.status == StatusCode.EOK
    assert hello.bookie_id == "bookie-1"
    assert hello.features == 0  # none asked for, none used
    wrong = await client.request(m.HelloRequest, PROTOCOL_VERSION + 7, "test")
    assert wrong.status == StatusCode.EBADVERSION
    info = await client.request(m.GetBookieInfoRequest)
    assert info.status == StatusCode.EOK
    assert info.info["state"] == "writable"
    assert info.info["free_disk_bytes"] > 0
    assert info.info["ledger_id_max"] == 0  # holds no ledger yet
    assert (await client.add(7, 0, b"x")).status == StatusCode.EOK
    assert (await client.add(3, 0, b"x")).status == StatusCode.EOK
    assert (await client.request(m.GetBookieInfoRequest)).info["ledger_id_max"] == 7


async def test_add_read_lac_batch_list(client: WireClient) -> None:
    acks = await asyncio.gather(*(client.add(1, i, f"payload-{i}".encode()) for i in range(100)))
    assert {a.status for a in acks} == {StatusCode.EOK}
    read = await client.read(1, 42)
    assert read.status == StatusCode.EOK
    assert read.body == entry_body(1, 42, b"payload-42")
    assert read.lac == 98
    last = await client.read(1, -1)
    assert (last.entry_id, last.body) == (99, entry_body(1, 99, b"payload-99"))
    assert (await client.read(1, 100)).status == StatusCode.ENOENTRY
    assert (await client.read(2, 0)).status == StatusCode.ENOLEDGER
    assert (await client.read_lac(1)).lac == 98
    assert (await client.write_lac(1, 99)).status == StatusCode.EOK
    assert (await client.read_lac(1)).lac == 99
    batch = await client.request(m.BatchReadRequest, 1, 10, 20, 1 << 20, 0, KEY)
    assert batch.bodies == [entry_body(1, i, f"payload-{i}".encode()) for i in range(10, 30)]
    small = await client.request(m.BatchReadRequest, 1, 10, 20, 60, 0, KEY)
    assert len(small.bodies) == 1
    listing = await client.request(m.GetListOfEntriesRequest, 1, KEY)
    assert listing.ranges == [[0, 99]]
    force = await client.request(m.ForceLedgerRequest, 1, b"K" * 32)
    assert force.status == StatusCode.EOK
    wrong_key = await client.request(m.ForceLedgerRequest, 1, b"X" * 32)
    assert wrong_key.status == StatusCode.EUA


async def test_add_acks_batch_the_ok_answers_when_agreed_in_hello(client: WireClient) -> None:
    hello = await client.request(m.HelloRequest, PROTOCOL_VERSION, "test", FEATURE_ADD_ACKS | 0x80)
    assert hello.features == FEATURE_ADD_ACKS  # the unknown bit is not echoed
    good = [client.add(1, i, b"payload-%d" % i) for i in range(200)]
    bad = client.add(1, 200, b"x", key=b"other")  # an error is always a single ADD_ENTRY answer
    acks = await asyncio.gather(*good)
    assert {a.status for a in acks} == {StatusCode.EOK}
    assert (await bad).status == StatusCode.EUA
    batched = [rid for ids in client.add_acks for rid in ids]
    assert sorted(batched) == sorted(a.request_id for a in acks)  # each answered once
    assert len(client.add_acks) < 50  # per journal group, not per add
    assert not client.unmatched
    read = await client.read(1, 199)
    assert read.body == entry_body(1, 199, b"payload-199")


async def test_master_key_mismatch_is_eua(client: WireClient) -> None:
    assert (await client.add(5, 0, b"x")).status == StatusCode.EOK
    assert (await client.add(5, 1, b"x", key=b"other")).status == StatusCode.EUA


async def test_body_header_must_match_request(client: WireClient) -> None:
    body = entry_body(1, 7, b"x")
    response = await client.request(m.AddEntryRequest, 1, 8, 0, b"K" * 32, body)
    assert response.status == StatusCode.EBADREQ


async def test_fenced_after_restart_rejects_adds_accepts_recovery(bookie: BookieProcess) -> None:
    client = await WireClient.connect(*bookie.address)
    for i in range(5):
        assert (await client.add(3, i, b"data")).status == StatusCode.EOK
    fenced = await client.fence(3, 4)
    assert fenced.status == StatusCode.EOK
    assert fenced.body == entry_body(3, 4, b"data")
    assert (await client.add(3, 5, b"late")).status == StatusCode.EFENCED
    unknown = await client.fence(77)  # fencing an unknown ledger creates it fenced
    assert unknown.status == StatusCode.ENOENTRY
    client.close()
    bookie.kill()
    bookie.restart()
    client = await WireClient.connect(*bookie.address)
    assert (await client.add(3, 5, b"late")).status == StatusCode.EFENCED
    assert (await client.add(77, 0, b"late")).status == StatusCode.EFENCED
    assert (await client.add(3, 5, b"recovered", recovery=True)).status == StatusCode.EOK
    assert (await client.read(3, 5)).body == entry_body(3, 5, b"recovered")
    assert (await client.read_lac(3)).lac == 4  # piggybacked by entry 5: 5 - 1
    client.close()


async def test_long_poll_returns_on_new_lac_and_at_timeout(client: WireClient, bookie: BookieProcess) -> None:
    assert (await client.add(9, 0, b"a")).status == StatusCode.EOK  # LAC stays -1
    flags = ReadFlag.LONG_POLL | ReadFlag.ENTRY_PIGGYBACK
    started = time.monotonic()
    timed_out = await client.read(9, 0, flags=flags, previous_lac=-1, timeout_ms=300)
    elapsed = time.monotonic() - started
    assert timed_out.status == StatusCode.EOK
    assert timed_out.body is None
    assert 0.28 <= elapsed < 1.0
    writer = await WireClient.connect(*bookie.address)
    poll = client.read(9, 0, flags=flags, previous_lac=-1, timeout_ms=10_000)
    await asyncio.sleep(0.2)
    assert not poll.done()
    sent = time.monotonic()
    assert (await writer.add(9, 1, b"b", lac=0)).status == StatusCode.EOK
    acked = time.monotonic()
    woken = await poll
    woke = time.monotonic()
    assert woken.lac == 0
    assert woken.body == entry_body(9, 0, b"a")
    assert woke - acked < 0.05, f"long poll answered {1000 * (woke - acked):.1f} ms after the LAC advanced"
    assert woke - sent < 0.5
    writer.close()


async def test_sigterm_is_a_clean_shutdown(tmp_path: Path) -> None:
    proc = BookieProcess(tmp_path / "b", bookie_id="b")
    proc.start()
    client = await WireClient.connect(*proc.address)
    pending = [client.add(1, i, b"x" * 100) for i in range(500)]
    await pending[0]
    code = proc.stop()
    assert code == 0
    results = await asyncio.gather(*pending, return_exceptions=True)
    acked = [i for i, r in enumerate(results) if isinstance(r, m.AddEntryResponse) and r.status == 0]
    proc.start()
    client = await WireClient.connect(*proc.address)
    for i in acked:
        assert (await client.read(1, i)).body == entry_body(1, i, b"x" * 100)
    assert "storage.checkpointed" in proc.log_path.read_text()
    client.close()
    proc.cleanup()


async def test_cookie_refuses_other_bookie_id(bookie: BookieProcess) -> None:
    bookie.stop()
    other = BookieProcess(bookie.data_dir, bookie_id="someone-else")
    assert other.start_expect_failure() == 3
    assert "belongs to bookie" in other.log_tail()


async def test_a_data_dir_wiped_but_its_cookie_refuses_to_start(tmp_path: Path) -> None:
    """An operator clears journal/ and index/ and keeps the COOKIE: the bookie used to start empty
    under its old identity and answer ENOLEDGER for the entry it had acknowledged."""
    proc = BookieProcess(tmp_path / "b", bookie_id="b")
    try:
        proc.start()
        client = await WireClient.connect(*proc.address)
        assert (await client.add(1, 0, b"acked")).status == StatusCode.EOK
        client.close()
        assert proc.stop() == 0
        shutil.rmtree(proc.data_dir / "journal")
        shutil.rmtree(proc.data_dir / "index")
        assert proc.start_expect_failure() == 3
        assert "wiped or lost" in proc.log_tail()
    finally:
        proc.cleanup()


@pytest.mark.parametrize("flag", [ReadFlag.FENCE_LEDGER])
async def test_fence_read_needs_key(client: WireClient, flag: int) -> None:
    response = await client.read(1, 0, flags=flag, key=None)
    assert response.status == StatusCode.EBADREQ
