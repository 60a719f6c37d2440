"""The journal record format and the replay decision table, byte by byte."""

from __future__ import annotations

import pytest

from bookie import journal_format as fmt


def _segment(groups: list[list[bytes]], segment_id: int = 1, zeros: int = 0) -> bytes:
    """A segment as the journal writes it: the header, then each group led by its GROUP header."""
    out = fmt.encode_segment_header(segment_id, 0)
    for records in groups:
        out += fmt.encode_group_header(segment_id, len(out), sum(len(r) for r in records))
        out += b"".join(records)
    return out + bytes(zeros)


def _body(ledger_id: int, entry_id: int, payload: bytes) -> bytes:
    """An entry body as the add path takes it: it starts with its ids (protocol/digest.py)."""
    return fmt.LEDGER_ENTRY.pack(ledger_id, entry_id) + payload


def _entries(count: int, size: int = 40) -> list[bytes]:
    return [fmt.encode_entry(_body(7, i, bytes([i % 251]) * size)) for i in range(count)]


def _scan(data: bytes, segment_id: int = 1) -> fmt.ScanResult:
    return fmt.scan(data, fmt.SEGMENT_HEADER_BYTES, segment_id)


def test_record_round_trip_all_types() -> None:
    records = [
        fmt.encode_entry(_body(1, 2, b"body")),
        fmt.encode_master_key(1, b"k" * 32),
        fmt.encode_fence(1),
        fmt.encode_explicit_lac(1, 5, b"lacbody"),
        fmt.encode_entry_v2(1, 3, _body(1, 3, b"old")),
    ]
    scan = _scan(_segment([records]))
    assert scan.tail is fmt.Tail.CLEAN
    assert scan.groups == 1
    assert [r.type for r in scan.records] == [7, 2, 3, 4, 1]  # the group header is not a record
    assert fmt.parse_ledger_entry(scan.records[0].body) == (1, 2)
    assert bytes(fmt.entry_of(scan.records[0])) == _body(1, 2, b"body")
    assert bytes(scan.records[1].body[8:]) == b"k" * 32
    assert fmt.parse_ledger(scan.records[2].body) == 1
    assert fmt.parse_ledger_entry(scan.records[3].body) == (1, 5)
    assert fmt.parse_ledger_entry(scan.records[4].body) == (1, 3)  # format 2: the ids come first too
    assert bytes(fmt.entry_of(scan.records[4])) == _body(1, 3, b"old")


@pytest.mark.parametrize("size", [0, 1, 1000, 70_000])
def test_entry_head_and_body_equal_whole_record(size: int) -> None:
    body = _body(3, 4, bytes(i & 0xFF for i in range(size)))
    head = fmt.encode_entry_head(body)
    assert len(head) + len(body) == fmt.ENTRY_RECORD_OVERHEAD_BYTES + len(body)
    assert head + body == fmt.encode_entry(body)
    record = fmt.decode_record_at(head + body, 0)
    assert record is not None
    assert record.type == fmt.RecordType.ENTRY
    assert bytes(fmt.entry_of(record)) == body


def test_entry_record_parts_are_each_bodys_head_and_body() -> None:
    """The add path's batch of ENTRY records (``entry_record_parts``) is, body by body, the record
    ``encode_entry`` makes: its head, then the body itself (not a copy)."""
    bodies = [
        _body(3, entry_id, bytes([entry_id]) * size) for entry_id, size in enumerate([0, 1, 1000, 70_000, 5])
    ]
    parts = list(fmt.entry_record_parts(bodies))
    assert len(parts) == 2 * len(bodies)
    assert parts[0::2] == [fmt.encode_entry_head(body) for body in bodies]
    assert all(part is body for part, body in zip(parts[1::2], bodies, strict=True))
    assert b"".join(parts) == b"".join(fmt.encode_entry(body) for body in bodies)
    assert list(fmt.entry_record_parts([])) == []


