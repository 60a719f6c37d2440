"""Truncation and retention (docs/api.md "Logs"): whole ledgers leave the front of the list.

A cut never removes the last ledger, an OPEN ledger or anything after one, nor the ledger a named
cursor points into (or anything after it): the slowest cursor bounds it. The list changes first (one
CAS: the metadata then records ``truncated_before``, so a reader asking for a truncated position gets
`LogTruncated`, never a silent gap), then the dropped ledgers are deleted.
"""

from __future__ import annotations

import structlog

from bookkeeper_aio.client.bookkeeper import BookKeeper
from bookkeeper_aio.errors import BKError
from bookkeeper_aio.log._common import log_manager
from bookkeeper_aio.log.position import LogPosition
from metadata.log_metadata import LogLedgerState, LogMetadata

log = structlog.get_logger("bookkeeper_aio.log.truncation")


def truncate_list(
    md: LogMetadata, before_ledger_id: int, cursors: dict[str, tuple[int, int]]
) -> tuple[LogMetadata, list[int]]:
    """The list without its ledgers below the cut (bounded as the module says), and their ids."""
    cut = before_ledger_id
    if md.ledgers:
        cut = min(cut, md.ledgers[-1].ledger_id)
    for entry in md.ledgers:
        if entry.state is LogLedgerState.OPEN:
            cut = min(cut, entry.ledger_id)
            break
    for ledger_id, _ in cursors.values():
        cut = min(cut, ledger_id)
    dropped = [entry.ledger_id for entry in md.ledgers if entry.ledger_id < cut]
    if not dropped:
        return md, []
    return md.with_truncated_before(cut), dropped


def retention_cut(md: LogMetadata, age_s: float | None, size: int | None, now_ms: int) -> int | None:
    """The ledger id retention would truncate before (None: nothing to drop). Age: closed ledgers
    closed more than ``age_s`` ago. Size: the oldest closed ledgers beyond ``size`` payload bytes,
    counted from the newest. Ledgers with an unknown close time or length are kept."""
    closed = [e for e in md.ledgers[:-1] if e.state is LogLedgerState.CLOSED]
    cut: int | None = None
    if age_s is not None:
        for entry in closed:
            if entry.closed_ms is None or now_ms - entry.closed_ms <= age_s * 1000:
                break
            cut = _after(md, entry.ledger_id)
    if size is not None:
        kept = 0
        for entry in reversed(closed):
            kept += entry.length or 0
            if entry.length is None or kept > size:
                if entry.length is not None:
                    later = _after(md, entry.ledger_id)
                    cut = later if cut is None else max(cut, later)
                break
    return cut


def _after(md: LogMetadata, ledger_id: int) -> int:
    index = md.index_of(ledger_id)
    assert index is not None
    return md.ledgers[index + 1].ledger_id


async def truncate_log(bk: BookKeeper, name: str, before: LogPosition) -> LogPosition | None:
    """Drop the log's whole ledgers before ``before.ledger_id`` (bounded as the module says) and
    delete them; a live writer keeps writing. Returns the log's first position afterwards (None: no
    ledger). Raises NoSuchLog, MetadataFormatError, MetadataUnavailable."""
    manager = log_manager(bk)
    cursors = await manager.read_cursors(name)
    dropped: list[int] = []

    def change(md: LogMetadata) -> LogMetadata:
        proposed, gone = truncate_list(md, before.ledger_id, cursors)
        dropped[:] = gone
        return proposed

    versioned = await manager.update(name, change)
    await delete_ledgers(bk, name, dropped)
    ledgers = versioned.metadata.ledgers
    return LogPosition(ledgers[0].ledger_id, 0) if ledgers else None


async def delete_ledgers(bk: BookKeeper, name: str, ledger_ids: list[int]) -> None:
    """Delete truncated ledgers (they already left the list); a failure is logged, not raised: the
    ledger is then an orphan for `bkaio ledger delete`."""
    for ledger_id in ledger_ids:
        try:
            await bk.delete_ledger(ledger_id)
        except BKError as error:
            log.warning("log.truncated_ledger_not_deleted", log=name, ledger_id=ledger_id, error=repr(error))
        else:
            log.info("log.truncated_ledger_deleted", log=name, ledger_id=ledger_id)
