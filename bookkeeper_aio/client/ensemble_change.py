"""The replication primitive: replace failed bookies of one fragment of a ledger and record it.

One primitive, :class:`BookieReplacer`, for everything that moves a ledger's entries off a bookie:

- the **writer** (:class:`~bookkeeper_aio.client.ledger.LedgerHandle`): a bookie of the current
  ensemble failed; :meth:`BookieReplacer.replace` CASes a new fragment at LAC+1 (replacing the
  last fragment if it already starts there) and the write pipeline re-sends its outstanding adds
  to the replacement (they are in memory: no copy is needed);
- **recovery's write-back** (:mod:`bookkeeper_aio.client.recovery_writeback`): a bookie failed
  while found entries were written back; :meth:`BookieReplacer.choose` picks the replacement (or
  gives the bookie up), the fragment stays local until recovery's close CASes it;
- an **autorecovery worker** (re-replication of a lost bookie's fragments): :meth:`replace` with
  ``first_entry`` the fragment's first entry, ``accept`` that allows a closed ledger, and a
  ``copy`` step that reads the fragment's entries from the surviving replicas and writes them to
  the replacement *before* the CAS makes the new ensemble visible to readers.

Rules (docs/replication.md §2):

- A replacement is chosen by the placement policy among the writable bookies, never one of the
  ensemble nor one failing now; one that failed for this ledger before (``ever_failed``) only when
  no other is writable (it registered again: a restarted bookie).
- No replacement: before NotEnoughBookies is raised the ledger's metadata is read and ``accept``
  asked, so a writer whose ledger was fenced or closed meanwhile says so (LedgerFenced /
  LedgerClosed) instead of blaming the bookies.
- Each replaced bookie is recorded in the ledger's ``replaced_bookies`` history by the same CAS
  (first entry, replaced bookie, replacement, time): a fragment replaced in place (an ensemble
  change at its first entry) otherwise leaves no trace of the bookie it had.
- The CAS goes through :meth:`metadata.ledger_manager.LedgerManager.update`: on a conflict the
  decision is taken again on the fresh metadata (``accept`` first: the writer refuses a ledger
  that is no longer OPEN), with a new choice if the fragment changed. An unknown CAS outcome is
  re-read too: finding our own proposal there means it landed.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Collection, Sequence

from bookkeeper_aio.client.context import ClientContext
from bookkeeper_aio.errors import MetadataConflict, NotEnoughBookies
from metadata.errors import MetadataError, UpdateRetriesExhausted
from metadata.ledger_manager import UNCHANGED, VersionedLedger, _Unchanged
from metadata.ledger_metadata import LedgerMetadata, ReplacedBookie
from metadata.store import Guards

Ensemble = tuple[str, ...]


class Replacement:
    """What :class:`BookieReplacer` decided for one fragment: its ``ensemble`` after the change,
    the bookies ``replaced`` in it and those ``given_up`` (no replacement, only when allowed);
    ``stored`` is the ledger's metadata after the CAS (None when the change is local)."""

    __slots__ = ("ensemble", "first_entry", "given_up", "replaced", "stored")

    def __init__(
        self,
        first_entry: int,
        ensemble: Ensemble,
        replaced: tuple[str, ...],
        given_up: tuple[str, ...] = (),
        stored: VersionedLedger | None = None,
    ) -> None:
        self.first_entry = first_entry
        self.ensemble = ensemble
        self.replaced = replaced
        self.given_up = given_up
        self.stored = stored


Accept = Callable[[LedgerMetadata], None]
"""``accept(metadata)`` raises if the change may no longer be made to the ledger as it is now."""
Copy = Callable[[Replacement], Awaitable[None]]
"""``copy(replacement)`` writes the fragment's entries to the bookies that replaced others."""


