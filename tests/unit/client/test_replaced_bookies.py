"""The replaced-bookies history of ledger metadata: recorded by the BookieReplacer's CAS (also when
an ensemble change at a fragment's first entry replaces it in place), bounded, serialized
backward-compatibly (metadata written without it still decodes), shown by ``describe_ledger``."""

from __future__ import annotations

import random

import msgpack
import pytest

from bookkeeper_aio import ClientConfig, LedgerState, RandomPlacement, ReplacedBookie
from bookkeeper_aio.client.bookie_client import BookiePool
from bookkeeper_aio.client.context import ClientContext, StaticDirectory
from bookkeeper_aio.client.ensemble_change import BookieReplacer
from bookkeeper_aio.errors import LedgerFenced
from metadata import ledger_metadata as serde
from metadata.cluster import describe_ledger
from metadata.errors import MetadataFormatError
from metadata.ledger_manager import LedgerManager
from metadata.ledger_metadata import REPLACED_BOOKIES_MAX, LedgerMetadata
from metadata.memory import MemoryStore

BOOKIES = ("a", "b", "c")


def _context(writable: list[str]) -> ClientContext:
    config = ClientConfig(metadata_timeout_s=2.0)
    return ClientContext(
        config=config,
        pool=BookiePool(config),
        ledgers=LedgerManager(MemoryStore(), "/t", rng=random.Random(1)),
        directory=StaticDirectory(writable),
        placement=RandomPlacement(random.Random(7)),
    )


def _open(md: LedgerMetadata) -> None:
    if md.state is not LedgerState.OPEN:
        raise LedgerFenced("not open")


async def test_change_at_entry_0_replaces_in_place_but_the_history_keeps_the_bookie() -> None:
    ctx = _context(["a", "b", "c", "d", "e"])
    created = await ctx.ledgers.create(BOOKIES, write_quorum=2, ack_quorum=2)
    assert created.metadata.replaced_bookies == ()
    replacer = BookieReplacer(ctx, created.ledger_id)
    first = await replacer.replace(created, 0, {"b"}, accept=_open, attempts_max=4)
    assert first.stored is not None
    new = first.ensemble[1]
    assert first.stored.metadata.ensembles == ((0, ("a", new, "c")),)  # "b" is gone from the fragments
    second = await replacer.replace(first.stored, 0, {"a"}, accept=_open, attempts_max=4)
    stored = (await ctx.ledgers.read(created.ledger_id)).metadata
    assert second.stored is not None
    assert second.stored.metadata == stored
    history = [(r.first_entry, r.bookie, r.replacement) for r in stored.replaced_bookies]
    assert history == [(0, "b", new), (0, "a", second.ensemble[0])]
    assert all(r.time_ms > 0 for r in stored.replaced_bookies)
    assert describe_ledger(stored, 1)["replaced_bookies"][0][:3] == [0, "b", new]


def test_history_roundtrips_and_is_bounded() -> None:
    md = LedgerMetadata.new(7, BOOKIES, write_quorum=2, ack_quorum=2)
    records = [ReplacedBookie(i, f"x{i}", f"y{i}", 1000 + i) for i in range(REPLACED_BOOKIES_MAX + 5)]
    md = md.with_replaced_bookies(records[:3]).with_replaced_bookies(records[3:])
    assert md.replaced_bookies == tuple(records[-REPLACED_BOOKIES_MAX:])  # the latest kept
    assert serde.decode(serde.encode(md), key="k", ledger_id=7) == md


def test_metadata_without_the_history_decodes_and_encodes_as_before() -> None:
    md = LedgerMetadata.new(7, BOOKIES, write_quorum=2, ack_quorum=2, ctime_ms=5)
    data = serde.encode(md)
    body = msgpack.unpackb(data[len(serde.MAGIC) :], raw=False)
    assert "replaced_bookies" not in body  # no history: the bytes older code wrote
    old = serde.MAGIC + msgpack.packb(body, use_bin_type=True)
    assert serde.decode(old, key="k", ledger_id=7).replaced_bookies == ()


def test_malformed_history_is_a_format_error() -> None:
    md = LedgerMetadata.new(7, BOOKIES, write_quorum=2, ack_quorum=2)
    body = msgpack.unpackb(serde.encode(md)[len(serde.MAGIC) :], raw=False)
    for bad in ("x", [[0, "a", "b"]], [[-1, "a", "b", 5]], [[0, "", "b", 5]]):
        body["replaced_bookies"] = bad
        with pytest.raises(MetadataFormatError, match="ledger 7"):
            serde.decode(serde.MAGIC + msgpack.packb(body, use_bin_type=True), key="k", ledger_id=7)
