"""Acceptance: kill -9 mid-stream at many points (signals and failpoints), restart, and every
acknowledged entry reads back byte-identical, with LAC and fence bits as before the kill.
Plus the torn-tail sweep against real processes."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from bookie import journal_format as fmt
from bookie import replay
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import StatusCode
from tests.harness.bookie_proc import BookieProcess

from .wire import KEY, WireClient, entry_body

ENTRIES = 10_000
WINDOW = 500
DATA_LEDGER = 1
FENCED_LEDGER = 2


@dataclass(frozen=True)
class KillPoint:
    name: str
    failpoints: str = ""  # BKAIO_FAILPOINTS for the first run; "" = SIGKILL from the test
    kill_after_acks: int = 0
    checkpoint_interval_s: float = 0.3  # short, so checkpoints happen while entries stream in
    # The data dir is made by a clean start and stop first, so that the count of a failpoint a
    # first start hits too (it writes the COOKIE twice: two renames, four directory fsyncs) is
    # the stream's alone; a count that included them killed the bookie before it was ready.
    made_before: bool = False
    left_behind: str = ""  # a file the kill leaves in the data dir: proof it hit the step meant


CHECKPOINT_TMP = f"{replay.INDEX_DIR}/{replay.CHECKPOINT_FILE}.tmp"  # durable, not yet renamed


KILL_POINTS = [
    *(
        KillPoint(f"sigkill-after-{n}", kill_after_acks=n)
        for n in (1, 137, 1500, 3333, 5000, 7777, 8800, 9100)
    ),
    KillPoint("journal-write-torn", "journal.write=count:30:partial:700"),
    KillPoint("journal-write-torn-early", "journal.write=count:2:partial:13"),
    KillPoint("journal-write-kill", "journal.write=count:15:kill"),
    KillPoint("before-fdatasync", "journal.before_fdatasync=count:9:kill"),
    KillPoint("after-fdatasync", "journal.after_fdatasync=count:12:kill"),
    KillPoint("before-ack", "bookie.before_ack=count:2500:kill"),
    KillPoint("index-checkpoint", "index.checkpoint=count:1:kill", checkpoint_interval_s=0.05),
    KillPoint(
        "checkpoint-rename",
        "fileio.rename=count:2:kill",
        checkpoint_interval_s=0.05,
        made_before=True,
        left_behind=CHECKPOINT_TMP,
    ),
    KillPoint("dir-fsync", "fileio.dir_fsync=count:4:kill", checkpoint_interval_s=0.05, made_before=True),
    KillPoint("fence-persist", "bookie.fence_persist=count:1:kill"),
    KillPoint("after-fdatasync-late", "journal.after_fdatasync=count:40:kill"),
    KillPoint("sigkill-mid-checkpoint-window", kill_after_acks=6100),
]
QUICK = {
    "sigkill-after-3333",
    "journal-write-torn",
    "journal-write-torn-early",
    "after-fdatasync",
    "index-checkpoint",
    "fence-persist",
}


def payload(entry_id: int) -> bytes:
    return random.Random(entry_id).randbytes(64 + entry_id % 200)


async def write_until_killed(bookie: BookieProcess, point: KillPoint) -> tuple[set[int], int, bool]:
    """Stream adds; returns (acked entry ids, LAC read before the kill, fence acked?)."""
    client = await WireClient.connect(*bookie.address)
    acked: set[int] = set()
    lac_seen = -1
    fence_acked = False
    sem = asyncio.Semaphore(WINDOW)
    killed = asyncio.Event()

    async def one(entry_id: int) -> None:
        nonlocal lac_seen, fence_acked
        try:
            response = await client.add(DATA_LEDGER, entry_id, payload(entry_id))
        except ConnectionError:
            return
        finally:
            sem.release()
        if response.status == StatusCode.EOK:
            acked.add(entry_id)
        if entry_id == 1000:  # fence a second ledger and record an explicit LAC mid-stream
            fence = await client.fence(FENCED_LEDGER)
            fence_acked = fence.status in (StatusCode.EOK, StatusCode.ENOENTRY)
        if point.kill_after_acks and len(acked) >= point.kill_after_acks and not killed.is_set():
            lac = await client.read_lac(DATA_LEDGER)
            lac_seen = lac.lac
            killed.set()
            bookie.kill()

    tasks = []
    for entry_id in range(ENTRIES):
        if killed.is_set() or client.closed.done():
            break
        await sem.acquire()
        tasks.append(asyncio.ensure_future(one(entry_id)))
    await asyncio.gather(*tasks, return_exceptions=True)
    if not killed.is_set() and not client.closed.done():
        lac_seen = (await client.read_lac(DATA_LEDGER)).lac
        bookie.kill()
    client.close()
    bookie.wait()
    return acked, lac_seen, fence_acked


async def check_after_restart(
    bookie: BookieProcess, acked: set[int], lac_seen: int, fence_acked: bool
) -> None:
    bookie.env.pop("BKAIO_FAILPOINTS", None)
    bookie.restart()
    client = await WireClient.connect(*bookie.address)
    stored: dict[int, bytes] = {}
    start = 0
    while start < ENTRIES:
        batch = await client.request(m.BatchReadRequest, DATA_LEDGER, start, 10_000, 4 << 20, 0, KEY)
        if batch.status != StatusCode.EOK:
            # past the end; "unknown" in limbo, after a cut that zeroed bytes (bookie/limbo.py)
            in_limbo = (bookie.data_dir / "limbo").exists()
            absent = (
                (StatusCode.EUNKNOWNLEDGERSTATE,) if in_limbo else (StatusCode.ENOENTRY, StatusCode.ENOLEDGER)
            )
            assert batch.status in absent, batch
            break
        for offset, body in enumerate(batch.bodies):
            stored[start + offset] = body
        start += len(batch.bodies)
    missing = sorted(acked - stored.keys())
    if missing:  # a gap in the batch? read the rest one by one
        for entry_id in missing:
            read = await client.read(DATA_LEDGER, entry_id)
            assert read.status == StatusCode.EOK, f"acked entry {entry_id} lost: {read}"
            stored[entry_id] = read.body
    for entry_id in acked:
        assert stored[entry_id] == entry_body(DATA_LEDGER, entry_id, payload(entry_id)), entry_id
    lac = (await client.read_lac(DATA_LEDGER)).lac if acked else -1
    assert lac >= lac_seen, f"LAC went back from {lac_seen} to {lac}"
    if acked:  # every acked entry piggybacked LAC entry_id - 1, and is durable
        assert lac >= max(acked) - 1, f"LAC {lac} is behind acked entry {max(acked)}"
    if fence_acked:
        late = await client.add(FENCED_LEDGER, 0, b"late")
        assert late.status == StatusCode.EFENCED
    again = await client.add(DATA_LEDGER, ENTRIES + 1, b"after restart")
    assert again.status == StatusCode.EOK
    client.close()
    bookie.stop()


async def run_kill_point(tmp_path: Path, point: KillPoint) -> None:
    bookie = BookieProcess(
        tmp_path / point.name, bookie_id="durable",
        extra_args=[
            "--checkpoint-interval-s", str(point.checkpoint_interval_s),
            "--journal-segment-bytes", str(40 * 1024 * 1024),
        ],
    )  # fmt: skip
    try:
        if point.made_before:
            bookie.start()
            assert bookie.stop() == 0
        if point.failpoints:
            bookie.env["BKAIO_FAILPOINTS"] = point.failpoints
        bookie.start()
        acked, lac_seen, fence_acked = await write_until_killed(bookie, point)
        print(f"{point.name}: {len(acked)} acked before the kill, lac {lac_seen}, fence acked {fence_acked}")
        assert len(acked) < ENTRIES, "the kill did not happen mid-stream"
        if point.left_behind:
            assert (bookie.data_dir / point.left_behind).exists(), "the kill came at another step"
        await check_after_restart(bookie, acked, lac_seen, fence_acked)
        if ":partial:" in point.failpoints:
            # the crash tore the write in flight, never synced: the journal's synced mark (same
            # boot) proves it, so the cut puts nothing in limbo (bookie/replay.py)
            assert not (bookie.data_dir / "limbo").exists(), "a process crash's torn write looked like rot"
            if int(point.failpoints.rsplit(":", 1)[1]) < fmt.GROUP_HEADER_BYTES:  # no group fits: torn
                assert "journal.torn_tail_cut" in bookie.log_path.read_text(), "the failpoint tore no write"
    finally:
        bookie.cleanup()


@pytest.mark.parametrize("point", [p for p in KILL_POINTS if p.name in QUICK], ids=lambda p: p.name)
async def test_kill9_acked_entries_survive(tmp_path: Path, point: KillPoint) -> None:
    await run_kill_point(tmp_path, point)


@pytest.mark.slow
@pytest.mark.parametrize("point", [p for p in KILL_POINTS if p.name not in QUICK], ids=lambda p: p.name)
async def test_kill9_acked_entries_survive_all_points(tmp_path: Path, point: KillPoint) -> None:
    await run_kill_point(tmp_path, point)


# ---------------------------------------------------------------------------------- torn tail
TORN_RECORDS = 50


async def write_journal_of_50(tmp_path: Path) -> tuple[Path, list[int]]:
    """A journal of exactly 50 ENTRY records (plus the master key record); returns record ends."""
    origin = tmp_path / "origin"
    bookie = BookieProcess(origin, bookie_id="torn", extra_args=["--checkpoint-interval-s", "3600"])
    bookie.start()
    client = await WireClient.connect(*bookie.address)
    for entry_id in range(TORN_RECORDS):
        assert (await client.add(1, entry_id, b"e%d" % entry_id)).status == StatusCode.EOK
    client.close()
    bookie.kill()  # no final checkpoint: a restart must replay the journal
    data = (origin / "journal" / fmt.segment_name(1)).read_bytes()
    scan = fmt.scan(data, fmt.SEGMENT_HEADER_BYTES, 1)
    entries = [r for r in scan.records if r.type in fmt.ENTRY_TYPES]
    assert len(entries) == TORN_RECORDS
    return origin, [r.offset + r.length for r in entries]


async def check_cut(tmp_path: Path, origin: Path, ends: list[int], cut: int) -> None:
    work = tmp_path / f"cut-{cut}"
    shutil.copytree(origin, work)
    os.truncate(work / "journal" / fmt.segment_name(1), cut)
    (work / "LOCK").unlink(missing_ok=True)
    bookie = BookieProcess(work, bookie_id="torn")
    try:
        bookie.start()
        client = await WireClient.connect(*bookie.address)
        whole = sum(1 for end in ends if end <= cut)
        # a cut that zeroed bytes puts every ledger in limbo (bookie/limbo.py): what the bookie
        # lacks is unknown, never "no such entry" (the cut group may have been synced and acked)
        absent = StatusCode.ENOENTRY if cut in ends else StatusCode.EUNKNOWNLEDGERSTATE
        for entry_id in range(max(0, whole - 2), TORN_RECORDS):
            read = await client.read(1, entry_id)
            expected = StatusCode.EOK if entry_id < whole else absent
            assert read.status == expected, f"cut at {cut}: entry {entry_id} -> {read.status}"
            if expected == StatusCode.EOK:
                assert read.body == entry_body(1, entry_id, b"e%d" % entry_id)
        client.close()
    finally:
        bookie.cleanup()
        shutil.rmtree(work, ignore_errors=True)


def cut_offsets(ends: list[int]) -> list[int]:
    return list(range(ends[-4], ends[-1]))  # every byte offset inside the last 3 records


async def test_torn_tail_sample_of_cuts(tmp_path: Path) -> None:
    origin, ends = await write_journal_of_50(tmp_path)
    offsets = cut_offsets(ends)
    sample = sorted({offsets[0], offsets[1], offsets[5], offsets[13], ends[-3], ends[-2] - 1, offsets[-1]})
    for cut in sample:
        await check_cut(tmp_path, origin, ends, cut)


# A bookie process per cut, 243 cuts: 140 s on a quiet 2-core machine, past the default 300 s at
# load 8, 990 s at load 12-19 (a start is CPU-bound: ~0.7 s of imports); each start has its own
# READY bound.
@pytest.mark.slow
@pytest.mark.timeout(3600)
async def test_torn_tail_every_offset_in_last_three_records(tmp_path: Path) -> None:
    origin, ends = await write_journal_of_50(tmp_path)
    for cut in cut_offsets(ends):
        await check_cut(tmp_path, origin, ends, cut)


async def test_records_lost_at_the_end_of_a_middle_segment_refuse_to_start(tmp_path: Path) -> None:
    """The last group of a segment that is not the last one reads back as zeros after a crash (a
    lost write, a zeroed extent): the bookie refuses to start (exit 3) instead of serving without
    those acknowledged entries (it used to start and answer ENOENTRY for them)."""
    data_dir = tmp_path / "b"
    args = ["--checkpoint-interval-s", "3600", "--journal-segment-bytes", "262144"]
    args += ["--frame-bytes-max", "65536"]
    bookie = BookieProcess(data_dir, bookie_id="lost", extra_args=args)
    try:
        bookie.start()
        client = await WireClient.connect(*bookie.address)
        payload = b"x" * 20_000  # a dozen entries per segment, one group each (acked one by one)
        for entry_id in range(40):
            assert (await client.add(1, entry_id, payload)).status == StatusCode.EOK
        client.close()
        bookie.kill()
        middle = data_dir / "journal" / fmt.segment_name(2)
        assert (data_dir / "journal" / fmt.segment_name(3)).stat().st_size > 0
        data = middle.read_bytes()
        last = fmt.scan(data, fmt.SEGMENT_HEADER_BYTES, 2).records[-1]
        group = last.offset - fmt.GROUP_HEADER_BYTES
        assert fmt.group_length_at(data, group, 2) == last.length  # the whole last group
        with middle.open("r+b") as out:
            out.seek(group)
            out.write(bytes(len(data) - group))
        assert bookie.start_expect_failure() == 3
        assert "refusing to start" in bookie.log_tail(20)
    finally:
        bookie.cleanup()
