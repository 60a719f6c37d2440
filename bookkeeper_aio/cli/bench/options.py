"""``bkaio bench`` options: one frozen :class:`BenchOptions` built from the command line, checked
before anything starts (a bad value fails with a message that says what to type instead).

The load shape is BookKeeper's ``bin/benchmark writes`` with the knobs the issue names: entry size,
E/Qw/Qa, ledgers per client process, client processes, in-flight window, fixed rate (open loop) or
closed loop, duration and warm-up. Options a scenario does not use are accepted and ignored, so one
command line can be replayed across scenarios.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bookkeeper_aio.cli.bench.errors import BenchUsageError
from bookkeeper_aio.client.config import ClientConfig
from bookkeeper_aio.client.discovery import home

SCENARIOS = ("write", "read", "tail", "recovery", "restart", "log", "curves")
PEERS = ("bound", "nats", "etcd", "single-reads", "one-client")
PEERS_BY_SCENARIO: dict[str, tuple[str, ...]] = {
    "write": ("bound", "nats", "etcd", "one-client"),
    "read": ("etcd", "single-reads"),
    "tail": ("etcd",),
    "recovery": ("etcd",),
    "restart": ("etcd",),
    "log": ("etcd",),
    "curves": (),
}
"""``--compare`` peers each scenario can run: the bound and NATS take the write shape only; etcd is
the metadata path, beside any scenario; ``single-reads`` is our own read with batch reads turned off
(one request per entry: the read path before batching, in the same run); ``one-client`` is our own
write from one client process with one ledger (the same window), beside a fan-in shape
(``--clients 4 --ledgers 25``): the aggregate against the one-client figure in the same run."""

BOUND_ENV = "BKAIO_BENCH_BOUND"
"""Where ``--compare bound`` finds ``replication_bound.py`` when ``--bound-script`` is not given."""

CLIENTS_MAX = 64
"""Client processes: each is a Python process with its own event loop; past a few per core they
measure the scheduler, not the cluster."""
LEDGERS_MAX = 100_000
WINDOW_MAX = 1_000_000
ENTRY_BYTES_MAX = ClientConfig().entry_bytes_max


@dataclass(frozen=True)
class BenchOptions:
    scenario: str
    metadata: str | None
    sandbox: bool
    bookies: int
    out: Path
    quiet: bool
    json: bool
    size: int
    ensemble: int
    write_quorum: int
    ack_quorum: int
    ledgers: int
    clients: int
    window: int
    rate: float
    latency_from: str
    duration_s: float
    warmup_s: float
    reps: int
    compare: tuple[str, ...]
    bound_script: Path | None
    entries: int
    journal_mib: int
    roll_every: int
    in_flight: int
    sizes: tuple[int, ...] = (100, 1024, 10 * 1024, 100 * 1024, 1024 * 1024)
    ledger_counts: tuple[int, ...] = (1, 10, 100, 1000, 10_000)
    journal_s: float = 30.0

    @property
    def closed_loop(self) -> bool:
        return self.rate == 0

    @property
    def shape(self) -> str:
        """The load shape in one line, with what this scenario uses only."""
        quorums = f"E{self.ensemble}/Qw{self.write_quorum}/Qa{self.ack_quorum}, {self.size} B"
        loop = "closed loop" if self.closed_loop else f"{self.rate:g} entries/s"
        if not self.closed_loop and self.latency_from == "send":
            loop += " (latency from the send tick)"
        if self.scenario == "read":
            return f"{quorums}, {self.entries:,} entries"
        if self.scenario == "tail":
            pace = "back to back" if self.closed_loop else f"{self.rate:g} entries/s"
            return f"{quorums}, one add at a time, {pace}, {self.duration_s:g} s"
        if self.scenario == "recovery":
            return f"{quorums}, {self.in_flight} adds in flight when the writer dies"
        if self.scenario == "restart":
            return f"E1/Qw1/Qa1 on a bookie of its own, {self.size} B, {self.journal_mib} MiB of journal"
        if self.scenario == "log":
            return f"{quorums}, window {self.window}, {loop}, roll every {self.roll_every:,} entries"
        return f"{quorums}, {self.clients} client(s) x {self.ledgers} ledger(s), window {self.window}, {loop}"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["out"] = str(self.out)
        data["bound_script"] = None if self.bound_script is None else str(self.bound_script)
        data["compare"] = list(self.compare)
        return data


USED_BY: dict[str, tuple[str, ...]] = {
    "--size": ("write", "read", "tail", "recovery", "restart", "log", "curves"),
    "--ensemble": ("write", "read", "tail", "recovery", "log", "curves"),
    "--write-quorum": ("write", "read", "tail", "recovery", "log", "curves"),
    "--ack-quorum": ("write", "read", "tail", "recovery", "log", "curves"),
    "--ledgers": ("write", "curves"),
    "--clients": ("write", "curves"),
    "--window": ("write", "restart", "log", "curves"),
    "--rate": ("write", "tail", "log", "curves"),
    "--latency-from": ("write", "log", "curves"),
    "--duration": ("write", "tail", "log", "curves"),
    "--warmup": ("write", "log", "curves"),
    "--bound-script": ("write",),
    "--entries": ("read",),
    "--journal-mib": ("restart",),
    "--roll-every": ("log",),
    "--in-flight": ("recovery",),
    "--sizes": ("curves",),
    "--ledger-counts": ("curves",),
    "--journal-s": ("curves",),
}
"""Which scenarios use each load option: ``--help`` of a scenario shows its own only (the others are
still accepted, and ignored, so a command line can be replayed across scenarios). An option not
named here applies to every scenario."""


def add_arguments(parser: argparse.ArgumentParser, scenario: str) -> None:
    """The options of ``bkaio bench SCENARIO``."""

    def add(*flags: str, **kwargs: Any) -> None:
        long = next(flag for flag in flags if flag.startswith("--"))
        if scenario not in USED_BY.get(long, (scenario,)):
            kwargs["help"] = argparse.SUPPRESS  # accepted, ignored, not shown
        parser.add_argument(*flags, **kwargs)

    _add_arguments(add, scenario)


def _add_arguments(add: Callable[..., None], scenario: str) -> None:
    add("--metadata", help="etcd://HOST:PORT[,HOST:PORT]/ROOT (default: $BKAIO_METADATA, else the sandbox)")
    add(
        "--sandbox",
        action="store_true",
        help="run against a private sandbox (etcd + --bookies bookie processes in a temporary "
        "directory) started for this run and stopped after it",
    )
    add("--bookies", type=int, default=3, help="bookies of --sandbox (default 3)")
    add("--out", type=Path, default=None, help="results folder (default $BKAIO_HOME/bench/<time>-<scenario>)")
    add("--quiet", "-q", action="store_true", help="no live progress display")
    add("--json", action="store_true", help="print the result JSON instead of the summary")
    add("--size", type=int, default=1024, help="entry size in bytes (default 1024)")
    add("--ensemble", "-E", type=int, default=3, help="bookies each ledger is striped over (default 3)")
    add("--write-quorum", "-W", type=int, default=2, help="copies of each entry written (default 2)")
    add(
        "--ack-quorum",
        "-A",
        type=int,
        default=2,
        help="copies acknowledged before an add succeeds (default 2)",
    )
    add("--ledgers", type=int, default=1, help="ledgers per client process (default 1)")
    add("--clients", type=int, default=1, help="client processes (default 1)")
    add("--window", type=int, default=1000, help="adds in flight per client process (default 1000)")
    add(
        "--rate",
        type=float,
        default=0.0,
        help="fixed rate in entries/s over all clients (open loop: latency counts from the intended "
        "send time); 0 = closed loop, as fast as the window allows (default)",
    )
    add(
        "--latency-from",
        choices=("intended", "send"),
        default=None,
        help="with --rate: measure latency from the intended send time (no coordinated omission) or "
        "from the timer tick that sent it, as replication_bound.py measures its own (default: send "
        "with --compare bound, so the ratio is like for like; intended otherwise)",
    )
    add("--duration", type=float, default=10.0, help="measured seconds (default 10)")
    add("--warmup", type=float, default=2.0, help="unmeasured seconds first (default 2)")
    add("--reps", type=int, default=1, help="repetitions, medians reported (default 1)")
    add(
        "--compare",
        action="append",
        default=[],
        metavar="PEER",
        help=f"also run a peer in the same run, interleaved: {', '.join(PEERS_BY_SCENARIO[scenario])} "
        "(repeatable, or comma-separated)",
    )
    add(
        "--bound-script",
        type=Path,
        default=None,
        help=f"replication_bound.py for --compare bound (default ${BOUND_ENV})",
    )
    add("--entries", type=int, default=50_000, help="read: entries in the ledger read back (default 50000)")
    add("--journal-mib", type=int, default=64, help="restart: journal to replay, in MiB (default 64)")
    add(
        "--roll-every", type=int, default=10_000, help="log: entries per ledger before a roll (default 10000)"
    )
    add(
        "--in-flight",
        type=int,
        default=1000,
        help="recovery: adds in flight when the writer dies (default 1000)",
    )
    add(
        "--sizes",
        default="100,1024,10240,102400,1048576",
        help="curves: entry sizes in bytes, comma-separated (default 100 B .. 1 MiB)",
    )
    add(
        "--ledger-counts",
        default="1,10,100,1000,10000",
        help="curves: open ledgers of the ledger curve, comma-separated (default 1 .. 10000; "
        "100000 take about a minute to create, and as long to delete)",
    )
    add(
        "--journal-s",
        type=float,
        default=30.0,
        help="curves: seconds of the journal curve's run (throughput as the journal grows; default 30)",
    )


def build(args: argparse.Namespace, scenario: str) -> BenchOptions:
    """Check ``args`` and freeze them; raises :class:`BenchUsageError`."""
    _check_range("--size", args.size, 1, ENTRY_BYTES_MAX)
    for name, value in (("--ensemble", args.ensemble), ("--write-quorum", args.write_quorum)):
        _check_range(name, value, 1, 64)
    _check_range("--ack-quorum", args.ack_quorum, 1, 64)
    if not args.ensemble >= args.write_quorum >= args.ack_quorum:
        raise BenchUsageError(
            f"need --ensemble >= --write-quorum >= --ack-quorum, got "
            f"{args.ensemble}/{args.write_quorum}/{args.ack_quorum} (e.g. -E 3 -W 2 -A 2)"
        )
    _check_range("--ledgers", args.ledgers, 1, LEDGERS_MAX)
    _check_range("--clients", args.clients, 1, CLIENTS_MAX)
    _check_range("--window", args.window, 1, WINDOW_MAX)
    if args.window < args.ledgers:
        raise BenchUsageError(
            f"--window {args.window} is below --ledgers {args.ledgers}: every ledger needs at least "
            "one add in flight; raise --window or lower --ledgers"
        )
    if not args.rate >= 0 or args.rate != args.rate:
        raise BenchUsageError(f"--rate must be >= 0 entries/s (0 = closed loop), got {args.rate}")
    if not 0 < args.duration <= 24 * 3600:
        raise BenchUsageError(f"--duration must be > 0 and at most a day, in seconds, got {args.duration}")
    if not 0 <= args.warmup <= 3600:
        raise BenchUsageError(f"--warmup must be in [0, 3600] seconds, got {args.warmup}")
    _check_range("--reps", args.reps, 1, 1000)
    _check_range("--bookies", args.bookies, 1, 32)
    if args.sandbox and args.metadata:
        raise BenchUsageError("--sandbox starts a cluster of its own: drop --metadata (or --sandbox)")
    if args.sandbox and args.bookies < args.ensemble:
        raise BenchUsageError(f"--sandbox --bookies {args.bookies} is below --ensemble {args.ensemble}")
    _check_range("--entries", args.entries, 1, 100_000_000)
    _check_range("--journal-mib", args.journal_mib, 1, 64 * 1024)
    _check_range("--roll-every", args.roll_every, 1, 1_000_000_000)
    _check_range("--in-flight", args.in_flight, 1, WINDOW_MAX)
    sizes = _int_list("--sizes", args.sizes, 1, ENTRY_BYTES_MAX)
    ledger_counts = _int_list("--ledger-counts", args.ledger_counts, 1, LEDGERS_MAX)
    if not 0 < args.journal_s <= 24 * 3600:
        raise BenchUsageError(f"--journal-s must be > 0 and at most a day, in seconds, got {args.journal_s}")
    compare = _peers(args.compare, scenario)
    bound_script = None
    if "bound" in compare:
        bound_script = find_bound_script(args.bound_script)
    return BenchOptions(
        scenario=scenario,
        metadata=args.metadata,
        sandbox=args.sandbox,
        bookies=args.bookies,
        out=(args.out or default_out(scenario)).absolute(),
        quiet=args.quiet,
        json=args.json,
        size=args.size,
        ensemble=args.ensemble,
        write_quorum=args.write_quorum,
        ack_quorum=args.ack_quorum,
        ledgers=args.ledgers,
        clients=args.clients,
        window=args.window,
        rate=float(args.rate),
        latency_from=args.latency_from or ("send" if "bound" in compare else "intended"),
        duration_s=float(args.duration),
        warmup_s=float(args.warmup),
        reps=args.reps,
        compare=compare,
        bound_script=bound_script,
        entries=args.entries,
        journal_mib=args.journal_mib,
        roll_every=args.roll_every,
        in_flight=args.in_flight,
        sizes=sizes,
        ledger_counts=ledger_counts,
        journal_s=float(args.journal_s),
    )


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise BenchUsageError(f"{name} must be in [{low}, {high}], got {value}")


def _int_list(name: str, text: str, low: int, high: int) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise BenchUsageError(
            f"{name} takes integers separated by commas (e.g. 1,10,100), not {text!r}"
        ) from None
    if not values:
        raise BenchUsageError(f"{name} needs at least one value (e.g. 1,10,100)")
    for value in values:
        _check_range(name, value, low, high)
    return values


def _peers(given: list[str], scenario: str) -> tuple[str, ...]:
    allowed = PEERS_BY_SCENARIO[scenario]
    peers: list[str] = []
    for item in given:
        for name in filter(None, (part.strip() for part in item.split(","))):
            if name not in PEERS:
                raise BenchUsageError(f"--compare {name}: unknown peer; choose from {', '.join(PEERS)}")
            if name not in allowed:
                raise BenchUsageError(
                    f"--compare {name} does not apply to `bench {scenario}`; it takes {', '.join(allowed)}"
                )
            if name not in peers:
                peers.append(name)
    return tuple(peers)


def find_bound_script(explicit: Path | None) -> Path:
    """``--bound-script``, else ``$BKAIO_BENCH_BOUND``; the bound is not shipped with the package."""
    given = explicit or (Path(os.environ[BOUND_ENV]) if os.environ.get(BOUND_ENV) else None)
    if given is None:
        raise BenchUsageError(
            "--compare bound needs the replication bound script (replication_bound.py, not shipped "
            f"with bkaio): pass --bound-script PATH or set ${BOUND_ENV}"
        )
    if not given.is_file():
        raise BenchUsageError(f"--compare bound: {given} is not a file; pass --bound-script PATH")
    return given.absolute()


def default_out(scenario: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return home() / "bench" / f"{stamp}-{scenario}"
