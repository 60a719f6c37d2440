"""Recovery benchmark: real bookie processes (fsync on), a writer that dies with ~1,000 entries in
flight, and the time a second client needs to fence, recover, replicate and close the ledger.

Shape (issue 5): 3 bookies, E3/Qw3/Qa2 (the default also used by the acceptance tests), 1 KiB
entries. Per run: the writer appends ``--acked`` entries and waits for them, then hands
``--in-flight`` more to the bookies and is aborted right after the frames left (the bookies see
exactly what a kill -9 of the writer process leaves behind: entries past the LAC that carry the old
LAC). After the bookies settled, a second client (connections already open, as a taking-over
leader's would be) times ``open_ledger(recovery=True)`` (the steps are ``bkaio bench recovery``'s,
``bookkeeper_aio.cli.bench.scenarios.recover_once``). Prints one JSON line per run and a summary
(median over ``--reps``).

    python -m benchmarks.recovery --reps 5
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
from bookkeeper_aio.client.keys import codec_for
from bookkeeper_aio.client.recovery import recover_ledger
from metadata.ledger_manager import LedgerManager
from tests.harness.bookie_proc import BookieProcess


def _client(procs: list[BookieProcess], ledgers: LedgerManager, window: int) -> BookKeeper:
    return BookKeeper(
        ledgers,
        StaticDirectory([p.bookie_id for p in procs]),
        config=ClientConfig(add_window_max=window),
        resolver=StaticResolver({p.bookie_id: p.address for p in procs}),
    )


async def one_run(
    procs: list[BookieProcess], args: argparse.Namespace, ledgers: LedgerManager
) -> dict[str, Any]:
    writer = _client(procs, ledgers, args.acked + args.in_flight + 10)
    recoverer = _client(procs, ledgers, 1000)
    try:
        lh = await writer.create_ledger(args.ensemble, args.qw, args.qa, password=b"bench")
        if args.window:  # the engine directly first, with another window (1 = BookKeeper's one at a time)
            recoverer = _WindowedRecoverer(recoverer, args.window)  # type: ignore[assignment]
        return await scenarios.recover_once(
            recoverer,
            lh,
            size=args.size,
            acked=args.acked,
            in_flight=args.in_flight,
            settle_s=args.settle_s,
            password=b"bench",
        )
    finally:
        writer.abort()
        await recoverer.close()


class _WindowedRecoverer:
    """A client whose ``open_ledger(recovery=True)`` runs the recovery engine with ``window`` first."""

    def __init__(self, bk: BookKeeper, window: int) -> None:
        self._bk, self._window = bk, window

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bk, name)

    async def open_ledger(self, ledger_id: int, *, password: bytes, recovery: bool) -> Any:
        md = (await self._bk.context.ledgers.read(ledger_id)).metadata
        codec = codec_for(md, password)
        await recover_ledger(self._bk.context, ledger_id, codec, codec.master_key, window=self._window)
        return await self._bk.open_ledger(ledger_id, password=password, recovery=recovery)


def main() -> None:
    parser = _cluster.parser(__doc__)
    parser.add_argument("--acked", type=int, default=2000)
    parser.add_argument("--in-flight", type=int, default=1000)
    parser.add_argument("--settle-s", type=float, default=0.5)
    parser.add_argument("--window", type=int, default=0, help="recovery window (0: the default)")
    args = parser.parse_args()
    runs = _cluster.run_reps("recovery", args, one_run)
    times = [r["recovery_s"] for r in runs]
    summary = {
        "bench": "recovery",
        "shape": f"{_cluster.shape(args)}, {args.in_flight} in flight",
        "window": args.window or "default",
        "reps": len(runs),
        "recovery_s_median": round(statistics.median(times), 4),
        "recovery_s_min": min(times),
        "recovery_s_max": max(times),
        "recovered_entries_median": statistics.median(r["recovered_entries"] for r in runs),
        "loadavg": os.getloadavg(),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
