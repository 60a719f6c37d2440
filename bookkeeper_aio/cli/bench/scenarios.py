"""``bkaio bench read|tail|recovery|restart|log``: the scenarios that are not a plain write load.
Each runs in this process against the cluster (``restart`` adds a bookie process of its own), rep
by rep, and adds one :class:`~bookkeeper_aio.cli.bench.report.Run` per rep (plus, with
``--compare etcd``, the metadata path beside it). Ledgers and logs they create are deleted.

- read: one ledger of ``--entries`` entries, written once; per rep a cold client (new connections)
  reads it whole (batch reads: consecutive for ``Qw == E``, stepped stripes for ``Qw < E``);
  ``--compare single-reads`` reads it again with batch reads off, interleaved.
- tail: a writer appends (``--rate``, or back to back), a second client tails the ledger; per
  entry the write latency (ack - send) and the tail latency (reader has it - ack).
- recovery: a writer acknowledges ``2 x --in-flight`` entries, sends ``--in-flight`` more and is
  aborted; a second client times ``open_ledger(recovery=True)`` (fence, recover, close).
- restart: a bookie of its own, registered in the cluster, gets ``--journal-mib`` of entries, is
  killed with SIGKILL and restarted on the same data dir and ports: seconds until it serves (its
  port answers), is registered writable, and its ``/ready`` answers 200; the last entry is read back.
- log: closed-loop appends (``--window`` in flight) to a plain ledger, to a log writer, and to a log
  writer rolling every ``--roll-every`` entries, interleaved; log / ledger ratios.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import metadata
from bookkeeper_aio.cli.bench import bookies, peers
from bookkeeper_aio.cli.bench.errors import BenchFailed
from bookkeeper_aio.cli.bench.live import LiveLine
from bookkeeper_aio.cli.bench.load import Span, clock, drive
from bookkeeper_aio.cli.bench.options import BenchOptions
from bookkeeper_aio.cli.bench.report import OURS, Report, Run
from bookkeeper_aio.cli.bench.stats import HdrHistogram, latency_ms, new_histogram
from bookkeeper_aio.cli.bench.worker import BENCH_MARK, PASSWORD
from bookkeeper_aio.cli.procs import free_port, port_open
from bookkeeper_aio.client.bookie_client import StaticResolver
from bookkeeper_aio.client.bookkeeper import BookKeeper
from bookkeeper_aio.client.config import ClientConfig
from bookkeeper_aio.client.context import StaticDirectory
from bookkeeper_aio.client.ledger import LedgerHandle
from bookkeeper_aio.log.admin import delete_log
from bookkeeper_aio.log.writer import open_log_writer
from metadata.keys import ClusterKeys

RESTART_TIMEOUT_S = 600.0
"""A replay of the largest journal --journal-mib allows, on a slow disk, still ends within this."""


def _marked(opts: BenchOptions) -> dict[str, bytes]:
    return {BENCH_MARK: opts.scenario.encode()}


async def _bench_ledger(bk: BookKeeper, opts: BenchOptions) -> LedgerHandle:
    """A new ledger of the run's shape, marked as the benchmark's (so a cleanup finds it)."""
    return await bk.create_ledger(
        opts.ensemble, opts.write_quorum, opts.ack_quorum, password=PASSWORD, custom_metadata=_marked(opts)
    )


async def _with_etcd(opts: BenchOptions, report: Report, live: LiveLine, reps: Any) -> None:
    """Run ``reps(rep)`` for every rep, with the metadata pair after each when ``--compare etcd``."""
    async with contextlib.AsyncExitStack() as stack:
        etcd = None
        if "etcd" in opts.compare:
            live.show("starting a 3-member etcd cluster ...")
            etcd = await stack.enter_async_context(peers.etcd_cluster(opts.out / "logs"))
        for rep in range(opts.reps):
            got = await reps(rep)
            for run in got if isinstance(got, list) else [got]:
                report.add(run)
            if etcd is not None:
                for run in await peers.run_metadata_pair(opts, etcd, rep, live):
                    report.add(run)


async def _fill(handle: Any, count: int, size: int, live: LiveLine, label: str) -> None:
    payload = os.urandom(size)
    futures = []
    for index in range(count):
        futures.append(await handle.append_async(payload))
        if index % 5000 == 0:
            live.show(f"{label}: {index:,}/{count:,} entries written")
    await asyncio.gather(*futures)


# ------------------------------------------------------------------ read
async def run_read(opts: BenchOptions, url: str, report: Report, live: LiveLine) -> None:
    endpoints = await bookies.discover(url)
    report.cluster = {"metadata_url": url, "bookies": [e.bookie_id for e in endpoints]}
    async with BookKeeper.connect(url) as writer:
        handle = await _bench_ledger(writer, opts)
        try:
            await _fill(handle, opts.entries, opts.size, live, "read: writing the ledger")
            await handle.close()

            async def one(rep: int) -> list[Run]:
                systems = [OURS, *(["single-reads"] if "single-reads" in opts.compare else [])]
                if rep % 2:
                    systems.reverse()
                return [await one_read(system, rep) for system in systems]

            async def one_read(system: str, rep: int) -> Run:
                live.show(f"read rep {rep} ({system}): reading {opts.entries:,} entries ...")
                # single-reads: batch reads off, one READ_ENTRY per entry (the path before batching)
                config = ClientConfig.load()
                if system != OURS:
                    config = dataclasses.replace(config, batch_read_count_max=1)
                async with BookKeeper.connect(url, config=config) as reader:
                    rh = await reader.open_ledger(handle.id, password=PASSWORD)
                    before = await bookies.sample(endpoints)
                    cpu0, started = time.process_time(), clock()
                    count = 0
                    async for _entry in rh.read():
                        count += 1
                    elapsed, cpu_s = clock() - started, time.process_time() - cpu0
                    after = await bookies.sample(endpoints)
                if count != opts.entries:
                    raise BenchFailed(f"read {count} entries of {opts.entries}")
                side = bookies.breakdown(before, after, count)
                return Run(
                    system,
                    rep,
                    {
                        "entries_per_s": round(count / elapsed, 1),
                        "seconds": round(elapsed, 3),
                        "client_cpu_us_per_entry": round(cpu_s / count * 1e6, 2),
                        "bookies_cpu_us_per_entry": side.get("cpu_us_per_entry"),
                        "batch_reads": system == OURS,
                    },
                )

            await _with_etcd(opts, report, live, one)
        finally:
            handle.abort()
            await writer.delete_ledger(handle.id, password=PASSWORD)


# ------------------------------------------------------------------ tail
async def run_tail(opts: BenchOptions, url: str, report: Report, live: LiveLine) -> None:
    report.cluster = {"metadata_url": url}

    async def one(rep: int) -> Run:
        live.show(f"tail rep {rep}: {opts.duration_s:g} s ...")
        async with BookKeeper.connect(url) as writer, BookKeeper.connect(url) as reader:
            lh = await _bench_ledger(writer, opts)
            try:
                metrics, tail_hist = await tail_once(
                    lh, reader, size=opts.size, rate=opts.rate, duration_s=opts.duration_s
                )
                return Run(OURS, rep, metrics, histogram=tail_hist)
            finally:
                lh.abort()
                await writer.delete_ledger(lh.id, password=PASSWORD)

    await _with_etcd(opts, report, live, one)


async def tail_once(
    lh: Any, reader: BookKeeper, *, size: int, rate: float, duration_s: float, password: bytes = PASSWORD
) -> tuple[dict[str, Any], HdrHistogram]:
    """Append to ``lh`` (one at a time, at ``rate`` or back to back) for ``duration_s`` while
    ``reader`` tails it: the write and tail-after-ack latencies, and the tail histogram."""
    await lh.append(b"warm-up")  # entry 0: connections are up before the clock starts
    rh = await reader.open_ledger(lh.id, password=password)
    seen_at: dict[int, float] = {}

    async def follow() -> None:
        async for entry in rh.tail(1):
            seen_at[entry.entry_id] = clock()

    follower = asyncio.create_task(follow())
    acked_at: dict[int, float] = {}
    write_hist, tail_hist = new_histogram(), new_histogram()
    payload = os.urandom(size)
    interval_s = 1 / rate if rate else 0.0
    started = next_at = clock()
    while clock() - started < duration_s:
        if interval_s:
            next_at += interval_s
            await asyncio.sleep(max(0.0, next_at - clock()))
            sent = next_at  # from the intended send time: a late loop shows up as latency
        else:
            sent = clock()
        entry_id = await lh.append(payload)
        acked_at[entry_id] = clock()
        write_hist.record_value(max(1, int((acked_at[entry_id] - sent) * 1e6)))
    last = max(acked_at)
    await lh.close()
    await asyncio.wait_for(follower, 30)
    for entry_id, acked in acked_at.items():
        if entry_id != last:  # the last one waits for the close (or the explicit LAC) by design
            tail_hist.record_value(max(1, int((seen_at[entry_id] - acked) * 1e6)))
    write_ms, tail_ms = latency_ms(write_hist), latency_ms(tail_hist)
    metrics = {
        "entries": len(acked_at),
        **{f"write_{k}_ms": v for k, v in write_ms.items()},
        **{f"tail_after_ack_{k}_ms": v for k, v in tail_ms.items()},
        "last_entry_after_ack_ms": round((seen_at[last] - acked_at[last]) * 1e3, 3),
    }
    return metrics, tail_hist


# ------------------------------------------------------------------ recovery
async def run_recovery(opts: BenchOptions, url: str, report: Report, live: LiveLine) -> None:
    report.cluster = {"metadata_url": url}
    acked_count = 2 * opts.in_flight

    async def one(rep: int) -> Run:
        live.show(f"recovery rep {rep}: writing, then the writer dies with {opts.in_flight} in flight ...")
        config = ClientConfig(add_window_max=acked_count + opts.in_flight + 10)
        async with BookKeeper.connect(url, config=config) as writer, BookKeeper.connect(url) as recoverer:
            lh = await _bench_ledger(writer, opts)
            try:
                metrics = await recover_once(
                    recoverer, lh, size=opts.size, acked=acked_count, in_flight=opts.in_flight
                )
            finally:
                with contextlib.suppress(Exception):
                    await recoverer.delete_ledger(lh.id, password=PASSWORD)
        return Run(OURS, rep, metrics)

    await _with_etcd(opts, report, live, one)


async def recover_once(
    recoverer: BookKeeper,
    lh: Any,
    *,
    size: int,
    acked: int,
    in_flight: int,
    settle_s: float = 0.5,
    password: bytes = PASSWORD,
) -> dict[str, Any]:
    """The writer of ``lh`` appends ``acked`` entries and waits for them, sends ``in_flight`` more and
    dies (aborted right after the frames left: what a kill -9 leaves); ``recoverer`` (connections
    already up, as a taking-over leader's) then times ``open_ledger(recovery=True)``."""
    payload = os.urandom(size)
    futures = [await lh.append_async(payload) for _ in range(acked)]
    await asyncio.gather(*futures)
    for _ in range(in_flight):
        await lh.append_async(payload)
    await asyncio.sleep(0)  # the frames are written in this tick ...
    await asyncio.sleep(0)
    lac_at_death = lh.last_add_confirmed
    lh.abort()  # ... and the writer is gone (its frames left: the kernel sends them after a kill -9)
    await asyncio.sleep(settle_s)
    md = lh.metadata
    warm = await recoverer.create_ledger(
        md.ensemble_size, md.write_quorum, md.ack_quorum, custom_metadata=dict(md.custom_metadata)
    )
    try:
        await warm.append(b"w")
        await warm.close()
    finally:
        warm.abort()
        await recoverer.delete_ledger(warm.id)
    started = clock()
    rh = await recoverer.open_ledger(lh.id, password=password, recovery=True)
    elapsed = clock() - started
    if rh.last_add_confirmed < lac_at_death:
        raise BenchFailed(f"recovery lost entries: last {rh.last_add_confirmed} < LAC {lac_at_death}")
    return {
        "recovery_s": round(elapsed, 4),
        "lac_at_death": lac_at_death,
        "recovered_entries": rh.last_add_confirmed - lac_at_death,
    }


# ------------------------------------------------------------------ log
async def run_log(opts: BenchOptions, url: str, report: Report, live: LiveLine) -> None:
    report.cluster = {"metadata_url": url}
    payload = os.urandom(opts.size)
    passes = ("ledger", "log", "log_roll")

    async def one_pass(which: str, rep: int) -> Run:
        live.show(f"log rep {rep}: {which} ...")
        config = ClientConfig.load(add_window_max=opts.window)
        async with BookKeeper.connect(url, config=config) as bk:
            if which == "ledger":
                target: Any = await _bench_ledger(bk, opts)
            else:
                name = f"bkaio-bench-{uuid.uuid4().hex[:8]}"
                target = await open_log_writer(
                    bk,
                    name,
                    ensemble=opts.ensemble,
                    write_quorum=opts.write_quorum,
                    ack_quorum=opts.ack_quorum,
                    password=PASSWORD,
                    roll_entries_max=opts.roll_every if which == "log_roll" else None,
                )
            try:
                await target.append(b"warm-up")
                span = Span(clock(), opts.warmup_s, opts.duration_s, max(0.1, opts.duration_s / 40))

                async def submit() -> asyncio.Future[Any]:
                    future: asyncio.Future[Any] = await target.append_async(payload)
                    return future

                result = await drive(
                    [submit], span, window=opts.window, rate=opts.rate, latency_from=opts.latency_from
                )
                ledgers = len(target.ledger_ids) if which != "ledger" else 1
                await target.close()
            finally:
                if which == "ledger":
                    await bk.delete_ledger(target.id, password=PASSWORD)
                else:
                    await delete_log(bk, name, password=PASSWORD)
        hist = result.histogram()
        return Run(
            which,
            rep,
            {
                "entries_per_s": round(result.acked / opts.duration_s, 1),
                **{f"{k}_ms": v for k, v in latency_ms(hist).items()},
                "client_cpu_us_per_entry": round(result.cpu_s / result.acked * 1e6, 2)
                if result.acked
                else None,
                "ledgers": ledgers,
            },
            histogram=hist,
            timeline=[round(n / span.interval_s, 1) for n in result.timeline],
            timeline_interval_s=span.interval_s,
        )

    async def one_rep(rep: int) -> list[Run]:
        order = list(passes[rep % 3 :] + passes[: rep % 3])  # rotating: no pass always runs first
        return [await one_pass(which, rep) for which in order]

    await _with_etcd(opts, report, live, one_rep)
    summary = report.summary()
    if "ledger" in summary:
        base = summary["ledger"].get("entries_per_s")
        for which in ("log", "log_roll"):
            value = summary.get(which, {}).get("entries_per_s")
            if base and value is not None:
                report.notes.append(f"{which} / ledger throughput (medians): {value / base:.3f}")


# ------------------------------------------------------------------ restart
async def run_restart(opts: BenchOptions, url: str, report: Report, live: LiveLine) -> None:
    report.cluster = {"metadata_url": url}
    bookie_id = f"{RESTART_BOOKIE_PREFIX}{uuid.uuid4().hex[:8]}"
    base = Path(tempfile.mkdtemp(prefix="bkaio-bench-restart-"))
    port, admin_port = free_port(), free_port()
    argv = [
        sys.executable, "-m", "bookie", "--data-dir", str(base / "data"), "--bookie-id", bookie_id,
        "--host", "127.0.0.1", "--port", str(port), "--metadata", url, "--admin-port", str(admin_port),
    ]  # fmt: skip
    log_path = opts.out / "logs" / f"{bookie_id}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    async with metadata.connect(url) as meta:
        await sweep_restart_leftovers(meta)
    proc = _start_bookie(argv, log_path)
    made: list[int] = []  # the run's ledgers: deleted however it ends (Ctrl-C included)
    try:
        await _wait(lambda: port_open("127.0.0.1", port), proc, log_path)
        async with metadata.connect(url) as meta:
            try:
                ledger_id = await _fill_journal(opts, meta, bookie_id, port, live, made)
                for rep in range(opts.reps):
                    live.show(f"restart rep {rep}: kill -9, restart, replay ...")
                    key = ClusterKeys(meta.root).bookie("writable", bookie_id)
                    old = await meta.store.get(key)
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
                    killed = clock()
                    proc = _start_bookie(argv, log_path)
                    old_lease = 0 if old is None else old.lease_id
                    times = await _restart_times(
                        proc, log_path, meta, key, old_lease, port, admin_port, killed
                    )
                    await _check_readable(meta, bookie_id, port, ledger_id)
                    report.add(Run(OURS, rep, {**times, "journal_mib": opts.journal_mib}))
            finally:
                for made_id in made:
                    with contextlib.suppress(metadata.NoSuchLedger):
                        await meta.ledger_manager().delete(made_id)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        await _forget_cookie(url, bookie_id)
        await asyncio.to_thread(shutil.rmtree, base, True)


RESTART_BOOKIE_PREFIX = "bkaio-bench-"
"""The restart scenario's own bookie ids start with this (its cookie is deleted when the run ends)."""


async def sweep_restart_leftovers(meta: metadata.MetadataConnection) -> list[int]:
    """Delete the ledgers an interrupted ``bench restart`` of an older version (or a killed one) left:
    marked ``bkaio-bench: restart``, on the benchmark's own bookies only, none of which still has a
    cookie (so no run in progress owns them; their data went with the bookie). Returns their ids."""
    manager = meta.ledger_manager()
    gone: list[int] = []
    start_after: int | None = None
    while True:
        page = await manager.read_page(start_after=start_after, on_undecodable=lambda _id, _exc: None)
        for ledger_id, versioned in page.ledgers.items():
            md = versioned.metadata
            if md.custom_metadata.get(BENCH_MARK) != b"restart":
                continue
            names = {bookie for _first, ensemble in md.ensembles for bookie in ensemble}
            if not all(name.startswith(RESTART_BOOKIE_PREFIX) for name in names):
                continue
            if any([await metadata.read_cookie(meta.store, meta.root, name) for name in names]):
                continue
            with contextlib.suppress(metadata.NoSuchLedger):
                await manager.delete(ledger_id)
            gone.append(ledger_id)
        if not page.more or not page.ledger_ids:
            return gone
        start_after = page.ledger_ids[-1]


def _start_bookie(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:
        return subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=log,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "BKAIO_LOG_FORMAT": "json"},
        )


