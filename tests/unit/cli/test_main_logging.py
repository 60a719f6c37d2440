"""``bkaio``'s log level: a failing command prints its one clear line, not the client's JSON log
lines above it; ``-v`` (or ``--log-level``, or ``$BKAIO_LOG_LEVEL``) shows them. A bad value (of an
option, a variable, a URL) is one line too, never a traceback or "a bug"."""

from __future__ import annotations

from pathlib import Path

import pytest

from bookkeeper_aio.cli import main as cli_main


def test_the_default_is_error_and_v_raises_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BKAIO_LOG_LEVEL", raising=False)
    assert cli_main.log_level(None, 0) == "error"
    assert [cli_main.log_level(None, n) for n in (1, 2, 3, 4)] == ["warning", "info", "debug", "debug"]
    assert cli_main.log_level("info", 3) == "info"  # --log-level wins
    assert cli_main.log_level(None, 0, daemon=True) == "warning"  # autorecovery run: its log matters
    monkeypatch.setenv("BKAIO_LOG_LEVEL", "debug")
    assert cli_main.log_level(None, 0) == "debug"


def test_main_configures_the_level_before_running(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BKAIO_LOG_LEVEL", raising=False)
    seen: list[str | None] = []
    monkeypatch.setattr(cli_main, "configure_logging", lambda level=None: seen.append(level))
    assert cli_main.main(["bench", "write", "--size", "0"]) == 2  # a usage error, after logging is set
    assert cli_main.main(["-vv", "bench", "write", "--size", "0"]) == 2
    assert seen == ["error", "info"]


def test_a_closed_stdout_ends_quietly_with_141(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bkaio cluster init | head -1``: no BrokenPipeError traceback."""
    from bookkeeper_aio.cli import shell

    async def closed(args: object) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(shell, "cmd_cluster_init", closed)
    assert cli_main.main(["cluster", "init", "--metadata", "etcd://127.0.0.1:1/x"]) == 141
    assert "Traceback" not in capsys.readouterr().err


def test_an_unreachable_etcd_says_what_to_check(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import metadata
    from bookkeeper_aio.cli import shell

    async def unreachable(args: object) -> int:
        raise metadata.MetadataUnavailable("no etcd endpoint reachable of ['127.0.0.1:1'] in time")

    monkeypatch.setattr(shell, "cmd_simpletest", unreachable)
    assert cli_main.main(["simpletest", "--metadata", "etcd://127.0.0.1:1/x"]) == 1
    err = capsys.readouterr().err
    assert "bkaio simpletest: MetadataUnavailable: no etcd endpoint reachable" in err
    assert "check that etcd runs at the URL's HOST:PORT" in err


def test_a_bare_timeout_says_what_timed_out_and_what_to_check(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A TimeoutError has no text of its own (``asyncio.timeout``): before, the line read
    ``bkaio ledgers: TimeoutError: `` and nothing after it."""
    from bookkeeper_aio.cli import shell

    async def times_out(args: object) -> int:
        raise TimeoutError

    monkeypatch.setattr(shell, "cmd_ledgers", times_out)
    assert cli_main.main(["ledgers", "--metadata", "memory:///x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "bkaio ledgers: TimeoutError: an operation got no answer in time" in err
    assert "check that etcd runs at the URL's HOST:PORT" in err


def test_a_lost_metadata_answer_says_to_look_before_retrying(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import metadata
    from bookkeeper_aio.cli import shell

    async def lost(args: object) -> int:
        raise metadata.CasResultUnknown("/x/ledgers/7", "etcd UNAVAILABLE: connection reset")

    monkeypatch.setattr(shell, "cmd_ledger_delete", lost)
    assert cli_main.main(["ledger", "delete", "7", "--metadata", "memory:///x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "may or may not have been made" in err


def test_an_unexpected_error_is_one_line_and_its_traceback_is_on_request(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bookkeeper_aio.cli import shell

    async def broken(args: object) -> int:
        raise RuntimeError("a bug")

    monkeypatch.setattr(shell, "cmd_ledgers", broken)
    assert cli_main.main(["ledgers", "--metadata", "memory:///x"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip() == (
        "bkaio ledgers: unexpected RuntimeError: a bug (a bug: run it again with --log-level debug for "
        "the traceback, and report it)"
    )
    assert cli_main.main(["--log-level", "debug", "ledgers", "--metadata", "memory:///x"]) == 1
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "env", "said"),
    [
        (["--log-level", "loud", "ledgers"], {}, "argument --log-level: invalid choice: 'loud'"),
        (["ledgers"], {"BKAIO_LOG_LEVEL": "loud"}, "bkaio: $BKAIO_LOG_LEVEL='loud': use one of debug,"),
        (["ledgers"], {"BKAIO_LOG_FORMAT": "xml"}, "bkaio: $BKAIO_LOG_FORMAT='xml': use one of json,"),
        (["ledgers", "--limit", "0"], {}, "argument --limit: 0 is out of range: must be in 1..10000"),
        (["ledgers", "--limit", "10001"], {}, "argument --limit: 10001 is out of range"),
        (["simpletest", "--entries", "-1"], {}, "argument --entries: -1 is out of range: must be >= 1"),
    ],
)
def test_a_bad_value_is_a_usage_error_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    env: dict[str, str],
    said: str,
) -> None:
    """Exit 2 with the option (or variable) and what it takes; before, a traceback, an
    "unexpected ValueError ... (a bug" line, or (``simpletest --entries -1``) ``ok True``."""
    monkeypatch.delenv("BKAIO_LOG_LEVEL", raising=False)
    monkeypatch.delenv("BKAIO_LOG_FORMAT", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        code = cli_main.main([*argv, "--metadata", "memory:///x"])
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err
    assert said in err
    assert "Traceback" not in err
    assert "a bug" not in err


def test_a_metadata_url_with_a_negative_timeout_is_an_invalid_url(capsys: pytest.CaptureFixture[str]) -> None:
    url = "etcd://127.0.0.1:1/bookkeeper/x?op_timeout_s=-1"
    assert cli_main.main(["ledgers", "--metadata", url]) == 1
    err = capsys.readouterr().err
    assert "bkaio ledgers: InvalidUrl: bad metadata URL" in err
    assert "op_timeout_s='-1': must be a positive number of seconds" in err
    assert "a bug" not in err


def test_bookie_gc_says_why_it_cannot_find_a_bookie_id(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bookie id is looked up in the cluster: an etcd that refuses, or no cluster at all, is the
    reason shown (before: "'bookie-0' is no registered bookie", as if the lookup had worked)."""
    monkeypatch.setenv("BKAIO_HOME", str(tmp_path))  # no sandbox state
    monkeypatch.delenv("BKAIO_METADATA", raising=False)
    refused = ["bookie", "gc", "bookie-0", "--metadata", "etcd://127.0.0.1:1/bookkeeper/x"]
    assert cli_main.main(refused) == 1
    err = capsys.readouterr().err
    assert "MetadataUnavailable: connection refused by every etcd endpoint (127.0.0.1:1)" in err
    assert "no registered bookie" not in err
    assert cli_main.main(["bookie", "gc", "bookie-0"]) == 1
    err = capsys.readouterr().err
    assert "bkaio bookie gc: no cluster given: pass --metadata" in err
    assert "no registered bookie" not in err


class _InterruptedImport:
    """A finder that raises KeyboardInterrupt for one module: Ctrl-C while ``bkaio`` loads."""

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, fullname: str, path: object, target: object = None) -> None:
        if fullname == self.name:
            raise KeyboardInterrupt


def test_ctrl_c_while_bkaio_loads_ends_with_130_without_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from bookkeeper_aio import cli

    monkeypatch.delitem(sys.modules, "bookkeeper_aio.cli.main")
    monkeypatch.setattr(sys, "meta_path", [_InterruptedImport("bookkeeper_aio.cli.main"), *sys.meta_path])
    with pytest.raises(SystemExit) as exited:
        cli.run()
    assert exited.value.code == 130
