"""What proves a registration found under our bookie id was left by our own dead previous incarnation."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bookie.cookie import BOOT_ID_PATH, lock_identity
from bookie.fileio import OS_FILE_IO
from bookie.registration import MetadataRegistration
from metadata import BookieInfo

needs_boot_id = pytest.mark.skipif(not Path(BOOT_ID_PATH).exists(), reason="no kernel boot id (not Linux)")


@needs_boot_id
def test_lock_identity_names_the_lock_file_not_the_contents(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    fd = OS_FILE_IO.lock_dir(str(data))
    try:
        identity = lock_identity(str(data))
        assert identity
        assert lock_identity(str(data)) == identity  # stable while the file lives
        shutil.copytree(data, tmp_path / "copy")
        assert lock_identity(str(tmp_path / "copy")) != identity  # a copy is another bookie
    finally:
        OS_FILE_IO.close(fd)
    assert lock_identity(str(data)) == identity  # the same file after its holder is gone


def test_no_boot_id_or_no_lock_proves_nothing(tmp_path: Path) -> None:
    (tmp_path / "LOCK").touch()
    assert lock_identity(str(tmp_path), boot_id_path=str(tmp_path / "missing")) == ""
    assert lock_identity(str(tmp_path / "nowhere")) == ""


def _found(**attributes: str) -> BookieInfo:
    return BookieInfo("b1", "127.0.0.1", 3181, attributes=attributes)


def test_previous_self_needs_the_same_instance_and_the_same_lock() -> None:
    registration = MetadataRegistration("etcd://127.0.0.1:1/x")
    assert not registration._is_previous_self(_found())  # verify() not run: nothing known
    registration._instance_id, registration._lock_identity = "inst", "boot:1:2"
    assert registration._is_previous_self(_found(instance_id="inst", data_dir_lock="boot:1:2"))
    assert not registration._is_previous_self(_found(instance_id="inst", data_dir_lock="boot:1:3"))
    assert not registration._is_previous_self(_found(instance_id="other", data_dir_lock="boot:1:2"))
    assert not registration._is_previous_self(_found(instance_id="inst"))  # an older bookie
