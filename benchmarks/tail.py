"""Tail benchmark: how long after the writer's ack does a tailing reader hand out the entry?

Real bookie processes (fsync on), 3 bookies, E3/Qw3/Qa2 by default, 1 KiB entries. One writer
appends one entry at a time for ``--secs`` (``await append``: the write latency is the ack latency of
a lone add), optionally paced at ``--rate`` entries/s; a second client tails the ledger with
``ReadHandle.tail()`` in the same process (the loop is ``bkaio bench tail``'s,
``bookkeeper_aio.cli.bench.scenarios.tail_once``). Per entry: write latency = ack - send, tail latency =
reader has it - ack. A reader learns of entry k when a bookie's LAC reaches k, i.e. when entry
k + 1 (which carries LAC k) is durable there, or when the writer's explicit LAC goes out after
``explicit_lac_interval_ms`` idle — so back to back, the tail latency is about one write latency.

Prints one JSON line per run and a summary (medians over ``--reps``).

    python -m benchmarks.tail --reps 5
    python -m benchmarks.tail --reps 3 --rate 500 --explicit-lac-ms 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

from benchmarks import _cluster
from bookkeeper_aio import BookKeeper, ClientConfig
from bookkeeper_aio.cli.bench import scenarios
from bookkeeper_aio.client.bookie_client import StaticResolver
from bookkeeper_aio.client.context import StaticDirectory
from metadata.ledger_manager import LedgerManager
from tests.harness.bookie_proc import BookieProcess


def _client(procs: list[BookieProcess], ledgers: LedgerManager, explicit_lac_ms: int) -> BookKeeper:
    return BookKeeper(
        ledgers,
        StaticDirectory([p.bookie_id for p in procs]),
        config=ClientConfig(explicit_lac_interval_ms=explicit_lac_ms),
        resolver=StaticResolver({p.bookie_id: p.address for p in procs}),
    )


async def one_run(
    procs: list[BookieProcess], args: argparse.Namespace, ledgers: LedgerManager
) -> dict[str, Any]:
    writer = _client(procs, ledgers, args.explicit_lac_ms)
    reader = _client(procs, ledgers, args.explicit_lac_ms)
    try:
        lh = await writer.create_ledger(args.ensemble, args.qw, args.qa, password=b"bench")
        metrics, _ = await scenarios.tail_once(
            lh, reader, size=args.size, rate=args.rate, duration_s=args.secs, password=b"bench"
        )
        return {"rate": args.rate or "back-to-back", **metrics}
    finally:
        await reader.close()
        await writer.close()


def main() -> None:
    parser = _cluster.parser(__doc__)
    parser.add_argument("--secs", type=float, default=3.0, help="seconds of appends per run")
    parser.add_argument("--rate", type=float, default=0.0, help="entries/s; 0 = back to back")
    parser.add_argument("--explicit-lac-ms", type=int, default=100)
    args = parser.parse_args()
    runs = _cluster.run_reps("tail", args, one_run)
    keys = ("write_p50_ms", "write_p99_ms", "tail_after_ack_p50_ms", "tail_after_ack_p99_ms")
    summary: dict[str, Any] = {
        "bench": "tail",
        "shape": _cluster.shape(args),
        "explicit_lac_ms": args.explicit_lac_ms,
        "rate": args.rate or "back-to-back",
        "reps": len(runs),
    }
    for key in keys:
        summary[f"{key}_median"] = round(statistics.median(r[key] for r in runs), 3)
    summary["tail_minus_write_p50_ms_median"] = round(
        statistics.median(r["tail_after_ack_p50_ms"] - r["write_p50_ms"] for r in runs), 3
    )
    summary["loadavg"] = os.getloadavg()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
