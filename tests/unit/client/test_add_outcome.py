"""Which add errors say "outcome unknown" (``BKError.outcome_unknown``), and which error a writer
sees when no replacement bookie exists but its ledger was fenced or closed meanwhile.

Fake bookies on real TCP and the in-memory metadata store (tests/unit/client/conftest.py).
"""

from __future__ import annotations

import asyncio

import pytest

from bookkeeper_aio import (
    BKError,
    BKInterfaceError,
    LedgerClosed,
    LedgerFenced,
    NotEnoughBookies,
)
from bookkeeper_aio.client.context import StaticDirectory
from bookkeeper_aio.client.ledger import LedgerHandle
from bookkeeper_aio.protocol import messages as m
from metadata.ledger_manager import LedgerManager
from tests.harness.fake_bookie import FakeCluster, Reply
from tests.unit.client.conftest import FAST, make_client


async def _sent_adds_failing(lh: LedgerHandle, n: int = 3) -> list[BKError]:
    """``n`` adds handed to the bookies whose futures then fail: their errors."""
    futures = [await lh.append_async(b"x") for _ in range(n)]
    results = await asyncio.gather(*futures, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BKError)]
    assert len(errors) == n, results
    return errors


def _hold_adds(cluster: FakeCluster, bookie_id: str) -> None:
    """The bookie never answers adds (they time out after ``add_timeout_s``: an ensemble change)."""
    cluster.by_id(bookie_id).script = lambda req: Reply.drop() if isinstance(req, m.AddEntryRequest) else None


async def _mark(ledgers: LedgerManager, ledger_id: int, *, closed: bool) -> None:
    current = await ledgers.read(ledger_id)
    md = current.metadata.closed(-1, 0) if closed else current.metadata.in_recovery()
    await ledgers.write(md, current.version)


async def test_sent_add_failing_with_ledger_fenced_has_unknown_outcome(
    ledgers: LedgerManager, cluster: FakeCluster
) -> None:
    bk = make_client(ledgers, StaticDirectory(cluster.ids))
    lh = await bk.create_ledger(3, 2, 2)
    await lh.append(b"a")
    await _mark(ledgers, lh.id, closed=False)  # a recoverer got there first
    _hold_adds(cluster, lh.metadata.current_ensemble[1])
    errors = await _sent_adds_failing(lh)
    assert all(isinstance(e, LedgerFenced) and e.outcome_unknown for e in errors), errors
    with pytest.raises(LedgerFenced) as refused:  # the next add is refused before sending
        await lh.append_async(b"y")
    assert refused.value.outcome_unknown is False
    bk.abort()


async def test_sent_add_failing_with_ledger_closed_has_unknown_outcome(
    ledgers: LedgerManager, cluster: FakeCluster
) -> None:
    """A writer resuming after a reader recovered and closed its ledger."""
    bk = make_client(ledgers, StaticDirectory(cluster.ids))
    lh = await bk.create_ledger(3, 2, 2)
    await lh.append(b"a")
    await _mark(ledgers, lh.id, closed=True)
    _hold_adds(cluster, lh.metadata.current_ensemble[1])
    errors = await _sent_adds_failing(lh)
    assert all(isinstance(e, LedgerClosed) and e.outcome_unknown for e in errors), errors
    with pytest.raises(LedgerClosed) as refused:
        await lh.append(b"y")
    assert refused.value.outcome_unknown is False
    bk.abort()


async def test_sent_add_failing_with_not_enough_bookies_has_unknown_outcome(
    ledgers: LedgerManager, cluster: FakeCluster
) -> None:
    bk = make_client(ledgers, StaticDirectory(cluster.ids[:3]))  # no bookie to replace with
    lh = await bk.create_ledger(3, 2, 2)
    await lh.append(b"a")
    await cluster.by_id(lh.metadata.current_ensemble[1]).kill()
    errors = await _sent_adds_failing(lh)
    assert all(isinstance(e, NotEnoughBookies) and e.outcome_unknown for e in errors), errors
    with pytest.raises(NotEnoughBookies) as refused:
        await lh.append(b"y")
    assert refused.value.outcome_unknown is False
    await bk.close()


async def test_aborted_handle__sent_adds_unknown_later_adds_known(
    ledgers: LedgerManager, cluster: FakeCluster
) -> None:
    bk = make_client(ledgers, StaticDirectory(cluster.ids))
    lh = await bk.create_ledger(3, 2, 2)
    _hold_adds(cluster, lh.metadata.current_ensemble[0])
    _hold_adds(cluster, lh.metadata.current_ensemble[1])
    future = await lh.append_async(b"x")
    lh.abort()
    with pytest.raises(LedgerClosed) as sent:
        await future
    assert sent.value.outcome_unknown is True
    with pytest.raises(LedgerClosed) as refused:
        await lh.append(b"y")
    assert refused.value.outcome_unknown is False
    bk.abort()


async def test_add_refused_before_sending_has_known_outcome(
    ledgers: LedgerManager, cluster: FakeCluster
) -> None:
    bk = make_client(ledgers, StaticDirectory(cluster.ids))
    lh = await bk.create_ledger(3, 2, 2)
    with pytest.raises(BKInterfaceError) as oversize:
        await lh.append(b"x" * (FAST.entry_bytes_max + 1))
    assert oversize.value.outcome_unknown is False
    assert await lh.append(b"fits") == 0  # nothing was sent for the refused one
    await lh.close()
    with pytest.raises(LedgerClosed) as closed:
        await lh.append(b"late")
    assert closed.value.outcome_unknown is False
    await bk.close()


@pytest.mark.parametrize(("closed", "expected"), [(False, LedgerFenced), (True, LedgerClosed)])
async def test_no_replacement_bookie_but_ledger_fenced_or_closed__says_so(
    ledgers: LedgerManager, cluster: FakeCluster, closed: bool, expected: type[BKError]
) -> None:
    """Without a replacement the writer reads the ledger's state before blaming the bookies."""
    bk = make_client(ledgers, StaticDirectory(cluster.ids[:3]))
    lh = await bk.create_ledger(3, 2, 2)
    await lh.append(b"a")
    await _mark(ledgers, lh.id, closed=closed)
    await cluster.by_id(lh.metadata.current_ensemble[1]).kill()
    errors = await _sent_adds_failing(lh)
    assert all(type(e) is expected and e.outcome_unknown for e in errors), errors
    bk.abort()
