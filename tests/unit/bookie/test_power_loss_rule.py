"""The replay rule for a power loss, as a decision table: pure, bytes in, verdict out.

After a power loss the final group (written, its fdatasync not returned) may be on disk as any subset
of its pages; it was never acknowledged, so it is cut. Damage followed by a *later* group is damage to
acknowledged data: refuse. Rows marked (old: CORRUPT) were refused by the rule before groups existed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from bookie import journal_format as fmt

SEG = 1
PAGE = 4096


def test_classify_truth_table() -> None:
    assert fmt.classify(nonzero_after_end=False, later_group=False) is fmt.Tail.CLEAN
    assert fmt.classify(nonzero_after_end=False, later_group=True) is fmt.Tail.CLEAN  # never computed
    assert fmt.classify(nonzero_after_end=True, later_group=False) is fmt.Tail.TORN
    assert fmt.classify(nonzero_after_end=True, later_group=True) is fmt.Tail.CORRUPT


class Layout:
    """A segment of groups G0..Gn; ``spans[i]`` = (header offset, end) of group i."""

    def __init__(self, sizes: list[tuple[int, int]], zeros: int = 2 * PAGE) -> None:
        out = bytearray(fmt.encode_segment_header(SEG, 0))
        self.spans: list[tuple[int, int]] = []
        self.record_offsets: list[list[int]] = []
        entry = 0
        for count, size in sizes:
            records = []
            for _ in range(count):
                payload = bytes([entry % 251 + 1]) * size
                records.append(fmt.encode_entry(fmt.LEDGER_ENTRY.pack(9, entry) + payload))
                entry += 1
            start = len(out)
            out += fmt.encode_group_header(SEG, start, sum(len(r) for r in records))
            offsets = []
            for record in records:
                offsets.append(len(out))
                out += record
            self.spans.append((start, len(out)))
            self.record_offsets.append(offsets)
        self.data = out + bytes(zeros)

    def group_entries(self, upto: int) -> int:
        return sum(len(offsets) for offsets in self.record_offsets[:upto])

    def wipe(self, start: int, end: int, garble: bool = False) -> None:
        """Zero ``[start, end)``, or garble it (every byte changed)."""
        if garble:
            self.data[start:end] = bytes(
                b ^ ((i * 131 + 7) % 255 + 1) for i, b in enumerate(self.data[start:end])
            )
        else:
            self.data[start:end] = bytes(end - start)

    def wipe_pages_of_group(self, group: int, pages: list[int], garble: bool = False) -> None:
        """Unwrite the given pages of a group (page numbers relative to the group's first page):
        only the group's own bytes change, as a page holding the previous group's tail was synced."""
        start, end = self.spans[group]
        first = start // PAGE
        for page in pages:
            lo, hi = max(start, (first + page) * PAGE), min(end, (first + page + 1) * PAGE)
            if lo < hi:
                self.wipe(lo, hi, garble)

    def pages_of_group(self, group: int) -> int:
        start, end = self.spans[group]
        return (end - 1) // PAGE - start // PAGE + 1


@dataclass(frozen=True)
class Row:
    name: str
    damage: Callable[[Layout], None]
    tail: fmt.Tail
    whole_groups: int  # groups replayed
    start_group: int = 0  # scan from this group's header (an index checkpoint position)


# Four synced groups of about 3 pages each, then a final group of about 6 pages.
SIZES = [(3, 4000), (2, 5000), (3, 3500), (1, 9000), (6, 4000)]
FINAL = 4


def pages(group: int, *numbers: int, garble: bool = False) -> Callable[[Layout], None]:
    return lambda lay: lay.wipe_pages_of_group(group, list(numbers), garble)


def all_pages_but_last(lay: Layout) -> None:
    lay.wipe_pages_of_group(FINAL, list(range(lay.pages_of_group(FINAL) - 1)))


def all_pages(lay: Layout) -> None:
    lay.wipe_pages_of_group(FINAL, list(range(lay.pages_of_group(FINAL))))


def byte_of_record(group: int, record: int, at: int = 100) -> Callable[[Layout], None]:
    return lambda lay: lay.wipe(
        lay.record_offsets[group][record] + at, lay.record_offsets[group][record] + at + 1, True
    )


def byte_of_header(group: int, at: int) -> Callable[[Layout], None]:
    return lambda lay: lay.wipe(lay.spans[group][0] + at, lay.spans[group][0] + at + 1, True)


def final_prefix(lay: Layout) -> None:
    lay.wipe(lay.spans[FINAL][0] + 5000, len(lay.data))


def file_ends_in_final(lay: Layout) -> None:
    del lay.data[lay.spans[FINAL][1] - 10 :]


def damage_3_lose_final_header(lay: Layout) -> None:
    byte_of_record(3, 0)(lay)
    lay.wipe_pages_of_group(FINAL, [0])


ROWS = [
    Row("intact", lambda lay: None, fmt.Tail.CLEAN, 5),
    Row("final group: a prefix (process crash)", final_prefix, fmt.Tail.TORN, 4),
    Row("final group: file ends inside it", file_ends_in_final, fmt.Tail.TORN, 4),
    Row("final group: a middle page zero (old: CORRUPT)", pages(FINAL, 2), fmt.Tail.TORN, 4),
    Row("final group: a middle page garbled (old: CORRUPT)", pages(FINAL, 2, garble=True), fmt.Tail.TORN, 4),
    Row("final group: header page zero, later pages there (old: CORRUPT)", pages(FINAL, 0), fmt.Tail.TORN, 4),
    Row("final group: header page garbled (old: CORRUPT)", pages(FINAL, 0, garble=True), fmt.Tail.TORN, 4),
    Row("final group: only its last page (old: CORRUPT)", all_pages_but_last, fmt.Tail.TORN, 4),
    Row("final group: all pages lost", all_pages, fmt.Tail.CLEAN, 4),
    Row("final group: its GROUP record damaged (old: CORRUPT)", byte_of_header(FINAL, 20), fmt.Tail.TORN, 4),
    Row("final group torn, scan from group 2", pages(FINAL, 1, 3), fmt.Tail.TORN, 4, start_group=2),
    Row("synced group: a record garbled, later groups follow", byte_of_record(2, 1), fmt.Tail.CORRUPT, 2),
    Row("synced group: GROUP record garbled, later groups", byte_of_header(2, 15), fmt.Tail.CORRUPT, 2),
    Row("synced group: a whole page zeroed", pages(1, 1), fmt.Tail.CORRUPT, 1),
    Row("synced group: its whole extent zeroed", lambda lay: lay.wipe(*lay.spans[3]), fmt.Tail.CORRUPT, 3),
    Row("synced group damaged, the only later group intact", byte_of_record(3, 0), fmt.Tail.CORRUPT, 3),
    Row("synced group damaged, final header lost", damage_3_lose_final_header, fmt.Tail.CORRUPT, 3),
]  # fmt: skip


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_decision_table(row: Row) -> None:
    layout = Layout(SIZES)
    row.damage(layout)
    start = layout.spans[row.start_group][0]
    scan = fmt.scan(bytes(layout.data), start, SEG)
    assert scan.tail is row.tail, (scan.bad, scan.evidence)
    assert scan.groups == row.whole_groups - row.start_group
    expected_entries = layout.group_entries(row.whole_groups) - layout.group_entries(row.start_group)
    assert len(scan.records) == expected_entries
    end = layout.spans[row.whole_groups - 1][1] if row.whole_groups else fmt.SEGMENT_HEADER_BYTES
    assert scan.end == end  # appends (and the cut) start at the end of the last whole group
    if scan.tail is fmt.Tail.CORRUPT:
        assert scan.evidence >= scan.end


def test_a_group_header_found_elsewhere_than_it_names_is_no_evidence() -> None:
    """Bytes that form a valid GROUP record inside the final group's payload (a client can send any
    bytes) do not make a torn final group look like corruption unless they name the very place they
    lie at (then replay refuses: the safe direction)."""
    for names_its_place, tail in [(False, fmt.Tail.TORN), (True, fmt.Tail.CORRUPT)]:
        layout = Layout(SIZES)
        layout.wipe_pages_of_group(FINAL, [0])
        at = layout.record_offsets[FINAL][3] + 200
        fake = fmt.encode_group_header(SEG, at if names_its_place else at + 1, 10)
        layout.data[at : at + len(fake)] = fake
        scan = fmt.scan(bytes(layout.data), fmt.SEGMENT_HEADER_BYTES, SEG)
        assert scan.tail is tail
        assert scan.end == layout.spans[FINAL][0]