def test_an_entry_record_is_checked_whole_whichever_field_is_damaged() -> None:
    """A format-3 ENTRY record's CRC32C is its body's alone: a change of any one of its bytes
    (magic, length, checksum, type, the ids at the body's start, the rest of the body) still makes
    it no valid record, and so does a format-2 record's. A body too short to hold its ids is none."""
    entry = _body(5, 6, b"x" * 40)
    for record in (fmt.encode_entry(entry), fmt.encode_entry_v2(5, 6, entry)):
        assert fmt.decode_record_at(record + bytes(8), 0) is not None
        for i in range(len(record)):
            for bit in (0x01, 0x80):
                damaged = bytearray(record + bytes(8))
                damaged[i] ^= bit
                assert fmt.decode_record_at(bytes(damaged), 0) is None, (record[12], i, bit)
    with pytest.raises(ValueError, match="does not hold its ids"):
        fmt.encode_entry(b"short")
    short = fmt.encode_record(fmt.RecordType.ENTRY, b"short")  # what a checksum alone would pass
    assert fmt.decode_record_at(short, 0) is None


def test_entry_bodies__every_record_checked_like_the_decoder() -> None:
    """``entry_bodies`` (a read's check of the records the index points at) takes a record exactly
    when ``decode_record_at`` finds a valid ENTRY record of the entry wanted there, and stops at
    the first that is not: every byte of a record flipped, a wrong ledger or entry, a cut."""
    # a stripe (step 3), in both formats: compaction copies format-2 records as they are
    records = [
        fmt.encode_entry(entry) if i % 2 else fmt.encode_entry_v2(7, i, entry)
        for i, entry in ((i, _body(7, i, bytes([i]) * 50)) for i in range(0, 12, 3))
    ]
    offsets, at = [], 100
    for record in records:
        offsets.append(at)
        at += len(record) + 5  # other bytes between them
    data = bytearray(at)
    for offset, record in zip(offsets, records, strict=True):
        data[offset - 100 : offset - 100 + len(record)] = record
    out: list[memoryview] = []
    assert fmt.entry_bodies(memoryview(bytes(data)), offsets, 100, 7, 0, 3, out)
    assert [bytes(b) for b in out] == [_body(7, i, bytes([i]) * 50) for i in range(0, 12, 3)]
    for ledger_id, first, step in ((8, 0, 3), (7, 1, 3), (7, 0, 1)):
        out = []
        assert not fmt.entry_bodies(memoryview(bytes(data)), offsets, 100, ledger_id, first, step, out)
        assert len(out) == (1 if step == 1 else 0)  # (7, 0, 1): entry 0 right, 1 wanted next
    for k in (1, 2):  # format 3, then format 2
        at = offsets[k] - 100
        for i in range(len(records[k])):
            damaged = bytearray(data)
            damaged[at + i] ^= 0x10
            out = []
            assert not fmt.entry_bodies(memoryview(bytes(damaged)), offsets, 100, 7, 0, 3, out)
            assert len(out) == k
            assert fmt.decode_record_at(bytes(damaged), at) is None  # the same verdict
    second = offsets[1] - 100
    out = []
    cut = memoryview(bytes(data[: second + len(records[1]) - 1]))
    assert not fmt.entry_bodies(cut, offsets, 100, 7, 0, 3, out)
    assert len(out) == 1


def test_group_header_names_its_own_place() -> None:
    header = fmt.encode_group_header(3, 4096, 1234)
    assert len(header) == fmt.GROUP_HEADER_BYTES
    data = bytes(4096) + header
    assert fmt.group_length_at(data, 4096, 3) == 1234
    assert fmt.group_length_at(data, 4096, 4) is None  # another segment's header
    assert fmt.group_length_at(bytes(100) + header, 100, 3) is None  # found elsewhere than it says


