"""Torn journal tails and bit flips on one replica (fewer than Qa), edited offline between kill and restart.

Writers run on E3/Qw2/Qa2 and E3/Qw3/Qa2 ledgers over 4 bookies that checkpoint their index often.
Each round kills one bookie with SIGKILL (the writers go on: ensemble change), edits its data dir,
restarts it on the same data dir and port:

- ``torn``: a power loss during the final, unsynced group: a group header at the end of the journal
  naming its own place, followed by a prefix of its records (the next entries of the last ledger
  written, cut mid-record), or garbage bytes. The
  bookie must cut it and start; nothing it acknowledged was in that group.
- ``flip``: one bit of an entry record the index checkpoint covers (so replay does not read it) is
  flipped. The bookie starts; a read of that entry must answer EIO, never "no such entry", and the
  client reads it from another replica.

Then everything is recovered and read back by three clients, and the history checked: every acked
entry is seen. At the end each flipped entry is read from its damaged bookie directly: EIO.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from pathlib import Path

import pytest

from bookie import checkpoint
from bookie import journal_format as fmt
from bookkeeper_aio import BookKeeper
from bookkeeper_aio.client.keys import codec_for
from bookkeeper_aio.protocol.codes import StatusCode
from tests.faults import figures
from tests.faults.cluster import (
    CONFIG,
    FaultCluster,
    Workload,
    abandon_writers,
    fault_cycles,
    fault_seed,
    recover_and_read,
    stop_writers,
)
from tests.faults.conftest import ON_SHARED, SHARED_BOOKIE_ARGS
from tests.faults.history import History
from tests.integration.bookie.wire import WireClient

pytestmark = pytest.mark.etcd

SHAPES = [(3, 2, 2), (3, 3, 2)]
BOOKIE_ARGS = SHARED_BOOKIE_ARGS  # checkpoints often: a bit is flipped only where one covers it


def _segments(data_dir: Path) -> list[tuple[int, Path]]:
    journal = data_dir / "journal"
    found = [(fmt.parse_segment_name(p.name), p) for p in journal.iterdir()]
    return sorted((sid, p) for sid, p in found if sid is not None)


def _checkpointed(data_dir: Path) -> fmt.Position:
    """Where the bookie's index checkpoint stands (the journal's start when it has none yet)."""
    path = data_dir / "index" / "checkpoint"
    if not path.exists():
        return fmt.Position(_segments(data_dir)[0][0], fmt.SEGMENT_HEADER_BYTES)
    return checkpoint.decode(path.read_bytes())[0]


def tear_tail(data_dir: Path, rng: random.Random) -> tuple[str, int, int] | None:
    """Write a torn final group after the journal's last whole group (offline, bookie stopped):
    what was written, and the segment and offset where replay must cut (None: nothing to tear)."""
    written = [
        (segment_id, path, data)
        for segment_id, path in _segments(data_dir)
        if fmt.check_segment_header(data := path.read_bytes(), segment_id) is fmt.SegmentHeader.VALID
    ]
    if not written:  # no entry reached this bookie yet (a loaded machine): tear its first group,
        # segment header included, over the segment created ahead and never written
        segments = _segments(data_dir)
        if not segments:
            return None
        segment_id, path = segments[0]
        torn = os.urandom(rng.randrange(1, 4096))
        with path.open("r+b") as out:
            out.write(torn)
        return f"{len(torn)} garbage bytes over a never-written segment", segment_id, 0
    segment_id, path, data = written[-1]  # later ones are preallocated, never written
    # from the checkpoint, as replay does: a bit flipped behind it in an earlier round ends a scan
    # from the segment's start there, and the torn group would overwrite synced records
    position = _checkpointed(data_dir)
    start = position.offset if position.segment_id == segment_id else fmt.SEGMENT_HEADER_BYTES
    scan = fmt.scan(data, start, segment_id)
    assert scan.tail is fmt.Tail.CLEAN, scan
    end = scan.end
    if rng.random() < 0.5:
        # the next entries of the last ledger written: were the cut missed, they would be read back
        entries = [fmt.parse_ledger_entry(r.body) for r in scan.records if r.type in fmt.ENTRY_TYPES]
        ledger_id, last = entries[-1] if entries else (10**9, -1)
        bodies = [
            fmt.LEDGER_ENTRY.pack(ledger_id, last + 1 + k) + os.urandom(rng.randrange(50, 600))
            for k in range(rng.randint(1, 4))
        ]
        records = b"".join(fmt.encode_entry(b) for b in bodies)
        torn = fmt.encode_group_header(segment_id, end, len(records)) + records
        torn = torn[: rng.randrange(fmt.RECORD_HEADER_BYTES + 1, len(torn))]  # cut mid-group
        kind = f"torn group of {len(records)} bytes cut at {len(torn)}"
    else:
        torn = os.urandom(rng.randrange(1, 4096))
        kind = f"{len(torn)} garbage bytes"
    with path.open("r+b") as out:
        out.seek(end)
        out.write(torn)
    return kind, segment_id, end


def flip_bit(
    data_dir: Path, rng: random.Random, spared: set[tuple[int, int]], ledgers: set[int]
) -> tuple[int, int] | None:
    """Flip one bit in the body of an entry record of one of ``ledgers`` behind the index
    checkpoint; its (ledger, entry), or None when the checkpoint covers no such entry yet. Entries in
    ``spared`` are left alone."""
    position = _checkpointed(data_dir)
    candidates: list[tuple[Path, fmt.Record, int, int]] = []
    for segment_id, path in _segments(data_dir):
        if segment_id > position.segment_id:
            break
        data = path.read_bytes()
        scan = fmt.scan(data, fmt.SEGMENT_HEADER_BYTES, segment_id)
        for record in scan.records:
            covered = segment_id < position.segment_id or record.offset + record.length <= position.offset
            if record.type in fmt.ENTRY_TYPES and covered:
                ledger_id, entry_id = fmt.parse_ledger_entry(record.body)
                if ledger_id in ledgers and (ledger_id, entry_id) not in spared:
                    candidates.append((path, record, ledger_id, entry_id))
    if not candidates:
        return None
    path, record, ledger_id, entry_id = rng.choice(candidates)
    body_start = record.offset + fmt.RECORD_HEADER_BYTES + fmt.ENTRY_PREFIX_BYTES
    at = rng.randrange(body_start, record.offset + record.length)
    with path.open("r+b") as out:
        out.seek(at)
        byte = out.read(1)[0]
        out.seek(at)
        out.write(bytes([byte ^ (1 << rng.randrange(8))]))
    return ledger_id, entry_id


def _check_cut(log_path: Path, since: int, kind: str, segment_id: int, offset: int) -> None:
    """The restart that followed a tear logged a cut at the tear's place."""
    with log_path.open("rb") as log:
        log.seek(since)
        lines = log.read().decode(errors="replace").splitlines()
    cuts = [line for line in lines if "journal.torn_tail_cut" in line]
    want = {"segment": f"{segment_id:016x}", "offset": offset}
    if not any({k: json.loads(line).get(k) for k in want} == want for line in cuts):
        replay = "\n".join(line for line in lines if '"journal.' in line or "replay" in line)
        where = f"segment {segment_id:016x} offset {offset}"
        pytest.fail(f"{kind} at {where}: no cut there; the start's log:\n{replay}")


