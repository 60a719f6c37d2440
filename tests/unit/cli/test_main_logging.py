"""``bkaio``'s log level: a failing command prints its one clear line, not the client's JSON log
lines above it; ``-v`` (or ``--log-level``, or ``$BKAIO_LOG_LEVEL``) shows them."""

from __future__ import annotations

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
