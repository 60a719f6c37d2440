"""``bkaio cluster raise-ids``: move the ledger id counter above every ledger id in use.

A metadata snapshot restore (docs/operations.md) puts ``<root>/idgen`` back to where it was at the
snapshot, while the ledgers created after it still hold data on the bookies. Clients would hand
their ids out again; a new ledger under such an id presents a key metadata confirms, so a bookie
takes the stored ledger for a squatter's and drops it. This command finds the highest ledger id
in metadata (at or above the counter) and on every bookie (GET_BOOKIE_INFO's ``ledger_id_max``),
and raises the counter above it by CAS (never down). A bookie that has a cookie but does not
answer may hold higher ids: the command then changes nothing, unless told to ``--skip`` it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import metadata
from bookkeeper_aio.cli import output
from bookkeeper_aio.cli.state import resolve_metadata_url
from bookkeeper_aio.client.bookkeeper import BookKeeper
from bookkeeper_aio.protocol import messages as m
from metadata.bookies import list_cookie_ids
from metadata.idgen import raise_counter, read_counter
from metadata.keys import ClusterKeys
from metadata.ledger_manager import LedgerManager

BOOKIE_INFO_TIMEOUT_S = 5.0
MARGIN_DEFAULT = 1000
"""Ids left unused above the highest one found (one client's id block)."""
PAGE = 1000


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


async def _metadata_max(manager: LedgerManager, counter: int) -> tuple[int, int]:
    """(how many ledger ids metadata holds at or above ``counter``, the highest of them or 0)."""
    found, highest = 0, 0
    start_after = counter - 1
    while True:
        page = await manager.list_page(start_after=start_after, limit=PAGE)
        found += len(page.ledger_ids)
        if page.ledger_ids:
            highest = start_after = page.ledger_ids[-1]
            _say(f"metadata: {found} ledger ids at or above the counter so far (highest {highest})")
        if not page.more or not page.ledger_ids:
            return found, highest


async def _bookie_max(bk: BookKeeper, bookie_id: str) -> tuple[int | None, str]:
    """(the highest ledger id the bookie holds, "") or (None, why it is unknown)."""
    try:
        response = await bk.context.pool.request(bookie_id, m.GetBookieInfoRequest, BOOKIE_INFO_TIMEOUT_S)
    except Exception as error:  # noqa: BLE001 - one bookie's failure is reported, not a crash
        return None, f"did not answer: {type(error).__name__}: {error}"
    assert isinstance(response, m.GetBookieInfoResponse)
    if response.status != 0:
        return None, f"refused: {response.message}"
    value = response.info.get("ledger_id_max")
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        return None, "does not report ledger_id_max (a bookie older than this command: upgrade it)"
    return value, ""


async def cmd_cluster_raise_ids(args: argparse.Namespace) -> int:
    url = resolve_metadata_url(args.metadata)
    if args.margin < 0:
        raise SystemExit("bkaio cluster raise-ids: --margin must be >= 0")
    skip = set(args.skip or ())
    async with metadata.connect(url) as meta:
        if await metadata.read_cluster_info(meta.store, meta.root) is None:
            raise SystemExit(f"bkaio cluster raise-ids: no cluster at {url}")
        key = ClusterKeys(meta.root).idgen
        counter = await read_counter(meta.store, key)
        _say(f"id counter {key}: next id {counter}")
        in_metadata, metadata_max = await _metadata_max(LedgerManager(meta.store, meta.root), counter)
        _say(f"metadata: {in_metadata} ledger ids at or above the counter (highest {metadata_max or '-'})")
        bookies = await metadata.list_bookies(meta.store, meta.root)
        cookies = await list_cookie_ids(meta.store, meta.root)
    registered = sorted({*bookies.writable, *bookies.readonly})
    rows: list[dict[str, Any]] = []
    async with BookKeeper.connect(url) as bk:
        for number, bookie_id in enumerate(registered, 1):
            highest, why = await _bookie_max(bk, bookie_id)
            rows.append({"bookie_id": bookie_id, "ledger_id_max": highest, "problem": why})
            _say(f"bookie {number}/{len(registered)} {bookie_id}: " + (why or f"highest ledger id {highest}"))
    for bookie_id in sorted(set(cookies) - set(registered)):
        rows.append({"bookie_id": bookie_id, "ledger_id_max": None, "problem": "not registered (down?)"})
        _say(f"bookie {bookie_id}: has a cookie but is not registered (down?)")
    unknown = [row for row in rows if row["ledger_id_max"] is None and row["bookie_id"] not in skip]
    bookie_max = max((row["ledger_id_max"] or 0 for row in rows), default=0)
    target = max(metadata_max, bookie_max) + 1 + args.margin
    report: dict[str, Any] = {
        "counter": counter,
        "highest_in_metadata": metadata_max,
        "highest_on_bookies": bookie_max,
        "target": target,
        "bookies": rows,
    }
    if unknown:
        for row in unknown:
            _say(f"bookie {row['bookie_id']}: {row['problem']}")
        _say(
            "not raising the counter: a bookie above may hold higher ledger ids. Start it (or upgrade "
            "it) and run this again, or pass --skip BOOKIE_ID for a bookie whose data is gone for good"
        )
        report["raised"] = False
        output.emit(report if args.json else _summary(report), as_json=args.json)
        return 1
    if args.dry_run or counter >= target:
        report["raised"] = False
        if counter >= target:
            _say(f"the counter ({counter}) is already above every ledger id found: nothing to do")
        else:
            _say(f"dry run: would raise the counter from {counter} to {target}")
        output.emit(report if args.json else _summary(report), as_json=args.json)
        return 0
    async with metadata.connect(url) as meta:
        before, after = await raise_counter(meta.store, key, target)
    report.update(counter=before, counter_now=after, raised=after > before)
    _say(f"id counter raised from {before} to {after}" if after > before else f"id counter at {after}")
    output.emit(report if args.json else _summary(report), as_json=args.json)
    return 0


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k != "bookies"}


def add_command(cluster: Any, command: Any) -> None:
    """``raise-ids`` under the ``cluster`` group; ``command`` is shell's ``_command``."""
    parser: argparse.ArgumentParser = command(
        cluster,
        "raise-ids",
        cmd_cluster_raise_ids,
        "raise the ledger id counter above every ledger id in metadata and on the bookies (after a "
        "metadata snapshot restore, before any client starts)",
    )
    parser.add_argument("--dry-run", action="store_true", help="find the ids and report; change nothing")
    parser.add_argument(
        "--margin",
        type=int,
        default=MARGIN_DEFAULT,
        help=f"ids left unused above the highest found (default {MARGIN_DEFAULT})",
    )
    parser.add_argument(
        "--skip",
        action="append",
        metavar="BOOKIE_ID",
        help="a bookie with a cookie that does not answer and whose data is gone for good (repeatable)",
    )
