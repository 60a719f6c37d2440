"""Ledger access control against real bookie processes and a real etcd (issue 20, item 6): a wrong
key can neither read, fence, write, recover nor delete, on the client API and on the raw wire; the
metadata holds only a salted check value; deleting a ledger needs its password and fences a live
writer instead of acknowledging its adds into a deleted ledger."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

import pytest

from bookkeeper_aio import BookKeeper, LedgerFenced, LedgerRecoveryError, NoSuchLedger, Unauthorized
from bookkeeper_aio.client.keys import codec_for, password_hash
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import LAST_ENTRY, AddFlag, ReadFlag, StatusCode
from bookkeeper_aio.protocol.digest import EntryCodec, key_check, ledger_keys, master_key
from tests.integration.client.conftest import CONFIG, Cluster

pytestmark = pytest.mark.etcd

RIGHT = b"right password"
WRONG = b"wrong password"


def _raw_requests(ledger_id: int, key: bytes | None, body: bytes) -> dict[str, Callable[[int], m.Request]]:
    """Every request that touches a ledger's data, carrying ``key``."""
    fence = int(ReadFlag.FENCE_LEDGER)
    poll = int(ReadFlag.LONG_POLL | ReadFlag.ENTRY_PIGGYBACK)
    return {
        "read": lambda rid: m.ReadEntryRequest(rid, ledger_id, 0, 0, key),
        "read last": lambda rid: m.ReadEntryRequest(rid, ledger_id, LAST_ENTRY, 0, key),
        "long poll": lambda rid: m.ReadEntryRequest(rid, ledger_id, 1, poll, key, 0, 100),
        "read lac": lambda rid: m.ReadLacRequest(rid, ledger_id, key),
        "batch read": lambda rid: m.BatchReadRequest(rid, ledger_id, 0, 10, 1 << 20, 0, key),
        "list entries": lambda rid: m.GetListOfEntriesRequest(rid, ledger_id, key),
        **(
            {}
            if key is None
            else {
                "fence": lambda rid: m.ReadEntryRequest(rid, ledger_id, LAST_ENTRY, fence, key),
                "recovery read": lambda rid: m.ReadEntryRequest(rid, ledger_id, 0, fence, key),
                "batch fence": lambda rid: m.BatchReadRequest(rid, ledger_id, 0, 10, 1 << 20, fence, key),
                "recovery add": lambda rid: m.AddEntryRequest(
                    rid, ledger_id, 1, int(AddFlag.RECOVERY_ADD), key, body
                ),
                "add": lambda rid: m.AddEntryRequest(rid, ledger_id, 1, 0, key, body),
                "write lac": lambda rid: m.WriteLacRequest(rid, ledger_id, key, 0),
                "force": lambda rid: m.ForceLedgerRequest(rid, ledger_id, key),
            }
        ),
    }


async def test_a_wrong_key_can_neither_read_fence_write_recover_nor_delete(
    cluster: Cluster, bk: BookKeeper
) -> None:
    await cluster.start(3)
    writer = await bk.create_ledger(3, 3, 2, password=RIGHT)
    for i in range(5):
        await writer.append(b"secret-%d" % i)
    md = writer.metadata
    # The metadata holds a salt and a check value: neither the key, nor the old unsalted hashes.
    assert len(md.key_salt) == 16
    assert len(md.key_ledger_salt) == 16  # key format 4: the client's salt, and the ledger's own
    assert md.key_iterations > 0
    assert md.password_hash not in (master_key(RIGHT), password_hash(RIGHT), key_check(master_key(RIGHT)))

    async with BookKeeper.connect(cluster.url, config=CONFIG) as other:
        for recovery in (False, True):
            with pytest.raises(Unauthorized):
                await other.open_ledger(writer.id, password=WRONG, recovery=recovery)
        with pytest.raises(Unauthorized):
            await other.delete_ledger(writer.id, password=WRONG)
        assert (await other.context.ledgers.read(writer.id)).metadata.ledger_id == writer.id

        # On the wire, to a bookie holding the ledger: a junk key, the format-1 key of the right
        # password (what the bookies checked before salting), the format-2 key of the client's
        # salt (its PBKDF2 alone, without the ledger's salt), and no key at all.
        body = EntryCodec(md.digest_type, RIGHT).encode(writer.id, 1, 0, 0, b"forged")
        bookie = md.ensembles[0][1][0]
        client_key = ledger_keys(RIGHT, md.key_salt, md.key_iterations).master_key
        for key in (b"J" * 32, master_key(RIGHT), client_key, None):
            for name, make in _raw_requests(writer.id, key, body).items():
                response = await other.context.pool.request(bookie, make, CONFIG.read_timeout_s)
                assert response.status == StatusCode.EUA, (name, key, response)

        # Nothing above fenced, wrote or deleted anything: the writer goes on, the right password reads.
        assert await writer.append(b"secret-5") == 5
        reader = await other.open_ledger(writer.id, password=RIGHT)
        assert reader.last_add_confirmed == 4  # entry 5 carried LAC 4
        assert [e.payload async for e in reader.read()] == [b"secret-%d" % i for i in range(5)]
        key = codec_for(md, RIGHT).master_key
        for name, make in _raw_requests(writer.id, key, body).items():
            if name in ("read", "read last", "long poll", "read lac", "batch read", "list entries"):
                response = await other.context.pool.request(bookie, make, CONFIG.read_timeout_s)
                assert response.status == StatusCode.EOK, (name, response)
    await writer.close()


