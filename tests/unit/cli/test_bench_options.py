"""``bkaio bench`` refuses bad options before it touches a cluster, saying what to use instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from bookkeeper_aio.cli.main import main


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["write", "--size", "0"], "--size must be in [1,"),
        (["write", "-E", "2", "-W", "3"], "need --ensemble >= --write-quorum >= --ack-quorum"),
        (["write", "--ledgers", "10", "--window", "5"], "raise --window or lower --ledgers"),
        (["write", "--clients", "0"], "--clients must be in [1, 64]"),
        (["write", "--rate", "-1"], "--rate must be >= 0"),
        (["write", "--duration", "0"], "--duration must be > 0"),
        (["write", "--warmup", "-1"], "--warmup must be in [0, 3600]"),
        (["write", "--compare", "kafka"], "choose from bound, nats, etcd, single-reads, one-client"),
        (["read", "--compare", "nats"], "does not apply to `bench read`; it takes etcd, single-reads"),
        (["write", "--compare", "bound"], "pass --bound-script PATH or set $BKAIO_BENCH_BOUND"),
        (["write", "--compare", "bound", "--bound-script", "/nonexistent/bound.py"], "is not a file"),
        (["write", "--sandbox"], "--sandbox starts a cluster of its own: drop --metadata"),
        (["curves", "--sizes", "100,1k"], "--sizes takes integers separated by commas"),
        (["curves", "--sizes", "0"], "--sizes must be in [1,"),
        (["curves", "--ledger-counts", ","], "--ledger-counts needs at least one value"),
        (["curves", "--ledger-counts", "1,1000000"], "--ledger-counts must be in [1, 100000]"),
        (["curves", "--journal-s", "0"], "--journal-s must be > 0"),
        (["curves", "--compare", "bound"], "does not apply to `bench curves`"),
    ],
)
def test_bench_options__refused_with_what_to_do(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BKAIO_BENCH_BOUND", raising=False)
    assert main(["bench", *argv, "--metadata", "etcd://127.0.0.1:1/never-contacted"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"bkaio bench {argv[0]}: ")
    assert expected in err


def test_bench_options__bound_script_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bookkeeper_aio.cli.bench.options import find_bound_script

    script = tmp_path / "replication_bound.py"
    script.write_text("")
    monkeypatch.setenv("BKAIO_BENCH_BOUND", str(script))
    assert find_bound_script(None) == script
    assert find_bound_script(Path(script)) == script


def test_bench_options__default_results_folder_is_under_the_bkaio_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bookkeeper_aio.cli.bench.options import default_out

    monkeypatch.setenv("BKAIO_HOME", str(tmp_path))
    out = default_out("write")
    assert out.parent == tmp_path / "bench"
    assert out.name.endswith("-write")


def _help(scenario: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        main(["bench", scenario, "--help"])
    return capsys.readouterr().out


def test_each_scenario_help_shows_its_own_options(capsys: pytest.CaptureFixture[str]) -> None:
    restart = _help("restart", capsys)
    assert "--journal-mib" in restart
    for other in ("--entries", "--roll-every", "--in-flight", "--sizes", "--clients", "--ensemble"):
        assert other not in restart, other
    read = _help("read", capsys)
    assert "--entries" in read
    assert "copies of each entry written (default 2)" in read  # -W has help and its default
    assert "--journal-mib" not in read
    write = _help("write", capsys)
    assert "--clients" in write
    assert "--entries" not in write


def test_an_option_another_scenario_uses_is_still_accepted(tmp_path: Path) -> None:
    """One command line replays across scenarios: a hidden option is accepted and ignored."""
    import argparse

    from bookkeeper_aio.cli.bench import options

    parser = argparse.ArgumentParser()
    options.add_arguments(parser, "restart")
    opts = options.build(parser.parse_args(["--entries", "7", "--out", str(tmp_path)]), "restart")
    assert opts.entries == 7


@pytest.mark.parametrize(
    ("scenario", "shape"),
    [
        ("read", "E3/Qw2/Qa2, 1024 B, 50,000 entries"),
        ("tail", "E3/Qw2/Qa2, 1024 B, one add at a time, back to back, 10 s"),
        ("recovery", "E3/Qw2/Qa2, 1024 B, 1000 adds in flight when the writer dies"),
        ("restart", "E1/Qw1/Qa1 on a bookie of its own, 1024 B, 64 MiB of journal"),
        ("write", "E3/Qw2/Qa2, 1024 B, 1 client(s) x 1 ledger(s), window 1000, closed loop"),
    ],
)
def test_the_shape_names_what_the_scenario_uses(scenario: str, shape: str, tmp_path: Path) -> None:
    import argparse

    from bookkeeper_aio.cli.bench import options

    parser = argparse.ArgumentParser()
    options.add_arguments(parser, scenario)
    assert options.build(parser.parse_args(["--out", str(tmp_path)]), scenario).shape == shape


@pytest.mark.parametrize(
    ("argv", "cleanup"), [(["--sandbox"], False), (["--metadata", "etcd://h:1/r"], True)]
)
def test_only_a_private_sandbox_skips_closing_and_deleting_the_ledgers(
    argv: list[str], cleanup: bool, tmp_path: Path
) -> None:
    import argparse

    from bookkeeper_aio.cli.bench import options
    from bookkeeper_aio.cli.bench.writes import worker_spec

    parser = argparse.ArgumentParser()
    options.add_arguments(parser, "write")
    opts = options.build(parser.parse_args([*argv, "--out", str(tmp_path)]), "write")
    assert worker_spec(opts, "ours")["cleanup"] is cleanup
