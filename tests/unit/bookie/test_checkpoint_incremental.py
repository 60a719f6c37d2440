"""Index checkpoints built off the event loop and incrementally (issue 20, item 2): the file format is
the one a whole ``msgpack.packb`` gives, rows of unchanged ledgers are reused, every change since
invalidates its ledger's row, and a checkpoint taken while adds land holds at least everything
before its position (a restart from it alone reads every entry)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import crc32c
import msgpack
import pytest

from bookie import checkpoint
from bookie import storage as storage_module
from bookie.journal_format import Position
from bookie.ledger_state import LedgerState
from bookie.storage import Storage

from .test_storage import KEY, add, body, config, durable


def _old_style(position: Position, states: list[LedgerState]) -> bytes:
    """The checkpoint as the code before the incremental one encoded it (one packb)."""
    rows = [[s.ledger_id, s.master_key, s.fenced, s.piggyback_lac, s.explicit_lac] for s in states]
    for row, state in zip(rows, states, strict=True):
        row += [state.lac_body, state.index.last_entry_id]
    for row, state in zip(rows, states, strict=True):
        row.append(state.index.to_wire())
    payload = msgpack.packb([position.segment_id, position.offset, rows], use_bin_type=True)
    crc = crc32c.crc32c(payload)
    return checkpoint.HEADER.pack(checkpoint.MAGIC, checkpoint.VERSION, crc, len(payload)) + payload


def test_parts_are_byte_identical_to_the_whole_payload() -> None:
    states = []
    for ledger_id in range(2 * checkpoint.CHUNK_BYTES // 60):  # ~60-byte rows: chunks, a partial one
        state = LedgerState(ledger_id)
        state.master_key = KEY if ledger_id % 3 else None
        state.fenced = ledger_id % 2 == 0
        if ledger_id % 1000 == 4:  # 12 KB rows (1024 index slots) now and then
            state.index.put(ledger_id % 5, 1, 16 + ledger_id, 40)
            state.advance_piggyback(ledger_id % 5 - 1)
        states.append(state)
    position = Position(3, 12345)
    whole = checkpoint.encode(position, states)
    assert whole == _old_style(position, states)
    decoded_position, ledgers = checkpoint.decode(whole)
    assert decoded_position == position
    assert sorted(ledgers) == list(range(len(states)))
    assert ledgers[4].index.get(4) == states[4].index.get(4)
    assert checkpoint.decode(checkpoint.encode(position, []))[1] == {}


async def test_unchanged_rows_are_reused_and_changes_invalidate_them(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    for ledger_id in (1, 2, 3, 4):
        await add(storage, ledger_id, 0)
    await storage.write_checkpoint()
    rows = {lid: storage.ledger(lid).row for lid in (1, 2, 3, 4)}
    assert all(row is not None for row in rows.values())
    await add(storage, 1, 1)  # an add
    await durable(lambda cb: storage.fence(2, KEY, cb))  # a fence
    await durable(lambda cb: storage.write_lac(3, KEY, 7, b"lac", cb))  # an explicit LAC
    assert [storage.ledger(lid).row is None for lid in (1, 2, 3, 4)] == [True, True, True, False]
    await storage.write_checkpoint()
    assert storage.ledger(4).row is rows[4]  # reused, not encoded again
    storage.abort()
    reopened = await Storage.open(config(tmp_path))  # from the checkpoint alone: nothing to replay
    assert (await reopened.read_entry(1, 1))[1] == body(1, 1, 0)
    assert reopened.ledger(2).fenced
    assert reopened.ledger(3).lac == 7
    await reopened.close()


async def test_a_checkpoint_taken_while_adds_land_loses_none_of_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(storage_module, "CHECKPOINT_SLICE_S", 0.0)  # yield every 1024 ledgers
    storage = await Storage.open(config(tmp_path))
    for ledger_id in range(1, 3001):  # enough ledgers for the row collection to yield the loop
        storage.ledger_for_write(ledger_id, KEY)
    await durable(storage.force)

    async def keep_adding() -> int:
        entry_id = 0
        while not done.is_set():
            await add(storage, 1 + entry_id % 3000, entry_id // 3000)
            entry_id += 1
            added_so_far[0] = entry_id
        return entry_id

    added_so_far = [0]

    done = asyncio.Event()
    adder = asyncio.get_running_loop().create_task(keep_adding())
    for _ in range(3):
        before = added_so_far[0]
        await storage.write_checkpoint()
        assert added_so_far[0] > before  # adds did land while it collected rows
    done.set()
    added = await adder
    storage.abort()  # the last checkpoint plus replay after its position must give every add back
    reopened = await Storage.open(config(tmp_path))
    for entry_id in range(added):
        ledger_id, eid = 1 + entry_id % 3000, entry_id // 3000
        assert (await reopened.read_entry(ledger_id, eid))[1] == body(ledger_id, eid, eid - 1)
    await reopened.close()
