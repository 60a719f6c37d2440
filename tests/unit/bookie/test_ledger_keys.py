"""The bookie's key check against metadata (bookie/ledger_keys.py) on a real Storage with a scripted
metadata: unknown ledgers get no record unless metadata knows them and the key checks, a squatter's
record is re-keyed (also across a restart), a verified key's fence is never dropped."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from bookie import ledger_keys
from bookie.journal import JournalError
from bookie.ledger_keys import KeyInfo, KeyRefused, KeyVerifier
from bookie.mode import DiskThresholds, ModeMachine, ReadOnly
from bookie.storage import AddBatch, Fenced, NoLedger, Storage, Unauthorized
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.digest import key_check

from .fakes import FaultyFileIO
from .test_storage import add, body, config, durable, start_add

REAL = b"R" * 32
JUNK = b"J" * 32


class Metadata:
    """What metadata says per ledger id; counts lookups."""

    def __init__(self, ledgers: dict[int, bytes | None], closed: frozenset[int] = frozenset()) -> None:
        self.ledgers = ledgers
        self.closed = closed
        self.lookups = 0

    async def key_info(self, ledger_id: int) -> KeyInfo:
        self.lookups += 1
        await asyncio.sleep(0)
        if ledger_id not in self.ledgers:
            return KeyInfo(exists=False, check=None)
        return KeyInfo(exists=True, check=self.ledgers[ledger_id], writable=ledger_id not in self.closed)


async def _open(path: Path, md: Metadata) -> Storage:
    storage = await Storage.open(config(path))
    storage.keys = KeyVerifier(storage, md)
    return storage


async def test_unknown_ledgers_get_a_record_only_when_metadata_checks_the_key(tmp_path: Path) -> None:
    md = Metadata({1: key_check(REAL), 2: None})  # 2: a key-format-1 ledger (nothing to check)
    storage = await _open(tmp_path, md)
    with pytest.raises(KeyRefused, match="not in metadata"):
        await add(storage, 7, 0, key=JUNK)  # a future id: nothing is created
    with pytest.raises(KeyRefused):
        await add(storage, 1, 0, key=JUNK)  # a wrong key for a real ledger
    assert sorted(storage.ledgers) == []
    await asyncio.gather(*(add(storage, 1, i, key=REAL) for i in range(5)))  # in order, one lookup
    assert storage.ledger(1).key_verified
    await add(storage, 2, 0, key=JUNK)  # format 1: first key wins, as before
    lookups = md.lookups
    with pytest.raises(Unauthorized):
        await add(storage, 1, 5, key=JUNK)  # verified: refused at once (EUA), without asking again
    assert md.lookups == lookups
    assert [(await storage.read_entry(1, i))[1] for i in range(5)] == [body(1, i, i - 1) for i in range(5)]
    with pytest.raises(NoLedger):
        await storage.read_entry(7, 0)
    await storage.close()


async def test_a_squatters_record_is_rekeyed_and_stays_so_after_a_restart(tmp_path: Path) -> None:
    plain = await Storage.open(config(tmp_path))  # no metadata: the squatter's fence and add land
    await add(plain, 5, 0, key=JUNK, payload=b"junk")
    await durable(lambda cb: plain.fence(5, JUNK, cb))
    await plain.close()
    storage = await _open(tmp_path, Metadata({5: key_check(REAL)}))
    await add(storage, 5, 0, key=REAL)  # the real writer: the fence and the junk entry go
    await add(storage, 5, 1, key=REAL)
    state = storage.ledger(5)
    assert (state.master_key, state.fenced, len(state.index)) == (REAL, False, 2)
    assert storage.keys is not None
    assert storage.keys.rekeyed == 1
    storage.abort()  # replay alone (REKEY record) must give the same
    reopened = await Storage.open(config(tmp_path))
    state = reopened.ledger(5)
    assert (state.master_key, state.fenced, len(state.index)) == (REAL, False, 2)
    assert (await reopened.read_entry(5, 0))[1] == body(5, 0, -1)
    await reopened.close()


async def test_a_squatters_requests_in_flight_at_the_rekey_never_land_on_the_real_record(
    tmp_path: Path,
) -> None:
    """The squatter keeps writing with its key (which matches the record: no lookup) while the
    real writer's first add re-keys the record: its add and WRITE_LAC journaled before the REKEY
    but durable after it complete on the old record. Replay drops them with the REKEY; memory must
    not hold them either (an entry past the real LAC, an inflated LAC readers trust)."""
    fileio = FaultyFileIO()
    plain = await Storage.open(config(tmp_path), fileio)
    await add(plain, 5, 0, key=JUNK, payload=b"junk")  # no metadata: the squatter's record lands
    await plain.close()
    storage = await Storage.open(config(tmp_path), fileio)
    storage.keys = KeyVerifier(storage, Metadata({5: key_check(REAL)}))
    fileio.sync_gate = threading.Event()
    evil = start_add(storage, 5, 1000, body(5, 1000, 999_999, b"evil"), key=JUNK)
    lac = asyncio.ensure_future(durable(lambda cb: storage.write_lac(5, JUNK, 2_000_000, b"x", cb)))
    real = asyncio.ensure_future(add(storage, 5, 0, key=REAL))
    for _ in range(10):  # the lookup answers (the scripted metadata takes one loop turn)
        await asyncio.sleep(0)
    assert storage.keys.rekeyed == 1
    fileio.sync_gate.set()
    await asyncio.gather(evil, lac, real)
    state = storage.ledger(5)
    assert (state.master_key, sorted(state.index.entry_ids()), state.lac) == (REAL, [0], -1)
    storage.abort()
    reopened = await Storage.open(config(tmp_path))
    state = reopened.ledger(5)
    assert (state.master_key, sorted(state.index.entry_ids()), state.lac) == (REAL, [0], -1)
    await reopened.close()


async def test_a_real_keys_fence_is_never_dropped(tmp_path: Path) -> None:
    storage = await _open(tmp_path, Metadata({3: key_check(REAL)}))
    await durable(lambda cb: storage.fence(3, REAL, cb))  # recovery fenced a bookie with no entry
    for key in (JUNK, REAL):
        with pytest.raises(KeyRefused if key == JUNK else Fenced):
            await add(storage, 3, 0, key=key)
    assert storage.ledger(3).fenced
    storage.abort()
    reopened = await _open(tmp_path, Metadata({3: key_check(REAL)}))
    with pytest.raises(KeyRefused):
        await add(reopened, 3, 0, key=JUNK)
    with pytest.raises(Fenced):
        await add(reopened, 3, 0, key=REAL)
    await reopened.close()


async def test_a_writer_gets_no_new_record_of_a_ledger_metadata_shows_closed(tmp_path: Path) -> None:
    """A bookie with no record of a closed ledger (GC forgot it, fence included, after its copy was
    re-replicated elsewhere; or recovery's fences never reached it) refuses a writer's add and
    WRITE_LAC with EFENCED and creates nothing: a writer that lost the ledger gets no ack here.
    Recovery adds (write-back, re-replication) still make the record; a record the bookie holds
    keeps deciding by its own fence."""
    md = Metadata({4: key_check(REAL), 6: key_check(REAL), 8: key_check(REAL)}, closed=frozenset({4, 6, 8}))
    storage = await _open(tmp_path, md)
    assert storage.keys is not None
    with pytest.raises(ledger_keys.NotOpen):
        await add(storage, 4, 7, key=REAL)
    with pytest.raises(ledger_keys.NotOpen):
        await storage.keys.verify(4, REAL, writes=True)  # a WRITE_LAC
    assert 4 not in storage.ledgers
    await storage.keys.verify(4, REAL)  # a fence still creates its (fenced) record
    await add(storage, 6, 0, key=REAL, recovery=True)  # re-replication of a closed ledger
    await add(storage, 6, 1, key=REAL)  # its record is held now: decided by its own fence, as before
    assert sorted(storage.ledger(6).index.entry_ids()) == [0, 1]
    mixed = [start_add(storage, 8, 0, body(8, 0, -1), recovery=True, key=REAL)]
    mixed.append(start_add(storage, 8, 1, body(8, 1, 0), key=REAL))  # parked with the recovery add
    outcomes = await asyncio.gather(*mixed, return_exceptions=True)
    assert outcomes[0] is None
    assert isinstance(outcomes[1], ledger_keys.NotOpen)
    await storage.close()


async def test_a_checkpoint_never_holds_a_rekey_its_journal_lost(tmp_path: Path) -> None:
    """The crash window after a re-key: the REKEY is in memory at once, durable a group later. A
    checkpoint taken meanwhile waits for it, so a crash before it is durable cannot leave a
    checkpoint with the re-keyed row and, after it, the squatter's fence replayed onto that row
    (a junk fence on the real writer's ledger)."""
    fileio = FaultyFileIO()
    storage = await Storage.open(config(tmp_path), fileio)
    await add(storage, 5, 0, key=JUNK, payload=b"junk")  # a squatter's record (no metadata here)
    fileio.sync_gate = threading.Event()
    fence = asyncio.ensure_future(durable(lambda cb: storage.fence(5, JUNK, cb)))  # group 1
    await asyncio.sleep(0.05)  # group 1 is in its sync, held by the gate
    storage.rekey(storage.ledger(5), REAL)  # group 2: the REKEY
    checkpoint = asyncio.ensure_future(storage.write_checkpoint())  # its position: before group 1
    await asyncio.sleep(0.1)
    assert not checkpoint.done()  # it waits for the REKEY to be durable
    fileio.fail_write = True  # group 1 (written) reaches the disk, group 2 never does
    fileio.sync_gate.set()
    await fence
    with pytest.raises(JournalError):
        await checkpoint
    storage.abort()
    reopened = await Storage.open(config(tmp_path))
    state = reopened.ledger(5)
    assert (state.master_key, state.fenced) == (JUNK, True)  # the squatter's, whole: no mix
    await reopened.close()


class CreatedMidLookup(Metadata):
    """Metadata that learns ledger ``lid`` while a lookup of it is under way (a client creating the
    very id an attacker fences): that lookup read it before, every later one after."""

    def __init__(self, lid: int) -> None:
        super().__init__({})
        self.lid = lid
        self.reading = asyncio.Event()
        self.release = asyncio.Event()

    async def key_info(self, ledger_id: int) -> KeyInfo:
        before = dict(self.ledgers)
        self.lookups += 1
        if self.lookups == 1:
            self.reading.set()
            await self.release.wait()
        if ledger_id not in before:
            return KeyInfo(exists=False, check=None)
        return KeyInfo(exists=True, check=before[ledger_id])


async def test_a_request_that_joined_an_older_lookup_is_decided_by_a_newer_one(tmp_path: Path) -> None:
    md = CreatedMidLookup(9)
    storage = await _open(tmp_path, md)
    assert storage.keys is not None
    squat = asyncio.ensure_future(storage.keys.verify(9, JUNK))  # the attacker's fence: a lookup
    await md.reading.wait()
    md.ledgers[9] = key_check(REAL)  # the client's create lands meanwhile
    first_add = asyncio.ensure_future(add(storage, 9, 0, key=REAL))  # joins the lookup under way
    fence = asyncio.ensure_future(storage.keys.verify(9, REAL))  # so does a fence of the real key
    await asyncio.sleep(0)
    md.release.set()
    with pytest.raises(KeyRefused, match="not in metadata"):
        await squat  # its own lookup, begun after it arrived: refused
    await first_add  # decided again by a lookup begun after it arrived: accepted
    await fence
    assert md.lookups >= 2
    assert storage.ledger(9).master_key == REAL
    assert (await storage.read_entry(9, 0))[1] == body(9, 0, -1)
    assert storage.keys.refused == 1
    await storage.close()


class Gated(Metadata):
    """Every ledger exists with the real key; lookups wait for ``open`` and are recorded in the
    order they begin, with the most under way at once."""

    def __init__(self) -> None:
        super().__init__({})
        self.open = asyncio.Event()
        self.order: list[int] = []
        self.running = self.running_max = 0

    async def key_info(self, ledger_id: int) -> KeyInfo:
        self.order.append(ledger_id)
        self.running += 1
        self.running_max = max(self.running_max, self.running)
        try:
            await self.open.wait()
            await asyncio.sleep(0)
        finally:
            self.running -= 1
        return KeyInfo(exists=True, check=key_check(REAL))


class Client:
    """A reply target with a peer address that can be paused (as a ServerConnection)."""

    def __init__(self, address: str) -> None:
        self.peer_address = address
        self.closed = False
        self.pauses: list[bool] = []
        self.answers: dict[int, asyncio.Future[None]] = {}

    def pause_by_keys(self, paused: bool) -> None:
        self.pauses.append(paused)

    def close(self) -> None:
        self.closed = True
        self.peer_address = ""  # as a ServerConnection's once closed

    def add(self, storage: Storage, ledger_id: int, entry_id: int = 0) -> asyncio.Future[None]:
        rid = ledger_id * 1000 + entry_id
        future = self.answers[rid] = asyncio.get_running_loop().create_future()
        requests = m.AddRequests()
        requests.append(m.AddEntryRequest(rid, ledger_id, entry_id, 0, REAL, body(ledger_id, entry_id, -1)))
        storage.add_run(requests, self, ClientDone)
        return future


class ClientDone(AddBatch):
    __slots__ = ()

    def on_error(self, request_id: int, error: BaseException) -> None:
        self.target.answers[request_id].set_exception(error)

    def on_durable(self, error: BaseException | None) -> None:
        for rid in self.request_ids:
            answer = self.target.answers[rid]
            answer.set_result(None) if error is None else answer.set_exception(error)


async def test_a_bulk_creator_waits_its_turn_and_is_never_refused(tmp_path: Path) -> None:
    md = Gated()
    storage = await _open(tmp_path, md)
    broker, other = Client("10.0.0.1"), Client("10.0.0.2")
    count = ledger_keys.LOOKUPS_MAX + 44  # more than one peer's read slots, and than everyone's
    first_adds = [broker.add(storage, lid) for lid in range(1, count + 1)]
    first_adds += [broker.add(storage, lid, 1) for lid in range(1, count + 1)]  # pipelined: park too
    other_add = other.add(storage, 5000)
    await asyncio.sleep(0.01)
    assert md.running == ledger_keys.LOOKUPS_PER_PEER_MAX + 1  # the broker's slots full, the other's own
    md.open.set()
    await asyncio.gather(*first_adds, other_add)  # every one accepted: none refused for want of room
    assert md.running_max <= ledger_keys.LOOKUPS_PER_PEER_MAX + 1
    assert md.order.index(5000) < ledger_keys.LOOKUPS_PER_PEER_MAX + 1  # not behind the broker's queue
    assert sorted(md.order) == [*range(1, count + 1), 5000]  # one lookup per ledger
    assert broker.pauses == []  # well under WAITING_PER_PEER_MAX: never paused
    for lid in (1, count):
        assert (await storage.read_entry(lid, 1))[1] == body(lid, 1, -1)
    await storage.close()


async def test_a_peer_with_too_many_requests_waiting_is_not_read_until_half_are_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ledger_keys, "WAITING_PER_PEER_MAX", 8)
    md = Gated()
    storage = await _open(tmp_path, md)
    broker, other = Client("10.0.0.1"), Client("10.0.0.2")
    adds = [broker.add(storage, lid) for lid in range(1, 8)]
    assert broker.pauses == []
    adds.append(broker.add(storage, 8))  # the 8th waiting: this connection stops being read
    assert broker.pauses == [True]
    adds.append(broker.add(storage, 9))  # the rest of the read in hand is still taken, not refused
    adds.append(other.add(storage, 100))  # other peers are not paused
    assert other.pauses == []
    md.open.set()
    await asyncio.gather(*adds)
    assert broker.pauses == [True, False]
    await storage.close()


async def test_the_queue_of_a_peer_whose_connections_closed_is_dropped_unread(tmp_path: Path) -> None:
    md = Gated()
    storage = await _open(tmp_path, md)
    attacker, client = Client("10.0.0.9"), Client("10.0.0.1")
    flood = [attacker.add(storage, lid) for lid in range(1, 201)]  # 64 read, 136 queued
    await asyncio.sleep(0.01)
    attacker.close()  # it goes away, its reads under way and its queue waiting
    honest = client.add(storage, 500)
    md.open.set()
    async with asyncio.timeout(10):  # a lost count would leave the queue unserved: fail, not hang
        await honest  # its own turn, unaffected
        results = await asyncio.gather(*flood, return_exceptions=True)  # every one answered
    assert sorted(md.order) == [*range(1, ledger_keys.LOOKUPS_PER_PEER_MAX + 1), 500]  # the queue: unread
    assert all(isinstance(r, ConnectionError) for r in results[ledger_keys.LOOKUPS_PER_PEER_MAX :])
    again = Client("10.0.0.9")  # the same address, later: its count was given back, it is served
    await asyncio.wait_for(asyncio.gather(*(again.add(storage, lid) for lid in range(1000, 1100))), 10)
    assert again.pauses == []
    await storage.close()


async def test_an_add_parked_while_writable_is_refused_if_the_bookie_turned_read_only(tmp_path: Path) -> None:
    """An add waiting for its key check when the bookie turns read-only (disk low, an operator's
    drain) is refused like one arriving then (EREADONLY), not journaled with the gate it arrived
    with (none: the bookie was writable); a recovery add is still taken."""
    storage = await Storage.open(config(tmp_path))
    mode = ModeMachine(DiskThresholds(100, 200, 50))
    mode.free_bytes = 10_000  # above the reserve: recovery adds are allowed while read-only
    storage.keys = KeyVerifier(storage, Metadata({9: key_check(REAL)}), add_gate=mode.check_add)
    writer = start_add(storage, 9, 0, body(9, 0, -1), key=REAL)  # parked: the ledger is not held yet
    recovery = start_add(storage, 9, 1, body(9, 1, 0), key=REAL, recovery=True)
    mode.set_manual(True)  # before the lookup answers
    assert mode.read_only
    with pytest.raises(ReadOnly):
        await writer
    await recovery
    assert 1 in storage.ledger(9).index
    assert 0 not in storage.ledger(9).index
    await storage.close()


class Batched(Metadata):
    """A source that reads many ledgers at once (``key_infos``), leaving ``left_out`` ids for the
    caller to read one by one; ``fail_batches`` of its batch reads raise."""

    def __init__(self, ledgers: dict[int, bytes | None], left_out: frozenset[int] = frozenset()) -> None:
        super().__init__(ledgers)
        self.left_out = left_out
        self.batches: list[list[int]] = []
        self.singles: list[int] = []
        self.fail_batches = 0

    async def key_info(self, ledger_id: int) -> KeyInfo:
        self.singles.append(ledger_id)
        return await super().key_info(ledger_id)

    async def key_infos(self, ledger_ids: list[int]) -> dict[int, KeyInfo]:
        self.batches.append(list(ledger_ids))
        await asyncio.sleep(0)
        if self.fail_batches:
            self.fail_batches -= 1
            raise ConnectionError("metadata unavailable")
        infos = {}
        for lid in ledger_ids:
            if lid not in self.left_out:
                exists = lid in self.ledgers
                infos[lid] = KeyInfo(exists=exists, check=self.ledgers[lid] if exists else None)
        return infos


async def test_the_lookups_of_one_loop_turn_are_read_together(tmp_path: Path) -> None:
    """The first adds of many ledgers in one turn (a client's burst over new ledgers) take one
    batch read per turn, within the read slots; ids the source leaves out are read one by one; each
    ledger is decided as alone: a junk key and an id metadata does not hold are refused, the rest
    journaled and readable."""
    count = ledger_keys.LOOKUPS_PER_PEER_MAX + 36
    md = Batched({lid: key_check(REAL) for lid in range(1, count + 1)}, left_out=frozenset({3, 40}))
    storage = await _open(tmp_path, md)
    client = Client("10.0.0.1")
    adds = [client.add(storage, lid) for lid in range(1, count + 1)]
    stranger = client.add(storage, 10_000)  # not in metadata
    junk = m.AddRequests()
    junk.append(m.AddEntryRequest(5_000_001, 77, 1, 0, JUNK, body(77, 1, -1)))  # ledger 77, a wrong key
    client.answers[5_000_001] = asyncio.get_running_loop().create_future()
    storage.add_run(junk, client, ClientDone)
    await asyncio.gather(*adds)
    with pytest.raises(KeyRefused, match="not in metadata"):
        await stranger
    with pytest.raises(KeyRefused):
        await client.answers[5_000_001]
    assert md.batches[0] == list(range(1, ledger_keys.LOOKUPS_PER_PEER_MAX + 1))  # the peer's slots
    assert all(len(batch) <= ledger_keys.LOOKUPS_PER_PEER_MAX for batch in md.batches)
    assert sorted(lid for batch in md.batches for lid in batch) == [*range(1, count + 1), 10_000]
    assert md.singles == [3, 40]  # left out of their batch: read alone
    assert len(md.batches) < count // 8
    for lid in (1, 3, 40, count):
        assert storage.ledger(lid).key_verified
        assert (await storage.read_entry(lid, 0))[1] == body(lid, 0, -1)
    assert 10_000 not in storage.ledgers
    await storage.close()


async def test_a_failed_batch_read_fails_its_ledgers_adds_and_the_next_adds_look_again(
    tmp_path: Path,
) -> None:
    md = Batched({lid: key_check(REAL) for lid in range(1, 6)})
    md.fail_batches = 1
    storage = await _open(tmp_path, md)
    client = Client("10.0.0.1")
    first = [client.add(storage, lid) for lid in range(1, 6)]
    for answer in first:
        with pytest.raises(ConnectionError, match="metadata unavailable"):
            await answer
    assert not storage.ledgers  # nothing created on a failed check
    await asyncio.gather(*(client.add(storage, lid, 1) for lid in range(1, 6)))
    assert md.batches == [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]]
    assert (await storage.read_entry(5, 1))[1] == body(5, 1, -1)
    await storage.close()
