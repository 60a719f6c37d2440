"""Log benchmark (issue 14): log append throughput as a ratio of plain ledger append throughput, and
the delivery latency of a tailing log reader across a roll.

Real bookie processes (fsync on; benchmarks/_cluster.py), the real client, 1 KiB entries,
E3/Qw2/Qa2 by default. Metadata in memory (as the other client benchmarks) unless ``--etcd`` starts
a private etcd (then every ledger create and every ledger-list CAS is a real etcd write).

Throughput, per rep, three passes in a rotating order (interleaved: no side always runs first):

- ``ledger``: one ledger, ``append_async`` with ``--window`` appends in flight, ``--secs`` seconds;
- ``log``: the same through a log writer (no roll);
- ``log_roll``: the same with ``roll_entries_max=--roll-every`` (background rolls).

The ratios ``log / ledger`` and ``log_roll / ledger`` are taken rep by rep (each pair ran back to
back), then their median.

Delivery latency, per rep: a log writer with ``roll_entries_max=--tail-roll-every`` appends at a
fixed ``--rate``; a ``follow=True`` reader (another client, same process) tails the log. Per
record: the time from the append's ack to the reader handing it out. The first ``--after-roll``
entries of a ledger (other than the first ledger) count as "after a roll", the last ones of a
ledger (other than the last) as "before a roll", the others as "mid-ledger"; p50 / p99 / max of
each. Records acked after the last append was sent are left out (no later add carries their LAC:
only the writer's explicit LAC, ``explicit_lac_interval_ms``, or its close tells the reader).

Pauses at a switch (``--pause-entries N``), per rep in alternating order: N appends moving to a
new ledger every ``--roll-every``, once as a bare ledger switch (to a ledger created beforehand) and
once as a log writer's roll; per switch the longest gap between consecutive completions around it.

Prints one JSON line per pass and a final JSON summary (medians over ``--reps``).

    python -m benchmarks.log --reps 5
    python -m benchmarks.log --reps 5 --etcd
    python -m benchmarks.log --reps 5 --etcd --pause-entries 40000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import os
import platform
import statistics
import time
import uuid
from typing import Any

from benchmarks import _cluster
from bookkeeper_aio import BookKeeper, ClientConfig, open_log_reader, open_log_writer
from bookkeeper_aio.client.bookie_client import StaticResolver
from bookkeeper_aio.client.context import StaticDirectory
from bookkeeper_aio.client.ledger import LedgerHandle
from metadata.cluster import connect as metadata_connect
from metadata.cluster import ensure_cluster
from metadata.ledger_manager import LedgerManager
from tests.harness.bookie_proc import BookieProcess
from tests.harness.etcd import EtcdCluster, find_etcd_binary

PASSES = ("ledger", "log", "log_roll")
PASSWORD = b"bench"


def _client(procs: list[BookieProcess], ledgers: LedgerManager, window: int) -> BookKeeper:
    return BookKeeper(
        ledgers,
        StaticDirectory([p.bookie_id for p in procs]),
        config=ClientConfig(add_window_max=max(window, 1)),
        resolver=StaticResolver({p.bookie_id: p.address for p in procs}),
    )


async def _pipelined(append_async: Any, payload: bytes, window: int, secs: float) -> dict[str, float]:
    """Appends with ``window`` in flight for ``secs``: acked appends per second, and this
    process's CPU time per acked append (the client's cost, less sensitive to a busy machine)."""
    slots = asyncio.Semaphore(window)
    acked = [0]
    failed: list[BaseException] = []

    def done(future: asyncio.Future[Any]) -> None:
        slots.release()
        if future.exception() is not None:
            failed.append(future.exception())  # type: ignore[arg-type]
        else:
            acked[0] += 1

    pending: set[asyncio.Future[Any]] = set()
    cpu0 = time.process_time()
    started = time.perf_counter()
    deadline = started + secs
    while time.perf_counter() < deadline and not failed:
        await slots.acquire()
        future = await append_async(payload)
        future.add_done_callback(done)
        pending.add(future)
        if len(pending) > 4 * window:
            pending = {f for f in pending if not f.done()}
    await asyncio.gather(*pending, return_exceptions=True)
    elapsed = time.perf_counter() - started
    cpu_s = time.process_time() - cpu0
    if failed:
        raise failed[0]
    return {"entries_s": round(acked[0] / elapsed), "client_cpu_us": round(cpu_s / max(acked[0], 1) * 1e6, 2)}


async def _throughput(
    which: str, procs: list[BookieProcess], args: argparse.Namespace, ledgers: LedgerManager
) -> dict[str, Any]:
    payload = os.urandom(args.size)
    quorum = {"ensemble": args.ensemble, "write_quorum": args.qw, "ack_quorum": args.qa}
    async with _client(procs, ledgers, args.window) as bk:
        if which == "ledger":
            handle = await bk.create_ledger(args.ensemble, args.qw, args.qa, password=PASSWORD)
            await handle.append(b"warm-up")  # connections up before the clock starts
            measured = await _pipelined(handle.append_async, payload, args.window, args.secs)
            await handle.close()
            return {"pass": which, **measured}
        roll = args.roll_every if which == "log_roll" else None
        name = f"bench-{uuid.uuid4().hex[:8]}"
        writer = await open_log_writer(bk, name, roll_entries_max=roll, password=PASSWORD, **quorum)
        await writer.append(b"warm-up")
        measured = await _pipelined(writer.append_async, payload, args.window, args.secs)
        ledgers_used = len(writer.ledger_ids)
        await writer.close()
        return {"pass": which, **measured, "ledgers": ledgers_used}


async def _switch_pauses(
    which: str, procs: list[BookieProcess], args: argparse.Namespace, ledgers: LedgerManager
) -> dict[str, Any]:
    """``--pause-entries`` appends (``--window`` in flight) moving to a new ledger every
    ``--roll-every``: ``ledger`` switches to a ledger created beforehand (the next one is created
    right after) and closes the old one in the background (the bare cost of a switch); ``log`` is a
    log writer's own roll (CAS of its spare, close, CAS). Per switch: the longest gap between
    consecutive completions within 50 ms of the first completion in the new ledger."""
    payload = os.urandom(args.size)
    quorum = {"ensemble": args.ensemble, "write_quorum": args.qw, "ack_quorum": args.qa}
    slots = asyncio.Semaphore(args.window)
    completions: list[tuple[float, int]] = []  # (when, ledger id)

    def done(ledger_id: int | None, future: asyncio.Future[Any]) -> None:
        slots.release()
        if future.exception() is None:
            result = future.result()
            completions.append(
                (time.perf_counter(), ledger_id if ledger_id is not None else result.ledger_id)
            )

    async with _client(procs, ledgers, max(args.window, 1)) as bk:

        def create() -> asyncio.Task[LedgerHandle]:
            return asyncio.ensure_future(bk.create_ledger(args.ensemble, args.qw, args.qa, password=PASSWORD))

        current = await create()
        upcoming = create()  # the next ledger is made ahead, as a log writer's spare
        writer = None
        if which == "log":
            name = f"pause-{uuid.uuid4().hex[:8]}"
            writer = await open_log_writer(
                bk, name, roll_entries_max=args.roll_every, password=PASSWORD, **quorum
            )
        futures: list[asyncio.Future[Any]] = []
        closes = []
        for index in range(args.pause_entries):
            await slots.acquire()
            future: asyncio.Future[Any]
            if writer is not None:
                future = await writer.append_async(payload)
                future.add_done_callback(functools.partial(done, None))
            else:
                if index and index % args.roll_every == 0:
                    closes.append(asyncio.ensure_future(current.close()))
                    current, upcoming = await upcoming, create()
                future = await current.append_async(payload)
                future.add_done_callback(functools.partial(done, current.id))
            futures.append(future)
            if index % 16 == 15:
                await asyncio.sleep(0)  # the loop never waits while slots are free: no long bursts
        await asyncio.gather(*futures, *closes)
        if writer is not None:
            await writer.close()
        for handle in (current, await upcoming):
            await handle.close()
    first_at: dict[int, float] = {}  # each ledger's first completion (an old ledger's last ones come later)
    for when, ledger_id in completions:
        first_at.setdefault(ledger_id, when)
    firsts = sorted(first_at.values())[1:]
    gaps = [(a, b) for (a, _), (b, _) in itertools.pairwise(completions)]
    at_switch = [
        max((b - a for a, b in gaps if first - 0.05 <= b and a <= first + 0.05), default=0.0)
        for first in firsts
    ]
    ordered = sorted(b - a for a, b in gaps)
    return {
        "pass": f"pauses_{which}",
        "switches": len(firsts),
        "switch_gap_ms_median": round(statistics.median(at_switch) * 1e3, 2) if at_switch else None,
        "switch_gap_ms_max": round(max(at_switch) * 1e3, 2) if at_switch else None,
        "gap_ms_p999": round(ordered[int(0.999 * len(ordered))] * 1e3, 2) if ordered else None,
    }


def _percentiles(values_s: list[float]) -> dict[str, float | int | None]:
    if not values_s:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    ordered = sorted(values_s)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 3)

    return {"n": len(ordered), "p50_ms": at(0.50), "p99_ms": at(0.99), "max_ms": round(ordered[-1] * 1e3, 3)}


async def _delivery(
    procs: list[BookieProcess], args: argparse.Namespace, ledgers: LedgerManager
) -> dict[str, Any]:
    """Ack -> a following reader has it, for records right after a roll vs mid-ledger."""
    payload_tail = os.urandom(max(args.size - 16, 0))
    quorum = {"ensemble": args.ensemble, "write_quorum": args.qw, "ack_quorum": args.qa}
    name = f"tail-{uuid.uuid4().hex[:8]}"
    acked_at: dict[int, float] = {}
    seen_at: dict[int, tuple[float, int, int]] = {}  # index -> (when, ledger, entry)
    count = int(args.rate * args.tail_secs)
    async with _client(procs, ledgers, 1000) as wbk, _client(procs, ledgers, 1000) as rbk:
        writer = await open_log_writer(
            wbk, name, roll_entries_max=args.tail_roll_every, password=PASSWORD, **quorum
        )
        reader = await open_log_reader(rbk, name, password=PASSWORD, follow=True)

        async def read() -> None:
            async with contextlib.aclosing(reader):
                async for record in reader:
                    index = int.from_bytes(record.payload[:8], "big")
                    seen_at[index] = (
                        time.perf_counter(),
                        record.position.ledger_id,
                        record.position.entry_id,
                    )
                    if len(seen_at) == count:
                        return

        def acked(index: int, future: asyncio.Future[Any]) -> None:
            if future.exception() is None:
                acked_at[index] = time.perf_counter()

        reading = asyncio.create_task(read())
        started = time.perf_counter()
        futures = []
        for index in range(count):
            delay = started + index / args.rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            future = await writer.append_async(index.to_bytes(8, "big") + payload_tail)
            future.add_done_callback(functools.partial(acked, index))
            futures.append(future)
        last_sent = time.perf_counter()
        await asyncio.gather(*futures)
        async with asyncio.timeout(30):
            await reading
        rolls = len(writer.ledger_ids) - 1
        await writer.close()
    by_ledger: dict[int, int] = {}  # ledger -> its last entry seen
    for _, ledger, entry in seen_at.values():
        by_ledger[ledger] = max(entry, by_ledger.get(ledger, -1))
    first_ledger, last_ledger = min(by_ledger), max(by_ledger)
    classes: dict[str, list[float]] = {"after_roll": [], "before_roll": [], "mid_ledger": []}
    for index, (when, ledger, entry) in seen_at.items():
        if acked_at[index] > last_sent:
            continue  # no later add carries its LAC: only the explicit LAC or the close tells the reader
        if ledger != first_ledger and entry < args.after_roll:
            which = "after_roll"
        elif ledger != last_ledger and entry > by_ledger[ledger] - args.after_roll:
            which = "before_roll"  # handed out once the roll closed the ledger (or its LAC moved)
        else:
            which = "mid_ledger"
        classes[which].append(when - acked_at[index])
    return {
        "pass": "delivery",
        "rolls": rolls,
        **{which: _percentiles(values) for which, values in classes.items()},
    }


def main() -> None:
    ap = _cluster.parser(__doc__, reps=5)
    ap.set_defaults(qw=2, qa=2)
    ap.add_argument("--window", type=int, default=256, help="appends in flight (throughput passes)")
    ap.add_argument("--secs", type=float, default=4.0, help="length of each throughput pass")
    ap.add_argument("--roll-every", type=int, default=5000, help="roll_entries_max of the log_roll pass")
    ap.add_argument("--rate", type=float, default=2000.0, help="appends/s of the delivery pass")
    ap.add_argument("--tail-secs", type=float, default=3.0, help="length of the delivery pass")
    ap.add_argument("--tail-roll-every", type=int, default=500, help="roll_entries_max of the delivery pass")
    ap.add_argument(
        "--after-roll", type=int, default=5, help="entries of a new ledger counted as after a roll"
    )
    ap.add_argument("--etcd", action="store_true", help="metadata in a private etcd instead of memory")
    ap.add_argument(
        "--pause-entries", type=int, default=0, help="appends of the switch-pause passes (0: skip them)"
    )
    args = ap.parse_args()
    etcd: EtcdCluster | None = None
    if args.etcd:
        binary = find_etcd_binary()
        if binary is None:
            raise SystemExit("--etcd: no etcd binary ($ETCD_BIN, the venv or PATH)")
        etcd = EtcdCluster(binary).start()
    rep_index = [0]

    async def prepare(
        procs: list[BookieProcess], _args: argparse.Namespace, memory: LedgerManager
    ) -> LedgerManager:
        if etcd is None:
            return memory
        root = "/bench-log"
        conn = metadata_connect(etcd.url(root))
        await ensure_cluster(conn.store, root)
        return LedgerManager(conn.store, root)

    async def one_rep(
        procs: list[BookieProcess], args: argparse.Namespace, _memory: LedgerManager, ledgers: LedgerManager
    ) -> dict[str, Any]:
        rep = rep_index[0]
        rep_index[0] += 1
        order = list(PASSES[rep % len(PASSES) :] + PASSES[: rep % len(PASSES)])
        result: dict[str, Any] = {"rep": rep, "order": order}
        for which in order:
            line = await _throughput(which, procs, args, ledgers)
            print(json.dumps({"rep": rep, **line}), flush=True)
            result[which] = line
        if args.pause_entries:
            for which in ("ledger", "log") if rep % 2 == 0 else ("log", "ledger"):
                line = await _switch_pauses(which, procs, args, ledgers)
                print(json.dumps({"rep": rep, **line}), flush=True)
                result[line["pass"]] = line
        delivery = await _delivery(procs, args, ledgers)
        print(json.dumps({"rep": rep, **delivery}), flush=True)
        result["delivery"] = delivery
        result["log_over_ledger"] = round(result["log"]["entries_s"] / result["ledger"]["entries_s"], 3)
        result["log_roll_over_ledger"] = round(
            result["log_roll"]["entries_s"] / result["ledger"]["entries_s"], 3
        )
        result["log_cpu_over_ledger"] = round(
            result["log"]["client_cpu_us"] / result["ledger"]["client_cpu_us"], 3
        )
        return result

    try:
        runs = _cluster.run_reps("log", args, one_rep, prepare)
    finally:
        if etcd is not None:
            etcd.stop()

    def med(values: list[Any]) -> float | None:
        present = [float(v) for v in values if v is not None]
        return round(statistics.median(present), 3) if present else None

    summary = {
        "config": {
            **vars(args),
            "shape": _cluster.shape(args),
            "metadata": "etcd" if args.etcd else "memory",
        },
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "entries_s": {which: med([r[which]["entries_s"] for r in runs]) for which in PASSES},
        "client_cpu_us": {which: med([r[which]["client_cpu_us"] for r in runs]) for which in PASSES},
        "log_over_ledger": med([r["log_over_ledger"] for r in runs]),
        "log_cpu_over_ledger": med([r["log_cpu_over_ledger"] for r in runs]),
        "log_roll_over_ledger": med([r["log_roll_over_ledger"] for r in runs]),
        "log_roll_ledgers": med([r["log_roll"]["ledgers"] for r in runs]),
        **{
            f"pauses_{which}": {
                k: med([r[f"pauses_{which}"][k] for r in runs])
                for k in ("switches", "switch_gap_ms_median", "switch_gap_ms_max", "gap_ms_p999")
            }
            for which in ("ledger", "log")
            if args.pause_entries
        },
        "delivery_rolls": med([r["delivery"]["rolls"] for r in runs]),
        **{
            f"delivery_{which}": {
                k: med([r["delivery"][which][k] for r in runs]) for k in ("n", "p50_ms", "p99_ms", "max_ms")
            }
            for which in ("after_roll", "before_roll", "mid_ledger")
        },
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
