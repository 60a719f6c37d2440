"""Which key a ledger's record may hold: checked against metadata where the first comer could lie.

A bookie adopts a ledger's master key from the first request that brings one. Ids are sequential
and readable in metadata, so anyone could fence or add future ids with a junk key, and the real
writer's adds would then be refused (EUA) forever. Key format 2 metadata stores
``key_check = SHA-256(prefix + master_key)`` (bookkeeper_aio/protocol/digest.py), so the bookie can
tell a real key from a junk one without learning anything that lets it forge either. With a
:class:`KeySource` (the bookie runs with ``--metadata``) this module decides:

- **A fence, WRITE_LAC or add of a ledger the bookie does not hold**: the key is checked against
  metadata before a record is created. Metadata has no such ledger -> EUA (nothing is created: a
  stranger cannot make permanent records, and a legitimate recovery always reads the ledger's
  metadata before fencing, so it never meets this); a wrong key -> EUA; a format-1 ledger (no check
  value) -> adopted as before. Adds of the ledger wait (in order) for the answer: one metadata read
  per ledger per bookie, on its first add only; the add path of a known ledger is untouched.
- **A key mismatch on a record the bookie holds** (a squatter's, made while the bookie ran without
  metadata, or before this check existed): if metadata's check value matches the *presented* key
  and not the stored one, the stored record is a squatter's and is started anew under the real key
  (a REKEY journal record, :meth:`bookie.ledger_state.LedgerState.rekey`): its fence, entries and
  LACs go. Otherwise EUA, and a stored key that metadata confirms is marked ``key_verified`` so later
  mismatches are refused without asking again.

Why recovery stays safe (a bookie in the ensemble that never got an entry must keep its fence):
a legitimate fence carries the ledger's real key (recovery derives it from the password checked
against the same metadata), so a record fenced legitimately holds the real key; a re-key happens
only when metadata *disproves* the stored key, so it never drops a legitimate fence, and entries
stored under a junk key were never written by the ledger's writer. Bookie GC keeps every ledger
metadata knows. Without metadata (a standalone bookie) nothing here runs: first key wins, as before.

Bounds: at most :data:`LOOKUPS_MAX` ledgers in lookup at once, :data:`LOOKUPS_PER_PEER_MAX` of them
started by one peer address (a flood of unknown ids from one host leaves room for the others), and
:data:`PARKED_ADDS_MAX` adds waiting (beyond: ETOOMANYREQUESTS), each lookup bounded by
:data:`LOOKUP_TIMEOUT_S` (EIO after). The peer is the ``peer_address`` of the request's reply
target (the connection).
"""

from __future__ import annotations

import asyncio
import hmac
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import structlog

from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.digest import key_check

if TYPE_CHECKING:
    from bookie.storage import AddBatch, AddGate, Storage

log = structlog.get_logger(__name__)

LOOKUPS_MAX = 256
"""Ledgers whose metadata is being read at once (new ledgers arrive one add at a time per writer)."""
PARKED_ADDS_MAX = 10_000
"""Adds waiting for their ledger's lookup, over all connections (each holds its body in memory)."""
LOOKUPS_PER_PEER_MAX = 64
"""Lookups one peer address may have started and not seen answered (of :data:`LOOKUPS_MAX`)."""
LOOKUP_TIMEOUT_S = 10.0


class KeyInfo(NamedTuple):
    """What metadata says about a ledger's key."""

    exists: bool
    check: bytes | None
    """The key check value (key format 2); None for a format-1 ledger (nothing to check against)."""


@runtime_checkable
class KeySource(Protocol):
    async def key_info(self, ledger_id: int) -> KeyInfo:
        """Raise when metadata cannot be read (the request is then answered EIO)."""
        ...


class KeyRefused(Exception):
    """The presented key is not the ledger's (-> EUA)."""


class KeyCheckBusy(Exception):
    """Too many lookups or parked adds (-> ETOOMANYREQUESTS)."""


class _Parked(NamedTuple):
    request: m.AddEntryRequest
    target: Any
    batch_type: type[AddBatch]
    check_add: AddGate | None
    fresh: bool
    """Its lookup began after it arrived. One that joined a lookup under way may have been created
    in metadata since that lookup read it (an attacker's fence of the id a client is creating): a
    refusal of it is decided again by a lookup of its own."""


