"""What the client-side benchmarks share: the common flags, three real bookie processes on a temp
dir, in-memory metadata (one id space for every rep: bookies remember ledgers), and the rep loop
that prints one JSON line per run."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

import uvloop

from metadata.ledger_manager import LedgerManager
from metadata.memory import MemoryStore
from tests.harness.bookie_proc import BookieProcess

BOOKIES = 3

Run = Callable[..., Awaitable[dict[str, Any]]]
Prepare = Callable[[list[BookieProcess], argparse.Namespace, LedgerManager], Awaitable[Any]]


def parser(doc: str | None, *, reps: int = 5) -> argparse.ArgumentParser:
    """A parser with the flags every such benchmark takes (ledger shape, reps, data dir)."""
    result = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    result.add_argument("--reps", type=int, default=reps)
    result.add_argument("--size", type=int, default=1024)
    result.add_argument("--ensemble", type=int, default=3)
    result.add_argument("--qw", type=int, default=3)
    result.add_argument("--qa", type=int, default=2)
    result.add_argument("--dir", default=None)
    result.add_argument("--bookies", type=int, default=BOOKIES)
    return result


def shape(args: argparse.Namespace) -> str:
    return f"E{args.ensemble}/Qw{args.qw}/Qa{args.qa} {args.size} B"


def run_reps(
    name: str, args: argparse.Namespace, one_run: Run, prepare: Prepare | None = None
) -> list[dict[str, Any]]:
    """Start the bookies, run ``prepare`` once (its result is passed to every rep), then
    ``args.reps`` runs of ``one_run(procs, args, ledgers[, prepared])``; stops everything after."""
    base = tempfile.mkdtemp(prefix=f"bench-{name}-", dir=args.dir)
    count = getattr(args, "bookies", BOOKIES)
    procs = [BookieProcess(os.path.join(base, f"b{i}"), bookie_id=f"b{i}") for i in range(count)]
    runs: list[dict[str, Any]] = []
    try:
        for proc in procs:
            proc.start()
        ledgers = LedgerManager(MemoryStore(), "/bench")
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            extra = () if prepare is None else (runner.run(prepare(procs, args, ledgers)),)
            for _ in range(args.reps):
                result = runner.run(one_run(procs, args, ledgers, *extra))
                print(json.dumps(result), flush=True)
                runs.append(result)
    finally:
        for proc in procs:
            proc.cleanup()
        shutil.rmtree(base, ignore_errors=True)
    return runs
