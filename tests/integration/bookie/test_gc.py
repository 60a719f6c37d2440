"""Bookie GC with a real bookie process and a real etcd: ledgers deleted from metadata leave the
bookie (reads answer ENOLEDGER, also after a restart) and the others read back whole."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import metadata
from bookkeeper_aio import BookKeeper, ClientConfig
from bookkeeper_aio.protocol.codes import StatusCode
from tests.harness.admin_http import get_json, post_json, scrape
from tests.harness.bookie_proc import BookieProcess
from tests.harness.etcd import EtcdCluster

from .wire import KEY, WireClient, entry_body

pytestmark = pytest.mark.etcd


def payload(ledger_id: int, entry_id: int, size: int) -> bytes:
    return random.Random(ledger_id * 1_000_003 + entry_id).randbytes(size)


async def init_cluster(url: str) -> None:
    async with metadata.connect(url) as conn:
        await metadata.init_cluster(conn.store, conn.root)


async def create_ledgers(url: str, count: int) -> list[int]:
    async with metadata.connect(url) as conn:
        manager = metadata.LedgerManager(conn.store, conn.root)
        return [(await manager.create(["b0"], write_quorum=1, ack_quorum=1)).ledger_id for _ in range(count)]


async def list_bookies(url: str) -> metadata.BookieSet:
    async with metadata.connect(url) as conn:
        return await metadata.list_bookies(conn.store, conn.root)


async def delete_ledgers(url: str, ledger_ids: list[int]) -> None:
    async with metadata.connect(url) as conn:
        manager = metadata.LedgerManager(conn.store, conn.root)
        for ledger_id in ledger_ids:
            await manager.delete(ledger_id)


async def write(bookie: BookieProcess, ledger_ids: list[int], entries: int, size: int) -> None:
    client = await WireClient.connect(*bookie.address)
    try:
        for ledger_id in ledger_ids:
            futures = [client.add(ledger_id, e, payload(ledger_id, e, size)) for e in range(entries)]
            for response in await asyncio.gather(*futures):
                assert response.status == StatusCode.EOK
    finally:
        client.close()


async def read_back(bookie: BookieProcess, ledger_ids: list[int], entries: int, size: int) -> None:
    """Every entry of ``ledger_ids`` reads back byte-identical."""
    client = await WireClient.connect(*bookie.address)
    try:
        for ledger_id in ledger_ids:
            responses = await asyncio.gather(*(client.read(ledger_id, e) for e in range(entries)))
            for entry_id, response in enumerate(responses):
                assert response.status == StatusCode.EOK, (ledger_id, entry_id, response)
                assert response.body == entry_body(ledger_id, entry_id, payload(ledger_id, entry_id, size))
    finally:
        client.close()


async def statuses(bookie: BookieProcess, ledger_ids: list[int], key: bytes = KEY) -> set[int]:
    client = await WireClient.connect(*bookie.address)
    try:
        return {r.status for r in await asyncio.gather(*(client.read(i, 0, key=key) for i in ledger_ids))}
    finally:
        client.close()


async def run_gc(bookie: BookieProcess, timeout_s: float = 120.0) -> dict[str, Any]:
    """Start a pass through the admin endpoint and wait for its report."""
    host, port = bookie.admin_address()
    status, before = await get_json(host, port, "/gc")
    assert status == 200
    status, started = await post_json(host, port, "/gc", bookie.admin_token())
    assert (status, started["started"]) == (200, True)
    async with asyncio.timeout(timeout_s):
        while True:
            status, now = await get_json(host, port, "/gc")
            if now["passes"] > before["passes"]:
                report: dict[str, Any] = now["last"]
                return report
            await asyncio.sleep(0.05)


def gc_bookie(tmp_path: Path, url: str, *extra: str, env: dict[str, str] | None = None) -> BookieProcess:
    args = [
        "--metadata",
        url,
        "--admin-port",
        "0",
        "--gc-interval-s",
        "0",
        "--gc-deleted-ledger-grace-s",
        "0",
    ]
    return BookieProcess(tmp_path / "b0", "b0", extra_args=[*args, *extra], env=env)


async def test_deleted_ledgers_leave_the_bookie_and_stay_gone(
    etcd_server: EtcdCluster, tmp_path: Path
) -> None:
    url = etcd_server.url(f"/bookkeeper/gc-{uuid.uuid4().hex[:8]}")
    await init_cluster(url)
    bookie = gc_bookie(tmp_path, url)
    bookie.start()
    try:
        ledgers = await create_ledgers(url, 10)
        await write(bookie, ledgers, 20, 100)
        deleted, kept = ledgers[:7], ledgers[7:]
        await delete_ledgers(url, deleted)
        found = await list_bookies(url)
        assert found.writable["b0"].attributes["admin"] == "{}:{}".format(*bookie.admin_address())
        cli = [sys.executable, "-m", "bookkeeper_aio.cli.main", "bookie", "gc", "--metadata", url, "--json"]
        refused = await asyncio.to_thread(
            subprocess.run, [*cli, "b0"], capture_output=True, text=True, timeout=60
        )
        assert refused.returncode != 0  # a POST without the admin token changes nothing
        assert "--admin-token-file" in refused.stderr
        token_file = str(bookie.data_dir / "admin.token")
        command = [*cli, "b0", "--admin-token-file", token_file]  # by id: its registration names its admin
        done = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["error"] is None
        assert (report["ledgers_collected"], report["ledgers_in_metadata"]) == (7, 3)
        assert await statuses(bookie, deleted) == {StatusCode.ENOLEDGER}
        await read_back(bookie, kept, 20, 100)
        metrics = await scrape(*bookie.admin_address())
        assert metrics["bookie_gc_ledgers_collected_total"] == 7
        assert metrics["bookie_gc_passes_total"] == 1
        assert metrics["bookie_gc_running"] == 0

        bookie.kill()  # kill -9 after the pass: its checkpoint keeps the deleted ledgers out
        bookie.start()
        assert await statuses(bookie, deleted) == {StatusCode.ENOLEDGER}
        await read_back(bookie, kept, 20, 100)
        command = [*cli, "{}:{}".format(*bookie.admin_address()), "--admin-token-file", token_file]
        done = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        again = json.loads(done.stdout)
        assert (again["ledgers_collected"], again["error"]) == (0, None)
    finally:
        bookie.cleanup()


async def test_gc_of_a_bookie_whose_registered_admin_is_another_bookies_is_refused(
    etcd_server: EtcdCluster, tmp_path: Path
) -> None:
    """``bkaio bookie gc BOOKIE`` from another host: BOOKIE's registration publishes a loopback
    admin address, which here is the local bookie's. The pass must not start on the local bookie
    (the check ``decommission`` makes: the endpoint must answer for BOOKIE)."""
    url = etcd_server.url(f"/bookkeeper/gc-{uuid.uuid4().hex[:8]}")
    await init_cluster(url)
    bookie = gc_bookie(tmp_path, url)
    bookie.start()
    try:
        await create_ledgers(url, 1)  # an id counter: the pass can trust the listing
        local_admin = "{}:{}".format(*bookie.admin_address())
        remote = metadata.BookieInfo("remote", "10.9.9.9", 3181, attributes={"admin": local_admin})
        async with metadata.connect(url) as meta:
            await meta.store.put(meta.keys.bookie("writable", "remote"), remote.encode())
        token_file = str(bookie.data_dir / "admin.token")
        cli = [sys.executable, "-m", "bookkeeper_aio.cli.main", "bookie", "gc", "--metadata", url, "--json"]

        async def run(*args: str) -> subprocess.CompletedProcess[str]:
            command = [*cli, *args, "--admin-token-file", token_file]
            return await asyncio.to_thread(
                subprocess.run, command, capture_output=True, text=True, timeout=60
            )

        refused = await run("remote")
        assert refused.returncode == 1, refused
        assert "belongs to bookie 'b0', not 'remote'" in refused.stderr
        refused = await run("remote", "--admin", local_admin)  # given by hand: checked the same way
        assert "belongs to bookie 'b0', not 'remote'" in refused.stderr
        assert (await get_json(*bookie.admin_address(), "/gc"))[1]["passes"] == 0  # nothing started
        done = await run("b0", "--admin", local_admin)  # its own bookie: accepted
        assert done.returncode == 0, (done.stdout, done.stderr)
        assert json.loads(done.stdout)["error"] is None
        assert (await get_json(*bookie.admin_address(), "/gc"))[1]["passes"] == 1
    finally:
        bookie.cleanup()


def journal_bytes(bookie: BookieProcess) -> int:
    """Disk space the journal really takes (allocated blocks, not file sizes)."""
    journal = bookie.data_dir / "journal"
    return sum(p.stat().st_blocks * 512 for p in journal.iterdir() if p.name.startswith("segment-"))


async def write_interleaved(bookie: BookieProcess, ledger_ids: list[int], entries: int, size: int) -> None:
    """Entry 0 of every ledger, then entry 1 of every ledger, ...: every segment holds some of each."""
    client = await WireClient.connect(*bookie.address)
    try:
        for entry_id in range(entries):
            futures = [client.add(i, entry_id, payload(i, entry_id, size)) for i in ledger_ids]
            for response in await asyncio.gather(*futures):
                assert response.status == StatusCode.EOK
    finally:
        client.close()


SMALL_SEGMENTS = [
    "--journal-segment-bytes",
    "262144",
    "--frame-bytes-max",
    "65536",
    "--checkpoint-interval-s",
    "3600",
]
KILL_POINTS = [
    pytest.param("gc.copied=count:1:kill", id="first-copy-durable"),
    pytest.param("gc.copied=count:4:kill", id="fourth-copy-durable", marks=pytest.mark.slow),
    pytest.param("gc.before_checkpoint=kill", id="before-checkpoint", marks=pytest.mark.slow),
    pytest.param("index.checkpoint=count:2:kill", id="checkpoint-before-rename", marks=pytest.mark.slow),
    pytest.param("gc.before_delete=kill", id="checkpoint-durable-before-delete"),
    pytest.param("gc.after_delete=count:2:kill", id="second-unlink-before-dir-fsync", marks=pytest.mark.slow),
    # The bookie is restarted with the failpoint after the writes, so the journal's groups counted
    # here are the copies' (the pass's only journal writes).
    pytest.param("journal.write=count:3:partial:3000", id="copy-group-torn", marks=pytest.mark.slow),
    pytest.param("journal.before_fdatasync=count:2:kill", id="copy-group-before-fdatasync"),
]


async def _write_and_delete_nine_in_ten(url: str, bookie: BookieProcess) -> tuple[list[int], list[int]]:
    """20 ledgers of 60 interleaved 1,500-byte entries; all but every tenth deleted from metadata.
    (The ledgers, those kept.)"""
    ledgers = await create_ledgers(url, 20)
    await write_interleaved(bookie, ledgers, 60, 1500)
    kept = ledgers[::10]
    await delete_ledgers(url, [i for i in ledgers if i not in kept])
    return ledgers, kept


async def _killed_mid_pass_then_finished(bookie: BookieProcess, failpoint: str, kept: list[int]) -> None:
    """Restart ``bookie`` with ``failpoint``, start a GC pass: the failpoint kills it (kill -9)
    mid-pass. Then it restarts, has lost none of ``kept``, and its next pass finishes the work."""
    assert bookie.stop() == 0
    bookie.env = {"BKAIO_FAILPOINTS": failpoint}
    bookie.start()
    host, port = bookie.admin_address()
    assert (await post_json(host, port, "/gc", bookie.admin_token()))[1]["started"]
    assert await asyncio.to_thread(bookie.wait, 60.0) == 137  # the failpoint killed it mid-pass
    assert "gc.started" in bookie.log_path.read_text()

    bookie.env = {}
    bookie.start()  # restarts after kill -9 at that step ...
    await read_back(bookie, kept, 60, 1500)  # ... and lost nothing
    report = await run_gc(bookie)  # the next pass finishes the work
    assert report["error"] is None
    await read_back(bookie, kept, 60, 1500)


@pytest.mark.parametrize("failpoint", KILL_POINTS)
async def test_kill_at_a_compaction_step_loses_nothing(
    etcd_server: EtcdCluster, tmp_path: Path, failpoint: str
) -> None:
    url = etcd_server.url(f"/bookkeeper/gck-{uuid.uuid4().hex[:8]}")
    await init_cluster(url)
    bookie = gc_bookie(tmp_path, url, *SMALL_SEGMENTS)
    bookie.start()
    try:
        ledgers, kept = await _write_and_delete_nine_in_ten(url, bookie)
        before = journal_bytes(bookie)
        await _killed_mid_pass_then_finished(bookie, failpoint, kept)
        assert journal_bytes(bookie) < before / 2
        bookie.kill()
        bookie.start()
        await read_back(bookie, kept, 60, 1500)
        assert await statuses(bookie, [i for i in ledgers if i not in kept]) == {StatusCode.ENOLEDGER}
    finally:
        bookie.cleanup()


ONE_BIG_SEGMENT = [
    "--journal-segment-bytes",
    str(64 * 1024 * 1024),
    "--frame-bytes-max",
    "65536",
    "--checkpoint-interval-s",
    "3600",
]
ROLL_KILL_POINTS = [
    pytest.param("gc.rolled=kill", id="rolled"),
    pytest.param(
        "journal.before_fdatasync=count:1:kill", id="roll-group-before-fdatasync", marks=pytest.mark.slow
    ),
    pytest.param("gc.copied=count:1:kill", id="first-copy-durable", marks=pytest.mark.slow),
    pytest.param("gc.before_checkpoint=kill", id="before-checkpoint", marks=pytest.mark.slow),
    pytest.param("gc.before_delete=kill", id="checkpoint-durable-before-delete", marks=pytest.mark.slow),
    pytest.param("gc.after_delete=count:1:kill", id="unlink-before-dir-fsync", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("failpoint", ROLL_KILL_POINTS)
async def test_kill_at_each_step_of_compacting_the_current_segment_loses_nothing(
    etcd_server: EtcdCluster, tmp_path: Path, failpoint: str
) -> None:
    """Everything lies in the segment being written (64 MiB, 1.8 MiB written): the pass rolls it,
    then compacts and deletes it. kill -9 at each step: the bookie restarts, nothing is lost, the
    next pass finishes and the segment's space comes back."""
    url = etcd_server.url(f"/bookkeeper/gcr-{uuid.uuid4().hex[:8]}")
    await init_cluster(url)
    roll = ["--compaction-roll-dead-bytes", str(256 * 1024)]
    bookie = gc_bookie(tmp_path, url, *ONE_BIG_SEGMENT, *roll)
    bookie.start()
    try:
        ledgers, kept = await _write_and_delete_nine_in_ten(url, bookie)
        segments = sorted(p.name for p in (bookie.data_dir / "journal").iterdir())
        assert len(segments) <= 2  # the current one and the one created ahead
        await _killed_mid_pass_then_finished(bookie, failpoint, kept)
        assert segments[0] not in {p.name for p in (bookie.data_dir / "journal").iterdir()}
        bookie.kill()
        bookie.start()
        await read_back(bookie, kept, 60, 1500)
        assert await statuses(bookie, [i for i in ledgers if i not in kept]) == {StatusCode.ENOLEDGER}
    finally:
        bookie.cleanup()