async def test_an_hmac_ledgers_stored_bodies_do_not_test_password_guesses_without_pbkdf2(
    cluster: Cluster, bk: BookKeeper
) -> None:
    """A body an HMAC-SHA256 ledger's bookie stores (or that crosses the wire) was MACed with
    SHA-256(prefix + password) in key formats 1 to 3: one SHA-256 and one HMAC per password guess.
    A new ledger (key format 4) MACs with a key of its PBKDF2-derived secret; readers, a recovery
    and another client still verify it."""
    await cluster.start(3)
    writer = await bk.create_ledger(3, 3, 2, password=RIGHT, digest="hmac-sha256")
    for i in range(3):
        await writer.append(b"entry-%d" % i)
    md = writer.metadata
    assert md.key_format == 4
    key = codec_for(md, RIGHT).master_key
    response = await bk.context.pool.request(
        md.ensembles[0][1][0],
        lambda rid: m.ReadEntryRequest(rid, writer.id, 1, 0, key),
        CONFIG.read_timeout_s,
    )
    body = response.body
    assert response.status == StatusCode.EOK
    password_mac_key = hashlib.sha256(b"bookkeeper-aio/mac-key\x00" + RIGHT).digest()
    tag = hmac.new(password_mac_key, body[:32] + body[64:], hashlib.sha256).digest()
    assert not hmac.compare_digest(tag, body[32:64])  # the password alone no longer gives the MAC
    async with BookKeeper.connect(cluster.url, config=CONFIG) as other:
        recovered = await other.open_ledger(writer.id, password=RIGHT, recovery=True)
        assert recovered.last_add_confirmed == 2
        assert [e.payload async for e in recovered.read()] == [b"entry-%d" % i for i in range(3)]


async def test_delete_needs_the_password_and_fences_a_live_writer(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    writer = await bk.create_ledger(3, 2, 2, password=RIGHT)
    for i in range(3):
        await writer.append(b"entry-%d" % i)
    async with BookKeeper.connect(cluster.url, config=CONFIG) as other:
        with pytest.raises(Unauthorized):
            await other.delete_ledger(writer.id, password=WRONG)
        assert await writer.append(b"still mine") == 3  # the refused delete changed nothing

        await other.delete_ledger(writer.id, password=RIGHT)
        with pytest.raises(NoSuchLedger):
            await other.open_ledger(writer.id, password=RIGHT)
    # The writer is told, instead of getting acknowledgements for a ledger that is gone.
    with pytest.raises(LedgerFenced):
        await writer.append(b"after the delete")
    writer.abort()


async def test_delete_of_an_open_ledger_whose_bookies_are_gone_needs_fence_false(
    cluster: Cluster, bk: BookKeeper
) -> None:
    await cluster.start(3)
    writer = await bk.create_ledger(3, 2, 2, password=RIGHT)
    await writer.append(b"entry")
    writer.abort()  # our own writer, gone; then every bookie goes too
    for bookie_id in ("b0", "b1", "b2"):
        await cluster.kill(bookie_id)
    with pytest.raises(LedgerRecoveryError):  # the fence cannot be proven: nothing is deleted
        await bk.delete_ledger(writer.id, password=RIGHT)
    assert (await bk.context.ledgers.read(writer.id)).metadata.ledger_id == writer.id
    await bk.delete_ledger(writer.id, password=RIGHT, fence=False)
    with pytest.raises(NoSuchLedger):
        await bk.open_ledger(writer.id, password=RIGHT)