async def _run(cluster: FaultCluster, rounds: int, tmp_path: Path) -> None:
    seed = fault_seed()
    rng = random.Random(seed)
    history = History()
    stop = asyncio.Event()
    flipped: dict[tuple[int, int], int] = {}  # (ledger, entry) -> the bookie holding the bad copy
    async with BookKeeper.connect(cluster.url, config=CONFIG) as bk:
        workload = Workload(bk, history, SHAPES, stop, [])
        writers = [asyncio.create_task(workload.writer(f"w{i}", random.Random(seed + i))) for i in range(3)]
        try:
            for number in range(rounds):
                await asyncio.sleep(rng.uniform(0.6, 1.2))  # entries written, and checkpointed
                index = rng.randrange(len(cluster.bookies))
                await cluster.kill(index)
                bookie = cluster.bookies[index]
                tear = None
                if number % 2 == 0:
                    tear = await asyncio.to_thread(tear_tail, bookie.data_dir, rng)
                else:
                    hit = await asyncio.to_thread(
                        flip_bit, bookie.data_dir, rng, set(flipped), set(workload.ledgers)
                    )
                    if hit is not None:
                        flipped[hit] = index
                logged = bookie.log_path.stat().st_size
                await cluster.restart(index)  # raises if the bookie refuses to start
                if tear is not None:
                    _check_cut(bookie.log_path, logged, *tear)
        except BaseException:
            abandon_writers(stop, writers)
            raise
        await stop_writers(stop, writers)
        await cluster.heal()
        await recover_and_read(cluster, history, workload.ledgers)
    problems = history.check()
    row = figures.record("torn tails + bit flips on one replica", history, cycles=rounds, seed=seed)
    if problems:
        history.dump(tmp_path / "history.jsonl")
        pytest.fail(
            f"{len(problems)} violations (seed {seed}; history kept in {tmp_path}, data dirs and logs in "
            f"{cluster.base}; replay: FAULT_SEED={seed}):\n" + "\n".join(problems)
        )
    assert row["ok"], row
    assert flipped, "no bit flipped: the checkpoint covered no entry"
    keys = {}
    async with BookKeeper.connect(cluster.url) as bk:  # reads carry each ledger's (salted) key
        for ledger_id in {ledger_id for ledger_id, _ in flipped}:
            md = (await bk.context.ledgers.read(ledger_id)).metadata
            keys[ledger_id] = codec_for(md, b"f").master_key
    for (ledger_id, entry_id), index in flipped.items():
        client = await WireClient.connect(*cluster.bookies[index].address)
        try:
            status = (await client.read(ledger_id, entry_id, key=keys[ledger_id])).status
        finally:
            client.close()
        assert status == StatusCode.EIO, f"flipped entry {ledger_id}/{entry_id}: {StatusCode(status).name}"


@ON_SHARED
async def test_torn_tails_and_bit_flips_on_one_replica(shared: FaultCluster, tmp_path: Path) -> None:
    """`make test`: one torn tail, then one bit flip."""
    await _run(shared, fault_cycles(2), tmp_path)


@pytest.mark.slow
async def test_torn_tails_and_bit_flips_many_rounds(faults: FaultCluster, tmp_path: Path) -> None:
    """`make chaos`: FAULT_CYCLES rounds (default 20), torn tails and bit flips in turn."""
    await faults.start(4, bookie_args=BOOKIE_ARGS)
    await _run(faults, fault_cycles(20), tmp_path)