@pytest.mark.slow
async def test_acceptance_gc_of_90_percent_of_half_a_gib(etcd_server: EtcdCluster, tmp_path: Path) -> None:
    """Issue acceptance 5: a bookie holding >= 500 MiB; 90% of its ledgers deleted; after GC and
    compaction its disk usage drops accordingly and the remaining entries read back, also after a
    kill -9 in the middle of the compaction and a restart."""
    url = etcd_server.url(f"/bookkeeper/gca-{uuid.uuid4().hex[:8]}")
    await init_cluster(url)
    segment = ["--journal-segment-bytes", str(64 * 1024 * 1024), "--checkpoint-interval-s", "3600"]
    bookie = gc_bookie(tmp_path, url, *segment, env={"BKAIO_FAILPOINTS": "gc.copied=count:20:kill"})
    bookie.start()
    ledger_count, entries, size = 100, 80, 64 * 1024  # 100 x 80 x 64 KiB = 500 MiB
    try:
        ledgers = await create_ledgers(url, ledger_count)
        await write_interleaved(bookie, ledgers, entries, size)
        before = journal_bytes(bookie)
        assert before >= 500 * 1024 * 1024
        kept = ledgers[::10]
        await delete_ledgers(url, [i for i in ledgers if i not in kept])

        host, port = bookie.admin_address()
        assert (await post_json(host, port, "/gc", bookie.admin_token()))[1]["started"]
        assert await asyncio.to_thread(bookie.wait, 300.0) == 137  # killed mid-compaction
        bookie.env = {}
        bookie.start()
        await read_back(bookie, kept, entries, size)

        report = await run_gc(bookie, timeout_s=600.0)
        assert report["error"] is None
        after = journal_bytes(bookie)
        live = len(kept) * entries * (size + 32 + 29)
        mib = 1024 * 1024
        print(f"journal before {before // mib} MiB, after {after // mib} MiB, live {live // mib} MiB")
        print(f"report {report}")
        # What stays: the live 10% (copied to the head) plus the segment that was the head when the
        # pass started and the one created ahead of time (at most two segments).
        assert after <= live + 2 * 64 * 1024 * 1024 + 16 * 1024 * 1024
        assert after < before / 3
        await read_back(bookie, kept, entries, size)
        bookie.kill()
        bookie.start()
        await read_back(bookie, kept, entries, size)
    finally:
        bookie.cleanup()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 96 MiB tmpfs of the test's own (skips where mounting is not allowed)."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=96m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


