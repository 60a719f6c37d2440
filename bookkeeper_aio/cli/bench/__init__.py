"""``bkaio bench write|read|tail|recovery|restart|log|curves``: how fast is the cluster, against what, and
where does the time go, in one command (BookKeeper's ``bin/benchmark``).

Runs against the sandbox by default (its state file says where it is), any cluster
(``--metadata``), or a private sandbox started for the run (``--sandbox``); writes ``result.json``,
``summary.md`` and PNG plots to a results folder (``--out``, default
``$BKAIO_HOME/bench/<time>-<scenario>``) and prints the summary. The pieces:
:mod:`.options` (the command line), :mod:`.load` (the load loop), :mod:`.worker` / :mod:`.clients`
(client processes), :mod:`.bookies` (the bookie side), :mod:`.peers` (``--compare``),
:mod:`.writes`, :mod:`.curves` and :mod:`.scenarios` (what each scenario runs), :mod:`.report` (the folder).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bookkeeper_aio.cli.bench import options
from bookkeeper_aio.cli.bench.errors import BenchFailed, BenchUsageError, PeerUnavailable
from bookkeeper_aio.cli.bench.live import LiveLine
from bookkeeper_aio.cli.bench.options import BenchOptions
from bookkeeper_aio.cli.state import resolve_metadata_url

if TYPE_CHECKING:
    from bookkeeper_aio.cli.bench.report import Report

__all__ = ["BenchFailed", "BenchUsageError", "PeerUnavailable", "add_commands"]

HELP = {
    "write": "write throughput and latency (closed loop or a fixed rate), with --compare peers",
    "read": "read back a closed ledger: entries/s (batch reads when Qw = E)",
    "tail": "how long after the writer's ack a tailing reader has the entry",
    "recovery": "fence + recover a ledger whose writer died with adds in flight",
    "restart": "a bookie killed with -9 and restarted: time to serve, to register, to /ready",
    "log": "log appends against plain ledger appends, through a roll",
    "curves": "write throughput against entry size, open ledgers and journal size, plotted",
}

EPILOG = (
    "Exit status: 0 when every add succeeded; 1 when any add failed (the summary and the terminal "
    "show how many and the first error) or the run could not be made; 2 for a bad option; 130 when "
    "interrupted (Ctrl-C)."
)

Scenario = Callable[[BenchOptions, str, "Report", LiveLine], Awaitable[None]]


def add_commands(sub: Any) -> None:
    bench = sub.add_parser(
        "bench",
        help="benchmark the cluster (write, read, tail, recovery, restart, log, curves)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    scenarios = bench.add_subparsers(dest="bench_command", required=True, metavar="SCENARIO")
    for name in options.SCENARIOS:
        parser = scenarios.add_parser(name, help=HELP[name], description=HELP[name], epilog=EPILOG)
        options.add_arguments(parser, name)
        parser.set_defaults(func=cmd_bench)


async def cmd_bench(args: argparse.Namespace) -> int:
    scenario = args.bench_command
    try:
        opts = options.build(args, scenario)
    except BenchUsageError as error:
        print(f"bkaio bench {scenario}: {error}", file=sys.stderr)
        return 2
    from bookkeeper_aio.cli.bench.report import Report  # hdrhistogram, matplotlib: the bench extra

    argv = getattr(args, "argv", None) or sys.argv[1:]
    report = Report(opts, "bkaio " + " ".join(shlex.quote(a) for a in argv))
    live = LiveLine(not opts.quiet)
    with _stop_on_signals():
        try:
            async with _cluster(opts, live) as url:
                await _scenario(scenario)(opts, url, report, live)
        except asyncio.CancelledError:
            live.clear()
            logs = opts.out / "logs"
            kept = f"; the logs of the processes it started are in {logs}" if logs.is_dir() else ""
            print(
                f"bkaio bench {scenario}: interrupted; its client processes were stopped and its "
                f"ledgers deleted (no results written{kept})",
                file=sys.stderr,
            )
            return 130
        finally:
            live.clear()
    data = report.write()
    if opts.json:
        print(json.dumps(data, default=str))
    else:
        print((opts.out / "summary.md").read_text(), end="")
        print(f"results: {opts.out}")
    failures = report.failures()
    if failures:
        from bookkeeper_aio.cli.bench.report import failure_lines

        for line in failure_lines(failures):
            print(f"bkaio bench {scenario}: {line}", file=sys.stderr)
        print(
            f"bkaio bench {scenario}: adds failed (exit 1): see the first error above, and the "
            "bookies' logs for why",
            file=sys.stderr,
        )
        return 1
    return 0


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """Ctrl-C or SIGTERM cancels the run, so every ``finally`` stops what it started (client
    processes, peers, a --sandbox) and deletes what it created, instead of leaving them behind."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    signals = (signal.SIGINT, signal.SIGTERM)
    for signum in signals:
        loop.add_signal_handler(signum, task.cancel)
    try:
        yield
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)


@contextlib.asynccontextmanager
async def _cluster(opts: BenchOptions, live: LiveLine) -> AsyncIterator[str]:
    """The metadata URL to benchmark: ``--metadata``, ``$BKAIO_METADATA`` or the running sandbox;
    with ``--sandbox`` a private one, started here and stopped (and its data removed) after."""
    if not opts.sandbox:
        yield resolve_metadata_url(opts.metadata)
        return
    from bookkeeper_aio.cli.sandbox import Sandbox

    data_dir = Path(tempfile.mkdtemp(prefix="bkaio-bench-sandbox-"))
    box = Sandbox(data_dir, opts.bookies)
    try:
        live.show(f"starting a sandbox: etcd and {opts.bookies} bookies in {data_dir} ...")
        await asyncio.to_thread(box.start)  # synchronous: it waits for each child in turn
        yield box.metadata_url
    finally:
        await asyncio.to_thread(box.stop)
        await asyncio.to_thread(shutil.rmtree, data_dir, True)


def _scenario(name: str) -> Scenario:
    if name == "write":
        from bookkeeper_aio.cli.bench.writes import run_write

        return run_write
    if name == "curves":
        from bookkeeper_aio.cli.bench.curves import run_curves

        return run_curves
    from bookkeeper_aio.cli.bench.scenarios import run_log, run_read, run_recovery, run_restart, run_tail

    table: dict[str, Scenario] = {
        "read": run_read,
        "tail": run_tail,
        "recovery": run_recovery,
        "restart": run_restart,
        "log": run_log,
    }
    return table[name]
