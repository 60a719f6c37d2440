"""`bkaio cluster raise-ids` after a metadata snapshot restore: the id counter went back below
ledgers whose data the bookies still hold; the command raises it above every id found in metadata
and on the bookies (GET_BOOKIE_INFO), refuses while a bookie with a cookie cannot say, and changes
nothing in a dry run. Real bookies, real etcd."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bookkeeper_aio import BookKeeper
from bookkeeper_aio.cli.main import _parser
from metadata.bookies import Cookie, write_cookie
from metadata.idgen import read_counter
from metadata.keys import ClusterKeys
from tests.integration.client.conftest import CONFIG, Cluster, bk, cluster

__all__ = ["bk", "cluster"]

pytestmark = pytest.mark.etcd


async def _raise_ids(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any], str]:
    args = _parser().parse_args(["cluster", "raise-ids", "--json", *argv])
    code = await args.func(args)
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


async def _write_ledger(client: BookKeeper) -> int:
    handle = await client.create_ledger(3, 2, 2, password=b"pw")
    for i in range(5):
        await handle.append(f"entry {i}".encode())
    await handle.close()
    return handle.id


async def test_raise_ids_moves_the_counter_above_ledgers_a_restore_forgot(
    cluster: Cluster, bk: BookKeeper, capsys: pytest.CaptureFixture[str]
) -> None:
    await cluster.start(3)
    store, key = cluster.meta.store, ClusterKeys(cluster.root).idgen
    kept = await _write_ledger(bk)
    snapshot_counter = await read_counter(store, key)  # the "snapshot"
    async with BookKeeper.connect(cluster.url, config=CONFIG) as later_client:  # claims a block above it
        forgotten = await _write_ledger(later_client)
    assert forgotten >= snapshot_counter
    # The "restore": the ledger created after the snapshot leaves metadata, the counter goes back.
    await store.delete(ClusterKeys(cluster.root).ledger(forgotten))
    current = await store.get(key)
    assert current is not None
    await store.compare_and_set(key, str(snapshot_counter).encode(), current.version)
    assert await read_counter(store, key) == forgotten  # the next client would reuse its id

    code, report, err = await _raise_ids(capsys, "--metadata", cluster.url, "--dry-run")
    assert code == 0
    assert report["raised"] is False
    assert report["highest_on_bookies"] == forgotten
    assert report["target"] == forgotten + 1 + 1000
    assert {row["bookie_id"]: row["ledger_id_max"] for row in report["bookies"]} == {
        "b0": forgotten,
        "b1": forgotten,
        "b2": forgotten,
    }
    assert "dry run" in err  # progress on stderr
    assert "bookie 3/3 b2" in err
    assert await read_counter(store, key) == forgotten  # unchanged

    # A bookie the cluster knows (a cookie) that does not answer may hold higher ids: no change.
    await write_cookie(store, cluster.root, Cookie("ghost", "i-ghost", ("/d",), ("/d",)), None)
    code, report, err = await _raise_ids(capsys, "--metadata", cluster.url)
    assert code == 1
    assert report["raised"] is False
    assert "ghost" in err
    assert "--skip" in err
    assert await read_counter(store, key) == forgotten

    skip = ("--skip", "ghost", "--margin", "10")
    code, report, err = await _raise_ids(capsys, "--metadata", cluster.url, *skip)
    assert code == 0
    assert (report["counter"], report["counter_now"], report["raised"]) == (forgotten, forgotten + 11, True)
    assert await read_counter(store, key) == forgotten + 11
    code, report, _ = await _raise_ids(capsys, "--metadata", cluster.url, *skip)
    assert (code, report["raised"]) == (0, False)  # run again: nothing to do

    async with BookKeeper.connect(cluster.url, config=CONFIG) as fresh_client:
        fresh = await _write_ledger(fresh_client)
    assert fresh > forgotten
    assert kept < snapshot_counter