def test_preallocated_zeros_are_a_clean_end() -> None:
    data = _segment([[r] for r in _entries(5)], zeros=4096)
    scan = _scan(data)
    assert scan.tail is fmt.Tail.CLEAN
    assert len(scan.records) == 5
    assert scan.end == len(data) - 4096


@pytest.mark.parametrize("length", [0, 1, 63, 64, 65, 4096, (1 << 16) - 1, 1 << 16, (1 << 16) + 1, 200_000])
def test_the_end_of_the_non_zero_bytes_is_found_at_every_place(length: int) -> None:
    """The zero scan (chunks compared whole, the zero tail narrowed by halves) agrees with a plain
    rstrip for a last non-zero byte at each place, from any start."""
    for last in sorted({0, 1, length // 3, length // 2, length - 65, length - 64, length - 2, length - 1}):
        if not 0 <= last < length:
            continue
        data = bytearray(length)
        data[last] = 7
        if last > 10:
            data[last - 10] = 1  # a non-zero byte before it changes nothing
        for start in (0, min(last, 5), last, last + 1):
            want = max(start, len(bytes(data).rstrip(b"\x00")))
            assert fmt._last_nonzero(bytes(data), start) == want, (length, last, start)
    assert fmt.is_all_zero(bytes(length))
    assert fmt._last_nonzero(bytes(length), 0) == 0


@pytest.mark.parametrize("zeros", [0, 1000])
def test_torn_tail_every_offset_of_last_three_groups(zeros: int) -> None:
    """A process crash: the final group is a prefix of what was written (one record per group)."""
    records = _entries(50)
    whole = _segment([[r] for r in records])
    group_bytes = [fmt.GROUP_HEADER_BYTES + len(r) for r in records]
    starts = [len(whole) - sum(group_bytes[i:]) for i in range(47, 50)]
    for cut in range(starts[0], len(whole)):
        scan = _scan(whole[:cut] + bytes(zeros))
        complete = sum(1 for s in [*starts[1:], len(whole)] if s <= cut) + 47
        assert len(scan.records) == complete, cut
        assert scan.tail in (fmt.Tail.CLEAN, fmt.Tail.TORN), cut
        assert scan.tail is fmt.Tail.CLEAN or scan.end < scan.garbage_end


def test_corrupt_record_before_a_later_group_is_corrupt() -> None:
    records = _entries(10)
    data = bytearray(_segment([[r] for r in records]))
    offset = fmt.SEGMENT_HEADER_BYTES + sum(fmt.GROUP_HEADER_BYTES + len(r) for r in records[:4])
    data[offset + fmt.GROUP_HEADER_BYTES + 20] ^= 0xFF
    scan = _scan(bytes(data))
    assert scan.tail is fmt.Tail.CORRUPT
    assert len(scan.records) == 4
    assert scan.end == offset


def test_garbage_without_valid_records_after_is_torn() -> None:
    data = _segment([[r] for r in _entries(3)]) + b"\x01\x02garbage" + bytes(100)
    scan = _scan(data)
    assert scan.tail is fmt.Tail.TORN
    assert len(scan.records) == 3


def test_segment_header_checks() -> None:
    assert fmt.check_segment_header(fmt.encode_segment_header(9, 0), 9) is fmt.SegmentHeader.VALID
    assert fmt.check_segment_header(bytes(16), 9) is fmt.SegmentHeader.ZERO
    assert fmt.check_segment_header(b"", 9) is fmt.SegmentHeader.ZERO
    assert fmt.check_segment_header(b"\x07" * 16, 9) is fmt.SegmentHeader.GARBLED
    with pytest.raises(fmt.JournalCorrupt, match="names segment"):
        fmt.check_segment_header(fmt.encode_segment_header(8, 0), 9)
    for segment_id in (1, 9, 256, 2**40):  # a header write cut short (simulation race seed 2677)
        header = fmt.encode_segment_header(segment_id, 0)
        for kept in range(1, fmt.SEGMENT_HEADER_BYTES):
            torn = header[:kept] + bytes(4096 - kept)
            if any(torn[:16]):
                assert fmt.check_segment_header(torn, segment_id) is fmt.SegmentHeader.GARBLED, kept
        format_2 = fmt.SEGMENT_HEADER.pack(fmt.SEGMENT_MAGIC, 2, segment_id)  # torn before the upgrade
        for kept in range(6, fmt.SHORT_SEGMENT_HEADER_BYTES):
            torn = format_2[:kept] + bytes(4096 - kept)
            if torn[:16] != format_2:
                assert fmt.check_segment_header(torn, segment_id) is fmt.SegmentHeader.GARBLED, kept
    for version in (2, 3):
        header = fmt.SEGMENT_HEADER.pack(fmt.SEGMENT_MAGIC, version, 9)
        assert fmt.check_segment_header(header, 9) is fmt.SegmentHeader.VALID
        assert fmt.segment_format(header) == version
    assert fmt.segment_format(fmt.encode_segment_header(9, 0)) == fmt.SEGMENT_VERSION == 4
    assert fmt.segment_format(bytes(16)) == fmt.SEGMENT_VERSION  # not ours: rewritten with its first group
    for version in (1, 5):
        other = fmt.SEGMENT_HEADER.pack(fmt.SEGMENT_MAGIC, version, 9)
        with pytest.raises(
            fmt.JournalFormatUnsupported,
            match=rf"format version {version}; this bookie reads versions \[2, 3, 4\]",
        ):
            fmt.check_segment_header(other, 9)


def test_a_version_4_header_records_the_previous_end_under_its_checksum() -> None:
    header = fmt.encode_segment_header(9, 70_001)
    assert len(header) == fmt.SEGMENT_HEADER_BYTES == 24
    data = header + bytes(100)
    assert fmt.check_segment_header(data, 9) is fmt.SegmentHeader.VALID
    assert fmt.segment_layout(data) == (fmt.SEGMENT_HEADER_BYTES, 70_001)
    assert fmt.segment_layout(fmt.encode_segment_header(1, 0)) == (fmt.SEGMENT_HEADER_BYTES, 0)
    for at in range(16, fmt.SEGMENT_HEADER_BYTES):  # a flipped bit in the previous end or the CRC
        damaged = bytearray(data)
        damaged[at] ^= 0x10
        assert fmt.check_segment_header(damaged, 9) is fmt.SegmentHeader.GARBLED, at


@pytest.mark.parametrize("version", [2, 3])
def test_a_short_header_of_an_older_version_is_read_and_records_no_previous_end(version: int) -> None:
    data = fmt.SEGMENT_HEADER.pack(fmt.SEGMENT_MAGIC, version, 9) + bytes(100)
    assert fmt.check_segment_header(data, 9) is fmt.SegmentHeader.VALID
    assert fmt.segment_layout(data) == (fmt.SHORT_SEGMENT_HEADER_BYTES, 0)
    torn = fmt.SEGMENT_HEADER.pack(fmt.SEGMENT_MAGIC, version, 9)[:10] + bytes(100)
    assert fmt.check_segment_header(torn, 9) is fmt.SegmentHeader.GARBLED


def test_decode_rejects_huge_declared_length() -> None:
    header = fmt.RECORD_HEADER.pack(fmt.RECORD_MAGIC, 2**32 - 1, 0, 1)
    assert fmt.decode_record_at(header + b"x" * 10, 0) is None


def test_segment_names_round_trip() -> None:
    assert fmt.parse_segment_name(fmt.segment_name(0xABC)) == 0xABC
    assert fmt.parse_segment_name("segment-zz.log") is None
    assert fmt.parse_segment_name("other") is None


@pytest.mark.parametrize("module", ["journal_format", "index", "checkpoint", "cookie"])
def test_pure_modules_do_no_network_or_event_loop_io(module: str) -> None:
    """Pure cores: the record format, index and checkpoint serde are pure cores."""
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
