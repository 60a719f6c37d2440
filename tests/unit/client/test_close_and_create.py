"""Seed 000 "Closing a ledger as a writer": the three outcomes of a lost close CAS; create/open errors."""

from __future__ import annotations

import pytest

from bookkeeper_aio import (
    BKInterfaceError,
    BookKeeper,
    LedgerFenced,
    MetadataConflict,
    NoSuchLedger,
    NotEnoughBookies,
    Unauthorized,
)
from bookkeeper_aio.client.context import StaticDirectory
from metadata.ledger_manager import LedgerManager
from metadata.ledger_metadata import LedgerState
from tests.harness.fake_bookie import FakeCluster
from tests.unit.client.conftest import make_client


async def _ledger_with_three_entries(bk: BookKeeper):  # type: ignore[no-untyped-def]
    lh = await bk.create_ledger(3, 2, 2)
    for i in range(3):
        await lh.append(b"%d" % i)
    return lh


async def test_close__cas_lost_to_recovery_in_progress_is_an_error(
    bk: BookKeeper, ledgers: LedgerManager
) -> None:
    lh = await _ledger_with_three_entries(bk)
    current = await ledgers.read(lh.id)
    await ledgers.write(current.metadata.in_recovery(), current.version)
    with pytest.raises(LedgerFenced):
        await lh.close()
    assert (await ledgers.read(lh.id)).metadata.state is LedgerState.IN_RECOVERY


async def test_close__cas_lost_to_close_at_same_last_entry_succeeds(
    bk: BookKeeper, ledgers: LedgerManager
) -> None:
    lh = await _ledger_with_three_entries(bk)
    current = await ledgers.read(lh.id)
    await ledgers.write(current.metadata.closed(2, lh.length), current.version)
    await lh.close()
    assert (await ledgers.read(lh.id)).metadata.last_entry_id == 2


async def test_close__cas_lost_to_close_at_other_last_entry_is_an_error(
    bk: BookKeeper, ledgers: LedgerManager
) -> None:
    lh = await _ledger_with_three_entries(bk)
    current = await ledgers.read(lh.id)
    await ledgers.write(current.metadata.closed(1, 2), current.version)
    with pytest.raises(MetadataConflict):
        await lh.close()


async def test_close__cas_lost_to_harmless_change_retries(bk: BookKeeper, ledgers: LedgerManager) -> None:
    lh = await _ledger_with_three_entries(bk)
    current = await ledgers.read(lh.id)
    await ledgers.write(current.metadata.with_custom_metadata({"k": b"v"}), current.version)
    await lh.close()
    stored = (await ledgers.read(lh.id)).metadata
    assert stored.state is LedgerState.CLOSED
    assert stored.last_entry_id == 2


@pytest.mark.parametrize(("e", "qw", "qa"), [(2, 3, 2), (3, 2, 3), (3, 0, 0), (0, 0, 0)])
async def test_create__bad_quorums_fail_before_metadata_is_written(
    bk: BookKeeper, ledgers: LedgerManager, e: int, qw: int, qa: int
) -> None:
    with pytest.raises(BKInterfaceError, match="ensemble >= write_quorum >= ack_quorum"):
        await bk.create_ledger(e, qw, qa)
    assert (await ledgers.list_page()).ledger_ids == ()


async def test_create__bad_digest_is_an_interface_error(bk: BookKeeper) -> None:
    with pytest.raises(BKInterfaceError):
        await bk.create_ledger(3, 2, 2, digest="md5")


async def test_create__not_enough_bookies(ledgers: LedgerManager, cluster: FakeCluster) -> None:
    bk = make_client(ledgers, StaticDirectory(cluster.ids[:2]))
    with pytest.raises(NotEnoughBookies):
        await bk.create_ledger(3, 2, 2)
    assert (await ledgers.list_page()).ledger_ids == ()
    await bk.close()


async def test_open__wrong_password_is_unauthorized(bk: BookKeeper) -> None:
    lh = await bk.create_ledger(3, 2, 2, password=b"right")
    await lh.append(b"a")
    await lh.close()
    with pytest.raises(Unauthorized):
        await bk.open_ledger(lh.id, password=b"wrong")


async def test_open__missing_ledger_with_and_without_recovery(bk: BookKeeper) -> None:
    with pytest.raises(NoSuchLedger):
        await bk.open_ledger(12345)
    with pytest.raises(NoSuchLedger):
        await bk.open_ledger(12345, recovery=True)


async def test_read__beyond_lac_is_an_interface_error(bk: BookKeeper) -> None:
    lh = await bk.create_ledger(3, 2, 2)
    await lh.append(b"a")
    await lh.close()
    rh = await bk.open_ledger(lh.id)
    with pytest.raises(BKInterfaceError):
        rh.read(0, 1)
