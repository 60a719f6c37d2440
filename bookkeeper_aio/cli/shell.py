"""Operator shell commands: what BookKeeper's ``bin/bookkeeper shell`` gives, on our cluster.

Each command is an ``async def cmd_<name>(args) -> int`` that prints a human table, or JSON with
``--json``. They talk to the cluster through the metadata URL (see :mod:`bookkeeper_aio.cli.state`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import fcntl
import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import metadata
from bookkeeper_aio.cli import autorecovery_commands, id_commands, output, state
from bookkeeper_aio.cli import passwords as cli_passwords
from bookkeeper_aio.cli.admin_endpoint import check_admin_is
from bookkeeper_aio.cli.argtypes import int_in
from bookkeeper_aio.cli.demo import DEMO_PASSWORD
from bookkeeper_aio.cli.state import METADATA_ENV, resolve_metadata_url
from bookkeeper_aio.client.bookkeeper import BookKeeper
from bookkeeper_aio.client.ledger import LedgerHandle
from bookkeeper_aio.errors import BKError, Unauthorized
from bookkeeper_aio.protocol import messages as m
from metadata.store import LIST_PAGE_LIMIT_MAX

BOOKIE_INFO_TIMEOUT_S = 3.0


class NoSuchCluster(RuntimeError):
    """The URL's root holds no cluster: never initialised, or a typo in the root."""


def _url(args: argparse.Namespace) -> str:
    return resolve_metadata_url(args.metadata)


async def _require_cluster(meta: metadata.MetadataConnection, url: str) -> None:
    """The check a bookie makes before registering (``bookie.registration``): a root without
    ``<root>/cluster`` is no cluster, not an empty one."""
    if await metadata.read_cluster_info(meta.store, meta.root) is not None:
        return
    where = url if urllib.parse.urlsplit(url).path else f"{url} (no root in the URL, so {meta.root})"
    raise NoSuchCluster(
        f"no cluster at {where}: run `bkaio cluster init --metadata {url}` first "
        "(or check the root in the URL: `make run` prints the sandbox's)"
    )


def _uses_sandbox(args: argparse.Namespace) -> bool:
    """Whether the cluster comes from the sandbox's state file (no --metadata, no $BKAIO_METADATA)."""
    return not args.metadata and not os.environ.get(METADATA_ENV)


async def _cluster_url(args: argparse.Namespace) -> str:
    """The metadata URL, checked to hold a cluster."""
    url = _url(args)
    async with metadata.connect(url) as meta:
        await _require_cluster(meta, url)
    return url


async def cmd_cluster_init(args: argparse.Namespace) -> int:
    async with metadata.connect(_url(args)) as meta:
        info = await metadata.ensure_cluster(meta.store, meta.root)
    output.emit(
        {"root": meta.root, "instance_id": info.instance_id, "created_ms": info.created_ms}, as_json=args.json
    )
    return 0


async def cmd_bookies(args: argparse.Namespace) -> int:
    """``--json`` gives ``free_disk`` / ``total_disk`` in bytes (null when the bookie did not say);
    the table shows them in KiB / MiB / GiB."""
    url = _url(args)
    async with metadata.connect(url) as meta:
        await _require_cluster(meta, url)
        found = await metadata.list_bookies(meta.store, meta.root)
    rows: list[dict[str, Any]] = []
    async with BookKeeper.connect(url) as bk:
        for state, bookies in (("writable", found.writable), ("readonly", found.readonly)):
            for bookie_id, info in sorted(bookies.items()):
                disk = await _bookie_info(bk, bookie_id)
                rows.append(
                    {"bookie_id": bookie_id, "state": state, "address": f"{info.host}:{info.port}", **disk}
                )
    table = [
        {**row, "free_disk": _size(row["free_disk"]), "total_disk": _size(row["total_disk"])} for row in rows
    ]
    output.emit(rows, as_json=args.json, table=table)
    return 0


