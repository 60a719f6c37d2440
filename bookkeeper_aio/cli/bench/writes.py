"""``bkaio bench write``: the write load on the cluster, and the ``--compare`` peers with the same
shape in the same run, interleaved rep by rep (ours first in even reps, last in odd ones, so neither
side always runs on the machine the other just warmed or loaded).

Ours: ``--clients`` processes, each with ``--ledgers`` ledgers and a window of ``--window`` adds
(:mod:`bookkeeper_aio.cli.bench.clients`); the bookies are read at both ends of the measured span.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from bookkeeper_aio.cli.bench import bookies, peers
from bookkeeper_aio.cli.bench.clients import run_clients
from bookkeeper_aio.cli.bench.live import LiveLine
from bookkeeper_aio.cli.bench.options import BenchOptions
from bookkeeper_aio.cli.bench.report import OURS, Report, Run

TIMELINE_BUCKETS = 40
"""Points of the throughput-over-time plot (at least 0.1 s each)."""


def worker_spec(opts: BenchOptions, system: str, **extra: Any) -> dict[str, Any]:
    """What every client process of a load run gets (:mod:`bookkeeper_aio.cli.bench.worker`)."""
    return {
        "system": system,
        "scenario": opts.scenario,
        "size": opts.size,
        "ensemble": opts.ensemble,
        "write_quorum": opts.write_quorum,
        "ack_quorum": opts.ack_quorum,
        "ledgers": opts.ledgers,
        "window": opts.window,
        "rate": opts.rate / opts.clients,
        "latency_from": opts.latency_from,
        "warmup_s": opts.warmup_s,
        "duration_s": opts.duration_s,
        "interval_s": max(0.1, round(opts.duration_s / TIMELINE_BUCKETS, 2)),
        # a private sandbox is removed after the run: its ledgers need no close nor delete
        "cleanup": not opts.sandbox,
        **extra,
    }


def load_run(system: str, rep: int, merged: dict[str, Any]) -> Run:
    """A report row from :func:`run_clients`' merged result."""
    metrics: dict[str, Any] = {
        "entries_per_s": merged["entries_per_s"],
        **{f"{k}_ms": v for k, v in merged["latency_ms"].items()},
        "client_cpu_us_per_entry": merged["client_cpu_us_per_entry"],
        "client_rss_end_mib": merged["client_rss_end_mib"],
        "client_rss_peak_mib": merged["client_rss_peak_mib"],
        "failed": merged["failed"],
        "fairness_min_over_max": merged["fairness"].get("min_over_max"),
        "first_error": merged["first_error"],
        "clients": merged["clients"],
    }
    return Run(
        system,
        rep,
        metrics,
        histogram=merged["_histogram"],
        timeline=merged["timeline_entries_per_s"],
        timeline_interval_s=merged["timeline_interval_s"],
    )


async def run_ours(opts: BenchOptions, url: str, rep: int, live: LiveLine) -> Run:
    endpoints = await bookies.discover(url)
    merged = await run_clients(
        worker_spec(opts, OURS, metadata_url=url),
        opts.clients,
        opts.out / "logs",
        live,
        label=f"{OURS}-rep{rep}",
        at_span_ends=lambda: bookies.sample(endpoints),
    )
    run = load_run(OURS, rep, merged)
    if len(merged["_samples"]) == 2:
        before, after = merged["_samples"]
        side = bookies.breakdown(before, after, merged["entries"])
        run.metrics["bookies_cpu_us_per_entry"] = side.get("cpu_us_per_entry")
        run.metrics["bookie_side"] = side
    return run


async def run_write(opts: BenchOptions, url: str, report: Report, live: LiveLine) -> None:
    endpoints = await bookies.discover(url)
    report.cluster = {"metadata_url": url, "bookies": [e.bookie_id for e in endpoints]}
    if len(endpoints) < opts.ensemble:
        report.notes.append(f"only {len(endpoints)} bookies registered for an ensemble of {opts.ensemble}")
    if "bound" in opts.compare and len(endpoints) != opts.ensemble:
        report.notes.append(
            f"the bound runs {opts.ensemble} bookies (its E); the cluster has {len(endpoints)}: the "
            "ratio compares different shapes"
        )
    async with contextlib.AsyncExitStack() as stack:
        nats = None
        if "nats" in opts.compare:
            live.show("starting a 3-node NATS JetStream cluster ...")
            nats = await stack.enter_async_context(peers.nats_cluster(opts.out / "nats", opts.write_quorum))
        etcd = None
        if "etcd" in opts.compare:
            live.show("starting a 3-member etcd cluster ...")
            etcd = await stack.enter_async_context(peers.etcd_cluster(opts.out / "etcd"))
        for rep in range(opts.reps):
            order = [OURS, *[p for p in opts.compare if p != "etcd"]]
            if rep % 2:
                order.reverse()
            for system in order:
                if system == OURS:
                    report.add(await run_ours(opts, url, rep, live))
                elif system == "one-client":  # the fan-in's baseline: one process, one ledger
                    one = dataclasses.replace(opts, clients=1, ledgers=1)
                    run = await run_ours(one, url, rep, live)
                    run.system = "one-client"
                    report.add(run)
                elif system == "bound":
                    live.show(f"bound rep {rep}: {opts.warmup_s + opts.duration_s:.0f} s ...")
                    report.add(await peers.run_bound(opts, rep))
                elif system == "nats":
                    assert nats is not None
                    merged = await run_clients(
                        worker_spec(opts, "nats", nats_servers=nats.servers, nats_subject=nats.subject),
                        opts.clients,
                        opts.out / "logs",
                        live,
                        label=f"nats-rep{rep}",
                        at_span_ends=nats.cpu_s,
                    )
                    run = load_run("nats", rep, merged)
                    before, after = merged["_samples"]
                    if before is not None and after is not None and merged["entries"]:
                        run.metrics["servers_cpu_us_per_entry"] = round(
                            (after - before) / merged["entries"] * 1e6, 2
                        )
                    report.add(run)
            if etcd is not None:
                for run in await peers.run_metadata_pair(opts, etcd, rep, live):
                    report.add(run)
        if nats is not None:
            report.notes.append(nats.describe())
