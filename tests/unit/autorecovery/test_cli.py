"""The autorecovery commands' bad input: a clear one-line error and exit 1, never a traceback."""

from __future__ import annotations

import pytest

from bookkeeper_aio.cli.main import main


def test_list_with_a_bad_limit(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["autorecovery", "list-underreplicated", "--limit", "0", "--metadata", "memory://"])
    assert code == 1
    err = capsys.readouterr().err
    assert "--limit must be >= 1" in err
    assert "Traceback" not in err


def test_a_root_without_a_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["autorecovery", "status", "--metadata", "memory:///bookkeeper/nothing-here"])
    assert code == 1
    assert "bkaio cluster init" in capsys.readouterr().err


def test_bad_durations_name_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["recover", "b1", "--open-ledger-grace", "-5", "--metadata", "memory://"])
    assert code == 1
    assert "open_ledger_grace_s" in capsys.readouterr().err


def test_bad_metadata_url(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["autorecovery", "enable", "--metadata", "http://nope"])
    assert code == 1
    assert "etcd://" in capsys.readouterr().err
