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
  per ledger per bookie, on its first add only; the add path of a known ledger is untouched. A
  writer's add (not a recovery add) or WRITE_LAC of a ledger metadata shows in recovery or closed
  -> EFENCED, and no record (:class:`NotOpen`): the bookie may be one whose record GC dropped, fence
  included (its copy re-replicated elsewhere while it was away), or one recovery's fences never
  reached; a writer that lost the ledger gets no ack from it. Recovery adds (write-back,
  re-replication) still create the record. The same holds for a ledger in limbo
  (:mod:`bookie.limbo`) the bookie does hold: a journal cut may have taken its fence. Once a lookup
  after the start shows a ledger OPEN, its writers' adds go on as usual (a fence since is here).
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

Bounds, by backpressure, never by refusal (a broker opening hundreds of topics from one host
starts hundreds of ledgers at once; it must be slowed down, not failed): at most
:data:`LOOKUPS_MAX` metadata reads at once, :data:`LOOKUPS_PER_PEER_MAX` of them for one peer
address; further lookups queue per peer address and start in turn, one peer after the other (a
flood of unknown ids from one host leaves room for the others). Requests waiting for a lookup
(parked adds, fences, WRITE_LACs: each holds one of its connection's in-flight permits anyway) are
counted per peer address: once a peer has :data:`WAITING_PER_PEER_MAX` of them, or all peers
together :data:`WAITING_MAX`, the connection that added one stops being read (after the frames of
the read in hand) until that count halves. Each lookup is bounded by :data:`LOOKUP_TIMEOUT_S` once
started (EIO after). An attacker's unknown ids still cost it refusals (EUA), charged to its
address's error budget (bookie/connection_handler.py), and a queued lookup whose requests' connections
all closed is dropped unread. The peer is the ``peer_address`` of the request's reply target (the
connection).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import structlog

from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import AddFlag
from bookkeeper_aio.protocol.digest import key_check

if TYPE_CHECKING:
    from bookie.storage import AddBatch, AddGate, Storage

log = structlog.get_logger(__name__)

LOOKUPS_MAX = 256
"""Metadata reads under way at once (beyond, lookups queue: :data:`LOOKUPS_PER_PEER_MAX`)."""
LOOKUPS_PER_PEER_MAX = 64
"""Metadata reads under way at once for one peer address (of :data:`LOOKUPS_MAX`): its further
lookups wait in its queue, so one host's many new ledgers never take every read slot."""
WAITING_PER_PEER_MAX = 4096
"""Requests of one peer address waiting for a key check before the connection adding one stops
being read (each holds a permit and its body: about ``frame`` bytes each)."""
WAITING_MAX = 10_000
"""Requests waiting for a key check over all peers before a connection adding one stops being read."""
LOOKUP_TIMEOUT_S = 10.0

_RECOVERY_ADD = int(AddFlag.RECOVERY_ADD)


class KeyInfo(NamedTuple):
    """What metadata says about a ledger's key."""

    exists: bool
    check: bytes | None
    """The key check value (key format 2); None for a format-1 ledger (nothing to check against)."""
    writable: bool = True
    """The ledger is OPEN: not in recovery, not closed. A ledger that is not takes no new record
    from a writer's add or WRITE_LAC (:class:`NotOpen`)."""


@runtime_checkable
class KeySource(Protocol):
    """Where key checks read metadata. A source may also offer ``key_infos(ledger_ids) ->
    dict[int, KeyInfo]``: many ledgers in one read (the lookups started in one loop turn go
    together), ids it leaves out are then read one by one."""

    async def key_info(self, ledger_id: int) -> KeyInfo:
        """Raise when metadata cannot be read (the request is then answered EIO)."""
        ...


class KeyRefused(Exception):
    """The presented key is not the ledger's (-> EUA)."""


