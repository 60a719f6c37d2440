"""Many ledgers through one client, on real bookie processes and a real etcd (issue 19): a burst
over 2,000 open ledgers is a backlog of the client, not a failure of the bookies.

At 100,000 ledgers the adds of one burst timed out on the client's own backlog, each ledger started
an ensemble change and each change listed the bookies from etcd on its own (DEADLINE_EXCEEDED):
every ledger failed. The full size is a benchmark (docs/benchmarks.md, issue 19); this is the
shape at a size that stays fast.
"""

from __future__ import annotations

import asyncio

import pytest

from bookkeeper_aio import BookKeeper, ClientConfig, LedgerHandle
from bookkeeper_aio.client.bookkeeper import RegistryDirectory
from tests.integration.client.conftest import Cluster

pytestmark = pytest.mark.etcd

LEDGERS = 2_000
ROUNDS = 5
CREATE_CONCURRENCY = 64  # as `bkaio bench` creates them


async def test_a_burst_over_2000_ledgers__every_add_acked_in_order_and_no_ensemble_change(
    cluster: Cluster,
) -> None:
    await cluster.start(3)
    config = ClientConfig(add_timeout_s=5.0, reconnect_backoff_max_s=0.5)
    async with BookKeeper.connect(cluster.url, config=config) as bk:
        handles: list[LedgerHandle] = []
        for start in range(0, LEDGERS, CREATE_CONCURRENCY):
            count = min(CREATE_CONCURRENCY, LEDGERS - start)
            handles += await asyncio.gather(
                *(bk.create_ledger(3, 2, 2, password=b"pw") for _ in range(count))
            )
        directory = bk.context.directory
        assert isinstance(directory, RegistryDirectory)
        assert directory.listings < LEDGERS, "concurrent creates share a listing of the bookies"
        payload = b"x" * 1024
        # every ledger's adds of every round handed over at once: 10,000 adds in one burst
        futures = [await lh.append_async(payload) for _ in range(ROUNDS) for lh in handles]
        results = await asyncio.gather(*futures)
        assert results == [r for r in range(ROUNDS) for _ in handles]
        assert [lh.ensemble_changes for lh in handles] == [0] * LEDGERS
        assert all(len(lh.metadata.ensembles) == 1 for lh in handles)
        assert all(lh.last_add_confirmed == ROUNDS - 1 for lh in handles)
        for start in range(0, LEDGERS, CREATE_CONCURRENCY):
            await asyncio.gather(*(lh.close() for lh in handles[start : start + CREATE_CONCURRENCY]))
        some = handles[:: LEDGERS // 10]
        for lh in some:
            rh = await bk.open_ledger(lh.id, password=b"pw")
            assert rh.last_add_confirmed == ROUNDS - 1
            assert [e.entry_id async for e in rh.read()] == list(range(ROUNDS))