async def test_acceptance_full_disk_read_only_then_gc_makes_it_writable(
    etcd_server: EtcdCluster, small_disk: Path
) -> None:
    """Issue acceptance 6: the disk fills, the bookie goes read-only (adds get EREADONLY, nothing
    acked is lost); ledgers are deleted and a GC pass brings it back to writable."""
    url = etcd_server.url(f"/bookkeeper/gcf-{uuid.uuid4().hex[:8]}")
    await init_cluster(url)
    mib = 1024 * 1024
    bookie = BookieProcess(
        small_disk / "b0",
        "b0",
        extra_args=[
            *("--metadata", url, "--admin-port", "0", "--gc-interval-s", "0"),
            *("--gc-deleted-ledger-grace-s", "0", "--checkpoint-interval-s", "3600"),
            *("--journal-segment-bytes", str(8 * mib), "--frame-bytes-max", str(mib)),
            *("--disk-free-bytes-min", str(24 * mib), "--disk-free-bytes-writable", str(40 * mib)),
            *("--disk-reserve-bytes", str(8 * mib), "--disk-check-interval-s", "0.05"),
        ],
    )
    bookie.start()
    host, port = bookie.admin_address()
    entries, size = 32, 64 * 1024  # 2 MiB per ledger, written one ledger after the other
    try:
        ledgers = await create_ledgers(url, 60)
        acked: dict[int, int] = {}
        client = await WireClient.connect(*bookie.address)
        refused = None
        for ledger_id in ledgers:
            responses = await asyncio.gather(
                *(client.add(ledger_id, e, payload(ledger_id, e, size)) for e in range(entries))
            )
            ok = [r.status == StatusCode.EOK for r in responses]
            acked[ledger_id] = ok.index(False) if False in ok else entries
            if not all(ok):
                refused = next(r for r in responses if r.status != StatusCode.EOK)
                break
        client.close()
        assert refused is not None, "the disk never filled"
        assert refused.status == StatusCode.EREADONLY
        assert (await get_json(host, port, "/readonly"))[1]["mode"] == "readonly"
        written = [i for i in ledgers if acked.get(i)]
        for ledger_id in written:  # nothing acked is lost
            await read_back(bookie, [ledger_id], acked[ledger_id], size)

        kept = written[::10]
        await delete_ledgers(url, [i for i in written if i not in kept])
        report = await run_gc(bookie)
        assert report["error"] is None
        assert report["segments_deleted"] > 0
        print(f"written {len(written)} ledgers before EREADONLY; GC report {report}")
        async with asyncio.timeout(10):
            while True:
                mode = (await get_json(host, port, "/readonly"))[1]
                if mode["mode"] == "writable":
                    break
                await asyncio.sleep(0.05)
        for ledger_id in kept:
            await read_back(bookie, [ledger_id], acked[ledger_id], size)
        extra = ledgers[-1]
        await write(bookie, [extra], 8, size)  # writable again: adds are accepted
        await read_back(bookie, [extra], 8, size)
    finally:
        bookie.cleanup()


