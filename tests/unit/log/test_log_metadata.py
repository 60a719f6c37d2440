"""Log metadata model + serde, and LogManager against MemoryStore."""

from __future__ import annotations

import msgpack
import pytest

from bookkeeper_aio.errors import NoSuchLog
from metadata import MemoryStore, log_metadata
from metadata.errors import BadVersion, InvalidMetadata, MetadataFormatError, NodeExists
from metadata.keys import ClusterKeys
from metadata.log_manager import UNCHANGED, LogManager
from metadata.log_metadata import (
    COMMIT_TAG_BYTES_MAX,
    IMPORTER_BYTES_MAX,
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
    assert md.ledgers == (LogLedger(7, LogLedgerState.OPEN, 0), LogLedger(9, LogLedgerState.OPEN))
    md = md.with_closed(7, last_entry_id=4, length=50, closed_ms=6)
    assert md.ledgers[0] == LogLedger(7, LogLedgerState.CLOSED, 0, 4, 50, 6)
    assert md.ledgers[1] == LogLedger(9, LogLedgerState.OPEN, 5)  # offset follows from ledger 7's end
    md = md.with_closed(9, last_entry_id=-1).with_ledger_appended(11)
    assert md.ledgers[2].first_offset == 5  # ledger 9 was empty
    md = md.with_commit("job", 3).with_truncated_before(9)
    assert decode(encode(md), key=KEY, name="orders") == md
    assert md.ledger_ids == (9, 11)
    assert md.truncated_before == 9
    assert md.commits == {"job": 3}
    assert md.index_of(11) == 1
    assert md.index_of(8) is None


def test_version_1_values_decode_with_the_new_fields_unknown() -> None:
    md = decode(_body(ledgers=[[1, "closed"], [2, "open"]]), key=KEY, name="orders")
    assert md.ledgers == (LogLedger(1, LogLedgerState.CLOSED), LogLedger(2, LogLedgerState.OPEN))
    assert (md.truncated_before, md.sequenced, dict(md.commits)) == (0, False, {})


def test_the_spare_is_recorded_above_the_list_and_gone_once_a_ledger_is_appended() -> None:
    md = LogMetadata("orders").with_ledger_appended(3).with_spare(5)
    assert decode(encode(md), key=KEY, name="orders").spare == 5
    assert md.ledger_ids == (3,)  # not part of the log
    assert md.with_ledger_appended(5).spare is None  # the roll listed it
    assert md.with_ledger_appended(7).spare is None  # a fresh ledger went in instead
    assert md.with_spare(None).spare is None
    with pytest.raises(InvalidMetadata, match="spare ledger 3 is not above"):
        md.with_spare(3)
    with pytest.raises(InvalidMetadata, match="spare ledger 2 is not above"):
        LogMetadata("orders", truncated_before=3).with_spare(2)
    with pytest.raises(MetadataFormatError, match="spare"):
        decode(_body(ledgers=[[4, "open"]], spare=4), key=KEY, name="orders")
    assert decode(_body(ledgers=[[4, "open"]]), key=KEY, name="orders").spare is None  # absent


def test_truncation_keeps_the_offsets_and_new_ledgers_must_sort_after_truncated_ones() -> None:
    md = LogMetadata("orders").with_ledger_appended(3).with_closed(3, last_entry_id=9).with_ledger_appended(4)
    md = md.with_closed(4, last_entry_id=9).with_truncated_before(4)
    assert md.ledgers[0].first_offset == 10
    assert md.with_truncated_before(5).last_ledger_id == 4  # an empty list still remembers
    with pytest.raises(InvalidMetadata, match="ids must grow"):
        md.with_truncated_before(5).with_ledger_appended(4)


def test_a_change_checks_its_new_entries_and_hands_on_the_checked_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    md = LogMetadata("orders", (), 5, commits={"imp": 3}).with_ledger_appended(7).with_ledger_appended(9)
    checked: list[object] = []
    real = log_metadata._ledger_problem
    monkeypatch.setattr(log_metadata, "_ledger_problem", lambda entry: checked.append(entry) or real(entry))
    appended = md.with_ledger_appended(11)
    assert checked == [LogLedger(11, LogLedgerState.OPEN)]  # 7 and 9 were checked when they came
    assert appended == LogMetadata(
        "orders", (*md.ledgers, LogLedger(11, LogLedgerState.OPEN)), 5, commits={"imp": 3}
    )
    assert md.with_commit("imp", 4).commits == {"imp": 4}
    assert md.commits == {"imp": 3}  # the original is untouched
    with pytest.raises(InvalidMetadata, match="bad ledger id"):
        md._replace(ledgers=(*md.ledgers, LogLedger(-1, LogLedgerState.OPEN)))  # a new entry: checked
    with pytest.raises(InvalidMetadata, match="ids must grow"):
        md._replace(ledgers=(md.ledgers[1], md.ledgers[0]))  # checked entries, still in order


@pytest.mark.parametrize("name", ["", "a/b", ".", "..", "x" * 257])
def test_bad_names_rejected(name: str) -> None:
    with pytest.raises(InvalidMetadata):
        LogMetadata(name)
    with pytest.raises(InvalidMetadata):
        ClusterKeys(ROOT).log(name)


def test_ledger_ids_must_grow() -> None:
    with pytest.raises(InvalidMetadata, match="ids must grow"):
        LogMetadata("orders").with_ledger_appended(3).with_ledger_appended(3)
    with pytest.raises(InvalidMetadata, match="ids must grow"):
        LogMetadata("orders").with_ledger_appended(3).with_ledger_appended(2)
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
        (_body(format_version=3), "unsupported format_version"),
        (_body(name="other"), "names log 'other'"),
        (_body(ledgers="x"), "'ledgers'"),
        (_body(ledgers=[[1, "weird"]]), "weird"),
        (_body(ledgers=[[1, "open"], [1, "closed"]]), "ids must grow"),
        (_body(ledgers=[[1, "open", -5, None, None, None]]), "bad first_offset"),
        (_body(commits=[1]), "commits must be a map"),
        (_body(sequenced="yes"), "sequenced must be a bool"),
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


async def test_manager_read_if_changed_decodes_only_a_newer_list() -> None:
    store = MemoryStore()
    manager = LogManager(store, ROOT)
    start = await manager.create("orders")
    assert await manager.read_if_changed("orders", start.version) is None
    await store.put(KEY, b"not a log", lease_id=0)  # a value it would fail to decode...
    with pytest.raises(MetadataFormatError):
        await manager.read_if_changed("orders", start.version)  # ...at a new version: decoded
    garbage = await store.get(KEY)
    assert garbage is not None
    newer = await manager.write(start.metadata.with_ledger_appended(4), garbage.version)
    assert await manager.read_if_changed("orders", start.version) == newer
    await manager.delete("orders")
    with pytest.raises(NoSuchLog):
        await manager.read_if_changed("orders", newer.version)


async def test_manager_corrupt_value_names_the_log() -> None:
    store = MemoryStore()
    await store.put(KEY, b"not a log")
    with pytest.raises(MetadataFormatError, match="log 'orders'"):
        await LogManager(store, ROOT).read("orders")


async def test_manager_watch_yields_current_then_changes_then_none() -> None:
    manager = LogManager(MemoryStore(), ROOT)
    created = await manager.create("orders")
    watch = manager.watch("orders")
    assert await anext(watch) == created
    changed = await manager.write(created.metadata.with_ledger_appended(3), created.version)
    assert await anext(watch) == changed
    await manager.delete("orders")
    assert await anext(watch) is None
    with pytest.raises(StopAsyncIteration):
        await anext(watch)
    with pytest.raises(NoSuchLog):
        await anext(manager.watch("orders"))


async def test_manager_cursors_round_trip_and_reject_bad_names() -> None:
    manager = LogManager(MemoryStore(), ROOT)
    await manager.write_cursor("orders", "billing", 3, 7)
    await manager.write_cursor("orders", "audit", 2, -1)
    await manager.write_cursor("other", "x", 9, 9)
    assert await manager.read_cursors("orders") == {"audit": (2, -1), "billing": (3, 7)}
    assert await manager.delete_cursor("orders", "audit")
    assert not await manager.delete_cursor("orders", "audit")
    await manager.delete_cursors("orders")
    assert await manager.read_cursors("orders") == {}
    assert await manager.read_cursors("other") == {"x": (9, 9)}
    with pytest.raises(InvalidMetadata):
        await manager.write_cursor("orders", "a/b", 1, 1)
    with pytest.raises(InvalidMetadata):
        await manager.write_cursor("orders", "c", -1, 1)


def test_an_importer_id_is_capped_in_utf8_bytes() -> None:
    """`has_room` counts the tokens' bytes: one unbounded importer id could fill the list."""
    md = LogMetadata("orders", (), 5)
    assert md.with_commit("i" * IMPORTER_BYTES_MAX, 1).commits == {"i" * IMPORTER_BYTES_MAX: 1}
    with pytest.raises(InvalidMetadata, match="importer id of 257 bytes > 256"):
        md.with_commit("i" * (IMPORTER_BYTES_MAX + 1), 1)
    with pytest.raises(InvalidMetadata, match="importer id of 258 bytes"):
        md.with_commit("é" * 129, 1)  # 129 characters, 258 bytes
    with pytest.raises(InvalidMetadata, match="not encodable"):
        md.with_commit("\udc80", 1)
    with pytest.raises(InvalidMetadata, match="non-empty"):
        LogMetadata("orders", (), 5, commits={"": 1})


def test_an_importer_id_stored_before_the_cap_still_decodes_and_its_log_still_changes() -> None:
    """A log whose list holds a longer importer id (stored before the cap) must stay readable:
    every operation on the log, its deletion included, reads the list first."""
    long_id = "i" * (IMPORTER_BYTES_MAX + 44)
    md = decode(_body(format_version=2, commits={long_id: 1}), key=KEY, name="orders")
    assert md.commits == {long_id: 1}
    assert md.with_commit(long_id, 2).commits == {long_id: 2}  # its own next batch
    assert md.with_truncated_before(0).commits == {long_id: 1}  # other changes keep it
    with pytest.raises(InvalidMetadata, match="importer id of 257 bytes > 256"):
        md.with_commit("j" * (IMPORTER_BYTES_MAX + 1), 1)  # a new one is capped


def test_a_commit_tag_goes_with_its_token_and_an_untagged_token_still_decodes() -> None:
    """The tag (a Spark query id) is stored beside the importer's batch id; a token stored before
    tags existed decodes with none, and a new batch without a tag drops the old batch's tag."""
    md = decode(_body(format_version=2, commits={"sink": 4}), key=KEY, name="orders")
    assert (dict(md.commits), dict(md.commit_tags)) == ({"sink": 4}, {})
    tagged = md.with_commit("sink", 5, "query-1").with_commit("other", 1)
    assert decode(encode(tagged), key=KEY, name="orders") == tagged
    assert dict(tagged.commit_tags) == {"sink": "query-1"}
    assert tagged != md.with_commit("sink", 5, "query-2").with_commit("other", 1)
    assert dict(tagged.with_commit("sink", 6).commit_tags) == {}
    assert tagged.with_truncated_before(0).commit_tags == {"sink": "query-1"}
    assert (
        md.with_commit("sink", 5, "q" * COMMIT_TAG_BYTES_MAX).commit_tags["sink"]
        == "q" * COMMIT_TAG_BYTES_MAX
    )
    with pytest.raises(InvalidMetadata, match=f"commit tag of {COMMIT_TAG_BYTES_MAX + 1} bytes"):
        md.with_commit("sink", 5, "q" * (COMMIT_TAG_BYTES_MAX + 1))
    with pytest.raises(MetadataFormatError, match="has no commit token"):
        decode(
            _body(format_version=2, commits={"sink": 4}, commit_tags={"gone": "q"}), key=KEY, name="orders"
        )
    with pytest.raises(MetadataFormatError, match="bad commit tag"):
        decode(_body(format_version=2, commits={"sink": 4}, commit_tags={"sink": 7}), key=KEY, name="orders")
