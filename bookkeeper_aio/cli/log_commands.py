"""``bkaio log ...``: logs (docs/api.md "Logs") from the command line.

``list`` (names, ledgers, state), ``show NAME`` (the ledger list with offsets, cursors, commit
tokens), ``tail NAME`` (records from a position, ``--follow`` to keep tailing), ``truncate NAME
--before LEDGER[:ENTRY]`` (a ledger of the log, unless ``--force``), ``cursors NAME`` (list; ``--set
NAME=LEDGER:ENTRY``, a record the log holds; ``--delete NAME``).
Human tables by default, ``--json`` for scripts, as the rest of the shell.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
from typing import Any

from bookkeeper_aio.cli import output
from bookkeeper_aio.cli import passwords as cli_passwords
from bookkeeper_aio.cli.demo import DEMO_PASSWORD
from bookkeeper_aio.cli.shell import _cluster_url, _command, _group, _show, _uses_sandbox, _whole
from bookkeeper_aio.client.bookkeeper import BookKeeper
from bookkeeper_aio.errors import BKInterfaceError, Unauthorized
from bookkeeper_aio.log import (
    LogInfo,
    LogPosition,
    commit_cursor,
    delete_cursor,
    describe_log,
    list_logs,
    open_log_reader,
    read_cursors,
    truncate_log,
)


def add_commands(sub: Any) -> None:
    logs = _group(sub, "log", "logs (ordered chains of ledgers): list, show, tail, truncate, cursors")
    _command(logs, "list", cmd_log_list, "list logs with their ledger count and state")
    show = _command(logs, "show", cmd_log_show, "show a log's ledger list, cursors and commit tokens")
    show.add_argument("name")
    tail = _command(logs, "tail", cmd_log_tail, "print a log's records (without fencing its writer)")
    tail.add_argument("name")
    tail.add_argument(
        "--from",
        dest="start",
        default="earliest",
        help="earliest (default), latest, or LEDGER:ENTRY (inclusive)",
    )
    tail.add_argument("-n", "--limit", type=int, default=None, help="stop after this many records")
    tail.add_argument(
        "-f", "--follow", action="store_true", help="keep waiting for new records (Ctrl-C stops)"
    )
    cli_passwords.add_options(
        tail, many=False, what=f"the log's password (the sandbox demo's: {DEMO_PASSWORD.decode()})"
    )
    truncate = _command(logs, "truncate", cmd_log_truncate, "drop a log's whole ledgers before a position")
    truncate.add_argument("name")
    truncate.add_argument(
        "--before",
        required=True,
        help="LEDGER[:ENTRY]: ledgers below LEDGER, a ledger of the log (see `log show`), are dropped",
    )
    truncate.add_argument(
        "--force",
        action="store_true",
        help="accept a LEDGER the log does not list: every ledger below it is dropped (never the last one, "
        "an open one or one a cursor points into)",
    )
    cli_passwords.add_options(
        truncate,
        many=False,
        what="the log's password: deleting the dropped ledgers needs it (without it they stay as orphans)",
    )
    cursors = _command(logs, "cursors", cmd_log_cursors, "list a log's named cursors, or set / delete one")
    cursors.add_argument("name")
    cursors.add_argument(
        "--set",
        dest="set_cursor",
        default=None,
        help="CURSOR=LEDGER:ENTRY: the last record consumed, one the log holds (a ledger of its list; "
        "at most a closed ledger's last entry)",
    )
    cursors.add_argument("--delete", dest="delete_cursor", default=None, help="CURSOR to delete")


def _position(text: str, what: str) -> LogPosition:
    ledger, _, entry = text.partition(":")
    try:
        return LogPosition(int(ledger), int(entry) if entry else 0)
    except ValueError:
        raise BKInterfaceError(f"{what} must look like LEDGER:ENTRY (e.g. 12:0), got {text!r}") from None


def _when(ms: int | None) -> str:
    if ms is None:
        return ""
    return datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _info_json(info: LogInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "ledgers": [entry._asdict() for entry in info.ledgers],
        "truncated_before": info.truncated_before,
        "sequenced": info.sequenced,
        "ctime_ms": info.ctime_ms,
        "commits": dict(info.commits),
        "cursors": {name: list(position) for name, position in info.cursors.items()},
        "version": info.version,
        "spare": info.spare,
    }


async def cmd_log_list(args: argparse.Namespace) -> int:
    async with BookKeeper.connect(await _cluster_url(args)) as bk:
        infos = [await describe_log(bk, name) for name in await list_logs(bk)]
    rows = [
        {
            "name": info.name,
            "ledgers": len(info.ledgers),
            "open": sum(entry.state == "open" for entry in info.ledgers),
            "records": _records(info),
            "cursors": len(info.cursors),
            "sequenced": "yes" if info.sequenced else "no",
        }
        for info in infos
    ]
    output.emit([_info_json(info) for info in infos], as_json=args.json, table=rows)
    return 0


def _records(info: LogInfo) -> str:
    """Records the log holds in its closed ledgers (``+`` when an open ledger holds more)."""
    closed = [e for e in info.ledgers if e.last_entry_id is not None]
    count = sum(e.last_entry_id + 1 for e in closed if e.last_entry_id is not None)
    return f"{count}+" if len(closed) < len(info.ledgers) else str(count)


async def cmd_log_show(args: argparse.Namespace) -> int:
    async with BookKeeper.connect(await _cluster_url(args)) as bk:
        info = await describe_log(bk, args.name)
    if args.json:
        output.emit(_info_json(info), as_json=True)
        return 0
    print(f"log {info.name!r}: created {_when(info.ctime_ms)} UTC, {len(info.ledgers)} ledgers", end="")
    print(", sequenced" if info.sequenced else "", end="")
    print(f", truncated before ledger {info.truncated_before}" if info.truncated_before else "", end="")
    print(f", spare ledger {info.spare} (the writer's next)" if info.spare is not None else "")
    output.print_table(
        [
            {
                "ledger_id": e.ledger_id,
                "state": e.state,
                "first_offset": "" if e.first_offset is None else e.first_offset,
                "last_entry": "" if e.last_entry_id is None else e.last_entry_id,
                "bytes": "" if e.length is None else e.length,
                "closed": _when(e.closed_ms),
            }
            for e in info.ledgers
        ]
    )
    if info.cursors:
        print(
            "cursors: " + ", ".join(f"{name}={p.ledger_id}:{p.entry_id}" for name, p in info.cursors.items())
        )
    if info.commits:
        print("commit tokens: " + ", ".join(f"{name}={batch}" for name, batch in info.commits.items()))
    return 0


async def cmd_log_tail(args: argparse.Namespace) -> int:
    """``--json``: one JSON object per line per record (position, sequence, the whole payload as
    UTF-8 or base64). The human view shows the first 64 bytes."""
    start: Any = args.start if args.start in ("earliest", "latest") else _position(args.start, "--from")
    if args.limit is not None and args.limit < 1:
        raise BKInterfaceError(f"--limit must be >= 1, got {args.limit}")
    shown = 0
    async with BookKeeper.connect(await _cluster_url(args)) as bk:
        try:
            reader = await open_log_reader(
                bk, args.name, start=start, follow=args.follow, password=cli_passwords.password(args)
            )
            async with contextlib.aclosing(reader):
                async for record in reader:
                    position = f"{record.position.ledger_id}:{record.position.entry_id}"
                    if args.json:
                        row = {"position": list(record.position), "sequence": record.sequence}
                        output.emit({**row, **_whole(record.payload)}, as_json=True)
                    else:
                        seq = "" if record.sequence is None else f"#{record.sequence} "
                        print(
                            f"{position:>14}  {len(record.payload):>8}  {seq}{_show(record.payload)}",
                            flush=True,
                        )
                    shown += 1
                    if args.limit is not None and shown >= args.limit:
                        break
        except Unauthorized as error:
            hint = "give the log's password with --password PASSWORD"
            if _uses_sandbox(args):
                hint += f" (the sandbox demo's log: --password {DEMO_PASSWORD.decode()})"
            raise Unauthorized(f"{error}: {hint}") from error
    if not shown and not args.json:
        print("(no records)")
    return 0


async def cmd_log_truncate(args: argparse.Namespace) -> int:
    before = _position(args.before, "--before")
    async with BookKeeper.connect(await _cluster_url(args)) as bk:
        was = await describe_log(bk, args.name)
        first = await truncate_log(
            bk, args.name, before, password=cli_passwords.password(args), force=args.force
        )
        now = await describe_log(bk, args.name)
    dropped = [e.ledger_id for e in was.ledgers if e.ledger_id not in {n.ledger_id for n in now.ledgers}]
    result = {
        "log": args.name,
        "dropped_ledgers": dropped,
        "first_position": None if first is None else list(first),
    }
    if args.json:
        output.emit(result, as_json=True)
    else:
        held = "" if not now.cursors else f" (cursors hold back: {', '.join(now.cursors)})"
        where = "empty" if first is None else f"{first.ledger_id}:{first.entry_id}"
        print(f"dropped {len(dropped)} ledgers {dropped}; the log now starts at {where}{held}")
    return 0


async def cmd_log_cursors(args: argparse.Namespace) -> int:
    async with BookKeeper.connect(await _cluster_url(args)) as bk:
        if args.set_cursor is not None:
            cursor, sep, where = args.set_cursor.partition("=")
            if not sep:
                raise BKInterfaceError(f"--set must look like CURSOR=LEDGER:ENTRY, got {args.set_cursor!r}")
            await commit_cursor(bk, args.name, cursor, _position(where, "--set"))
        if args.delete_cursor is not None and not await delete_cursor(bk, args.name, args.delete_cursor):
            raise BKInterfaceError(f"log {args.name!r} has no cursor {args.delete_cursor!r}")
        cursors = await read_cursors(bk, args.name)
    rows = [{"cursor": name, "ledger_id": p.ledger_id, "entry_id": p.entry_id} for name, p in cursors.items()]
    output.emit({name: list(p) for name, p in cursors.items()}, as_json=args.json, table=rows)
    return 0