async def _wait(ready: Any, proc: subprocess.Popen[bytes], log_path: Path) -> float:
    deadline = clock() + RESTART_TIMEOUT_S
    while True:
        if await asyncio.to_thread(ready):
            return clock()
        if proc.poll() is not None:
            raise BenchFailed(f"the benchmark's bookie exited with {proc.returncode}; see {log_path}")
        if clock() > deadline:
            raise BenchFailed(
                f"the benchmark's bookie was not back after {RESTART_TIMEOUT_S:.0f} s; see {log_path}"
            )
        await asyncio.sleep(0.02)


def _client(meta: metadata.MetadataConnection, bookie_id: str, port: int, window: int) -> BookKeeper:
    """A client that places ledgers on the benchmark's own bookie only."""
    return BookKeeper(
        meta.ledger_manager(),
        StaticDirectory([bookie_id]),
        config=ClientConfig(add_window_max=window),
        resolver=StaticResolver({bookie_id: ("127.0.0.1", port)}),
    )


async def _fill_journal(
    opts: BenchOptions,
    meta: metadata.MetadataConnection,
    bookie_id: str,
    port: int,
    live: LiveLine,
    made: list[int],
) -> int:
    """Write ``--journal-mib`` to one ledger on the benchmark's bookie; its id goes in ``made`` as
    soon as it exists (the caller deletes it however the run ends)."""
    entries = max(1, opts.journal_mib * 2**20 // opts.size)
    bk = _client(meta, bookie_id, port, opts.window)
    try:
        lh = await bk.create_ledger(1, 1, 1, password=PASSWORD, custom_metadata=_marked(opts))
        made.append(int(lh.id))
        await _fill(lh, entries, opts.size, live, f"restart: writing {opts.journal_mib} MiB to the journal")
        await lh.close()
    finally:
        bk.abort()
    return int(lh.id)


async def _restart_times(
    proc: subprocess.Popen[bytes],
    log_path: Path,
    meta: metadata.MetadataConnection,
    key: str,
    old_lease: int,
    port: int,
    admin_port: int,
    killed: float,
) -> dict[str, float]:
    async def registered() -> float:
        """The killed incarnation's key stays until its lease is revoked or expires: registered
        means the key is there again under another lease."""
        while True:
            found = await meta.store.get(key)
            if found is not None and found.lease_id != old_lease:
                return clock()
            await asyncio.sleep(0.02)

    # one task group: a Ctrl-C (or one of them failing) cancels and awaits the others, so none
    # is left to fail unseen once the bookie is stopped
    try:
        async with asyncio.TaskGroup() as group:
            serving = group.create_task(_wait(lambda: port_open("127.0.0.1", port), proc, log_path))
            ready = group.create_task(
                _wait(lambda: _http_ok(f"http://127.0.0.1:{admin_port}/ready"), proc, log_path)
            )
            registering = group.create_task(asyncio.wait_for(registered(), RESTART_TIMEOUT_S))
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None  # the first failure, as the CLI reports one
    serving_at, ready_at, registered_at = serving.result(), ready.result(), registering.result()
    return {
        "serving_s": round(serving_at - killed, 3),
        "registered_s": round(registered_at - killed, 3),
        "ready_s": round(ready_at - killed, 3),
    }


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


async def _check_readable(
    meta: metadata.MetadataConnection, bookie_id: str, port: int, ledger_id: int
) -> None:
    bk = _client(meta, bookie_id, port, 10)
    try:
        rh = await bk.open_ledger(ledger_id, password=PASSWORD)
        async for _entry in rh.read(rh.last_add_confirmed, rh.last_add_confirmed):
            pass
    finally:
        bk.abort()


async def _forget_cookie(url: str, bookie_id: str) -> None:
    """The benchmark's bookie leaves nothing in the cluster: its cookie goes with its data."""
    with contextlib.suppress(Exception):
        async with metadata.connect(url) as meta:
            cookie = await metadata.read_cookie(meta.store, meta.root, bookie_id)
            if cookie is not None:
                await metadata.delete_cookie(meta.store, meta.root, bookie_id, cookie[1])
