"""Limbo ledgers with real bookie processes, a real etcd, a real client and a real replication
worker (bookie/limbo.py): bit rot in a bookie's final journal group, synced and acknowledged, which
replay cuts as a torn tail.

Two ledgers with Qw = Qa = 2 on two bookies; their last entries share the victim's final journal
group. The victim is killed (SIGKILL), one byte of that group flipped, and restarted: replay cuts
the group, the victim is in limbo. Its reads of the lost entries answer EUNKNOWNLEDGERSTATE, fencing
reads included (before the fix: ENOENTRY, and with Qw = Qa one such answer let recovery truncate
the ledger before an acknowledged entry). Recovery of the open ledger closes it at its last
acknowledged entry; the closed one's lost copies are marked under-replicated by the victim, a
worker moves them to a third bookie, and the victim leaves limbo (the marker removed).
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from bookie import journal_format as fmt
from bookie import limbo
from bookkeeper_aio import BookKeeper, ClientConfig
from bookkeeper_aio.autorecovery.config import AutorecoveryConfig
from bookkeeper_aio.autorecovery.worker import ReplicationWorker
from bookkeeper_aio.client.keys import codec_for
from bookkeeper_aio.protocol.codes import ReadFlag, StatusCode
from metadata.ledger_metadata import LedgerState
from metadata.underreplication import UnderReplicationManager
from tests.harness.bookie_proc import BookieProcess
from tests.harness.etcd import EtcdCluster

from .test_gc import init_cluster, payload
from .wire import WireClient

pytestmark = pytest.mark.etcd

PASSWORD = b"limbo"
FIRST = 8  # entries written one at a time (a group each)
TAIL = 12  # entries of each ledger appended in one go: the final group(s)
WAIT_S = 30.0


def final_group(data_dir: Path) -> tuple[Path, list[fmt.Record]]:
    """The last written journal segment of ``data_dir`` and the records of its last group (group
    headers lie between groups; a later segment may exist, created ahead of time, unwritten)."""
    segment, records = Path(), []
    for path in sorted(p for p in (data_dir / "journal").iterdir() if fmt.parse_segment_name(p.name)):
        scan = fmt.scan(path.read_bytes(), fmt.SEGMENT_HEADER_BYTES, fmt.parse_segment_name(path.name) or 0)
        if scan.records:
            segment, records = path, scan.records
    start = 0
    for i in range(1, len(records)):
        if records[i - 1].offset + records[i - 1].length != records[i].offset:
            start = i
    return segment, records[start:]


def flip_in(segment: Path, record: fmt.Record) -> None:
    at = record.offset + record.length - 1  # the last byte of its body: the record fails its CRC
    with segment.open("r+b") as out:
        out.seek(at)
        byte = out.read(1)[0]
        out.seek(at)
        out.write(bytes([byte ^ 0x10]))


async def wait_until(check: object, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not await check():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def test_bit_rot_in_the_final_synced_group_leaves_acked_entries_unknown_never_absent(
    etcd_server: EtcdCluster, tmp_path: Path
) -> None:
    url = etcd_server.url(f"/bookkeeper/limbo-{uuid.uuid4().hex[:8]}")
    await init_cluster(url)
    args = [*("--metadata", url, "--checkpoint-interval-s", "3600", "--limbo-check-interval-s", "0.2")]
    procs = [BookieProcess(tmp_path / f"b{i}", f"b{i}", extra_args=args) for i in range(3)]
    try:
        for proc in procs[:2]:
            proc.start()
        # no WRITE_LAC: the final journal group is the last entries
        config = ClientConfig(add_timeout_s=5.0, read_timeout_s=2.0, explicit_lac_interval_ms=0)
        async with BookKeeper.connect(url, config=config) as bk:
            closed = await bk.create_ledger(2, 2, 2, password=PASSWORD)
            writer = await bk.create_ledger(2, 2, 2, password=PASSWORD)
            handles = (closed, writer)
            acked: dict[int, list[bytes]] = {h.id: [] for h in handles}
            for entry_id in range(FIRST):
                for handle in handles:
                    acked[handle.id].append(payload(handle.id, entry_id, 200))
                    await handle.append(acked[handle.id][-1])
            futures = []
            for entry_id in range(FIRST, FIRST + TAIL):  # in one go: they share the final group(s)
                for handle in handles:
                    acked[handle.id].append(payload(handle.id, entry_id, 200))
                    futures.append(await handle.append_async(acked[handle.id][-1]))
            await asyncio.gather(*futures)  # every entry acknowledged: durable on both bookies
            await closed.close()
            keys = {
                h.id: codec_for((await bk.context.ledgers.read(h.id)).metadata, PASSWORD).master_key
                for h in handles
            }

            victim = procs[0]
            victim.kill()  # the writer of ``writer`` is abandoned: it never writes again
            segment, group = final_group(victim.data_dir)
            lost = [fmt.parse_ledger_entry(r.body) for r in group if r.type in fmt.ENTRY_TYPES]
            assert {lid for lid, _ in lost} == set(keys), (
                f"the final group holds no entry of one ledger: {lost}"
            )
            flip_in(segment, group[-1])
            victim.start()
            assert (victim.data_dir / limbo.MARKER_FILE).exists()
            assert "journal.torn_tail_cut" in victim.log_path.read_text()

            wire = await WireClient.connect(*victim.address)
            try:
                for ledger_id, entry_id in lost:  # plain reads and recovery's fencing reads alike
                    for flags in (0, int(ReadFlag.FENCE_LEDGER)):
                        read = await wire.read(ledger_id, entry_id, flags=flags, key=keys[ledger_id])
                        assert read.status == StatusCode.EUNKNOWNLEDGERSTATE, (ledger_id, entry_id, flags)
            finally:
                wire.close()

            # recovery of the open ledger (by another client: the writer's connection to the victim
            # is in its reconnect back-off): closed at its last acknowledged entry, none truncated
            async with BookKeeper.connect(url, config=config) as other:
                reader = await other.open_ledger(writer.id, password=PASSWORD, recovery=True)
                assert reader.last_add_confirmed == FIRST + TAIL - 1
                assert [e.payload async for e in reader.read()] == acked[writer.id]
                await reader.close()

            # the closed ledger: the victim marks its lost copies, a worker moves them, limbo clears
            urm = UnderReplicationManager(bk.context.ledgers.store, bk.context.ledgers.keys.root)

            async def marked() -> bool:
                mark = await urm.get(closed.id)
                return mark is not None and victim.bookie_id in mark.missing

            await wait_until(marked, "the victim to mark its lost copies under-replicated")
            procs[2].start()  # the replacement
            worker = ReplicationWorker(
                bk, urm, AutorecoveryConfig(passwords=(PASSWORD,)), worker_id="w-limbo"
            )
            for ledger_id in keys:
                mark = await urm.get(ledger_id)
                if mark is not None:
                    result = await worker.heal(mark)
                    assert result.left == (), result

            async def cleared() -> bool:
                return not (victim.data_dir / limbo.MARKER_FILE).exists()

            await wait_until(cleared, "the victim to leave limbo")
            assert "limbo.pass_finished" in victim.log_path.read_text()
            for ledger_id in keys:
                md = (await bk.context.ledgers.read(ledger_id)).metadata
                assert md.state is LedgerState.CLOSED
                assert md.last_entry_id == FIRST + TAIL - 1
                reader = await bk.open_ledger(ledger_id, password=PASSWORD)
                assert [e.payload async for e in reader.read()] == acked[ledger_id]
                await reader.close()
    finally:
        for proc in procs:
            proc.cleanup()