async def _bookie_info(bk: BookKeeper, bookie_id: str) -> dict[str, Any]:
    try:
        response = await bk.context.pool.request(bookie_id, m.GetBookieInfoRequest, BOOKIE_INFO_TIMEOUT_S)
    except Exception as error:  # noqa: BLE001 - a dead bookie is a row, not a crash of the listing
        return {"free_disk": None, "total_disk": None, "error": type(error).__name__}
    assert isinstance(response, m.GetBookieInfoResponse)
    info = response.info
    return {
        "free_disk": _bytes(info.get("free_disk_bytes")),
        "total_disk": _bytes(info.get("total_disk_bytes")),
        "error": "" if response.status == 0 else str(response.message),
    }


def _bytes(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _size(value: object) -> str:
    if not isinstance(value, int):
        return "?"
    amount = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if amount < 1024 or unit == "TiB":
            return f"{amount:.1f} {unit}"
        amount /= 1024
    return str(value)


async def cmd_ledgers(args: argparse.Namespace) -> int:
    url = _url(args)
    async with metadata.connect(url) as meta:
        await _require_cluster(meta, url)
        page = await metadata.list_ledgers(meta.store, meta.root, start_after=args.after, limit=args.limit)
        rows = []
        if args.long:
            for ledger_id in page.ledger_ids:
                view = await metadata.show_ledger(meta.store, meta.root, ledger_id)
                rows.append(
                    {k: view[k] for k in ("ledger_id", "state", "last_entry_id", "length", "ensemble_size")}
                )
        else:
            rows = [{"ledger_id": ledger_id} for ledger_id in page.ledger_ids]
    data = {"ledgers": rows, "more": page.more}
    output.emit(data, as_json=args.json, table=rows)
    if page.more and not args.json and page.ledger_ids:
        print(f"(more: --after {page.ledger_ids[-1]})")
    return 0


async def cmd_ledger_show(args: argparse.Namespace) -> int:
    """``--json`` is :func:`metadata.describe_ledger` as is (custom metadata values in hex); the
    human view decodes them as UTF-8 where they are text and lists the ensembles one per line."""
    url = _url(args)
    async with metadata.connect(url) as meta:
        await _require_cluster(meta, url)
        view = await metadata.show_ledger(meta.store, meta.root, args.ledger_id)
    if args.json:
        output.emit(view, as_json=True)
    else:
        print("\n".join(_ledger_lines(view)))
    return 0


def _ledger_lines(view: Mapping[str, Any]) -> list[str]:
    nested = {"ensembles", "custom_metadata"}
    width = max(len(key) for key in view)
    lines = [f"{key:<{width}}  {value}" for key, value in view.items() if key not in nested]
    lines.append("ensembles (first entry: bookies)")
    lines.extend(
        f"  {ensemble['first_entry_id']}: [{', '.join(ensemble['bookies'])}]"
        for ensemble in view["ensembles"]
    )
    custom = view["custom_metadata"]
    lines.append("custom_metadata" + ("" if custom else "  (none)"))
    lines.extend(f"  {key}: {_text_or_hex(bytes.fromhex(value))}" for key, value in sorted(custom.items()))
    return lines


def _text_or_hex(value: bytes) -> str:
    """UTF-8 text when ``value`` decodes to printable text, else ``0x`` and its hex."""
    try:
        text = value.decode()
    except UnicodeDecodeError:
        text = ""
    return text if text and text.isprintable() else "0x" + value.hex()


async def cmd_ledger_read(args: argparse.Namespace) -> int:
    """``--json``: one object per entry with the whole payload, as UTF-8 text when it decodes
    (``"encoding": "utf-8"``), else base64 (``"encoding": "base64"``). The human view shows the first
    64 bytes."""
    url = await _cluster_url(args)
    async with BookKeeper.connect(url) as bk:
        try:
            rows, last = await _read_entries(bk, args)
        except Unauthorized as error:
            hint = "give the ledger's password with --password PASSWORD"
            if _uses_sandbox(args):
                hint += f" (the sandbox demo's ledgers: --password {DEMO_PASSWORD.decode()})"
            raise Unauthorized(f"{error}: {hint}") from error
    if args.json:
        output.emit(rows, as_json=True)
    elif not rows:
        print(f"(no entries in [{args.start}, {last}])")
    return 0


async def _read_entries(bk: BookKeeper, args: argparse.Namespace) -> tuple[list[dict[str, Any]], int]:
    handle = await bk.open_ledger(args.ledger_id, password=cli_passwords.password(args))
    last = handle.last_add_confirmed if args.to is None else args.to
    rows = []
    async for entry in handle.read(args.start, last):
        if args.json:
            rows.append({"entry_id": entry.entry_id, "bytes": len(entry.payload), **_whole(entry.payload)})
        else:
            rows.append({"entry_id": entry.entry_id})
            print(f"{entry.entry_id:>10}  {len(entry.payload):>8}  {_show(entry.payload)}")
    return rows, last


def _whole(payload: bytes) -> dict[str, str]:
    try:
        return {"payload": payload.decode(), "encoding": "utf-8"}
    except UnicodeDecodeError:
        return {"payload": base64.b64encode(payload).decode(), "encoding": "base64"}


def _show(payload: bytes, limit: int = 64) -> str:
    text = payload[:limit]
    try:
        shown = text.decode()
    except UnicodeDecodeError:
        shown = ""
    if not shown or not shown.isprintable():
        shown = text.hex()
    return shown + ("..." if len(payload) > limit else "")


async def cmd_ledger_delete(args: argparse.Namespace) -> int:
    async with BookKeeper.connect(await _cluster_url(args)) as bk:
        await bk.delete_ledger(args.ledger_id, password=cli_passwords.password(args))
    output.emit({"deleted": args.ledger_id}, as_json=args.json)
    return 0


async def cmd_bookie_format(args: argparse.Namespace) -> int:
    """Forget a bookie's data-dir identity (after a disk loss), optionally wiping its local data.
    Refused (unless --force) while the bookie is registered or a ledger still names it: its cookie
    is what makes it refuse to start on an empty disk, so deleting it under a live bookie, or one
    whose ledgers were not moved, hides data loss."""
    command = "bkaio bookie format"
    if args.data_dir and not args.force:
        raise SystemExit(f"{command}: wiping {args.data_dir} deletes its entries; add --force")
    url = _url(args)
    async with metadata.connect(url) as meta:
        await _require_cluster(meta, url)  # before wiping anything: a wrong URL changes nothing
        presence = await autorecovery_commands.bookie_presence(meta, args.bookie_id)
        if not presence.known and not args.data_dir:
            raise SystemExit(
                f"{command}: no bookie {args.bookie_id!r} in this cluster (no cookie, no registration, "
                "no ledger names it): see `bkaio bookies` for the registered ones"
            )
        if not args.force and (presence.registered or presence.ledgers):
            why = []
            if presence.registered:
                why.append("it is registered (running)")
            if presence.ledgers:
                more = "" if len(presence.ledgers) < 10 else ", ..."
                why.append(f"ledgers name it ({', '.join(map(str, presence.ledgers))}{more})")
            raise SystemExit(
                f"{command}: {args.bookie_id} is in use: {' and '.join(why)}. Move its ledgers off and "
                f"let it leave first (`bkaio decommission {args.bookie_id}`, or `bkaio recover "
                f"{args.bookie_id}` if it is lost and stopped), or add --force to delete its cookie anyway"
            )
        if args.data_dir:
            _wipe_data_dir(Path(args.data_dir))
        stored = await metadata.read_cookie(meta.store, meta.root, args.bookie_id)
        if stored is not None:
            await metadata.delete_cookie(meta.store, meta.root, args.bookie_id, stored[1])
    output.emit(
        {
            "bookie_id": args.bookie_id,
            "metadata_cookie_deleted": stored is not None,
            "wiped": args.data_dir or "",
        },
        as_json=args.json,
    )
    return 0


def _wipe_data_dir(path: Path) -> None:
    if not path.is_dir():
        raise SystemExit(f"bkaio bookie format: {path} is not a directory")
    lock = path / "LOCK"
    if lock.exists():
        with open(lock, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise SystemExit(
                    f"bkaio bookie format: a bookie is running on {path}; stop it first"
                ) from None
    for child in path.iterdir():
        if child.is_dir():
            shutil.rmtree(child)
        else:
            child.unlink()


GC_POLL_S = 0.5
GC_HTTP_TIMEOUT_S = 10.0


def _admin_json(address: str, path: str, method: str = "GET", token: str | None = None) -> dict[str, Any]:
    """One request to a bookie's admin endpoint (blocking: run in a thread); ``token`` for a POST."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"http://{address}{path}", method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=GC_HTTP_TIMEOUT_S) as response:
            data: dict[str, Any] = json.loads(response.read())
    except urllib.error.HTTPError as error:
        if error.code in (401, 403):
            raise SystemExit(
                f"bkaio bookie gc: the admin endpoint at {address} refused the change ({error.code}): "
                f"pass --admin-token-file FILE (or set ${state.ADMIN_TOKEN_ENV}): the bookie's "
                "admin_token_file, or <its data dir>/admin.token"
            ) from None
        raise SystemExit(f"bkaio bookie gc: {address} answered {error.code} {error.reason}") from None
    except (OSError, ValueError) as error:
        raise SystemExit(
            f"bkaio bookie gc: no answer from the admin endpoint at {address} ({error}): start the "
            "bookie with --admin-port (or check BOOKIE)"
        ) from None
    return data


async def _gc_endpoint(args: argparse.Namespace) -> str:
    """The admin endpoint of ``args.bookie``: for a bookie id registered in metadata, ``--admin``
    or the address its registration publishes, used only once it answered for that bookie (a
    published loopback address names, from another host, that host's own bookie:
    :mod:`bookkeeper_aio.cli.admin_endpoint`, as ``decommission`` does); else the argument itself
    taken as the endpoint's HOST:PORT."""
    registered = False
    admin = args.admin
    try:
        url = _url(args)
        async with metadata.connect(url) as meta:
            found = await metadata.list_bookies(meta.store, meta.root)
        info = found.writable.get(args.bookie) or found.readonly.get(args.bookie)
    except (state.NoClusterConfigured, metadata.MetadataError):
        if ":" not in args.bookie and not admin:
            raise  # a bookie id is found through the cluster: say why that failed
        info = None  # HOST:PORT, or --admin, works without it
    if info is not None:
        registered = True
        admin = admin or info.attributes.get("admin")
        if not admin:
            raise SystemExit(
                f"bkaio bookie gc: bookie {args.bookie} runs without an admin endpoint: restart it "
                "with --admin-port, or pass its admin HOST:PORT"
            )
    if admin and (registered or args.admin):
        await asyncio.to_thread(check_admin_is, admin, args.bookie)
        return str(admin)
    if ":" not in args.bookie:
        raise SystemExit(
            f"bkaio bookie gc: {args.bookie!r} is no registered bookie and not HOST:PORT (the "
            "bookie's ADMIN line)"
        )
    return str(args.bookie)


async def cmd_bookie_gc(args: argparse.Namespace) -> int:
    """Start a garbage-collection pass on one bookie (its admin endpoint) and follow it to the end."""
    args.admin = await _gc_endpoint(args)
    before = await asyncio.to_thread(_admin_json, args.admin, "/gc")
    token = state.admin_token(args.admin_token_file)
    started = await asyncio.to_thread(_admin_json, args.admin, "/gc", "POST", token)
    if not started.get("started"):
        print("a pass is already running: following it", file=sys.stderr)
    passes = before.get("passes", 0)
    progress: output.Progress | None = None
    while not args.no_wait:
        status = await asyncio.to_thread(_admin_json, args.admin, "/gc")
        if status.get("passes", 0) > passes and status.get("running") is None:
            break
        running = status.get("running") or {}
        done = running.get("progress") or {}
        if done.get("bytes_to_copy"):
            if progress is None:
                progress = output.Progress("gc: copying bytes", int(done["bytes_to_copy"]))
            progress.update(int(done.get("bytes_copied", 0)), done.get("paused") or running.get("phase", ""))
        await asyncio.sleep(GC_POLL_S)
    if progress is not None:
        progress.update(int((status.get("last") or {}).get("bytes_copied", progress.done)))
        progress.finish()
    if args.no_wait:
        output.emit({"started": bool(started.get("started"))}, as_json=args.json)
        return 0
    report = status["last"]
    fields = (
        *("phase", "error", "ledgers_collected", "ledgers_waiting_grace", "segments_compacted"),
        *("segments_deleted", "bytes_copied", "bytes_freed", "entries_corrupt"),
    )
    output.emit(report if args.json else {k: report.get(k) for k in fields}, as_json=args.json)
    if report.get("ledgers_waiting_grace"):
        print(
            f"{report['ledgers_waiting_grace']} ledgers missing from metadata wait for their grace period "
            "(gc_deleted_ledger_grace_s): a pass after it collects them",
            file=sys.stderr,
        )
    return 1 if report.get("error") else 0


async def cmd_simpletest(args: argparse.Namespace) -> int:
    """Create a ledger, write entries, read them back, delete it: the cluster works end to end."""
    password = os.urandom(8)
    started = time.perf_counter()
    async with BookKeeper.connect(await _cluster_url(args)) as bk:
        handle = await bk.create_ledger(args.ensemble, args.write_quorum, args.ack_quorum, password=password)
        try:
            payloads, read = await _write_and_read_back(bk, handle, password, args.entries)
        except BaseException:
            # a failed test leaves no ledger behind: its random password would keep autorecovery and
            # `bkaio decommission` from ever moving it
            handle.abort()
            with contextlib.suppress(BKError):  # no fence: the writer is ours, and aborted; the
                # bookies may be what failed (a refused connection), and the ledger must still go
                await bk.delete_ledger(handle.id, password=password, fence=False)
            raise
        await bk.delete_ledger(handle.id, password=password)
        if read != payloads:
            raise SystemExit(f"simpletest: ledger {handle.id} read back {len(read)} entries that differ")
    result = {
        "ledger_id": handle.id,
        "entries": args.entries,
        "ok": True,
        "seconds": round(time.perf_counter() - started, 3),
    }
    output.emit(result, as_json=args.json)
    return 0


async def _write_and_read_back(
    bk: BookKeeper, handle: LedgerHandle, password: bytes, entries: int
) -> tuple[list[bytes], list[bytes]]:
    """simpletest's work: ``entries`` appends with a progress bar, close, read back (written, read)."""
    payloads = [f"simpletest {handle.id} entry {i}".encode() for i in range(entries)]
    progress = output.Progress("simpletest write", entries)
    futures = [await handle.append_async(p) for p in payloads]
    for done, future in enumerate(asyncio.as_completed(futures), 1):
        await future
        progress.update(done)
    progress.finish()
    await handle.close()
    reader = await bk.open_ledger(handle.id, password=password)
    return payloads, [entry.payload async for entry in reader.read(0, reader.last_add_confirmed)]


def _command(sub: Any, name: str, func: Any, help_text: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help_text, description=help_text)
    parser.add_argument(
        "--metadata", help="etcd://HOST:PORT[,HOST:PORT]/ROOT (default: $BKAIO_METADATA, else the sandbox)"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=func)
    return parser


def _group(sub: Any, name: str, help_text: str) -> Any:
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help_text, description=help_text)
    return parser.add_subparsers(dest=f"{name}_command", required=True, metavar="COMMAND")


def add_commands(sub: Any) -> None:
    """Register the shell commands on an argparse subparsers object."""
    cluster = _group(sub, "cluster", "cluster-wide metadata operations")
    _command(cluster, "init", cmd_cluster_init, "initialise a new cluster root in etcd (idempotent)")
    id_commands.add_command(cluster, _command)
    _command(sub, "bookies", cmd_bookies, "list registered bookies (writable / read-only) with disk usage")
    ledgers = _command(sub, "ledgers", cmd_ledgers, "list ledger ids, a page at a time")
    ledgers.add_argument(
        "--limit",
        type=int_in(1, LIST_PAGE_LIMIT_MAX),
        default=100,
        help=f"ledgers per page, 1..{LIST_PAGE_LIMIT_MAX} (default 100)",
    )
    ledgers.add_argument("--after", type=int, default=None, help="start after this ledger id (next page)")
    ledgers.add_argument("-l", "--long", action="store_true", help="show state, last entry and length too")
    ledger = _group(sub, "ledger", "one ledger: show its metadata, read its entries, delete it")
    show = _command(ledger, "show", cmd_ledger_show, "show one ledger's metadata")
    show.add_argument("ledger_id", type=int)
    read = _command(ledger, "read", cmd_ledger_read, "read entries of a ledger (without fencing it)")
    read.add_argument("ledger_id", type=int)
    read.add_argument("--from", dest="start", type=int, default=0, help="first entry (default 0)")
    read.add_argument("--to", type=int, default=None, help="last entry (default: the last add confirmed)")
    cli_passwords.add_options(
        read, many=False, what=f"the ledger's password (the sandbox demo's ledgers: {DEMO_PASSWORD.decode()})"
    )
    delete = _command(ledger, "delete", cmd_ledger_delete, "delete a ledger (bookies reclaim space later)")
    delete.add_argument("ledger_id", type=int)
    cli_passwords.add_options(
        delete,
        many=False,
        what="the ledger's password (an open ledger is fenced first: its writer's adds fail from then on)",
    )
    bookie = _group(sub, "bookie", "one bookie's identity")
    fmt = _command(
        bookie, "format", cmd_bookie_format, "forget a bookie's data-dir cookie (after a disk loss)"
    )
    fmt.add_argument("bookie_id")
    fmt.add_argument(
        "--data-dir", default=None, help="also wipe this (stopped) bookie's local data directory"
    )
    fmt.add_argument(
        "--force",
        action="store_true",
        help="required with --data-dir; also formats a bookie that is registered or that ledgers still "
        "name (decommission it first instead: `bkaio decommission ID`)",
    )
    gc = _command(
        bookie, "gc", cmd_bookie_gc, "run garbage collection on a bookie now (reclaim deleted ledgers' space)"
    )
    gc.add_argument(
        "bookie", metavar="BOOKIE", help="a registered bookie id, or its admin endpoint HOST:PORT"
    )
    gc.add_argument(
        "--admin",
        default=None,
        help="the bookie's admin HOST:PORT (default: the one its registration publishes); used only "
        "if it answers for BOOKIE",
    )
    gc.add_argument("--no-wait", action="store_true", help="start the pass and return at once")
    gc.add_argument(
        "--admin-token-file",
        default=None,
        help=f"file with the bookie's admin token (default ${state.ADMIN_TOKEN_ENV}, else the "
        "sandbox's): the bookie's admin_token_file, or <its data dir>/admin.token",
    )
    simple = _command(sub, "simpletest", cmd_simpletest, "create, write, read back and delete one ledger")
    simple.add_argument("--entries", type=int_in(1), default=100, help="entries to write (default 100)")
    simple.add_argument(
        "--ensemble", "-E", type=int, default=3, help="bookies the ledger is striped over (default 3)"
    )
    simple.add_argument(
        "--write-quorum", "-W", type=int, default=2, help="copies of each entry written (default 2)"
    )
    simple.add_argument(
        "--ack-quorum",
        "-A",
        type=int,
        default=2,
        help="copies acknowledged before an add succeeds (default 2)",
    )
    autorecovery_commands.add_commands(sub)
