"""``bkaio autorecovery run|status|enable|disable|list-underreplicated``, ``bkaio recover BOOKIE``,
``bkaio decommission BOOKIE`` (docs/autorecovery.md).

``recover`` and ``decommission`` do the work in this process, as BookKeeper's shell does: they mark
every ledger on the bookie and heal the marks with a replication worker of their own (locks bound
to their own lease, so they never copy a ledger a daemon is copying), with a progress bar; a ledger
a daemon holds is waited for.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

import metadata
from bookkeeper_aio.autorecovery.auditor import mark_ledgers_on
from bookkeeper_aio.autorecovery.config import AutorecoveryConfig
from bookkeeper_aio.autorecovery.daemon import AutorecoveryDaemon, ReplacementDirectory
from bookkeeper_aio.autorecovery.errors import EntryUnavailable, NoPasswordForLedger
from bookkeeper_aio.autorecovery.lease import KeptLease
from bookkeeper_aio.autorecovery.metrics import AutorecoveryCollector, AutorecoveryMetrics
from bookkeeper_aio.autorecovery.worker import ReplicationWorker
from bookkeeper_aio.cli import output
from bookkeeper_aio.cli import passwords as cli_passwords
from bookkeeper_aio.cli.admin_endpoint import ADMIN_TIMEOUT_S, check_admin_is, registered_admin
from bookkeeper_aio.cli.argtypes import int_in
from bookkeeper_aio.cli.demo import DEMO_PASSWORD
from bookkeeper_aio.cli.state import ADMIN_TOKEN_ENV, admin_token, resolve_metadata_url
from bookkeeper_aio.client.bookkeeper import BookKeeper, RegistryDirectory
from bookkeeper_aio.errors import BKError, BKInterfaceError, NotEnoughBookies
from metadata.keys import validate_name
from metadata.underreplication import UnderReplicationManager

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

METRICS_HOST = "127.0.0.1"
"""Where ``autorecovery run --metrics-port`` listens unless ``--metrics-host`` says otherwise."""
HEAL_RETRY_S = 1.0
PROBLEM_SHOWN_MAX = 100
"""Characters of the latest heal problem the progress line shows."""


class NoSuchClusterHere(BKInterfaceError):
    """The URL's root holds no cluster."""


async def _connect(args: argparse.Namespace, *, daemon: bool = False) -> metadata.MetadataConnection:
    """The cluster's metadata; a ``daemon`` is not refused at once by an etcd that is restarting
    (no fail-fast probe: the store's retry budget applies)."""
    url = resolve_metadata_url(args.metadata, probe=not daemon)
    meta = metadata.connect(url)
    if await metadata.read_cluster_info(meta.store, meta.root) is None:
        await meta.close()
        raise NoSuchClusterHere(f"no cluster at {url}: run `bkaio cluster init --metadata {url}` first")
    return meta


def _config(args: argparse.Namespace) -> AutorecoveryConfig:
    values: dict[str, Any] = {"passwords": cli_passwords.passwords(args, many=True)}
    for name in (
        "lost_bookie_recovery_delay_s",
        "open_ledger_grace_s",
        "audit_interval_s",
        "check_interval_s",
        "workers",
        "lease_ttl_s",
        "copy_window",
    ):
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    if getattr(args, "copy_rate_mb", None) is not None:
        values["copy_bytes_per_s"] = args.copy_rate_mb * 1_000_000
    return AutorecoveryConfig(**values)


# ---- run ------------------------------------------------------------------------------------------


