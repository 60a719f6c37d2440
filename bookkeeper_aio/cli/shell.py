"""Operator shell commands: what BookKeeper's ``bin/bookkeeper shell`` gives, on our cluster.

Each command is an ``async def cmd_<name>(args) -> int`` that prints a human table, or JSON with
``--json``. They talk to the cluster through the metadata URL (see :mod:`bookkeeper_aio.cli.state`).
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import shutil
import time
from pathlib import Path
from typing import Any

import metadata
from bookkeeper_aio.cli import output
from bookkeeper_aio.cli.state import resolve_metadata_url
from bookkeeper_aio.client.bookkeeper import BookKeeper
from bookkeeper_aio.protocol import messages as m

BOOKIE_INFO_TIMEOUT_S = 3.0


def _url(args: argparse.Namespace) -> str:
    return resolve_metadata_url(args.metadata)


async def cmd_cluster_init(args: argparse.Namespace) -> int:
    async with metadata.connect(_url(args)) as meta:
        info = await metadata.ensure_cluster(meta.store, meta.root)
    output.emit(
        {"root": meta.root, "instance_id": info.instance_id, "created_ms": info.created_ms}, as_json=args.json
    )
    return 0


async def cmd_bookies(args: argparse.Namespace) -> int:
    url = _url(args)
    async with metadata.connect(url) as meta:
        found = await metadata.list_bookies(meta.store, meta.root)
    rows: list[dict[str, Any]] = []
    async with BookKeeper.connect(url) as bk:
        for state, bookies in (("writable", found.writable), ("readonly", found.readonly)):
            for bookie_id, info in sorted(bookies.items()):
                disk = await _bookie_info(bk, bookie_id)
                rows.append(
                    {"bookie_id": bookie_id, "state": state, "address": f"{info.host}:{info.port}", **disk}
                )
    output.emit(rows, as_json=args.json, table=rows)
    return 0


async def _bookie_info(bk: BookKeeper, bookie_id: str) -> dict[str, Any]:
    try:
        response = await bk.context.pool.request(bookie_id, m.GetBookieInfoRequest, BOOKIE_INFO_TIMEOUT_S)
    except Exception as error:  # noqa: BLE001 - a dead bookie is a row, not a crash of the listing
        return {"free_disk": "?", "total_disk": "?", "error": type(error).__name__}
    assert isinstance(response, m.GetBookieInfoResponse)
    info = response.info
    return {
        "free_disk": _size(info.get("free_disk_bytes")),
        "total_disk": _size(info.get("total_disk_bytes")),
        "error": "" if response.status == 0 else str(response.message),
    }


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
    async with metadata.connect(_url(args)) as meta:
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
    async with metadata.connect(_url(args)) as meta:
        view = await metadata.show_ledger(meta.store, meta.root, args.ledger_id)
    output.emit(view, as_json=args.json)
    return 0


async def cmd_ledger_read(args: argparse.Namespace) -> int:
    async with BookKeeper.connect(_url(args)) as bk:
        handle = await bk.open_ledger(args.ledger_id, password=args.password.encode())
        last = handle.last_add_confirmed if args.to is None else args.to
        rows = []
        async for entry in handle.read(args.start, last):
            row = {"entry_id": entry.entry_id, "bytes": len(entry.payload), "payload": _show(entry.payload)}
            rows.append(row)
            if not args.json:
                print(f"{row['entry_id']:>10}  {row['bytes']:>8}  {row['payload']}")
    if args.json:
        output.emit(rows, as_json=True)
    elif not rows:
        print(f"(no entries in [{args.start}, {last}])")
    return 0


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
    async with BookKeeper.connect(_url(args)) as bk:
        await bk.delete_ledger(args.ledger_id)
    output.emit({"deleted": args.ledger_id}, as_json=args.json)
    return 0


async def cmd_bookie_format(args: argparse.Namespace) -> int:
    """Forget a bookie's data-dir identity (after a disk loss), optionally wiping its local data."""
    if args.data_dir:
        if not args.force:
            raise SystemExit(f"bkaio bookie format: wiping {args.data_dir} deletes its entries; add --force")
        _wipe_data_dir(Path(args.data_dir))
    async with metadata.connect(_url(args)) as meta:
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


async def cmd_simpletest(args: argparse.Namespace) -> int:
    """Create a ledger, write entries, read them back, delete it: the cluster works end to end."""
    password = os.urandom(8)
    started = time.perf_counter()
    async with BookKeeper.connect(_url(args)) as bk:
        handle = await bk.create_ledger(args.ensemble, args.write_quorum, args.ack_quorum, password=password)
        payloads = [f"simpletest {handle.id} entry {i}".encode() for i in range(args.entries)]
        progress = output.Progress("simpletest write", args.entries)
        futures = [await handle.append_async(p) for p in payloads]
        for done, future in enumerate(asyncio.as_completed(futures), 1):
            await future
            progress.update(done)
        progress.finish()
        await handle.close()
        reader = await bk.open_ledger(handle.id, password=password)
        read = [entry.payload async for entry in reader.read(0, reader.last_add_confirmed)]
        if read != payloads:
            raise SystemExit(f"simpletest: ledger {handle.id} read back {len(read)} entries that differ")
        await bk.delete_ledger(handle.id)
    result = {
        "ledger_id": handle.id,
        "entries": args.entries,
        "ok": True,
        "seconds": round(time.perf_counter() - started, 3),
    }
    output.emit(result, as_json=args.json)
    return 0


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
    _command(sub, "bookies", cmd_bookies, "list registered bookies (writable / read-only) with disk usage")
    ledgers = _command(sub, "ledgers", cmd_ledgers, "list ledger ids, a page at a time")
    ledgers.add_argument("--limit", type=int, default=100, help="ledgers per page (default 100)")
    ledgers.add_argument("--after", type=int, default=None, help="start after this ledger id (next page)")
    ledgers.add_argument("-l", "--long", action="store_true", help="show state, last entry and length too")
    ledger = _group(sub, "ledger", "one ledger: show its metadata, read its entries, delete it")
    show = _command(ledger, "show", cmd_ledger_show, "show one ledger's metadata")
    show.add_argument("ledger_id", type=int)
    read = _command(ledger, "read", cmd_ledger_read, "read entries of a ledger (without fencing it)")
    read.add_argument("ledger_id", type=int)
    read.add_argument("--from", dest="start", type=int, default=0, help="first entry (default 0)")
    read.add_argument("--to", type=int, default=None, help="last entry (default: the last add confirmed)")
    read.add_argument("--password", default="", help="the ledger's password")
    delete = _command(ledger, "delete", cmd_ledger_delete, "delete a ledger (bookies reclaim space later)")
    delete.add_argument("ledger_id", type=int)
    bookie = _group(sub, "bookie", "one bookie's identity")
    fmt = _command(
        bookie, "format", cmd_bookie_format, "forget a bookie's data-dir cookie (after a disk loss)"
    )
    fmt.add_argument("bookie_id")
    fmt.add_argument(
        "--data-dir", default=None, help="also wipe this (stopped) bookie's local data directory"
    )
    fmt.add_argument("--force", action="store_true", help="required with --data-dir")
    simple = _command(sub, "simpletest", cmd_simpletest, "create, write, read back and delete one ledger")
    simple.add_argument("--entries", type=int, default=100, help="entries to write (default 100)")
    simple.add_argument("--ensemble", "-E", type=int, default=3)
    simple.add_argument("--write-quorum", "-W", type=int, default=2)
    simple.add_argument("--ack-quorum", "-A", type=int, default=2)
