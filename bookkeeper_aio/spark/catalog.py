"""The driver's view of the cluster: a client whose metadata is known to answer, and the ledgers
of a log with what each holds now (``describe_log`` plus one ledger open per ledger)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from bookkeeper_aio import (
    BKError,
    BookKeeper,
    LogInfo,
    LogLedgerInfo,
    NoSuchLog,
    ReadHandle,
    Unauthorized,
    describe_log,
    list_logs,
)
from bookkeeper_aio.spark import options as opt
from bookkeeper_aio.spark.plan import LedgerExtent


@contextlib.asynccontextmanager
async def connect(url: str, *, probe: bool = True) -> AsyncIterator[BookKeeper]:
    """A client of the cluster at ``url``. With ``probe`` (the driver's calls), one metadata read
    first, so that an unreachable or wrong URL is reported as the ``metadata`` option's fault
    instead of surfacing from the middle of a plan or a commit."""
    async with BookKeeper.connect(url) as bk:
        if probe:
            try:
                async for _ in bk.list_ledgers(page_size=1):
                    break
            except BKError as error:
                raise opt.SparkOptionError(
                    opt.METADATA,
                    f"cannot read the cluster's metadata at {url!r} ({type(error).__name__}: {error}); "
                    "check the URL and that etcd is reachable from the Spark driver and executors",
                ) from error
        yield bk


LOGS_NAMED_MAX = 10


async def _no_such_log(bk: BookKeeper, name: str) -> str:
    """What to tell about a log that does not exist: the logs that do (a typo), or that there
    are none (the metadata URL's root may be the wrong one)."""
    logs = await list_logs(bk)
    if not logs:
        return f"log {name!r} does not exist, and no log does under this metadata URL: check its root"
    shown = ", ".join(repr(log) for log in logs[:LOGS_NAMED_MAX])
    more = f" and {len(logs) - LOGS_NAMED_MAX} more" if len(logs) > LOGS_NAMED_MAX else ""
    return f"log {name!r} does not exist; the logs are {shown}{more}"


async def log_extents(bk: BookKeeper, name: str, password: bytes) -> tuple[LogInfo, list[LedgerExtent]]:
    """The log, and its ledgers in order, each with its last readable entry and first offset."""
    try:
        info = await describe_log(bk, name)
    except NoSuchLog:
        raise opt.SparkOptionError(opt.PATH, await _no_such_log(bk, name)) from None

    last_listed = info.ledgers[-1].ledger_id if info.ledgers else None

    async def one(ledger: LogLedgerInfo) -> LedgerExtent:
        last = ledger.last_entry_id
        # the last ledger is always opened: it checks the password before any task runs
        if ledger.state == "closed" and last is not None and ledger.ledger_id != last_listed:
            return LedgerExtent(ledger.ledger_id, last, ledger.first_offset)
        handle = await open_checked(bk, ledger.ledger_id, password)
        lac = handle.last_add_confirmed
        return LedgerExtent(ledger.ledger_id, lac, ledger.first_offset, closed=handle.is_closed)

    return info, list(await asyncio.gather(*(one(ledger) for ledger in info.ledgers)))


async def open_checked(bk: BookKeeper, ledger_id: int, password: bytes) -> ReadHandle:
    """``open_ledger``, a wrong password reported as the ``password`` option's fault."""
    try:
        return await bk.open_ledger(ledger_id, password=password)
    except Unauthorized:
        raise opt.SparkOptionError(
            opt.PASSWORD, f"wrong password for ledger {ledger_id}: give the ledgers' password"
        ) from None
