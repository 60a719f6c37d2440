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
