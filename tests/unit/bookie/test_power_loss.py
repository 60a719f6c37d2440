"""Power loss, simulated at the storage level: the final group's 4 KiB pages persisted in any subset.

A journal holds several synced groups and then a final group. For a power cut before the final
group's fdatasync returned, any subset of its pages may be on disk; each missing page holds its old
contents (zeros past the synced data) or garbage. The bookie must start and serve exactly the records
that were synced; then append and restart cleanly. Damage in an earlier synced group still refuses.
A cut that zeroed anything leaves every ledger in limbo (bookie/limbo.py): what it lacks is "unknown",
never "no such entry" (without metadata, as here, writers' adds go on: nothing to check them against).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bookie import journal_format as fmt
from bookie.index import Location
from bookie.journal import JournalConfig
from bookie.storage import NoEntry, Storage, StorageConfig, Unknown

from .test_storage import add, body, config, patch, start_add

PAGE = 4096
SYNCED = 24  # entries in synced groups (ledger 1, entries 0..23)
FINAL = 30  # entries appended in one tick: the final group
PAYLOAD = b"x" * 900


@dataclass
class Origin:
    path: Path
    final: list[tuple[int, int, int]]  # (segment id, start, end) of each run of the final group
    served: set[int]  # entries that must be served after any tear of the final group
    all_entries: int
    config: StorageConfig
    locations: dict[int, Location]

    def at(self, work: Path) -> StorageConfig:
        return dataclasses.replace(self.config, data_dir=str(work))


async def write_origin(path: Path, journal: JournalConfig | None = None) -> Origin:
    cfg = config(path) if journal is None else dataclasses.replace(config(path), journal=journal)
    storage = await Storage.open(cfg)
    for i in range(6):  # one group each
        await add(storage, 1, i, payload=PAYLOAD)
    for first in range(6, SYNCED, 6):  # groups of several records
        await asyncio.gather(*(add(storage, 1, i, payload=PAYLOAD) for i in range(first, first + 6)))
    start = storage.journal.synced_position
    groups = storage.journal.groups_written
    dones = [  # all in one tick: one group
        start_add(storage, 1, i, body(1, i, i - 1, PAYLOAD)) for i in range(SYNCED, SYNCED + FINAL)
    ]
    await asyncio.gather(*dones)
    end = storage.journal.synced_position
    assert storage.journal.groups_written == groups + 1, "the final adds did not form one group"
    segment_of: dict[int, Location] = {}
    for i in range(SYNCED + FINAL):
        location = storage.ledger(1).index.get(i)
        assert location is not None
        segment_of[i] = location
    storage.abort()
    if start.segment_id == end.segment_id:
        runs = [(start.segment_id, start.offset, end.offset)]
        served = set(range(SYNCED))
    else:  # the final group spans a roll: its first run was synced before the second was written
        first_end = max(
            loc.offset + loc.length for loc in segment_of.values() if loc.segment_id == start.segment_id
        )
        runs = [(start.segment_id, start.offset, first_end), (end.segment_id, 0, end.offset)]
        served = {i for i, loc in segment_of.items() if loc.segment_id == start.segment_id}
    return Origin(path, runs, served, SYNCED + FINAL, cfg, segment_of)  # fmt: skip


def tear(segment: Path, start: int, end: int, present: set[int], garble: bool, rng: random.Random) -> None:
    """Unwrite the pages of ``[start, end)`` not in ``present`` (page numbers from the run's first
    page). Bytes before ``start`` on a shared page were synced earlier and stay."""
    first = start // PAGE
    for page in range((end - 1) // PAGE - first + 1):
        if page in present:
            continue
        lo, hi = max(start, (first + page) * PAGE), min(end, (first + page + 1) * PAGE)
        patch(segment, lo, rng.randbytes(hi - lo) if garble else bytes(hi - lo))


def page_count(start: int, end: int) -> int:
    return (end - 1) // PAGE - start // PAGE + 1


def subsets(pages: int, randoms: int, rng: random.Random) -> Iterator[tuple[str, set[int]]]:
    everything = set(range(pages))
    yield "none", set()
    yield "only-the-last", {pages - 1}
    for missing in range(pages):
        yield f"all-but-{missing}", everything - {missing}
    for n in range(randoms):
        present = {p for p in everything if rng.random() < 0.5}
        if present != everything:
            yield f"random-{n}", present


async def check_starts_and_serves(origin: Origin, work: Path, served: set[int], what: str) -> None:
    storage = await Storage.open(origin.at(work))
    cut = storage.limbo is not None  # anything zeroed: every ledger in limbo
    assert cut == (storage.limbo is not None and storage.limbo.every_ledger), what
    try:
        for i in range(origin.all_entries):
            if i in served:
                assert (await storage.read_entry(1, i))[1] == body(1, i, i - 1, PAYLOAD), (what, i)
            else:
                with pytest.raises(Unknown if cut else NoEntry):
                    await storage.read_entry(1, i)
        nxt = max(served) + 1
        await add(storage, 1, nxt, payload=b"after the power loss")  # the journal goes on from the cut
    finally:
        storage.abort()
    storage = await Storage.open(origin.at(work))
    try:
        assert (await storage.read_entry(1, nxt))[1] == body(1, nxt, nxt - 1, b"after the power loss"), what
        assert storage.ledger(1).index.last_entry_id == nxt, what
        assert (storage.limbo is not None) == cut, what  # the marker outlives the restart
    finally:
        storage.abort()


async def sweep(tmp_path: Path, randoms: int, journal: JournalConfig | None = None) -> int:
    origin = await write_origin(tmp_path / "origin", journal)
    rng = random.Random(20240611)
    segment_id, start, end = origin.final[-1]  # only the last run can be torn (see write_group)
    served = origin.served
    cases = 0
    for name, present in subsets(page_count(start, end), randoms, rng):
        for garble in (False, True):
            work = tmp_path / "work"
            shutil.copytree(origin.path, work)
            tear(work / "journal" / fmt.segment_name(segment_id), start, end, present, garble, rng)
            await check_starts_and_serves(origin, work, served, f"{name} garble={garble}")
            shutil.rmtree(work)
            cases += 1
    return cases


async def test_power_loss_tears_the_final_group_in_any_page_order(tmp_path: Path) -> None:
    assert await sweep(tmp_path, randoms=6) >= 20


@pytest.mark.slow
async def test_power_loss_sweep_many_subsets(tmp_path: Path) -> None:
    assert await sweep(tmp_path, randoms=300) >= 500


SMALL_SEGMENTS = JournalConfig(segment_bytes=40 * 1024, record_bytes_max=8192)


async def test_power_loss_final_group_across_a_segment_roll(tmp_path: Path) -> None:
    """The final group spans a roll: its run in the older segment was synced before the newer one
    was written, so only the newer run is torn, its segment header page included."""
    origin = await write_origin(tmp_path / "origin", SMALL_SEGMENTS)
    assert len(origin.final) == 2, origin.final
    assert SYNCED < len(origin.served) < origin.all_entries  # the older run's records are durable
    rng = random.Random(7)
    segment_id, start, end = origin.final[-1]
    for name, present in subsets(page_count(start, end), 4, rng):
        for garble in (False, True):
            work = tmp_path / "work"
            shutil.copytree(origin.path, work)
            tear(work / "journal" / fmt.segment_name(segment_id), start, end, present, garble, rng)
            await check_starts_and_serves(origin, work, origin.served, f"{name} garble={garble}")
            shutil.rmtree(work)


async def test_power_loss_during_the_older_run_of_a_rolled_group(tmp_path: Path) -> None:
    """The cut came while the older run was being synced: the newer segment was never written."""
    origin = await write_origin(tmp_path / "origin", SMALL_SEGMENTS)
    (old_id, start, end), (new_id, _, new_end) = origin.final
    rng = random.Random(11)
    for name, present in subsets(page_count(start, end), 3, rng):
        work = tmp_path / "work"
        shutil.copytree(origin.path, work)
        patch(work / "journal" / fmt.segment_name(new_id), 0, bytes(new_end))
        tear(work / "journal" / fmt.segment_name(old_id), start, end, present, True, rng)
        await check_starts_and_serves(origin, work, set(range(SYNCED)), name)
        shutil.rmtree(work)


@pytest.mark.parametrize("final_torn", [False, True])
@pytest.mark.parametrize("where", ["record", "group-header"])
async def test_damage_in_an_earlier_synced_group_still_refuses(
    tmp_path: Path, where: str, final_torn: bool
) -> None:
    origin = await write_origin(tmp_path / "origin", None)
    work = tmp_path / "work"
    shutil.copytree(origin.path, work)
    segment = work / "journal" / fmt.segment_name(1)
    if where == "record":  # entry 9: in a synced group of six (entries 6..11)
        patch(segment, origin.locations[9].offset + 300, b"\xde\xad")
    else:  # the GROUP record leading that group
        patch(segment, origin.locations[6].offset - fmt.GROUP_HEADER_BYTES + 14, b"\xde\xad")
    if final_torn:
        _, start, end = origin.final[-1]
        tear(segment, start, end, {page_count(start, end) - 1}, False, random.Random(1))
    with pytest.raises(fmt.JournalCorrupt, match="refusing to start"):
        await Storage.open(config(work))