class NotOpen(Exception):
    """A writer's add or WRITE_LAC of a ledger this bookie holds no record of, which metadata shows
    in recovery or closed (-> EFENCED, and no record is created). Such a bookie may be one that GC
    made forget the ledger (its copy re-replicated elsewhere while it was away: its fence went with
    the record), or one the recovery's fences never reached: a writer that lost the ledger must not
    get acks from it."""


class _Parked(NamedTuple):
    request: m.AddEntryRequest
    target: Any
    batch_type: type[AddBatch]
    check_add: AddGate | None
    fresh: bool
    """Its lookup began after it arrived. One that joined a lookup under way may have been created
    in metadata since that lookup read it (an attacker's fence of the id a client is creating): a
    refusal of it is decided again by a lookup of its own."""
    peer: str
    """The peer address it is counted against (a closed connection no longer says it)."""


class _Lookup:
    """One ledger's metadata read: queued in its peer's turn, then under way."""

    __slots__ = ("future", "peer", "started", "verifiers")

    def __init__(self, future: asyncio.Future[KeyInfo], peer: str) -> None:
        self.future = future
        self.peer = peer
        """The peer address whose request asked for it (its read slot is counted there)."""
        self.started = False
        self.verifiers = 0
        """Requests other than adds awaiting it (:meth:`KeyVerifier.verify`)."""


