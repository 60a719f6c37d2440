"""Truncation and retention (docs/api.md "Logs"): whole ledgers leave the front of the list.

A cut never removes the last ledger, an OPEN ledger or anything after one, nor the ledger a named
cursor points into (or anything after it): the slowest cursor bounds it. The list changes first (one
CAS: the metadata then records ``truncated_before``, so a reader asking for a truncated position gets
`LogTruncated`, never a silent gap), then the dropped ledgers are deleted.
"""

from __future__ import annotations

from collections.abc import Callable

from bookkeeper_aio.client.bookkeeper import BookKeeper
from bookkeeper_aio.log import records
from bookkeeper_aio.log._common import delete_ledgers, log_manager
from bookkeeper_aio.log.position import LogPosition
from metadata.log_manager import LogManager
from metadata.log_metadata import LogLedgerState, LogMetadata


def truncate_list(
    md: LogMetadata, before_ledger_id: int, cursors: dict[str, tuple[int, int]], sequence: int | None = None
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
    return md.with_truncated_before(cut, sequence=sequence), dropped


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


async def truncate_log(
    bk: BookKeeper, name: str, before: LogPosition, *, password: bytes = b""
) -> LogPosition | None:
    """Drop the log's whole ledgers before ``before.ledger_id`` (bounded as the module says) and
    delete them; a live writer keeps writing. Returns the log's first position afterwards (None: no
    ledger). ``password`` (the log's) reads a sequenced log's last removed record and deletes the
    dropped ledgers (without it they stay as orphans, logged). Raises NoSuchLog,
    MetadataFormatError, MetadataUnavailable."""
    manager = log_manager(bk)
    current = await manager.read(name)
    change, dropped = await plan_truncation(bk, manager, current.metadata, before.ledger_id, password)
    versioned = await manager.update(name, change, current=current)
    await delete_ledgers(bk, name, dropped, password, why="truncated")
    ledgers = versioned.metadata.ledgers
    return LogPosition(ledgers[0].ledger_id, 0) if ledgers else None


async def plan_truncation(
    bk: BookKeeper, manager: LogManager, md: LogMetadata, before_ledger_id: int, password: bytes
) -> tuple[Callable[[LogMetadata], LogMetadata], list[int]]:
    """The list change of a truncation, and the ids it dropped once applied (filled in by the
    change). The cut is fixed here, from the cursors and the list as they are now (a retry of the
    CAS never cuts further); for a sequenced log the highest removed sequence number goes along."""
    cursors = await manager.read_cursors(md.name)
    planned, gone = truncate_list(md, before_ledger_id, cursors)
    cut = planned.truncated_before if gone else before_ledger_id
    sequence = None
    if md.sequenced and gone:
        removed = [entry for entry in md.ledgers if entry.ledger_id in set(gone)]
        sequence = await records.last_sequence_in(bk, md.name, removed, password)
    dropped: list[int] = []

    def change(current: LogMetadata) -> LogMetadata:
        proposed, now_gone = truncate_list(current, min(cut, before_ledger_id), cursors, sequence)
        dropped[:] = now_gone
        return proposed

    return change, dropped
