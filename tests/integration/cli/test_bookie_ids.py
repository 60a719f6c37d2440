"""Commands that take a bookie id refuse one the cluster has no trace of (a typo must not succeed
silently), and ``bkaio bookie format`` refuses a bookie that is registered or still named by a
ledger unless ``--force``. A real etcd; the bookie's traces are written to it directly."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid

import pytest

import metadata
from bookkeeper_aio.cli.main import main
from metadata.keys import ClusterKeys
from tests.harness.etcd import EtcdCluster

pytestmark = pytest.mark.etcd


async def _setup(url: str) -> None:
    """b-cookie: only a cookie (a stopped, empty bookie); b-ledger: a cookie and a ledger naming it;
    b-live: a cookie and a registration."""
    async with metadata.connect(url) as meta:
        info = await metadata.init_cluster(meta.store, meta.root)
        for bookie_id in ("b-cookie", "b-ledger", "b-live"):
            cookie = metadata.Cookie(bookie_id, info.instance_id, ("/j",), ("/l",))
            await metadata.write_cookie(meta.store, meta.root, cookie, None)
        await meta.ledger_manager().create(["b-ledger"], write_quorum=1, ack_quorum=1)
        await meta.store.put(ClusterKeys(meta.root).bookie("writable", "b-live"), b"{}")


async def _cookie(url: str, bookie_id: str) -> bool:
    async with metadata.connect(url) as meta:
        return await metadata.read_cookie(meta.store, meta.root, bookie_id) is not None


def _bkaio(url: str, *argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``bkaio *argv --metadata url`` in this process (a subprocess each costs seconds of imports):
    the exit status, stdout and stderr as a user sees them."""
    try:
        code = main([*argv, "--metadata", url])
    except SystemExit as exit_:
        code = 1 if isinstance(exit_.code, str) else int(exit_.code or 0)
        if isinstance(exit_.code, str):
            print(exit_.code, file=sys.stderr)
    out, err = capsys.readouterr()
    return code, out, err


def test_a_bookie_id_typo_is_an_error_and_format_refuses_a_bookie_in_use(
    etcd_server: EtcdCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    url = etcd_server.url(f"/bookkeeper/ids-{uuid.uuid4().hex[:8]}")
    asyncio.run(_setup(url))

    for argv in (["recover", "nosuch"], ["decommission", "nosuch"], ["bookie", "format", "nosuch"]):
        code, out, err = _bkaio(url, *argv, capsys=capsys)
        assert code == 1, (argv, out, err)
        assert "no bookie 'nosuch' in this cluster" in err, (argv, err)
        assert "bkaio bookies" in err

    code, out, err = _bkaio(url, "bookie", "format", "b-live", capsys=capsys)
    assert code == 1, out
    assert "b-live is in use: it is registered" in err
    assert "bkaio decommission b-live" in err
    code, out, err = _bkaio(url, "bookie", "format", "b-ledger", capsys=capsys)
    assert code == 1, out
    assert "ledgers name it (" in err
    assert asyncio.run(_cookie(url, "b-live"))
    assert asyncio.run(_cookie(url, "b-ledger"))  # nothing deleted by a refusal

    code, out, err = _bkaio(url, "bookie", "format", "b-cookie", "--json", capsys=capsys)
    assert code == 0, err
    assert json.loads(out)["metadata_cookie_deleted"] is True
    code, out, err = _bkaio(url, "bookie", "format", "b-ledger", "--force", "--json", capsys=capsys)
    assert code == 0, err
    assert json.loads(out)["metadata_cookie_deleted"] is True
    assert not asyncio.run(_cookie(url, "b-ledger"))