async def cmd_run(args: argparse.Namespace) -> int:
    config = _config(args)
    meta = await _connect(args, daemon=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        daemon = AutorecoveryDaemon(meta, config, daemon_id=args.id)
        if args.metrics_port is not None:
            serve_metrics(daemon.metrics, args.metrics_host, args.metrics_port)
        async with daemon:
            print(f"READY autorecovery {daemon.daemon_id} workers={config.workers}", flush=True)
            if args.parent_pid is not None:
                watcher = asyncio.create_task(_exit_with(args.parent_pid, stop))
            await stop.wait()
            if args.parent_pid is not None:
                watcher.cancel()
    finally:
        await meta.close()
    return 0


def serve_metrics(metrics: AutorecoveryMetrics, host: str, port: int) -> WSGIServer:
    """Serve ``metrics`` to Prometheus on ``host:port`` (a thread of prometheus_client's). The
    command binds loopback unless told otherwise (``--metrics-host``), like a bookie's admin
    endpoint: prometheus_client's own default is every interface."""
    from prometheus_client import start_http_server
    from prometheus_client.registry import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(AutorecoveryCollector(metrics))
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as error:
        reason = error.strerror or str(error)
        if error.errno == errno.EADDRINUSE:
            hint = (
                f"another process listens on port {port} (`ss -ltnp 'sport = :{port}'` shows which): "
                "choose another --metrics-port"
            )
        else:
            hint = "check --metrics-host (an address of this host, or 0.0.0.0) and --metrics-port"
        raise BKInterfaceError(
            f"the metrics endpoint cannot listen on {host}:{port}: {reason}; {hint}"
        ) from error
    return server


async def _exit_with(pid: int, stop: asyncio.Event) -> None:
    """Set ``stop`` once process ``pid`` is gone (a supervisor killed with SIGKILL leaves no orphan)."""
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            stop.set()
            return
        except PermissionError:
            pass  # alive, another user's
        await asyncio.sleep(1.0)


# ---- status / switch / list -----------------------------------------------------------------------


async def cmd_status(args: argparse.Namespace) -> int:
    meta = await _connect(args)
    async with meta:
        urm = UnderReplicationManager(meta.store, meta.root)
        leader = await meta.store.get(meta.keys.auditor)
        daemons = await urm.statuses()
        locks = await urm.locks()
        summary = {
            "enabled": await urm.is_enabled(),
            "auditor": None if leader is None else leader.value.decode(errors="replace"),
            "under_replicated_ledgers": await urm.count(),
            "ledgers_being_healed": len(locks),
            "decommissioning": sorted(await urm.decommissioning()),
            "daemons": daemons,
        }
    if args.json:
        output.emit(summary, as_json=True)
        return 0
    output.emit({k: v for k, v in summary.items() if k != "daemons"}, as_json=False)
    rows = [
        {
            "daemon": name,
            "auditor": "yes" if status.get("is_auditor") else "",
            "workers": status.get("workers", ""),
            "healed": status.get("ledgers_healed", 0),
            "copied": _size(status.get("bytes_copied", 0)),
            "entries": status.get("entries_copied", 0),
            "failures": status.get("heal_failures", 0),
            "heal_s_max": round(float(status.get("heal_seconds_max", 0.0)), 1),
            "heal_s_last": round(float(status.get("heal_seconds_last", 0.0)), 1),
        }
        for name, status in sorted(daemons.items())
    ]
    print()
    output.print_table(rows)
    if not daemons:
        print("no autorecovery daemon is running: start one with `bkaio autorecovery run`", file=sys.stderr)
    return 0


def _size(value: object) -> str:
    amount = float(value) if isinstance(value, int | float) else 0.0
    for unit in ("B", "KiB", "MiB", "GiB"):
        if amount < 1024 or unit == "GiB":
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    return str(value)


async def cmd_enable(args: argparse.Namespace) -> int:
    meta = await _connect(args)
    async with meta:
        await UnderReplicationManager(meta.store, meta.root).set_enabled(True)
    output.emit({"enabled": True}, as_json=args.json)
    return 0


async def cmd_disable(args: argparse.Namespace) -> int:
    meta = await _connect(args)
    async with meta:
        await UnderReplicationManager(meta.store, meta.root).set_enabled(False)
    output.emit({"enabled": False}, as_json=args.json)
    return 0


async def cmd_list(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise BKInterfaceError(f"--limit must be >= 1, got {args.limit}")
    meta = await _connect(args)
    async with meta:
        urm = UnderReplicationManager(meta.store, meta.root)
        if args.bookie is None:
            marks, more = await urm.list_page(start_after=args.after, limit=args.limit)
        else:  # only the ledgers missing this bookie, up to --limit of them
            marks, more = [], False
            async for mark in urm.iter_marks():
                if args.after is not None and mark.ledger_id <= args.after:
                    continue
                if args.bookie in mark.missing:
                    if len(marks) == args.limit:
                        more = True
                        break
                    marks.append(mark)
        holders = {lock.ledger_id: lock.owner for lock in await urm.locks()}
    now_ms = time.time_ns() // 1_000_000
    rows = [
        {
            "ledger_id": mark.ledger_id,
            "missing": ",".join(mark.missing),
            "reasons": ",".join(mark.reasons),
            "marked_s_ago": round((now_ms - mark.marked_ms) / 1000, 1),
            "healing_by": holders.get(mark.ledger_id, ""),
        }
        for mark in marks
    ]
    if args.json:
        output.emit({"ledgers": rows, "more": more}, as_json=True)
    else:
        output.print_table(rows)
        if more:
            print(f"(more: --after {marks[-1].ledger_id})")
    return 0


# ---- recover / decommission -----------------------------------------------------------------------


NEEDS_OPERATOR: dict[type[BKError], str] = {
    NoPasswordForLedger: "give the ledger's password (--password PW or --password-file FILE)",
    NotEnoughBookies: "start a writable bookie that the ledger's fragments do not list (every other "
    "one is in them already, read-only, or being decommissioned)",
    EntryUnavailable: "bring {bookie} back: no other replica has the entry, its disk may hold the only copy",
}
"""Heal failures that do not pass by themselves (unlike a metadata timeout, a daemon holding the
ledger, an unreachable replica), with what the operator can do."""
STUCK_S = 10.0
"""How long every pending ledger may keep failing for a reason of `NEEDS_OPERATOR` before
``recover`` / ``decommission`` stop, instead of retrying until ``--timeout`` (a bookie restarting
passes within it)."""


@dataclasses.dataclass(frozen=True)
class HealOutcome:
    """What an inline heal did: ledgers ``healed``, the problems ``left`` (one line per ledger), and
    ``stuck``: the error kinds (keys of `NEEDS_OPERATOR`) that made it stop before its timeout
    (empty: it did not)."""

    healed: int
    left: list[str]
    stuck: tuple[type[BKError], ...] = ()


async def _heal_inline(
    bk: BookKeeper,
    urm: UnderReplicationManager,
    config: AutorecoveryConfig,
    ledger_ids: list[int],
    bookie_id: str,
    timeout_s: float,
    label: str,
) -> HealOutcome:
    """Heal the marks of ``ledger_ids`` with a worker of this process, under a lease kept alive
    (a new one when it expired, as the daemon's) until done or ``timeout_s``. A ledger whose heal
    failed (metadata timing out, no replacement, ...) is tried again at the next round, its problem
    kept for the report and the latest one shown in the progress line; once every ledger left has
    failed for `STUCK_S` for a reason that needs the operator (`NEEDS_OPERATOR`), it stops."""
    lease = KeptLease(urm.store, config.lease_ttl_s, owner=f"{label}-{bookie_id}")
    await lease.start()
    worker = ReplicationWorker(bk, urm, config, worker_id=f"{label}-{bookie_id}")
    pending = set(ledger_ids)
    problems: dict[int, str] = {}
    blocked: dict[int, type[BKError]] = {}  # ledger -> the NEEDS_OPERATOR kind its last try met
    latest = ""
    progress = output.Progress("heal", len(ledger_ids))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    stuck_since: float | None = None
    stuck: tuple[type[BKError], ...] = ()

    def status() -> str:
        copied = f"copied {_size(worker.metrics.bytes_copied)}"
        return f"{copied}; {latest[:PROBLEM_SHOWN_MAX]}" if latest else copied

    try:
        while pending and loop.time() < deadline:
            for ledger_id in sorted(pending):
                try:
                    mark = await urm.get(ledger_id)
                    if mark is None or bookie_id not in mark.missing:
                        pending.discard(ledger_id)
                        continue
                    lock = await urm.acquire(ledger_id, worker.worker_id, lease.lease_id())
                    if lock is None:  # a daemon's turn: what our last try met still holds
                        if ledger_id not in blocked:
                            problems[ledger_id] = "being healed by a daemon"
                        continue
                    blocked.pop(ledger_id, None)
                    result = await worker.heal_locked(lock)
                    if result.resolved or bookie_id in result.healed:
                        pending.discard(ledger_id)
                        problems.pop(ledger_id, None)
                        latest = ""
                    else:
                        problems[ledger_id] = "open ledger: waiting for its writer or the grace period"
                except (BKError, metadata.MetadataError, TimeoutError) as error:
                    # as in the daemon: retried at the next round (LeaseExpired: a new lease soon)
                    problems[ledger_id] = f"{type(error).__name__}: {str(error) or 'no answer in time'}"
                    latest = f"ledger {ledger_id}: {problems[ledger_id]}"
                    kind = next((kind for kind in NEEDS_OPERATOR if isinstance(error, kind)), None)
                    if kind is None:
                        blocked.pop(ledger_id, None)
                    else:
                        blocked[ledger_id] = kind
                progress.update(len(ledger_ids) - len(pending), status())
            if pending and all(ledger_id in blocked for ledger_id in pending):
                stuck_since = loop.time() if stuck_since is None else stuck_since
                if loop.time() - stuck_since >= STUCK_S:
                    stuck = tuple(sorted({blocked[lid] for lid in pending}, key=lambda kind: kind.__name__))
                    break
            else:
                stuck_since = None
            if pending:
                await asyncio.sleep(HEAL_RETRY_S)
        progress.update(len(ledger_ids) - len(pending), status())
        progress.finish(status())
    finally:
        await lease.close()
    left = [f"ledger {lid}: {problems.get(lid, 'not healed in time')}" for lid in sorted(pending)]
    return HealOutcome(len(ledger_ids) - len(pending), left, stuck)


@dataclasses.dataclass(frozen=True)
class BookiePresence:
    """What the cluster holds of one bookie id: its cookie, its registration, ledgers naming it."""

    cookie: bool
    registered: bool
    ledgers: tuple[int, ...]  # the first few ledgers whose ensembles name it
    writable: bool = False  # registered as writable (it runs and takes writes)

    @property
    def known(self) -> bool:
        return self.cookie or self.registered or bool(self.ledgers)


async def bookie_presence(
    meta: metadata.MetadataConnection, bookie_id: str, ledgers_max: int = 10
) -> BookiePresence:
    """Look ``bookie_id`` up: cookie, registration, and (one scan of the ledgers) which name it."""
    cookie = await metadata.read_cookie(meta.store, meta.root, bookie_id)
    bookies = await metadata.list_bookies(meta.store, meta.root)
    naming: list[int] = []
    manager = meta.ledger_manager()
    start_after: int | None = None
    while len(naming) < ledgers_max:
        page = await manager.read_page(start_after=start_after, on_undecodable=lambda _id, _exc: None)
        for ledger_id, versioned in sorted(page.ledgers.items()):
            if any(bookie_id in ensemble for _first, ensemble in versioned.metadata.ensembles):
                naming.append(ledger_id)
        if not page.more or not page.ledger_ids:
            break
        start_after = page.ledger_ids[-1]
    return BookiePresence(
        cookie is not None,
        bookie_id in bookies.registered,
        tuple(naming[:ledgers_max]),
        writable=bookie_id in bookies.writable,
    )


async def require_known_bookie(
    meta: metadata.MetadataConnection, bookie_id: str, command: str
) -> BookiePresence:
    """``bookie_id``'s presence; exits (status 1) when the cluster has no trace of it: a typo must
    not succeed silently."""
    presence = await bookie_presence(meta, bookie_id)
    if not presence.known:
        raise SystemExit(
            f"{command}: no bookie {bookie_id!r} in this cluster (no cookie, no registration, no "
            "ledger names it): see `bkaio bookies` for the registered ones"
        )
    return presence


def _client(meta: metadata.MetadataConnection, urm: UnderReplicationManager) -> BookKeeper:
    registry = RegistryDirectory(meta.store, meta.root)
    return BookKeeper(meta.ledger_manager(), ReplacementDirectory(registry, urm), resolver=registry)


async def cmd_recover(args: argparse.Namespace) -> int:
    """Re-replicate every ledger fragment on BOOKIE (lost, or suspect) to other bookies; refused
    for a bookie registered writable unless ``--force``. With ``--cancel``: drop the marks a
    recover of it left."""
    if args.cancel:
        return await _cancel_recover(args)
    config = _config(args)
    meta = await _connect(args)
    async with meta:
        bookie_id = validate_name(args.bookie_id, "bookie id")
        presence = await require_known_bookie(meta, bookie_id, "bkaio recover")
        if presence.writable and not args.force:
            raise SystemExit(
                f"bkaio recover: {bookie_id} is registered and writable (it runs): recover is for a lost "
                "or suspect bookie; it marks every ledger on it, and the marks stay until each is copied "
                "elsewhere (the daemons retry them, the under-replicated count stays up). To retire a "
                f"running bookie use `bkaio decommission {bookie_id}`; to copy its ledgers anyway (a "
                f"suspect disk) add --force. A bookie that was just killed stays registered until its "
                "registration's lease runs out (its registration_ttl_s, 10 s by default): run this again "
                f"then. `bkaio recover --cancel {bookie_id}` drops the marks an earlier recover left"
            )
        urm = UnderReplicationManager(meta.store, meta.root)
        bk = _client(meta, urm)
        try:
            code = await _recover(args, config, meta, urm, bk, reason="operator")
        finally:
            await bk.close()
    return code


async def _recover(
    args: argparse.Namespace,
    config: AutorecoveryConfig,
    meta: metadata.MetadataConnection,
    urm: UnderReplicationManager,
    bk: BookKeeper,
    *,
    reason: str,
) -> int:
    bookie_id = validate_name(args.bookie_id, "bookie id")
    ledgers = meta.ledger_manager()
    total = 0
    async for _ in ledgers.iter_ledger_ids():
        total += 1
    scan = output.Progress("scan", total)
    marked = await mark_ledgers_on(
        ledgers,
        urm,
        {bookie_id},
        reason=reason,
        progress=lambda s, m: scan.update(min(s, total), f"marked {m}"),
    )
    scan.finish(f"marked {len(marked)}")
    outcome = await _heal_inline(bk, urm, config, marked, bookie_id, args.timeout, reason)
    result = {"bookie": bookie_id, "ledgers": len(marked), "healed": outcome.healed, "left": outcome.left}
    if outcome.stuck:
        result["stopped"] = [kind.__name__ for kind in outcome.stuck]
    output.emit(result, as_json=args.json)
    if outcome.stuck:
        todo = "; ".join(
            f"{kind.__name__}: {NEEDS_OPERATOR[kind].format(bookie=bookie_id)}" for kind in outcome.stuck
        )
        print(
            f"stopped before --timeout: for {STUCK_S:.0f} s every ledger left failed for a reason that "
            f"does not pass by itself. {todo}. Then run this again; their marks stay meanwhile (the "
            "autorecovery daemons meet the same problem)",
            file=sys.stderr,
        )
        return 1
    if outcome.left:
        print(
            f"{len(outcome.left)} ledger(s) still list {bookie_id}; their marks stay for the autorecovery "
            "daemons (`bkaio autorecovery list-underreplicated`), or run this again",
            file=sys.stderr,
        )
        return 1
    return 0


async def cmd_decommission(args: argparse.Namespace) -> int:
    """Move every ledger off a live (or dead) bookie, then let it leave: afterwards no ledger lists
    it and its cookie is gone. With ``--cancel``: end a decommission left in progress."""
    if args.cancel:
        return await _cancel_decommission(args)
    config = _config(args)
    meta = await _connect(args)
    async with meta:
        urm = UnderReplicationManager(meta.store, meta.root)
        bookie_id = validate_name(args.bookie_id, "bookie id")
        await require_known_bookie(meta, bookie_id, "bkaio decommission")
        admin = args.admin or await registered_admin(meta, bookie_id)
        token = None
        if admin:  # before anything is recorded: a loopback admin address names this host's bookie
            await asyncio.to_thread(check_admin_is, admin, bookie_id)
            token = admin_token(args.admin_token_file)
            if token is None:
                raise BKInterfaceError(
                    f"making {bookie_id} read-only through its admin endpoint {admin} needs its admin "
                    f"token: pass --admin-token-file FILE (or set ${ADMIN_TOKEN_ENV}): the bookie's "
                    "admin_token_file, or <its data dir>/admin.token"
                )
        # a run before left it in progress (the re-run _say_in_progress asks for): its marks stand
        resumed = bookie_id in await urm.decommissioning()
        await urm.start_decommission(bookie_id)  # never chosen as a replacement from now on
        if admin:
            try:
                await asyncio.to_thread(_set_read_only, admin, token, True)
            except BaseException:
                if resumed:  # ending it would leave the marks for it naming a replacement candidate
                    _say_in_progress(bookie_id)
                else:  # this run started it and marked nothing yet: no decommission is left behind
                    await urm.end_decommission(bookie_id)
                raise
        else:
            print(
                f"{bookie_id} publishes no admin endpoint and --admin was not given: it is not made "
                "read-only, so writers may still place new ledgers on it (they are moved off by the "
                "next scan)",
                file=sys.stderr,
            )
        bk = _client(meta, urm)
        ended = False
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + args.timeout
            while True:  # new ledgers may have been placed on it meanwhile: until a scan finds none
                code = await _recover(args, config, meta, urm, bk, reason="decommission")
                if code != 0:  # timed out, or stuck on what needs the operator: said already
                    return code
                marked = await mark_ledgers_on(meta.ledger_manager(), urm, {bookie_id}, reason="decommission")
                if not marked:
                    break
                if loop.time() >= deadline:
                    print(f"ledgers still on {bookie_id}: {marked[:20]}", file=sys.stderr)
                    return 1
            cookie = await metadata.read_cookie(meta.store, meta.root, bookie_id)
            if cookie is not None:
                await metadata.delete_cookie(meta.store, meta.root, bookie_id, cookie[1])
            # the auditor's record of its data dir goes with the cookie (a fresher record stays)
            await urm.forget_instance(bookie_id, None if cookie is None else cookie[0].instance_id)
            await urm.end_decommission(bookie_id)
            ended = True
        finally:
            await bk.close()
            if not ended:  # failed, timed out or interrupted: say how to go on, or out
                _say_in_progress(bookie_id)
    print(
        f"{bookie_id} holds no ledger that metadata lists and its cookie is gone: stop it now",
        file=sys.stderr,
    )
    return 0


def _say_in_progress(bookie_id: str) -> None:
    print(
        f"the decommission of {bookie_id} is still in progress: it is never chosen as a replacement, "
        "the autorecovery daemons go on moving its ledgers off (fencing open ones after the grace), "
        f"and its cookie stays. Run `bkaio decommission {bookie_id}` again to finish it, or "
        f"`bkaio decommission --cancel {bookie_id}` to end it and keep the bookie in service",
        file=sys.stderr,
    )


async def _cancel_decommission(args: argparse.Namespace) -> int:
    """End ``args.bookie_id``'s decommission: it may be chosen as a replacement again, the marks
    that list it for the decommission alone lose it (those for another reason keep it: a lost or
    replaced bookie must still be healed), and the manual read-only mode the decommission set
    through its admin endpoint is cleared. Ledgers already moved off it stay where they are."""
    meta = await _connect(args)
    async with meta:
        urm = UnderReplicationManager(meta.store, meta.root)
        bookie_id = validate_name(args.bookie_id, "bookie id")
        was_leaving = bookie_id in await urm.decommissioning()
        await urm.end_decommission(bookie_id)  # first: from now on no worker takes it for gone
        dropped = 0
        async for mark in urm.iter_marks(on_undecodable=lambda _id, _error: None):
            if bookie_id in mark.missing and mark.reasons_of(bookie_id) == ("decommission",):
                await urm.unmark(mark.ledger_id, bookie_id, "decommission")
                dropped += 1
        admin = args.admin or await registered_admin(meta, bookie_id)
    result: dict[str, Any] = {
        "bookie": bookie_id,
        "was_decommissioning": was_leaving,
        "marks_dropped": dropped,
        "writable": False,
    }
    if admin:
        token = admin_token(args.admin_token_file)
        if token is None:
            output.emit(result, as_json=args.json)
            raise BKInterfaceError(
                f"the decommission of {bookie_id} is ended, but making it writable again through its "
                f"admin endpoint {admin} needs its admin token: pass --admin-token-file FILE (or set "
                f"${ADMIN_TOKEN_ENV}) and run this again"
            )
        await asyncio.to_thread(check_admin_is, admin, bookie_id)
        await asyncio.to_thread(_set_read_only, admin, token, False)
        result["writable"] = True
    else:
        print(
            f"{bookie_id} publishes no admin endpoint (not registered?) and --admin was not given: if "
            "the decommission made it read-only, clear that with POST /readonly?set=0 on its admin "
            "endpoint once it runs",
            file=sys.stderr,
        )
    output.emit(result, as_json=args.json)
    return 0


async def _cancel_recover(args: argparse.Namespace) -> int:
    """End what ``bkaio recover BOOKIE`` left: the marks that list the bookie for ``operator``
    alone lose it, by CAS (`UnderReplicationManager.unmark`: a bookie also marked for another
    reason, `lost`, `replaced`, `decommission`, `check`, stays, and so do the mark's other
    bookies; a mark left with no bookie goes). Ledgers already copied elsewhere stay where they
    are."""
    meta = await _connect(args)
    async with meta:
        urm = UnderReplicationManager(meta.store, meta.root)
        bookie_id = validate_name(args.bookie_id, "bookie id")
        dropped = kept = 0
        async for mark in urm.iter_marks(on_undecodable=lambda _id, _error: None):
            if bookie_id not in mark.missing:
                continue
            if mark.reasons_of(bookie_id) == ("operator",):
                await urm.unmark(mark.ledger_id, bookie_id, "operator")
                dropped += 1
            else:
                kept += 1
    output.emit(
        {"bookie": bookie_id, "marks_dropped": dropped, "marks_kept_for_other_reasons": kept},
        as_json=args.json,
    )
    return 0


def _set_read_only(admin: str, token: str | None, read_only: bool) -> None:
    url = f"http://{admin}/readonly?set={int(read_only)}"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=ADMIN_TIMEOUT_S) as answer:
            answer.read()
    except (urllib.error.URLError, OSError) as error:
        what = "read-only" if read_only else "writable again"
        raise BKInterfaceError(
            f"could not make the bookie {what} through {url}: {error}; check --admin (the bookie's "
            "ADMIN host:port) and --admin-token-file (401/403: the bookie's admin token)"
            + (", or leave --admin out and stop writers from placing ledgers on it" if read_only else "")
        ) from error


# ---- registration ---------------------------------------------------------------------------------


def _command(sub: Any, name: str, func: Any, help_text: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help_text, description=help_text)
    parser.add_argument(
        "--metadata", help="etcd://HOST:PORT[,HOST:PORT]/ROOT (default: $BKAIO_METADATA, else the sandbox)"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=func)
    return parser


def _password_option(parser: argparse.ArgumentParser) -> None:
    cli_passwords.add_options(
        parser,
        many=True,
        what="a ledger password the workers may use (each ledger's is found by the check value its "
        f"metadata stores; default: the empty password; sandbox demo: {DEMO_PASSWORD.decode()})",
    )
    parser.add_argument(
        "--copy-rate-mb",
        type=float,
        default=None,
        help="copy at most this many MB/s (all workers together; default: unlimited)",
    )
    parser.add_argument(
        "--copy-window",
        type=int,
        default=None,
        help="entries each worker writes to a replacement at once (default 64; more copies faster and "
        "costs the replacement's foreground adds more latency: docs/autorecovery.md)",
    )
    parser.add_argument(
        "--open-ledger-grace",
        dest="open_ledger_grace_s",
        type=float,
        default=None,
        help="seconds an open ledger's last fragment is left to its writer before it is fenced (default 30)",
    )


def _recover_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bookie_id")
    _password_option(parser)
    parser.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds")


def add_commands(sub: Any) -> None:
    """Register ``autorecovery``, ``recover`` and ``decommission`` on the bkaio subparsers."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "autorecovery",
        help="the self-healing daemon and its state",
        description="The autorecovery daemon (auditor + replication workers) and its state in metadata.",
    )
    group = parser.add_subparsers(dest="autorecovery_command", required=True, metavar="COMMAND")
    run = _command(group, "run", cmd_run, "run an autorecovery daemon (auditor candidate + workers)")
    run.add_argument("--id", default=None, help="daemon id (default HOST-PID)")
    run.add_argument("--workers", type=int, default=None, help="replication workers (default 2)")
    run.add_argument(
        "--lost-bookie-delay",
        dest="lost_bookie_recovery_delay_s",
        type=float,
        default=None,
        help="seconds a bookie may be unregistered before its ledgers are re-replicated (default 30)",
    )
    run.add_argument("--audit-interval", dest="audit_interval_s", type=float, default=None)
    run.add_argument(
        "--lease-ttl",
        dest="lease_ttl_s",
        type=int,
        default=None,
        help="seconds: the daemon's lease (its locks) and the auditor election's (default 10)",
    )
    run.add_argument(
        "--check-interval",
        dest="check_interval_s",
        type=float,
        default=None,
        help="seconds between checks of every ledger's replicas (default 86400; 0: never)",
    )
    run.add_argument(
        "--metrics-port",
        type=int_in(0, 65535),
        default=None,
        help="serve Prometheus metrics on this port (0: any free one)",
    )
    run.add_argument(
        "--metrics-host",
        default=METRICS_HOST,
        help=f"the address --metrics-port listens on (default {METRICS_HOST}: this host only; 0.0.0.0 "
        "for every interface, e.g. for a Prometheus elsewhere)",
    )
    run.add_argument(
        "--parent-pid", type=int, default=None, help="exit when this process is gone (supervisors)"
    )
    _password_option(run)
    _command(group, "status", cmd_status, "auditor, switch, under-replicated count, daemons and metrics")
    _command(group, "enable", cmd_enable, "let workers re-replicate (the default)")
    _command(
        group, "disable", cmd_disable, "stop workers from taking new ledgers (the auditor keeps marking)"
    )
    listing = _command(group, "list-underreplicated", cmd_list, "ledgers marked under-replicated")
    listing.add_argument("--limit", type=int, default=100)
    listing.add_argument("--after", type=int, default=None, help="start after this ledger id")
    listing.add_argument("--bookie", default=None, help="only ledgers missing this bookie")
    recover = _command(sub, "recover", cmd_recover, "re-replicate every ledger fragment on a bookie")
    _recover_options(recover)
    recover.add_argument(
        "--force",
        action="store_true",
        help="recover a bookie that is registered and writable (refused without it: use decommission to "
        "retire a running bookie)",
    )
    recover.add_argument(
        "--cancel",
        action="store_true",
        help="drop the marks a recover of the bookie left (those for `operator` alone; a mark for another "
        "reason keeps it); ledgers already copied stay copied. Stop a running recover of it first",
    )
    decommission = _command(
        sub, "decommission", cmd_decommission, "move every ledger off a bookie, then forget it (cookie)"
    )
    _recover_options(decommission)
    decommission.add_argument(
        "--cancel",
        action="store_true",
        help="end a decommission left in progress (failed, timed out, interrupted): the bookie may be "
        "chosen as a replacement again, its marks for the decommission alone go, and it is made "
        "writable again through its admin endpoint; ledgers already moved off it stay moved",
    )
    decommission.add_argument(
        "--admin",
        default=None,
        help="the bookie's admin HOST:PORT (default: the one its registration publishes): it is made "
        "read-only first, so writers move off it and new ledgers avoid it",
    )
    decommission.add_argument(
        "--admin-token-file",
        default=None,
        help=f"file with the bookie's admin token (default ${ADMIN_TOKEN_ENV}, else the sandbox's): "
        "the bookie's admin_token_file, or <its data dir>/admin.token",
    )
