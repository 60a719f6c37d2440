"""Log metadata model + serde, and LogManager against MemoryStore."""

from __future__ import annotations

import msgpack
import pytest

from bookkeeper_aio.errors import NoSuchLog
from metadata import MemoryStore
from metadata.errors import BadVersion, InvalidMetadata, MetadataFormatError, NodeExists
from metadata.keys import ClusterKeys
from metadata.log_manager import UNCHANGED, LogManager
from metadata.log_metadata import (
    MAGIC,
    LogLedger,
    LogLedgerState,
    LogMetadata,
    decode,
    encode,
)

ROOT = "/bookkeeper/test"
KEY = "/bookkeeper/test/logs/orders"


def test_roundtrip_and_transitions() -> None:
    md = LogMetadata("orders", (), 5).with_ledger_appended(7).with_ledger_appended(9)
    assert md.ledgers == (LogLedger(7, LogLedgerState.OPEN), LogLedger(9, LogLedgerState.OPEN))
    md = md.with_closed(7)
    assert md.ledgers[0].state is LogLedgerState.CLOSED
    assert md.ledgers[1].state is LogLedgerState.OPEN
    assert decode(encode(md), key=KEY, name="orders") == md
    assert md.ledger_ids == (7, 9)
    assert md.index_of(9) == 1
    assert md.index_of(8) is None


@pytest.mark.parametrize("name", ["", "a/b", ".", "..", "x" * 257])
def test_bad_names_rejected(name: str) -> None:
    with pytest.raises(InvalidMetadata):
        LogMetadata(name)
    with pytest.raises(InvalidMetadata):
        ClusterKeys(ROOT).log(name)


def test_ledger_listed_twice_rejected() -> None:
    with pytest.raises(InvalidMetadata, match="listed twice"):
        LogMetadata("orders").with_ledger_appended(3).with_ledger_appended(3)
    with pytest.raises(InvalidMetadata, match="bad ledger id"):
        LogMetadata("orders").with_ledger_appended(-1)


def _body(**changes: object) -> bytes:
    body: dict[str, object] = {"format_version": 1, "name": "orders", "ledgers": [[1, "open"]], "ctime_ms": 0}
    body.update(changes)
    return MAGIC + msgpack.packb(body, use_bin_type=True)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"garbage", "bad magic"),
        (MAGIC + b"\xc1", "corrupt msgpack"),
        (MAGIC + msgpack.packb([1, 2]), "expected a map"),
        (_body(format_version=2), "unsupported format_version"),
        (_body(name="other"), "names log 'other'"),
        (_body(ledgers="x"), "'ledgers'"),
        (_body(ledgers=[[1, "weird"]]), "weird"),
        (_body(ledgers=[[1, "open"], [1, "closed"]]), "listed twice"),
        (_body(ledgers=[["1", "open"]]), "bad ledger entry"),
    ],
)
def test_decode_errors_name_the_log(data: bytes, why: str) -> None:
    with pytest.raises(MetadataFormatError, match=why) as caught:
        decode(data, key=KEY, name="orders")
    assert "log 'orders'" in str(caught.value)
    assert KEY in str(caught.value)


def test_keys() -> None:
    keys = ClusterKeys(ROOT)
    assert keys.log("orders") == KEY
    assert keys.log_name_of(KEY) == "orders"
    assert keys.logs_prefix == "/bookkeeper/test/logs/"
    with pytest.raises(InvalidMetadata):
        keys.log_name_of("/bookkeeper/test/ledgers/0000000000000000001")


async def test_manager_create_read_write_list_delete() -> None:
    store = MemoryStore()
    manager = LogManager(store, ROOT, now_ms=lambda: 42)
    created = await manager.create("orders")
    assert created.metadata == LogMetadata("orders", (), 42)
    with pytest.raises(NodeExists):
        await manager.create("orders")
    await manager.create("audit")
    read = await manager.read("orders")
    assert read == created
    written = await manager.write(read.metadata.with_ledger_appended(1), read.version)
    with pytest.raises(BadVersion):
        await manager.write(read.metadata.with_ledger_appended(2), read.version)
    assert (await manager.read("orders")).metadata.ledger_ids == (1,)
    assert [name async for name in manager.iter_names(page_size=1)] == ["audit", "orders"]
    await manager.delete("orders", written.version)
    with pytest.raises(NoSuchLog, match="'orders'"):
        await manager.read("orders")
    with pytest.raises(NoSuchLog):
        await manager.delete("orders")
    with pytest.raises(NoSuchLog):
        await manager.write(read.metadata, read.version)


async def test_manager_update_loop_retries_on_conflict() -> None:
    store = MemoryStore()
    manager = LogManager(store, ROOT)
    start = await manager.create("orders")
    await manager.write(start.metadata.with_ledger_appended(1), start.version)  # someone else wins
    calls: list[tuple[int, ...]] = []

    def append_two(md: LogMetadata) -> LogMetadata:
        calls.append(md.ledger_ids)
        return md.with_ledger_appended(2)

    result = await manager.update("orders", append_two, current=start)
    assert calls == [(), (1,)]  # decided again on the fresh list
    assert result.metadata.ledger_ids == (1, 2)
    same = await manager.update("orders", lambda md: UNCHANGED)
    assert same == result


async def test_manager_corrupt_value_names_the_log() -> None:
    store = MemoryStore()
    await store.put(KEY, b"not a log")
    with pytest.raises(MetadataFormatError, match="log 'orders'"):
        await LogManager(store, ROOT).read("orders")