class KeyVerifier:
    """Owned by :class:`~bookie.storage.Storage` when the bookie has metadata (module doc)."""

    def __init__(self, storage: Storage, source: KeySource) -> None:
        self._storage = storage
        self._source = source
        self._lookups: dict[int, asyncio.Task[KeyInfo]] = {}
        self._lookups_by_peer: dict[str, int] = {}
        self._parked: dict[int, list[_Parked]] = {}
        self._parked_count = 0
        self.rekeyed = 0
        self.refused = 0

    # ------------------------------------------------------------------ the add path
    def wants(self, ledger_id: int, key: bytes) -> bool:
        """Whether an add of ``ledger_id`` with ``key`` must wait for metadata: the ledger is
        unknown, its lookup is under way, or its stored key differs and is not verified."""
        if ledger_id in self._parked:
            return True
        state = self._storage.ledgers.get(ledger_id)
        if state is None:
            return True
        known = state.master_key
        return known is not None and not state.key_verified and not hmac.compare_digest(known, key)

    def park(
        self,
        request: m.AddEntryRequest,
        target: Any,
        batch_type: type[AddBatch],
        check_add: AddGate | None,
        *,
        fresh: bool = False,
    ) -> None:
        """Hold an add until its ledger's lookup answers; then it is journaled (in arrival order,
        through :meth:`Storage.add_run`) or refused. Raises :class:`KeyCheckBusy`."""
        lid = request.ledger_id
        if self._parked_count >= PARKED_ADDS_MAX:
            raise KeyCheckBusy(f"ledger {lid}: {PARKED_ADDS_MAX} adds already wait for a key check")
        fresh = fresh or lid not in self._lookups
        self._start_lookup(lid, _peer(target))
        self._parked.setdefault(lid, []).append(_Parked(request, target, batch_type, check_add, fresh))
        self._parked_count += 1

    # ------------------------------------------------------------------ other requests
    def may_verify(self, ledger_id: int) -> bool:
        """Whether a refused (or record-creating) request of ``ledger_id`` is worth a lookup."""
        state = self._storage.ledgers.get(ledger_id)
        return state is None or not state.key_verified

    async def verify(self, ledger_id: int, key: bytes, target: Any = None) -> None:
        """Return once ``key`` may be used on ``ledger_id`` (a squatter's record re-keyed to it if
        need be; an unknown ledger's record is then created by the caller's handler); ``target``:
        the requester (its ``peer_address`` counts the lookup). Raises :class:`KeyRefused`,
        :class:`KeyCheckBusy`, or the lookup's error."""
        joined = ledger_id in self._lookups
        info = await asyncio.shield(self._start_lookup(ledger_id, _peer(target)))
        try:
            self._settle(ledger_id, key, info)
        except KeyRefused:
            if not joined:
                raise
            self.refused -= 1  # not yet: decided again
            # the lookup joined may have read metadata before the ledger was created: one that
            # began after this request decides (see _Parked.fresh)
            info = await asyncio.shield(self._start_lookup(ledger_id, _peer(target)))
            self._settle(ledger_id, key, info)

    # ------------------------------------------------------------------ internals
    def _start_lookup(self, ledger_id: int, peer: str) -> asyncio.Task[KeyInfo]:
        task = self._lookups.get(ledger_id)
        if task is not None:
            return task
        if len(self._lookups) >= LOOKUPS_MAX:
            raise KeyCheckBusy(f"ledger {ledger_id}: {LOOKUPS_MAX} key checks already under way")
        by_peer = self._lookups_by_peer
        if by_peer.get(peer, 0) >= LOOKUPS_PER_PEER_MAX:
            raise KeyCheckBusy(f"ledger {ledger_id}: {LOOKUPS_PER_PEER_MAX} key checks of {peer} under way")
        by_peer[peer] = by_peer.get(peer, 0) + 1
        task = asyncio.get_running_loop().create_task(self._lookup(ledger_id), name=f"key-check-{ledger_id}")
        self._lookups[ledger_id] = task
        task.add_done_callback(lambda done: self._looked_up(ledger_id, peer, done))
        return task

    async def _lookup(self, ledger_id: int) -> KeyInfo:
        async with asyncio.timeout(LOOKUP_TIMEOUT_S):
            return await self._source.key_info(ledger_id)

    def _looked_up(self, ledger_id: int, peer: str, task: asyncio.Task[KeyInfo]) -> None:
        del self._lookups[ledger_id]
        left = self._lookups_by_peer[peer] - 1
        if left:
            self._lookups_by_peer[peer] = left
        else:
            del self._lookups_by_peer[peer]
        parked = self._parked.pop(ledger_id, [])
        self._parked_count -= len(parked)
        error: BaseException | None
        if task.cancelled():
            error = ConnectionError("the key check was cancelled (the bookie is closing)")
        else:
            error = task.exception()
            if error is not None:
                log.warning("ledger_keys.lookup_failed", ledger_id=ledger_id, error=repr(error))
        run: list[_Parked] = []
        again: list[_Parked] = []
        for add in parked:
            refusal = error
            if refusal is None:
                try:
                    self._settle(ledger_id, add.request.master_key, task.result())
                except KeyRefused as refused:
                    refusal = refused
            if refusal is None:
                run.append(add)
                continue
            self._journal(run)
            run = []
            if isinstance(refusal, KeyRefused) and not add.fresh:
                self.refused -= 1  # not yet: decided again below
                again.append(add)
                continue
            add.batch_type(add.target).on_error(add.request.request_id, refusal)
        self._journal(run)
        for add in again:  # decided by a lookup that begins now, after each of them arrived
            try:
                self.park(add.request, add.target, add.batch_type, add.check_add, fresh=True)
            except KeyCheckBusy as busy:
                add.batch_type(add.target).on_error(add.request.request_id, busy)
        state = self._storage.ledgers.get(ledger_id)
        if state is not None and error is None and not state.key_verified:
            info = task.result()
            known = state.master_key
            if info.check is not None and known is not None and _matches(known, info.check):
                state.key_verified = True  # adopted just now, checked: mismatches are refused at once

    def _journal(self, run: list[_Parked]) -> None:
        """Hand accepted adds back to the add path, consecutive ones of one target together."""
        start = 0
        while start < len(run):
            first = run[start]
            requests = m.AddRequests()
            end = start
            while end < len(run) and run[end][1:4] == first[1:4]:  # target, batch_type, check_add
                requests.append(run[end].request)
                end += 1
            target, batch_type, check_add = first.target, first.batch_type, first.check_add
            self._storage.add_run(requests, target, batch_type, check_add, keys_checked=True)
            start = end

    def _settle(self, ledger_id: int, key: bytes, info: KeyInfo) -> None:
        """Decide ``key`` for ``ledger_id`` from metadata's ``info`` (module doc); re-key a
        squatter's record. Raises :class:`KeyRefused`."""
        if not info.exists:
            self.refused += 1
            raise KeyRefused(f"ledger {ledger_id} is not in metadata: no record is created for it")
        state = self._storage.ledgers.get(ledger_id)
        known = None if state is None else state.master_key
        if known is not None and hmac.compare_digest(known, key):
            return
        if info.check is None:  # key format 1: nothing to check against; first key wins, as before
            if known is None:
                return
            if state is not None:
                state.key_verified = True  # metadata can never disprove it: do not ask again
            self.refused += 1
            raise KeyRefused(f"ledger {ledger_id}: master key mismatch")
        if state is not None and known is not None and _matches(known, info.check):
            state.key_verified = True
            self.refused += 1
            raise KeyRefused(f"ledger {ledger_id}: master key mismatch")
        if not _matches(key, info.check):
            self.refused += 1
            raise KeyRefused(f"ledger {ledger_id}: master key mismatch (checked against metadata)")
        if state is not None and known is not None:
            log.warning(
                "ledger_keys.rekeyed",
                ledger_id=ledger_id,
                entries_dropped=len(state.index),
                fence_dropped=state.fenced,
            )
            self.rekeyed += 1
            self._storage.rekey(state, key)
        elif state is not None:
            state.key_verified = True


def _peer(target: Any) -> str:
    """The peer address a lookup is counted against ("" when the target does not say)."""
    return str(getattr(target, "peer_address", ""))


def _matches(key: bytes, check: bytes) -> bool:
    return hmac.compare_digest(key_check(key), check)
