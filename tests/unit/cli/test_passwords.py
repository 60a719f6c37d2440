"""Ledger passwords from a file or the environment, not only the command line (which every local
user reads in `ps`): every command that takes --password takes --password-file and
$BKAIO_PASSWORDS, through one helper; a file others may read is refused."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from bookkeeper_aio.cli import passwords as cli_passwords
from bookkeeper_aio.cli.main import _parser
from bookkeeper_aio.cli.passwords import PASSWORDS_ENV, PasswordSourceError, passwords, split_lines

SINGLE = [
    ["ledger", "read", "5"],
    ["ledger", "delete", "5"],
    ["log", "tail", "events"],
    ["log", "truncate", "events", "--before", "7"],
]
MANY = [["autorecovery", "run"], ["recover", "bookie-1"], ["decommission", "bookie-1"]]


@pytest.fixture(autouse=True)
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PASSWORDS_ENV, raising=False)


def _file(tmp_path: Path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / "passwords"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def _parse(*argv: str) -> argparse.Namespace:
    return _parser().parse_args(list(argv))


@pytest.mark.parametrize("command", SINGLE + MANY, ids=" ".join)
def test_every_password_command_takes_a_file_and_the_environment(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    many = command in MANY
    path = _file(tmp_path, "tenant-a\n")
    assert passwords(_parse(*command, "--password-file", path), many=many) == (b"tenant-a",)
    monkeypatch.setenv(PASSWORDS_ENV, "from-env\n")
    assert passwords(_parse(*command), many=many) == (b"from-env",)
    # The command line wins over the environment; without any, the empty password.
    assert passwords(_parse(*command, "--password", "argv"), many=many) == (b"argv",)
    monkeypatch.delenv(PASSWORDS_ENV)
    assert passwords(_parse(*command), many=many) == (b"",)
    # The command's help says why the file is better.
    help_text = _command_help(command)
    assert "--password-file" in help_text
    assert PASSWORDS_ENV in help_text


def _command_help(command: list[str]) -> str:
    """The help of the (sub)command ``command`` names."""
    parser = _parser()
    for name in command:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions or name not in actions[0].choices:
            break
        parser = actions[0].choices[name]
    return parser.format_help()


def test_a_file_others_may_read_is_refused_with_what_to_run(tmp_path: Path) -> None:
    for mode in (0o644, 0o640, 0o604, 0o620):
        path = _file(tmp_path, "secret\n", mode)
        with pytest.raises(PasswordSourceError, match=r"chmod 600") as caught:
            passwords(_parse("autorecovery", "run", "--password-file", path), many=True)
        assert "secret" not in str(caught.value)
        assert oct(mode)[2:] in str(caught.value)
    with pytest.raises(FileNotFoundError):
        passwords(_parse("ledger", "read", "1", "--password-file", str(tmp_path / "none")), many=False)
    with pytest.raises(PasswordSourceError, match="no password"):
        passwords(_parse("ledger", "read", "1", "--password-file", _file(tmp_path, "")), many=False)
    os.mkfifo(tmp_path / "fifo", 0o600)  # no writer: refused at once, not waited on
    with pytest.raises(PasswordSourceError, match="not a regular file"):
        passwords(_parse("ledger", "read", "1", "--password-file", str(tmp_path / "fifo")), many=False)


def test_the_daemon_takes_many_one_per_line_and_the_options_add_up(tmp_path: Path) -> None:
    path = _file(tmp_path, "\ntenant-a\ntenant-b\n")  # an empty line: the empty password
    got = passwords(_parse("autorecovery", "run", "--password-file", path, "--password", "argv"), many=True)
    assert got == (b"argv", b"", b"tenant-a", b"tenant-b")


def test_a_single_password_command_refuses_several(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _file(tmp_path, "one\ntwo\n")
    with pytest.raises(PasswordSourceError, match="takes one"):
        cli_passwords.password(_parse("ledger", "delete", "3", "--password-file", path))
    with pytest.raises(PasswordSourceError, match="takes one"):
        cli_passwords.password(_parse("ledger", "delete", "3", "--password", "a", "--password", "b"))
    monkeypatch.setenv(PASSWORDS_ENV, "one\ntwo")
    with pytest.raises(PasswordSourceError, match=PASSWORDS_ENV):
        cli_passwords.password(_parse("log", "tail", "x"))


def test_lines() -> None:
    assert split_lines("") == []
    assert split_lines("pw") == ["pw"]
    assert split_lines("pw\n") == ["pw"]
    assert split_lines("\n") == [""]
    assert split_lines("a b \nc\n\n") == ["a b ", "c", ""]
