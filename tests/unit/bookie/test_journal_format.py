"""The journal record format and the replay decision table, byte by byte."""

from __future__ import annotations

import pytest

from bookie import journal_format as fmt


def _segment(records: list[bytes], segment_id: int = 1, zeros: int = 0) -> bytes:
    return fmt.encode_segment_header(segment_id) + b"".join(records) + bytes(zeros)


def _entries(count: int, size: int = 40) -> list[bytes]:
    return [fmt.encode_entry(7, i, bytes([i % 251]) * size) for i in range(count)]


def test_record_round_trip_all_types() -> None:
    records = [
        fmt.encode_entry(1, 2, b"body"),
        fmt.encode_master_key(1, b"k" * 32),
        fmt.encode_fence(1),
        fmt.encode_explicit_lac(1, 5, b"lacbody"),
    ]
    scan = fmt.scan(_segment(records), fmt.SEGMENT_HEADER_BYTES)
    assert scan.tail is fmt.Tail.CLEAN
    assert [r.type for r in scan.records] == [1, 2, 3, 4]
    assert fmt.parse_ledger_entry(scan.records[0].body) == (1, 2)
    assert bytes(scan.records[0].body[fmt.ENTRY_PREFIX_BYTES :]) == b"body"
    assert bytes(scan.records[1].body[8:]) == b"k" * 32
    assert fmt.parse_ledger(scan.records[2].body) == 1
    assert fmt.parse_ledger_entry(scan.records[3].body) == (1, 5)


def test_entry_parts_equal_whole_record() -> None:
    head, body = fmt.encode_entry_parts(3, 4, b"payload")
    assert head + body == fmt.encode_entry(3, 4, b"payload")


def test_preallocated_zeros_are_a_clean_end() -> None:
    records = _entries(5)
    data = _segment(records, zeros=4096)
    scan = fmt.scan(data, fmt.SEGMENT_HEADER_BYTES)
    assert scan.tail is fmt.Tail.CLEAN
    assert len(scan.records) == 5
    assert scan.end == len(data) - 4096


@pytest.mark.parametrize("zeros", [0, 1000])
def test_torn_tail_every_offset_of_last_three_records(zeros: int) -> None:
    records = _entries(50)
    whole = _segment(records)
    starts = [len(whole) - sum(len(r) for r in records[i:]) for i in range(47, 50)]
    for cut in range(starts[0], len(whole)):
        data = whole[:cut] + bytes(zeros)
        scan = fmt.scan(data, fmt.SEGMENT_HEADER_BYTES)
        complete = sum(1 for s in [*starts[1:], len(whole)] if s <= cut) + 47
        assert len(scan.records) == complete, cut
        assert scan.tail in (fmt.Tail.CLEAN, fmt.Tail.TORN), cut
        assert scan.tail is fmt.Tail.CLEAN or scan.end < scan.garbage_end


def test_corrupt_middle_record_followed_by_valid_is_corrupt() -> None:
    records = _entries(10)
    data = bytearray(_segment(records))
    offset = fmt.SEGMENT_HEADER_BYTES + sum(len(r) for r in records[:4]) + 20
    data[offset] ^= 0xFF
    scan = fmt.scan(bytes(data), fmt.SEGMENT_HEADER_BYTES)
    assert scan.tail is fmt.Tail.CORRUPT
    assert len(scan.records) == 4


def test_garbage_without_valid_records_after_is_torn() -> None:
    data = _segment(_entries(3)) + b"\x01\x02garbage" + bytes(100)
    scan = fmt.scan(data, fmt.SEGMENT_HEADER_BYTES)
    assert scan.tail is fmt.Tail.TORN
    assert len(scan.records) == 3


def test_segment_header_checks() -> None:
    assert fmt.check_segment_header(fmt.encode_segment_header(9), 9)
    assert not fmt.check_segment_header(bytes(16), 9)
    assert not fmt.check_segment_header(b"", 9)
    with pytest.raises(fmt.JournalCorrupt):
        fmt.check_segment_header(fmt.encode_segment_header(8), 9)


def test_decode_rejects_huge_declared_length() -> None:
    header = fmt.RECORD_HEADER.pack(fmt.RECORD_MAGIC, 2**32 - 1, 0, 1)
    assert fmt.decode_record_at(header + b"x" * 10, 0) is None


def test_segment_names_round_trip() -> None:
    assert fmt.parse_segment_name(fmt.segment_name(0xABC)) == 0xABC
    assert fmt.parse_segment_name("segment-zz.log") is None
    assert fmt.parse_segment_name("other") is None


@pytest.mark.parametrize("module", ["journal_format", "index", "checkpoint", "cookie"])
def test_pure_modules_do_no_network_or_event_loop_io(module: str) -> None:
    """STYLE habit 1: the record format, index and checkpoint serde are pure cores."""
    import ast
    from pathlib import Path

    import bookie

    source = (Path(bookie.__file__).parent / f"{module}.py").read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"asyncio", "socket", "uvloop", "threading"}, imported
