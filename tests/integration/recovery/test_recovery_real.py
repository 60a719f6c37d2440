"""Issue 5 acceptance on real bookie processes and a real etcd: fencing a writer at full speed,
concurrent recoverers, tailing readers.

A small history checker records what the writer was told (acked entry -> payload, and which adds
failed with LedgerFenced) and compares it with what independent readers see after recovery.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from bookkeeper_aio import BKError, BookKeeper, LedgerFenced, LedgerHandle, ReadHandle
from metadata.ledger_metadata import LedgerState
from tests.integration.recovery.conftest import CONFIG, Cluster

pytestmark = pytest.mark.etcd
PASSWORD = b"pw"


def _payload(i: int) -> bytes:
    return b"entry-%08d-" % i + b"x" * 64


@dataclass
class History:
    acked: dict[int, bytes] = field(default_factory=dict)
    fenced: int = 0
    other_errors: list[BaseException] = field(default_factory=list)

    def check(self, last_entry: int, read_back: dict[int, bytes]) -> None:
        """Every acked entry is at or below the last entry and reads back identical."""
        assert self.acked, "the writer never got an ack"
        assert max(self.acked) <= last_entry, (max(self.acked), last_entry)
        assert sorted(read_back) == list(range(last_entry + 1))
        for entry_id, payload in self.acked.items():
            assert read_back[entry_id] == payload, entry_id
        for entry_id, payload in read_back.items():
            assert payload == _payload(entry_id)  # unacked-but-recovered entries are the writer's too


async def _write_until_fenced(lh: LedgerHandle, history: History, started: asyncio.Event) -> None:
    """Append as fast as the window allows until the handle fails."""
    i = 0

    def record(entry_id: int, payload: bytes, future: asyncio.Future[int]) -> None:
        error = future.exception()
        if error is None:
            assert future.result() == entry_id
            history.acked[entry_id] = payload
        elif isinstance(error, LedgerFenced):
            history.fenced += 1
        else:
            history.other_errors.append(error)

    def recorder(entry_id: int, payload: bytes) -> Callable[[asyncio.Future[int]], None]:
        return lambda future: record(entry_id, payload, future)

    while True:
        payload = _payload(i)
        try:
            future = await lh.append_async(payload)
        except LedgerFenced:
            history.fenced += 1
            return
        future.add_done_callback(recorder(i, payload))
        i += 1
        if i == 200:
            started.set()
        if i % 256 == 0:
            await asyncio.sleep(0)


async def _read_all(url: str, ledger_id: int) -> tuple[int, dict[int, bytes]]:
    async with BookKeeper.connect(url, config=CONFIG) as reader:
        rh = await reader.open_ledger(ledger_id, password=PASSWORD)
        assert rh.is_closed
        return rh.last_add_confirmed, {e.entry_id: e.payload async for e in rh.read()}


async def _fence_a_running_writer(cluster: Cluster, bk: BookKeeper, recoverers: int) -> None:
    await cluster.start(3)
    lh = await bk.create_ledger(3, 3, 2, password=PASSWORD)
    history = History()
    started = asyncio.Event()
    writer = asyncio.create_task(_write_until_fenced(lh, history, started))
    await asyncio.wait_for(started.wait(), 10)
    await asyncio.sleep(0.3)  # full speed for a while

    async def recover() -> ReadHandle:
        async with BookKeeper.connect(cluster.url, config=CONFIG) as other:
            return await other.open_ledger(lh.id, password=PASSWORD, recovery=True)

    handles = await asyncio.wait_for(asyncio.gather(*(recover() for _ in range(recoverers))), 30)
    await asyncio.wait_for(writer, 30)  # the writer stops on its own: LedgerFenced
    await asyncio.sleep(0.2)  # let the last add callbacks run
    assert lh.state.value == "failed"
    assert history.fenced > 0
    assert not history.other_errors, history.other_errors[:3]
    lasts = {h.last_add_confirmed for h in handles}
    assert len(lasts) == 1, f"recoverers disagree: {lasts}"
    last = lasts.pop()
    for h in handles:
        assert h.metadata.state is LedgerState.CLOSED
    reads = await asyncio.gather(*(_read_all(cluster.url, lh.id) for _ in range(3)))
    for reader_last, read_back in reads:
        assert reader_last == last
        history.check(last, read_back)
    assert reads[0][1] == reads[1][1] == reads[2][1]
    with contextlib.suppress(BKError):
        await lh.close()


async def test_recovery__fences_writer_at_full_speed_no_acked_entry_lost(
    cluster: Cluster, bk: BookKeeper
) -> None:
    await _fence_a_running_writer(cluster, bk, recoverers=1)


async def test_recovery__three_concurrent_recoverers_agree(cluster: Cluster, bk: BookKeeper) -> None:
    await _fence_a_running_writer(cluster, bk, recoverers=3)


async def test_tail__live_writer_every_entry_in_order_explicit_lac_and_close(
    cluster: Cluster, bk: BookKeeper
) -> None:
    await cluster.start(3)
    lh = await bk.create_ledger(3, 2, 2, password=PASSWORD)
    async with BookKeeper.connect(cluster.url, config=CONFIG) as other:
        rh = await other.open_ledger(lh.id, password=PASSWORD)
        seen: list[tuple[int, bytes]] = []
        idle_seen = asyncio.Event()
        idle_at = 299

        async def follow() -> None:
            async for entry in rh.tail(0):
                seen.append((entry.entry_id, entry.payload))
                if entry.entry_id == idle_at:
                    idle_seen.set()

        reader = asyncio.create_task(follow())
        for i in range(idle_at + 1):
            if i % 3 == 0:
                await lh.append(_payload(i))
            else:
                await (await lh.append_async(_payload(i)))
        # the writer is idle now: only the explicit LAC can show entry 299 to the reader
        await asyncio.wait_for(idle_seen.wait(), 3)
        for i in range(idle_at + 1, idle_at + 101):
            await lh.append_async(_payload(i))
        await lh.close()
        await asyncio.wait_for(reader, 10)
    assert seen == [(i, _payload(i)) for i in range(idle_at + 101)]