async def test_ledgers_deleted_through_the_client_are_collected_on_every_bookie(
    etcd_server: EtcdCluster, tmp_path: Path
) -> None:
    """End to end with the library: 3 self-registered bookies, E3/Qw2/Qa2 ledgers written and closed
    by the client, two thirds deleted with ``BookKeeper.delete_ledger``; a GC pass on each bookie
    drops them everywhere, and the client still reads every entry of the others."""
    url = etcd_server.url(f"/bookkeeper/gce-{uuid.uuid4().hex[:8]}")
    await init_cluster(url)
    procs = [
        BookieProcess(
            tmp_path / f"b{i}",
            f"b{i}",
            extra_args=[
                *("--metadata", url, "--admin-port", "0", "--gc-interval-s", "0"),
                *("--gc-deleted-ledger-grace-s", "0", *SMALL_SEGMENTS),
            ],
        )
        for i in range(3)
    ]
    try:
        for proc in procs:
            proc.start()
        config = ClientConfig(add_timeout_s=5.0, read_timeout_s=5.0)
        async with BookKeeper.connect(url, config=config) as bk:
            written: dict[int, list[bytes]] = {}
            for _ in range(9):
                handle = await bk.create_ledger(3, 2, 2, password=b"gc")
                payloads = [payload(handle.id, e, 1200) for e in range(40)]
                for p in payloads:
                    await handle.append(p)
                await handle.close()
                written[handle.id] = payloads
            ids = sorted(written)
            deleted = [i for n, i in enumerate(ids) if n % 3 != 0]
            for ledger_id in deleted:
                await bk.delete_ledger(ledger_id, password=b"gc")
            for proc in procs:
                report = await run_gc(proc)
                assert report["error"] is None
                assert report["ledgers_collected"] == len(deleted)
                assert await statuses(proc, deleted) == {StatusCode.ENOLEDGER}
            for ledger_id in ids:
                if ledger_id in deleted:
                    continue
                reader = await bk.open_ledger(ledger_id, password=b"gc")
                got = [entry.payload async for entry in reader.read(0, reader.last_add_confirmed)]
                assert got == written[ledger_id]
                await reader.close()
    finally:
        for proc in procs:
            proc.cleanup()
