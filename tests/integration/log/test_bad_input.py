"""Bad input to the log API (issue 14, acceptance 5): an unknown log, a position beyond the end, a
corrupt log key in etcd -> one clear error naming the log, raised where the caller asked (never a
hang, never a silent gap). Real bookies, real etcd. test_logs.py has the first cases (unknown log
for the reader and ``create=False``; a garbage key for the reader and the writer)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import pytest

from bookkeeper_aio import BookKeeper, LogPosition, NoSuchLog, open_log_reader, open_log_writer
from bookkeeper_aio.errors import BKError, BKInterfaceError
from bookkeeper_aio.log import delete_cursor, read_cursors
from metadata import log_metadata as log_serde
from metadata.errors import MetadataFormatError
from metadata.keys import ClusterKeys
from metadata.log_manager import LogManager
from tests.integration.log.conftest import Cluster

pytestmark = pytest.mark.etcd

QUORUM: dict[str, Any] = {"ensemble": 3, "write_quorum": 2, "ack_quorum": 2, "password": b"pw"}
WAIT_S = 10.0


async def _read_all(bk: BookKeeper, name: str, **kwargs: Any) -> list[LogPosition]:
    reader = await open_log_reader(bk, name, password=b"pw", **kwargs)
    return [record.position async for record in reader]


async def _closed_log(bk: BookKeeper, name: str, per_ledger: int = 3, ledgers: int = 2) -> list[LogPosition]:
    writer = await open_log_writer(bk, name, **QUORUM)
    positions: list[LogPosition] = []
    for index in range(ledgers):
        for i in range(per_ledger):
            position = await writer.append(f"{index}-{i}".encode())
            assert position is not None
            positions.append(position)
        if index < ledgers - 1:
            await writer.roll()
    await writer.close()
    return positions


# ------------------------------------------------------------------------------- unknown log
async def test_unknown_log_and_a_ledger_beyond_the_end(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    with pytest.raises(NoSuchLog, match="'ghost'"):
        await open_log_reader(bk, "ghost", follow=True)  # at the call, not while iterating
    with pytest.raises(NoSuchLog, match="'ghost'"):
        await open_log_reader(bk, "ghost", start=LogPosition(1, 0))
    # a log deleted under a following reader that waits for its next ledger: an error, not a hang
    positions = await _closed_log(bk, "doomed", ledgers=1)
    # a position beyond the end (a ledger after the last one): the log named, in both modes
    beyond = LogPosition(positions[-1].ledger_id + 1000, 0)
    for follow in (False, True):
        with pytest.raises(BKInterfaceError, match="log 'doomed'"):
            await open_log_reader(bk, "doomed", start=beyond, follow=follow)
    # the last record's position is a valid start: exactly that record
    assert await _read_all(bk, "doomed", start=positions[-1]) == [positions[-1]]
    reader = await open_log_reader(bk, "doomed", password=b"pw", follow=True)
    async with contextlib.aclosing(reader):
        seen = [await anext(reader) for _ in range(3)]
        assert [p.position.entry_id for p in seen] == [0, 1, 2]
        await LogManager(cluster.meta.store, cluster.root).delete("doomed")
        with pytest.raises(NoSuchLog, match="'doomed'"):
            async with asyncio.timeout(WAIT_S):
                await anext(reader)


# ---------------------------------------------------------------------------- beyond the end
async def test_an_entry_beyond_a_closed_ledgers_end_is_an_error(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    positions = await _closed_log(bk, "short")
    last = positions[-1]
    beyond = LogPosition(last.ledger_id, last.entry_id + 5)
    outcome: list[LogPosition] | BKError
    try:
        outcome = await _read_all(bk, "short", start=beyond)
    except BKError as error:
        outcome = error
    assert isinstance(outcome, BKError), f"start {tuple(beyond)} beyond the end: no error, read {outcome}"
    assert "'short'" in str(outcome), outcome


async def test_following_from_beyond_an_open_ledgers_end_leaves_no_silent_gap(
    cluster: Cluster, bk: BookKeeper
) -> None:
    await cluster.start(3)
    writer = await open_log_writer(bk, "live", **QUORUM)
    first = await writer.append(b"0")
    assert first is not None
    beyond = LogPosition(first.ledger_id, first.entry_id + 3)  # 1 and 2 do not exist yet
    outcome: LogPosition | BKError
    try:
        reader = await open_log_reader(bk, "live", start=beyond, password=b"pw", follow=True)
    except BKError as error:
        outcome = error
    else:
        async with contextlib.aclosing(reader):
            for i in range(1, 6):
                await writer.append(f"{i}".encode())
            async with asyncio.timeout(WAIT_S):
                outcome = (await anext(reader)).position
    await writer.close()
    assert isinstance(outcome, BKError), f"started at {tuple(beyond)}: got {outcome}, entries 1..2 skipped"
    assert "'live'" in str(outcome), outcome


# ------------------------------------------------------------------------------- corrupt key
def _mutations(valid: bytes) -> dict[str, bytes]:
    """Corrupt variants of a valid stored log value (built from its own map, so new fields stay)."""
    magic = log_serde.MAGIC
    body: dict[str, Any] = msgpack.unpackb(valid[len(magic) :], raw=False)

    def with_body(change: Callable[[dict[str, Any]], None]) -> bytes:
        copy = dict(body)
        change(copy)
        return magic + msgpack.packb(copy, use_bin_type=True)

    first = body["ledgers"][0]
    return {
        "garbage": b"\x00garbage",
        "empty": b"",
        "magic only": magic,
        "cut short": valid[: len(valid) // 2],
        "not a map": magic + msgpack.packb([1, 2, 3]),
        "newer format": with_body(lambda b: b.update(format_version=99)),
        "names another log": with_body(lambda b: b.update(name="other")),
        "ledgers not a list": with_body(lambda b: b.update(ledgers="many")),
        "ledger listed twice": with_body(lambda b: b.update(ledgers=[first, first])),
        "unknown ledger state": with_body(lambda b: b.update(ledgers=[[first[0], "zombie", *first[2:]]])),
        "negative ledger id": with_body(lambda b: b.update(ledgers=[[-1, *first[1:]]])),
        "no name": with_body(lambda b: b.pop("name")),
    }


async def test_a_corrupt_log_key_names_the_log(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    await _closed_log(bk, "good", ledgers=1)
    key = ClusterKeys(cluster.root).log("good")
    stored = await cluster.meta.store.get(key)
    assert stored is not None
    for what, value in _mutations(stored.value).items():
        await cluster.meta.store.put(key, value)
        for follow in (False, True):
            with pytest.raises(MetadataFormatError, match="log 'good'") as caught:
                await open_log_reader(bk, "good", follow=follow)
            assert key in str(caught.value), (what, caught.value)
        with pytest.raises(MetadataFormatError, match="log 'good'"):
            await open_log_writer(bk, "good", **QUORUM)
    # the writer did not "repair" the key by creating the log anew
    assert (await cluster.meta.store.get(key)).value == value  # type: ignore[union-attr]

    # corrupted under a following reader and a writer
    writer = await open_log_writer(bk, "hit", **QUORUM)
    await writer.append(b"0")
    key = ClusterKeys(cluster.root).log("hit")
    reader = await open_log_reader(bk, "hit", password=b"pw", follow=True)
    async with contextlib.aclosing(reader):
        assert (await anext(reader)).payload == b"0"
        await cluster.meta.store.put(key, b"\x00garbage")
        # the writer's next change of the list re-reads or CASes it: an error naming the log
        with pytest.raises(BKError, match="'hit'"):
            await writer.roll()
        # the reader's ledger ends (closed by its recovery below), then it reads the list: the error
        await bk.open_ledger(writer.ledger_id, password=b"pw", recovery=True)
        with pytest.raises(MetadataFormatError, match="log 'hit'"):
            async with asyncio.timeout(WAIT_S):
                await anext(reader)


async def test_cursors_of_an_unknown_log_name_the_log(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: read_cursors(bk, "nope"),
        lambda: delete_cursor(bk, "nope", "reader"),
    ]
    for call in calls:
        outcome: object
        try:
            outcome = await call()
        except NoSuchLog as error:
            outcome = error
        assert isinstance(outcome, NoSuchLog), f"no error for an unknown log: {outcome!r}"
        assert "'nope'" in str(outcome)
