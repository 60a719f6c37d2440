"""The bookie's files hold ledgers' master keys: every file it creates is 0600 and every directory
0700, whatever the umask lets through, and a data dir others may enter is warned about at start."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from bookie import limbo
from bookie.fileio import OS_FILE_IO
from bookie.storage import Storage

from .test_storage import KEY, add, config

LEDGER = 7


@pytest.fixture
def common_umask() -> Iterator[None]:
    """The usual default umask (0022): it lets 0644 files and 0755 directories through."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def modes(root: Path) -> dict[str, int]:
    found = {str(root): stat.S_IMODE(root.stat().st_mode)}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(dirpath, name)
            found[str(path.relative_to(root))] = stat.S_IMODE(path.stat().st_mode)
    return found


async def test_every_file_and_directory_of_a_data_dir_is_private(tmp_path: Path, common_umask: None) -> None:
    data_dir = tmp_path / "bookie"
    storage = await Storage.open(config(data_dir))
    await add(storage, LEDGER, 0, key=KEY)
    assert await storage.checkpoint()
    await storage.close()
    limbo.enter_blocking(OS_FILE_IO, str(data_dir), "test: the marker's mode")
    # a temp copy a crash left behind with the old default mode is tightened when reused
    leftover = data_dir / "COOKIE.tmp"
    leftover.write_bytes(b"old")
    leftover.chmod(0o644)
    OS_FILE_IO.write_file_atomic(str(data_dir / "COOKIE"), (data_dir / "COOKIE").read_bytes())

    found = modes(data_dir)
    files = [path for path in found if (data_dir / path).is_file()]
    # the journal (which holds the master key), the checkpoint, cookie, lock, synced mark, limbo marker
    assert any(path.startswith("journal") for path in files), found
    assert KEY in b"".join((data_dir / path).read_bytes() for path in files if path.startswith("journal"))
    for name in ("COOKIE", "LOCK", "limbo", "synced"):
        assert name in files, found
    assert any(path.startswith("index") for path in files), found
    shared = {path: oct(mode) for path, mode in found.items() if mode & 0o077}
    assert not shared, f"group/other may read: {shared}"
    assert all(found[path] == 0o600 for path in files), found
    assert all(mode == 0o700 for path, mode in found.items() if path not in files), found


async def test_a_data_dir_others_may_enter_is_warned_about_at_start(
    tmp_path: Path, common_umask: None
) -> None:
    data_dir = tmp_path / "bookie"
    data_dir.mkdir(mode=0o755)
    with capture_logs() as logs:
        storage = await Storage.open(config(data_dir))
        await storage.close()
    warnings = [entry for entry in logs if entry["event"] == "fileio.dir_not_private"]
    assert len(warnings) == 1, logs
    assert warnings[0]["path"] == str(data_dir)
    assert warnings[0]["mode"] == "0o755"
    assert warnings[0]["fix"] == f"chmod -R go-rwx {data_dir}"

    data_dir.chmod(0o700)
    with capture_logs() as logs:
        storage = await Storage.open(config(data_dir))
        await storage.close()
    assert not [entry for entry in logs if entry["event"] == "fileio.dir_not_private"]