class BookieReplacer:
    """Replaces bookies in the fragments of one ledger (see the module doc for the users).

    ``ever_failed`` grows with every bookie passed as failed and is never chosen again.
    """

    def __init__(self, ctx: ClientContext, ledger_id: int) -> None:
        self._ctx = ctx
        self._ledger_id = ledger_id
        self.ever_failed: set[str] = set()

    async def choose(
        self, ensemble: Ensemble, failed: Collection[str], *, give_up: bool = False
    ) -> Replacement:
        """Choose a replacement for each bookie of ``ensemble`` in ``failed`` (nothing is written).

        With ``give_up`` a bookie without a replacement stays in the ensemble and is listed in
        ``given_up``; otherwise raises NotEnoughBookies. ``first_entry`` of the result is -1.
        """
        self.ever_failed.update(failed)
        writable = await self._ctx.directory.writable_bookies()
        chosen = self._choose(-1, ensemble, failed, writable, give_up)
        await self._until_reachable(ensemble, chosen)
        return chosen

    async def replace(
        self,
        current: VersionedLedger,
        first_entry: int,
        failed: Collection[str],
        *,
        accept: Accept,
        copy: Copy | None = None,
        attempts_max: int,
        guards: Guards = (),
    ) -> Replacement:
        """Replace ``failed`` in the fragment of ``current`` that holds ``first_entry`` and CAS
        the fragment starting at ``first_entry`` (a new one past the last fragment's start, else
        the one starting there) with the new ensemble. ``copy`` (re-replication) runs between the
        choice and the CAS; if the fragment then changes under us the change is refused. Every CAS
        carries ``guards`` (an autorecovery worker's lock: a worker that lost it commits nothing).

        Raises what ``accept`` raises (also when no replacement exists: the stored metadata is
        checked first), NotEnoughBookies (no replacement, or the metadata race was lost
        ``attempts_max`` times), MetadataConflict (the fragment changed during ``copy``),
        TimeoutError (one read or CAS over ``metadata_timeout_s``), GuardFailed, MetadataError.
        """
        self.ever_failed.update(failed)
        writable = await self._ctx.directory.writable_bookies()
        base = current.metadata.ensemble_for(first_entry)
        try:
            chosen = self._choose(first_entry, base, failed, writable, False)
        except NotEnoughBookies as error:
            await self._check_stored(accept)
            # every bookie tried refused this client at the handshake (token, TLS): say that, with
            # what to check, rather than "no writable bookie"
            refusals = [self._ctx.pool.refusal(bookie) for bookie in sorted(self.ever_failed)]
            if refusals and all(refusals):
                raise refusals[0] from error  # type: ignore[misc]
            raise
        await self._until_reachable(base, chosen)
        if copy is not None:
            await copy(chosen)

        def transform(md: LedgerMetadata) -> LedgerMetadata | _Unchanged:
            nonlocal chosen, base
            accept(md)
            if _starting_at(md, first_entry) == chosen.ensemble:
                return UNCHANGED  # ours landed (its answer was lost, or a conflict came after)
            fresh = md.ensemble_for(first_entry)
            if fresh != base:  # decide again on the fresh fragment
                if copy is not None:
                    raise MetadataConflict(f"ledger {md.ledger_id}: fragment {first_entry} changed")
                base = fresh
                chosen = self._choose(first_entry, fresh, failed, writable, False)
            now_ms = self._ctx.ledgers.now_ms()
            history = [
                ReplacedBookie(first_entry, old, new, now_ms)
                for old, new in zip(base, chosen.ensemble, strict=True)
                if old != new
            ]
            return _with_fragment(md, first_entry, chosen.ensemble).with_replaced_bookies(history)

        ledgers = self._ctx.ledgers
        try:
            chosen.stored = await ledgers.update(
                self._ledger_id,
                transform,
                attempts_max=attempts_max,
                current=current,
                retry_unknown=True,
                attempt_timeout_s=self._ctx.config.metadata_timeout_s,
                guards=guards,
            )
        except UpdateRetriesExhausted as error:
            raise NotEnoughBookies(
                f"ledger {self._ledger_id}: ensemble change lost the metadata race too often"
            ) from error
        return chosen

    async def _until_reachable(self, ensemble: Ensemble, chosen: Replacement) -> None:
        """Wait out the pool's reconnect backoff of the replacements: the pool fails requests to a
        bookie in backoff at once, so a replacement sent to straight away fails again, and two
        failed bookies replace each other in a loop that takes no time (found by the simulation's
        race profile: in the writer, one metadata CAS per round, and in recovery's write-back)."""
        pool = self._ctx.pool
        delay_s = max((pool.reconnect_delay_s(b) for b in chosen.ensemble if b not in ensemble), default=0.0)
        if delay_s > 0:
            await asyncio.sleep(delay_s)

    async def _check_stored(self, accept: Accept) -> None:
        """Raise what ``accept`` raises on the stored metadata (the ledger may have been fenced or
        closed since the caller's copy). A metadata read that fails leaves the decision to the
        caller's error."""
        try:
            async with asyncio.timeout(self._ctx.config.metadata_timeout_s):
                stored = await self._ctx.ledgers.read(self._ledger_id)
        except (MetadataError, TimeoutError):
            return
        accept(stored.metadata)

    def _choose(
        self,
        first_entry: int,
        ensemble: Ensemble,
        failed: Collection[str],
        writable: Sequence[str],
        give_up: bool,
    ) -> Replacement:
        members = list(ensemble)
        replaced: list[str] = []
        given_up: list[str] = []
        for position, bookie_id in enumerate(members):
            if bookie_id not in failed:
                continue
            try:
                members[position] = self._replacement(members, position, writable, failed)
                replaced.append(bookie_id)
            except NotEnoughBookies:
                if not give_up:
                    raise
                given_up.append(bookie_id)
        return Replacement(first_entry, tuple(members), tuple(replaced), tuple(given_up))

    def _replacement(
        self, members: list[str], position: int, writable: Sequence[str], failed: Collection[str]
    ) -> str:
        """A bookie for ``members[position]``: one that never failed for this ledger if there is
        one; else one that failed earlier and is writable again (registered anew: a restarted
        bookie), rather than failing the ledger — a rolling restart of E + 1 bookies leaves no
        other. Never a member, never one failing now. Raises NotEnoughBookies."""
        placement = self._ctx.placement
        try:
            return placement.replace_bookie(members, position, writable, self.ever_failed | set(members))
        except NotEnoughBookies:
            return placement.replace_bookie(members, position, writable, set(failed) | set(members))


def _starting_at(md: LedgerMetadata, first_entry: int) -> Ensemble | None:
    for first, bookies in md.ensembles:
        if first == first_entry:
            return bookies
    return None


def _with_fragment(md: LedgerMetadata, first_entry: int, ensemble: Ensemble) -> LedgerMetadata:
    """``md`` with the fragment starting at ``first_entry`` set to ``ensemble``: a new last
    fragment, or the existing fragment starting there replaced (re-replication of a fragment,
    also the last one of a closed ledger: only a new fragment needs an open ledger)."""
    if first_entry > md.ensembles[-1][0]:
        return md.with_ensemble_change(first_entry, ensemble)
    fragments = tuple(
        (first, ensemble if first == first_entry else bookies) for first, bookies in md.ensembles
    )
    if _starting_at(md, first_entry) is None:
        raise MetadataConflict(f"ledger {md.ledger_id}: no fragment starts at entry {first_entry}")
    return dataclasses.replace(md, ensembles=fragments)
