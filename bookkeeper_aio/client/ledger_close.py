"""Closing a ledger as its writer: one CAS of state CLOSED and last entry = LAC (docs/replication.md §3).

The decision is a pure function of the metadata found (:func:`close_decision`), taken again on
every re-read of the CAS loop (:meth:`metadata.ledger_manager.LedgerManager.update`):

| found                         | outcome                                                |
|-------------------------------|--------------------------------------------------------|
| OPEN                          | CAS CLOSED at our LAC (on a conflict: re-read, decide)  |
| CLOSED at our LAC             | success (someone, or our own lost-answer CAS, did it)   |
| CLOSED at another last entry  | MetadataConflict                                        |
| IN_RECOVERY                   | LedgerFenced: a reader is recovering the ledger         |
"""

from __future__ import annotations

from bookkeeper_aio.client.context import ClientContext
from bookkeeper_aio.errors import LedgerFenced, MetadataConflict
from metadata.errors import UpdateRetriesExhausted
from metadata.ledger_manager import UNCHANGED, VersionedLedger, _Unchanged
from metadata.ledger_metadata import LedgerMetadata, LedgerState


def close_decision(md: LedgerMetadata, lac: int, length: int) -> LedgerMetadata | _Unchanged:
    """What the writer does on finding ``md`` when closing at ``lac`` (see the module table)."""
    if md.state is LedgerState.CLOSED:
        if md.last_entry_id == lac:
            return UNCHANGED
        raise MetadataConflict(
            f"ledger {md.ledger_id} was closed elsewhere at entry {md.last_entry_id}, we acked {lac}"
        )
    if md.state is LedgerState.IN_RECOVERY:
        raise LedgerFenced(f"ledger {md.ledger_id} is being recovered: our close at {lac} lost")
    return md.closed(lac, length)


async def close_in_metadata(
    ctx: ClientContext, current: VersionedLedger, lac: int, length: int
) -> VersionedLedger:
    """Close the ledger of ``current`` (the writer's latest copy) at ``lac``; returns the metadata
    as stored. Raises LedgerFenced, MetadataConflict, TimeoutError (one read or CAS over
    ``metadata_timeout_s``), MetadataError."""
    try:
        return await ctx.ledgers.update(
            current.ledger_id,
            lambda md: close_decision(md, lac, length),
            attempts_max=ctx.config.ensemble_change_attempts_max,
            current=current,
            retry_unknown=True,
            attempt_timeout_s=ctx.config.metadata_timeout_s,
        )
    except UpdateRetriesExhausted as error:
        raise MetadataConflict(
            f"ledger {current.ledger_id}: close lost the metadata race too often"
        ) from error
