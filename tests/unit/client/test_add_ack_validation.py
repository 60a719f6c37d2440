"""Malformed and stray ADD acks never complete an add (the inline ack check in
``BookieConnection.data_received`` and the generic decoder behind it).

What the code documents, and these tests pin:

- A frame that is not a valid response (bool where an int belongs, an array too short, a negative
  or non-integer id, not msgpack, trailing bytes, a length prefix above the maximum) is a
  ProtocolError: the connection is closed, its pending requests fail with BookieConnectionLost
  (whose cause is the ProtocolError) and the ledger replaces the bookie (ensemble change). The add
  completes only with the replacement's ack.
- A well-formed answer whose request id is not pending on that connection (never sent, already
  answered: a duplicate) is dropped; the connection stays up and nothing completes from it.
- Fields beyond the known ones are ignored (docs/protocol.md): such an ack is a valid ack.

Every ledger here is E=3 Qw=3 Qa=3, so an add cannot complete without the ack of the bookie under
test (or, after it is replaced, of its replacement).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgpack
import pytest

from bookkeeper_aio import BookieConnectionLost, BookKeeper
from bookkeeper_aio.client.connection import ConnectionState
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import FRAME_BYTES_MAX, REQUEST_ID_MAX
from bookkeeper_aio.protocol.errors import ProtocolError
from bookkeeper_aio.protocol.framing import LENGTH
from tests.harness.fake_bookie import FakeCluster
from tests.unit.client.mangling_bookie import EventLog, cluster, mangling, raw_frame

__all__ = ["cluster"]  # the fixture: four ManglingBookies instead of conftest's plain ones

# Each: (rid, ledger id, entry id) of the real ack -> the frame the bookie sends instead.
CLOSING: dict[str, Callable[[int, int, int], bytes]] = {
    "bool request id": lambda r, lid, eid: raw_frame([1, True, 0, None, lid, eid]),
    "bool status false": lambda r, lid, eid: raw_frame([1, r, False, None, lid, eid]),
    "bool status true": lambda r, lid, eid: raw_frame([1, r, True, None, lid, eid]),
    "bool op": lambda r, lid, eid: raw_frame([True, r, 0, None, lid, eid]),
    "array of 5": lambda r, lid, eid: raw_frame([1, r, 0, None, lid]),
    "array of 3": lambda r, lid, eid: raw_frame([1, r, 0]),
    "array of 1": lambda r, lid, eid: raw_frame([1]),
    "negative entry id": lambda r, lid, eid: raw_frame([1, r, 0, None, lid, -1]),
    "negative ledger id": lambda r, lid, eid: raw_frame([1, r, 0, None, -lid - 1, eid]),
    "negative request id": lambda r, lid, eid: raw_frame([1, -r, 0, None, lid, eid]),
    "entry id above ID_MAX": lambda r, lid, eid: raw_frame([1, r, 0, None, lid, 1 << 63]),
    "ledger id above ID_MAX": lambda r, lid, eid: raw_frame([1, r, 0, None, (1 << 64) - 1, eid]),
    "float entry id": lambda r, lid, eid: raw_frame([1, r, 0, None, lid, float(eid)]),
    "float request id": lambda r, lid, eid: raw_frame([1, float(r), 0, None, lid, eid]),
    "unknown status": lambda r, lid, eid: raw_frame([1, r, 12345, None, lid, eid]),
    "bytes message": lambda r, lid, eid: raw_frame([1, r, 0, b"ok", lid, eid]),
    "a map": lambda r, lid, eid: raw_frame({"op": 1, "rid": r}),
    "answer of another op": lambda r, lid, eid: raw_frame([4, r, 0, None, lid, eid]),
    "ADD_ACKS not agreed in HELLO": lambda r, lid, eid: raw_frame([11, 0, 0, None, [r]]),
    "not msgpack": lambda r, lid, eid: LENGTH.pack(1) + b"\xc1",
    "trailing bytes": lambda r, lid, eid: (
        LENGTH.pack(len(b := msgpack.packb([1, r, 0, None, lid, eid]) + b"\x00")) + b
    ),
    "frame too large": lambda r, lid, eid: LENGTH.pack(FRAME_BYTES_MAX + 1),
}


@pytest.mark.parametrize("kind", list(CLOSING))
async def test_malformed_ack__closes_connection_and_the_add_completes_only_after_replacement(
    bk: BookKeeper, cluster: FakeCluster, kind: str
) -> None:
    lh = await bk.create_ledger(3, 3, 3)
    events = EventLog()
    lh.set_event_listener(events)
    assert await lh.append(b"warm-up") == 0
    victim = mangling(cluster, lh.metadata.current_ensemble[1])
    conn = bk.context.pool.connection(victim.id)
    assert conn.state is ConnectionState.READY
    make = CLOSING[kind]
    victim.mangle = lambda resp, frame: [make(resp.request_id, resp.ledger_id, resp.entry_id)]

    assert await lh.append(b"one") == 1

    assert conn.state is ConnectionState.CLOSED
    assert isinstance(conn.error, BookieConnectionLost)
    assert isinstance(conn.error.__cause__, ProtocolError)
    assert lh.ensemble_changes == 1
    assert victim.id not in lh.metadata.current_ensemble
    # The add completed after the change, i.e. with the replacement's ack, never the bad frame's.
    assert events.events == [
        ("add.completed", 0),
        ("ensemble_change.started", 0),
        ("ensemble_change.finished", 1),
        ("add.completed", 1),
    ]
    replacement = next(b for b in lh.metadata.current_ensemble if b not in lh.metadata.ensembles[0][1])
    assert cluster.by_id(replacement).entry(lh.id, 1) is not None
    await lh.close()


async def test_malformed_ack__fails_every_request_pending_on_that_connection(
    bk: BookKeeper, cluster: FakeCluster
) -> None:
    """Several adds in flight on the victim: the bad frame fails them all at once (one change)."""
    lh = await bk.create_ledger(3, 3, 3)
    events = EventLog()
    lh.set_event_listener(events)
    await lh.append(b"warm-up")
    victim = mangling(cluster, lh.metadata.current_ensemble[0])
    bad = {"sent": False}

    def mangle(resp: m.AddEntryResponse, frame: bytes) -> list[bytes]:
        if resp.entry_id < 5:  # kept back: still pending when the bad frame arrives
            return []
        if not bad["sent"]:
            bad["sent"] = True
            return [raw_frame([1, resp.request_id, False, None, resp.ledger_id, resp.entry_id])]
        return [frame]

    victim.mangle = mangle
    futures = [await lh.append_async(b"%d" % i) for i in range(1, 6)]
    assert await asyncio.gather(*futures) == [1, 2, 3, 4, 5]
    assert lh.ensemble_changes == 1
    completed = [v for e, v in events.events if e == "add.completed"]
    assert completed == [0, 1, 2, 3, 4, 5]
    started = events.events.index(("ensemble_change.started", 0))
    assert all(e != "add.completed" for e, _ in events.events[1:started])
    await lh.close()


async def test_ack_with_unknown_request_id__is_ignored_and_completes_nothing(
    bk: BookKeeper, cluster: FakeCluster
) -> None:
    lh = await bk.create_ledger(3, 3, 3)
    await lh.append(b"warm-up")
    victim = mangling(cluster, lh.metadata.current_ensemble[2])
    conn = bk.context.pool.connection(victim.id)
    real: list[bytes] = []

    def mangle(resp: m.AddEntryResponse, frame: bytes) -> list[bytes]:
        real.append(frame)
        lid, eid, rid = resp.ledger_id, resp.entry_id, resp.request_id
        return [  # acks for ids never sent on this connection (the next ones, the maximum)
            raw_frame([1, rid + 1, 0, None, lid, eid]),
            raw_frame([1, rid + 1000, 0, None, lid, eid + 1]),
            raw_frame([1, REQUEST_ID_MAX, 0, None, lid, eid]),
        ]

    victim.mangle = mangle
    future = await lh.append_async(b"one")
    await asyncio.sleep(0.2)
    assert real, "the bookie answered"
    assert not future.done()
    assert conn.state is ConnectionState.READY
    assert conn.pending_count == 1  # the real request is still waiting
    victim.mangle = None
    victim.send_raw(real)
    assert await future == 1
    assert lh.ensemble_changes == 0
    assert conn.state is ConnectionState.READY
    await lh.close()


async def test_duplicate_ack__for_a_completed_add_is_ignored(bk: BookKeeper, cluster: FakeCluster) -> None:
    """Entry 0's ack comes twice at once, then twice more instead of entry 1's ack: entry 1 does
    not complete from them; the connection stays up; entry 1 completes with its own ack."""
    lh = await bk.create_ledger(3, 3, 3)
    victim = mangling(cluster, lh.metadata.current_ensemble[1])
    first: list[bytes] = []
    held: list[bytes] = []

    def mangle(resp: m.AddEntryResponse, frame: bytes) -> list[bytes]:
        if resp.entry_id == 0:
            first.append(frame)
            return [frame, frame]
        held.append(frame)
        return [first[0], first[0]]

    victim.mangle = mangle
    assert await lh.append(b"zero") == 0
    conn = bk.context.pool.connection(victim.id)
    future = await lh.append_async(b"one")
    await asyncio.sleep(0.2)
    assert held
    assert not future.done()
    assert lh.last_add_confirmed == 0
    assert conn.state is ConnectionState.READY
    victim.mangle = None
    victim.send_raw(held)
    assert await future == 1
    assert lh.ensemble_changes == 0
    await lh.close()


async def test_ack_with_trailing_fields__is_a_valid_ack(bk: BookKeeper, cluster: FakeCluster) -> None:
    """docs/protocol.md: fields beyond the known ones are ignored (room to evolve); a text message
    on an EOK ack is allowed too. Neither closes the connection."""
    lh = await bk.create_ledger(3, 3, 3)
    await lh.append(b"warm-up")
    victim = mangling(cluster, lh.metadata.current_ensemble[0])
    conn = bk.context.pool.connection(victim.id)
    shapes = [
        lambda r: raw_frame([1, r.request_id, 0, None, r.ledger_id, r.entry_id, "future field", 7]),
        lambda r: raw_frame([1, r.request_id, 0, "fine", r.ledger_id, r.entry_id]),
    ]
    for i, shape in enumerate(shapes, start=1):
        victim.mangle = lambda resp, frame, shape=shape: [shape(resp)]  # type: ignore[misc]
        assert await lh.append(b"x") == i
    assert conn.state is ConnectionState.READY
    assert lh.ensemble_changes == 0
    await lh.close()
