"""A data dir whose COOKIE stayed but whose journal or index went (bookie/cookie.py): the bookie must
not come back empty under its old identity, answering "no such entry" for entries it acknowledged
(docs/protocol.md, the absence rule). Real files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from bookie import journal_format as fmt
from bookie.cookie import COOKIE_FILE, JOURNAL_CREATED, DataDirWiped, holds_data
from bookie.fileio import OS_FILE_IO
from bookie.storage import NoLedger, Storage

from .test_storage import add, body, config


def cookie(path: Path) -> dict[str, object]:
    return json.loads((path / COOKIE_FILE).read_text())  # type: ignore[no-any-return]


async def test_a_first_start_makes_the_journal_it_vouches_for_before_saying_so(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    storage.abort()
    assert cookie(tmp_path)[JOURNAL_CREATED] is True
    assert os.listdir(tmp_path / "journal") == [fmt.segment_name(1)]  # empty, never written
    assert (tmp_path / "index").is_dir()
    assert not holds_data(OS_FILE_IO, str(tmp_path))  # registers as a bookie holding nothing
    storage = await Storage.open(config(tmp_path))  # and starts again, written to or not
    await add(storage, 1, 0)
    await storage.close()
    assert holds_data(OS_FILE_IO, str(tmp_path))


@pytest.mark.parametrize("wipe", ["journal and index", "journal", "index", "their files"])
async def test_a_data_dir_wiped_but_its_cookie_refuses_to_start(tmp_path: Path, wipe: str) -> None:
    storage = await Storage.open(config(tmp_path))
    await add(storage, 1, 0)
    await storage.close()
    if wipe == "their files":  # the directories kept, emptied
        for directory in ("journal", "index"):
            for name in os.listdir(tmp_path / directory):
                os.remove(tmp_path / directory / name)
    else:
        for directory in wipe.split(" and "):
            shutil.rmtree(tmp_path / directory)
    with pytest.raises(DataDirWiped, match="wiped or lost") as refused:
        await Storage.open(config(tmp_path))
    assert "wipe the whole data dir (COOKIE included)" in str(refused.value)
    assert "bkaio decommission bookie-1" in str(refused.value)


async def test_a_cookie_from_before_the_field_keeps_starting_and_gets_it(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    await add(storage, 1, 0)
    await storage.close()
    old = cookie(tmp_path)
    del old[JOURNAL_CREATED]
    (tmp_path / COOKIE_FILE).write_text(json.dumps(old))
    storage = await Storage.open(config(tmp_path))
    assert (await storage.read_entry(1, 0))[1] == body(1, 0, -1)
    await storage.close()
    assert cookie(tmp_path)[JOURNAL_CREATED] is True
    assert cookie(tmp_path)["instance_id"] == old["instance_id"]
    shutil.rmtree(tmp_path / "journal")  # protected from now on
    with pytest.raises(DataDirWiped):
        await Storage.open(config(tmp_path))


async def test_a_first_start_cut_short_before_the_field_starts_again(tmp_path: Path) -> None:
    """A crash after the cookie was written and before the journal was made (the field comes last):
    the next start makes it, as a first start would."""
    storage = await Storage.open(config(tmp_path))
    storage.abort()
    first = cookie(tmp_path)
    del first[JOURNAL_CREATED]
    (tmp_path / COOKIE_FILE).write_text(json.dumps(first))
    shutil.rmtree(tmp_path / "journal")
    shutil.rmtree(tmp_path / "index")
    storage = await Storage.open(config(tmp_path))
    with pytest.raises(NoLedger):
        await storage.read_entry(1, 0)
    await add(storage, 1, 0)
    await storage.close()
    assert cookie(tmp_path)[JOURNAL_CREATED] is True
