"""``bkaio bench write|read|tail|recovery|restart|log``: how fast is the cluster, against what, and
where does the time go, in one command (BookKeeper's ``bin/benchmark``).

Runs against the sandbox by default (its state file says where it is) or any cluster
(``--metadata``); writes ``result.json``, ``summary.md`` and PNG plots to a results folder
(``--out``, default ``$BKAIO_HOME/bench/<time>-<scenario>``) and prints the summary. The pieces:
:mod:`.options` (the command line), :mod:`.load` (the load loop), :mod:`.worker` / :mod:`.clients`
(client processes), :mod:`.bookies` (the bookie side), :mod:`.peers` (``--compare``),
:mod:`.writes` and :mod:`.scenarios` (what each scenario runs), :mod:`.report` (the folder).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Awaitable, Callable
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
}

Scenario = Callable[[BenchOptions, str, "Report", LiveLine], Awaitable[None]]


def add_commands(sub: Any) -> None:
    bench = sub.add_parser(
        "bench",
        help="benchmark the cluster (write, read, tail, recovery, restart, log)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    scenarios = bench.add_subparsers(dest="bench_command", required=True, metavar="SCENARIO")
    for name in options.SCENARIOS:
        parser = scenarios.add_parser(name, help=HELP[name], description=HELP[name])
        options.add_arguments(parser, name)
        parser.set_defaults(func=cmd_bench)


async def cmd_bench(args: argparse.Namespace) -> int:
    scenario = args.bench_command
    try:
        opts = options.build(args, scenario)
    except BenchUsageError as error:
        print(f"bkaio bench {scenario}: {error}", file=sys.stderr)
        return 2
    url = resolve_metadata_url(opts.metadata)
    from bookkeeper_aio.cli.bench.report import Report  # hdrhistogram, matplotlib: the bench extra

    argv = getattr(args, "argv", None) or sys.argv[1:]
    report = Report(opts, "bkaio " + " ".join(shlex.quote(a) for a in argv))
    live = LiveLine(not opts.quiet)
    try:
        await _scenario(scenario)(opts, url, report, live)
    finally:
        live.clear()
    data = report.write()
    if opts.json:
        print(json.dumps(data, default=str))
    else:
        print((opts.out / "summary.md").read_text(), end="")
        print(f"results: {opts.out}")
    return 0


def _scenario(name: str) -> Scenario:
    if name == "write":
        from bookkeeper_aio.cli.bench.writes import run_write

        return run_write
    from bookkeeper_aio.cli.bench.scenarios import run_log, run_read, run_recovery, run_restart, run_tail

    table: dict[str, Scenario] = {
        "read": run_read,
        "tail": run_tail,
        "recovery": run_recovery,
        "restart": run_restart,
        "log": run_log,
    }
    return table[name]