class KeyVerifier:
    """Owned by :class:`~bookie.storage.Storage` when the bookie has metadata (module doc)."""

    def __init__(self, storage: Storage, source: KeySource, *, add_gate: AddGate | None = None) -> None:
        self._storage = storage
        self._source = source
        self._add_gate = add_gate
        """The read-only gate (``ModeMachine.check_add``: it reads the mode when called), applied
        to parked adds as they are journaled: one that arrived while the bookie was writable
        carries no gate, and the bookie may have turned read-only while its lookup ran."""
        self._lookups: dict[int, _Lookup] = {}
        """Queued or under way, by ledger id: a request of a ledger in lookup joins it."""
        self._running = 0
        self._running_by_peer: dict[str, int] = {}
        self._queued: dict[str, collections.deque[int]] = {}
        """Ledger ids waiting for a read slot, per peer address; peers served in this order, a
        peer moving to the end once served (round robin)."""
        self._tasks: set[asyncio.Task[dict[int, KeyInfo | BaseException]]] = set()
        """The reads under way (the loop keeps only weak references to tasks)."""
        self._batch: list[tuple[int, _Lookup]] = []
        """Lookups started in this loop turn: read together at its end (:meth:`_read_batch`)."""
        self._key_infos = getattr(source, "key_infos", None)
        self._parked: dict[int, list[_Parked]] = {}
        self._waiting = 0
        self._waiting_by_peer: dict[str, int] = {}
        self._paused: dict[Any, str] = {}
        """Connections not read because their peer (or everyone) has too many requests waiting."""
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
        # a record without a key (a keyless fence's; replayed from records after a lost forget)
        # is as good as none: its first key is checked too
        return known is None or (not state.key_verified and not hmac.compare_digest(known, key))

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
        through :meth:`Storage.add_run`) or refused. Never refused for want of room: ``target``
        stops being read instead (module doc)."""
        lid = request.ledger_id
        peer = _peer(target)
        fresh = fresh or not self._under_way(lid)
        self._start_lookup(lid, peer)
        self._parked.setdefault(lid, []).append(_Parked(request, target, batch_type, check_add, fresh, peer))
        self._wait(peer, target)

    # ------------------------------------------------------------------ other requests
    def may_verify(self, ledger_id: int) -> bool:
        """Whether a refused (or record-creating) request of ``ledger_id`` is worth a lookup."""
        state = self._storage.ledgers.get(ledger_id)
        return state is None or not state.key_verified

    async def verify(self, ledger_id: int, key: bytes, target: Any = None, *, writes: bool = False) -> None:
        """Return once ``key`` may be used on ``ledger_id`` (a squatter's record re-keyed to it if
        need be; an unknown ledger's record is then created by the caller's handler); ``target``:
        the requester (its ``peer_address`` counts the lookup; it stops being read while its peer
        has too many requests waiting); ``writes``: a writer's request (WRITE_LAC), refused for a
        ledger held nowhere here that is not OPEN. Raises :class:`KeyRefused`, :class:`NotOpen`, or
        the lookup's error."""
        peer = _peer(target)
        self._wait(peer, target)
        try:
            joined = self._under_way(ledger_id)
            info = await self._await_lookup(ledger_id, peer)
            try:
                self._settle(ledger_id, key, info)
            except KeyRefused:
                if not joined:
                    raise
                self.refused -= 1  # not yet: decided again
                # the lookup joined may have read metadata before the ledger was created: one that
                # began after this request decides (see _Parked.fresh)
                info = await self._await_lookup(ledger_id, peer)
                self._settle(ledger_id, key, info)
            if writes and (not self._holds(ledger_id) or self._storage.in_limbo(ledger_id)):
                self._check_open(ledger_id, info)
        finally:
            self._unwait(peer, 1)

    async def _await_lookup(self, ledger_id: int, peer: str) -> KeyInfo:
        lookup = self._start_lookup(ledger_id, peer)
        lookup.verifiers += 1
        try:
            return await asyncio.shield(lookup.future)
        finally:  # cancelled too (its connection closed): a queued lookup nobody awaits is dropped
            lookup.verifiers -= 1

    # ------------------------------------------------------------------ lookups and their slots
    def _under_way(self, ledger_id: int) -> bool:
        """Whether a lookup of ``ledger_id`` has started (a request joining it arrived after it
        may have read metadata; one joining a queued lookup did not)."""
        lookup = self._lookups.get(ledger_id)
        return lookup is not None and lookup.started

    def _start_lookup(self, ledger_id: int, peer: str) -> _Lookup:
        """The ledger's lookup (joined if queued or under way); a new one starts at once if a read
        slot is free for ``peer``, else it queues in ``peer``'s turn."""
        lookup = self._lookups.get(ledger_id)
        if lookup is not None:
            return lookup
        lookup = self._lookups[ledger_id] = _Lookup(asyncio.get_running_loop().create_future(), peer)
        if self._running < LOOKUPS_MAX and self._running_by_peer.get(peer, 0) < LOOKUPS_PER_PEER_MAX:
            self._run(ledger_id, lookup)
        else:
            queue = self._queued.get(peer)
            if queue is None:
                queue = self._queued[peer] = collections.deque()
            queue.append(ledger_id)
        return lookup

    def _run(self, ledger_id: int, lookup: _Lookup) -> None:
        """Start ``lookup`` (its read slot taken now): read with the others started in this loop
        turn, at its end. Marked started at once: a request joining it from now on may arrive after
        the read (:attr:`_Parked.fresh`)."""
        lookup.started = True
        self._running += 1
        peer = lookup.peer
        self._running_by_peer[peer] = self._running_by_peer.get(peer, 0) + 1
        if not self._batch:
            asyncio.get_running_loop().call_soon(self._read_batch)
        self._batch.append((ledger_id, lookup))

    def _read_batch(self) -> None:
        batch, self._batch = self._batch, []
        ids = [ledger_id for ledger_id, _ in batch]
        name = f"key-check-{ids[0]}" if len(ids) == 1 else f"key-check-{ids[0]}+{len(ids) - 1}"
        task = asyncio.get_running_loop().create_task(self._lookup(ids), name=name)
        self._tasks.add(task)
        task.add_done_callback(lambda done: self._batch_done(batch, done))

    def _run_queued(self) -> None:
        """Start queued lookups while read slots are free, one peer after the other."""
        queued = self._queued
        while queued and self._running < LOOKUPS_MAX:
            for peer in queued:
                if self._running_by_peer.get(peer, 0) < LOOKUPS_PER_PEER_MAX:
                    break
            else:
                return  # every peer with a queue has its own slots full
            queue = queued.pop(peer)
            ledger_id = queue.popleft()
            if queue:
                queued[peer] = queue  # to the end: the next turn is another peer's
            lookup = self._lookups[ledger_id]
            if self._awaited(ledger_id, lookup):
                self._run(ledger_id, lookup)
            else:
                self._drop(ledger_id, lookup)

    def _awaited(self, ledger_id: int, lookup: _Lookup) -> bool:
        """Whether a queued lookup still has a request on an open connection waiting for it (an
        attacker that sends many unknown ids and closes its connections leaves only the reads
        under way behind, not its queue)."""
        if lookup.verifiers:
            return True
        return any(not getattr(add.target, "closed", False) for add in self._parked.get(ledger_id, ()))

    def _drop(self, ledger_id: int, lookup: _Lookup) -> None:
        """Forget a queued lookup nobody waits for any more (:meth:`_awaited`)."""
        del self._lookups[ledger_id]
        error = ConnectionError(f"ledger {ledger_id}: the connection closed before its key check")
        lookup.future.set_exception(error)
        lookup.future.exception()  # retrieved: nobody waits on it
        parked = self._parked.pop(ledger_id, [])
        for add in parked:
            add.batch_type(add.target).on_error(add.request.request_id, error)
        for peer_of, count in collections.Counter(add.peer for add in parked).items():
            self._unwait(peer_of, count)

    async def _lookup(self, ledger_ids: list[int]) -> dict[int, KeyInfo | BaseException]:
        """What metadata says of each ledger (or the error reading it): one read of them all when
        the source offers it, the ones it leaves out one by one."""
        async with asyncio.timeout(LOOKUP_TIMEOUT_S):
            found: dict[int, KeyInfo | BaseException] = {}
            if self._key_infos is not None and len(ledger_ids) > 1:
                found.update(await self._key_infos(ledger_ids))
            rest = [ledger_id for ledger_id in ledger_ids if ledger_id not in found]
            if rest:
                infos = await asyncio.gather(
                    *(self._source.key_info(ledger_id) for ledger_id in rest), return_exceptions=True
                )
                found.update(zip(rest, infos, strict=True))
            return found

    def _wait(self, peer: str, target: Any) -> None:
        """Count one request of ``peer`` waiting for a key check; stop reading ``target`` when its
        peer (or everyone) has too many."""
        waiting = self._waiting_by_peer[peer] = self._waiting_by_peer.get(peer, 0) + 1
        self._waiting += 1
        if (waiting >= WAITING_PER_PEER_MAX or self._waiting >= WAITING_MAX) and target not in self._paused:
            pause = getattr(target, "pause_by_keys", None)
            if pause is not None:
                self._paused[target] = peer
                pause(True)

    def _unwait(self, peer: str, count: int) -> None:
        left = self._waiting_by_peer[peer] - count
        if left:
            self._waiting_by_peer[peer] = left
        else:
            del self._waiting_by_peer[peer]
        self._waiting -= count
        if self._paused and self._waiting <= WAITING_MAX // 2:
            by_peer = self._waiting_by_peer
            for conn, conn_peer in list(self._paused.items()):
                if by_peer.get(conn_peer, 0) <= WAITING_PER_PEER_MAX // 2:
                    del self._paused[conn]
                    conn.pause_by_keys(False)

    def _batch_done(
        self, batch: list[tuple[int, _Lookup]], task: asyncio.Task[dict[int, KeyInfo | BaseException]]
    ) -> None:
        """The read of ``batch``'s ledgers answered: each lookup gets its ledger's answer."""
        self._tasks.discard(task)
        cancelled = ConnectionError("the key check was cancelled (the bookie is closing)")
        error: BaseException | None = cancelled if task.cancelled() else task.exception()
        found = task.result() if error is None else {}
        for ledger_id, lookup in batch:
            answer = found.get(ledger_id, error)
            if isinstance(answer, KeyInfo):
                self._looked_up(ledger_id, lookup, answer, None)
                continue
            if answer is None:  # a source's bug: it must answer every id or raise
                answer = LookupError(f"ledger {ledger_id}: metadata gave no key information")
            elif isinstance(answer, asyncio.CancelledError):
                answer = cancelled
            if answer is not cancelled:
                log.warning("ledger_keys.lookup_failed", ledger_id=ledger_id, error=repr(answer))
            self._looked_up(ledger_id, lookup, None, answer)

    def _looked_up(
        self, ledger_id: int, lookup: _Lookup, info: KeyInfo | None, error: BaseException | None
    ) -> None:
        """``lookup`` answered: metadata's ``info``, or the ``error`` reading it."""
        del self._lookups[ledger_id]
        peer = lookup.peer
        self._running -= 1
        left = self._running_by_peer[peer] - 1
        if left:
            self._running_by_peer[peer] = left
        else:
            del self._running_by_peer[peer]
        self._run_queued()
        if info is not None:
            lookup.future.set_result(info)
            limbo = self._storage.limbo
            if limbo is not None and info.writable and limbo.holds(ledger_id):
                # read after this start: a fence answered before it would show (recovery CASes
                # IN_RECOVERY first, and a ledger never goes back to OPEN)
                limbo.writes_checked.add(ledger_id)
        else:
            assert error is not None
            lookup.future.set_exception(error)
            lookup.future.exception()  # retrieved: the requests that wait on it answer it
        parked = self._parked.pop(ledger_id, [])
        self._settle_parked(ledger_id, parked, info, error)
        for peer_of, count in collections.Counter(add.peer for add in parked).items():
            self._unwait(peer_of, count)
        state = self._storage.ledgers.get(ledger_id)
        if state is not None and info is not None and not state.key_verified:
            known = state.master_key
            if info.check is not None and known is not None and _matches(known, info.check):
                state.key_verified = True  # adopted just now, checked: mismatches are refused at once

    def _settle_parked(
        self, ledger_id: int, parked: list[_Parked], info: KeyInfo | None, error: BaseException | None
    ) -> None:
        """Journal the parked adds the lookup accepts (in order), answer the refused ones; one that
        joined the lookup under way and is refused waits for a lookup of its own (_Parked.fresh)."""
        run: list[_Parked] = []
        again: list[_Parked] = []
        held = self._holds(ledger_id) and not self._storage.in_limbo(ledger_id)  # before any add makes it
        for add in parked:
            refusal = error
            if info is not None:
                try:
                    self._settle(ledger_id, add.request.master_key, info)
                    if not held and not add.request.flags & _RECOVERY_ADD:
                        self._check_open(ledger_id, info)
                except (KeyRefused, NotOpen) as refused:
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
            self.park(add.request, add.target, add.batch_type, add.check_add, fresh=True)

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
            target, batch_type, check_add = first.target, first.batch_type, first.check_add or self._add_gate
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

    def _holds(self, ledger_id: int) -> bool:
        """Whether the bookie holds a record of ``ledger_id`` with a key (one without is as none)."""
        state = self._storage.ledgers.get(ledger_id)
        return state is not None and state.master_key is not None

    @staticmethod
    def _check_open(ledger_id: int, info: KeyInfo) -> None:
        """Refuse a writer's request that would create the record of a ledger metadata shows not
        OPEN (:class:`NotOpen`; the caller knows the bookie holds no record: one it holds keeps its
        own fence)."""
        if not info.writable:
            raise NotOpen(
                f"ledger {ledger_id} is in recovery or closed in metadata: no new record for a writer"
            )


def _peer(target: Any) -> str:
    """The peer address a lookup is counted against ("" when the target does not say)."""
    return str(getattr(target, "peer_address", ""))


def _matches(key: bytes, check: bytes) -> bool:
    return hmac.compare_digest(key_check(key), check)
