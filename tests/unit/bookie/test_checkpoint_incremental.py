"""Index checkpoints built off the event loop and incrementally (issue 20, item 2): the parts make
the same file as one encode, version 1 files (one msgpack payload) are still read, rows of unchanged
ledgers are reused, every change since invalidates its ledger's row, and a checkpoint taken while
adds land holds at least everything before its position (a restart from it alone reads every
entry)."""

from __future__ import annotations

import asyncio
import gc
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


def _version_1(position: Position, states: list[LedgerState]) -> bytes:
    """The checkpoint as bookies before format version 2 wrote it (one msgpack payload)."""
    rows = []
    for s in states:
        base, positions, lengths, overflow = s.index.snapshot()
        spilled = [overflow[i : i + 4].tolist() for i in range(0, len(overflow), 4)]
        index = [
            base,
            positions.tobytes(),
            lengths.tobytes(),
            [o[0] for o in spilled],
            [o[1:] for o in spilled],
        ]
        fields = [s.ledger_id, s.master_key, s.fenced, s.piggyback_lac, s.explicit_lac]
        rows.append([*fields, s.lac_body, s.index.last_entry_id, index])
    payload = msgpack.packb([position.segment_id, position.offset, rows], use_bin_type=True)
    crc = crc32c.crc32c(payload)
    return checkpoint.HEADER.pack(checkpoint.MAGIC, checkpoint.VERSION_MSGPACK, crc, len(payload)) + payload


def _same(got: LedgerState, want: LedgerState) -> None:
    assert (got.ledger_id, got.master_key, got.fenced, got.fence_durable) == (
        want.ledger_id,
        want.master_key,
        want.fenced,
        want.fenced,
    )
    assert (got.piggyback_lac, got.explicit_lac, got.lac_body) == (
        want.piggyback_lac,
        want.explicit_lac,
        want.lac_body,
    )
    assert got.index.items() == want.index.items()
    assert (len(got.index), got.index.last_entry_id) == (len(want.index), want.index.last_entry_id)


def test_parts_are_byte_identical_to_the_whole_payload_and_version_1_reads_the_same() -> None:
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
    states[5].index.put(10**9, 7, 99, 41)  # one in the overflow
    states[5].advance_explicit(12, b"lac body")
    rows = [checkpoint.encode_row(state) for state in states]
    parts = checkpoint.encode_parts(position, rows)
    assert len(parts) > 3  # header, head, several chunks
    whole = b"".join(parts)
    assert whole == checkpoint.encode(position, states)
    for data in (whole, _version_1(position, states)):
        decoded_position, ledgers = checkpoint.decode(data)
        assert decoded_position == position
        assert sorted(ledgers) == list(range(len(states)))
        for state in states:
            _same(ledgers[state.ledger_id], state)
    assert checkpoint.decode(checkpoint.encode(position, []))[1] == {}
    assert checkpoint.decode(_version_1(position, []))[1] == {}


def test_a_checkpoint_cut_or_padded_anywhere_is_refused() -> None:
    state = LedgerState(3)
    state.master_key = KEY
    state.index.put(0, 1, 16, 40)
    rows = [checkpoint.encode_row(state), checkpoint.encode_row(LedgerState(4))]
    payload = b"".join(checkpoint.encode_parts(Position(1, 16), rows))[checkpoint.HEADER.size :]
    for bad in (payload[:-1], payload + b"\0", payload[:-40], payload[:30]):  # CRC made right each time
        data = (
            checkpoint.HEADER.pack(checkpoint.MAGIC, checkpoint.VERSION, crc32c.crc32c(bad), len(bad)) + bad
        )
        with pytest.raises(checkpoint.CheckpointCorrupt, match="does not decode"):
            checkpoint.decode(data)
    future = checkpoint.HEADER.pack(checkpoint.MAGIC, 3, crc32c.crc32c(payload), len(payload)) + payload
    with pytest.raises(checkpoint.CheckpointCorrupt, match="version 3"):
        checkpoint.decode(future)


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
    overlapped = 0
    for _ in range(30):  # three checkpoints during which adds landed (a slow fsync may leave one out)
        before = added_so_far[0]
        await storage.write_checkpoint()
        overlapped += added_so_far[0] > before
        if overlapped == 3:
            break
    assert overlapped, "no add landed while a checkpoint collected rows: nothing was tested"
    done.set()
    added = await adder
    storage.abort()  # the last checkpoint plus replay after its position must give every add back
    reopened = await Storage.open(config(tmp_path))
    for entry_id in range(added):
        ledger_id, eid = 1 + entry_id % 3000, entry_id // 3000
        assert (await reopened.read_entry(ledger_id, eid))[1] == body(ledger_id, eid, eid - 1)
    await reopened.close()


async def test_a_restart_keeps_the_rows_it_read_and_drops_those_replay_changes(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    for ledger_id in (1, 2, 3):
        await add(storage, ledger_id, 0)
    await storage.write_checkpoint()
    await add(storage, 2, 1)  # after the checkpoint: replayed at the restart
    storage.abort()
    reopened = await Storage.open(config(tmp_path))
    assert gc.isenabled()  # paused while recovery built the objects, back on after
    for ledger_id in (1, 3):  # the file's bytes, as encoding the state again gives them
        assert reopened.ledger(ledger_id).row == checkpoint.encode_row(reopened.ledger(ledger_id))
    assert reopened.ledger(2).row is None
    await reopened.write_checkpoint()
    reopened.abort()
    again = await Storage.open(config(tmp_path))
    for ledger_id, entry_id in ((1, 0), (2, 0), (2, 1), (3, 0)):
        assert (await again.read_entry(ledger_id, entry_id))[1] == body(ledger_id, entry_id, entry_id - 1)
    await again.close()
