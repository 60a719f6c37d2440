"""``bkaio`` against an etcd that is not there: one clear line and exit status 1, never a
traceback; an etcd that refuses connections is reported at once, not after the store's budget."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

import metadata
from bookkeeper_aio.cli.main import main
from tests.harness.etcd import EtcdCluster

REFUSED_REPORT_S_MAX = 2.0
"""Well under the store's budget (op_timeout_s 5 s plus the connect): before the probe a refused
endpoint took about 5.4 s to report."""


def _bkaio(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, float]:
    started = time.monotonic()
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # what a user would see as well
        code = 1 if isinstance(exit_.code, str) else int(exit_.code or 0)
        print(exit_.code, file=sys.stderr)
    return code, capsys.readouterr().err, time.monotonic() - started


async def _init(url: str) -> None:
    async with metadata.connect(url) as meta:
        await metadata.init_cluster(meta.store, meta.root)


@pytest.mark.parametrize(
    "command",
    [("ledgers",), ("bookies",), ("log", "list"), ("autorecovery", "status"), ("decommission", "b9:3181")],
)
def test_a_stopped_etcd_is_reported_at_once_in_one_line(
    etcd_private: EtcdCluster, capsys: pytest.CaptureFixture[str], command: tuple[str, ...]
) -> None:
    url = etcd_private.url("/cli-refused")
    asyncio.run(_init(url))
    code, err, _ = _bkaio("ledgers", "--metadata", url, capsys=capsys)
    assert code == 0, err  # the probe lets a live etcd through
    etcd_private.members[0].stop()  # nothing listens on its port now: every connection is refused
    code, err, took_s = _bkaio(*command, "--metadata", url, capsys=capsys)
    assert code == 1
    assert took_s < REFUSED_REPORT_S_MAX, f"took {took_s:.1f} s: {err}"
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "MetadataUnavailable: connection refused by every etcd endpoint" in lines[0]
    assert "check that etcd runs at the URL's HOST:PORT, from --metadata" in lines[0]


def test_a_paused_etcd_still_gets_the_stores_budget(
    etcd_private: EtcdCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """A member that accepts connections but does not answer (SIGSTOP) is not refused: the store
    retries within its budget and then says so in one line."""
    url = etcd_private.url("/cli-paused")
    asyncio.run(_init(url))
    etcd_private.members[0].pause()
    try:
        code, err, took_s = _bkaio("ledgers", "--metadata", url, capsys=capsys)
    finally:
        etcd_private.members[0].resume()
    assert code == 1
    assert took_s > 3.0, "a paused etcd must get the budget, not the refused fast path"
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert "MetadataUnavailable" in err


def test_the_autorecovery_daemon_rides_out_an_etcd_that_starts_late(etcd_private: EtcdCluster) -> None:
    """`bkaio autorecovery run` is a daemon: started while etcd restarts (refusing connections),
    it waits within the store's budget instead of taking the one-shot commands' fail-fast exit."""
    url = etcd_private.url("/cli-daemon")
    asyncio.run(_init(url))
    member = etcd_private.members[0]
    member.stop()
    with subprocess.Popen(
        [sys.executable, "-m", "bookkeeper_aio.cli.main", "autorecovery", "run", "--metadata", url,
         "--id", "d-late", "--password", "pw"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as daemon:  # fmt: skip
        try:
            time.sleep(1.5)  # the fail-fast probe would have refused it by now (about 0.65 s)
            assert daemon.poll() is None, "the daemon exited while etcd was restarting"
            member.start()
            member.wait_ready()
            assert daemon.stdout is not None
            ready = daemon.stdout.readline()
            assert ready.startswith("READY autorecovery d-late"), (ready, daemon.poll())
        finally:
            daemon.terminate()
            daemon.wait(10)
