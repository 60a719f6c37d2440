"""URL parsing, key layout, and the package's dependency rule."""

from __future__ import annotations

import msgpack
import pytest

from metadata.cluster import ensure_cluster, parse_url, read_cluster_info
from metadata.errors import InvalidMetadata, InvalidUrl, MetadataFormatError
from metadata.keys import ClusterKeys
from metadata.memory import MemoryStore


def test_etcd_url_with_several_endpoints_and_root() -> None:
    url = parse_url("etcd://127.0.0.1:2379,10.0.0.2:2380,etcd3/bookkeeper/prod?op_timeout_s=2.5")
    assert url.scheme == "etcd"
    assert url.endpoints == (("127.0.0.1", 2379), ("10.0.0.2", 2380), ("etcd3", 2379))
    assert url.root == "/bookkeeper/prod"
    assert url.op_timeout_s == 2.5


def test_defaults_and_memory_url() -> None:
    assert parse_url("etcd://localhost").root == "/bookkeeper/default"
    memory = parse_url("memory://")
    assert (memory.scheme, memory.root, memory.endpoints) == ("memory", "/bookkeeper/default", ())
    assert parse_url("memory:///bookkeeper/x").root == "/bookkeeper/x"


@pytest.mark.parametrize(
    "url",
    [
        "zk://localhost:2181/ledgers",
        "etcd:///bookkeeper/x",
        "etcd://host:notaport/bookkeeper/x",
        "etcd://host:2379/bookkeeper/x/",
        "etcd://host:2379/bookkeeper/x?bogus=1",
        "etcd://host:2379/bookkeeper/x?op_timeout_s=-1",
        "etcd://host:2379/bookkeeper/x?op_timeout_s=0",
        "etcd://host:2379/bookkeeper/x?connect_timeout_s=nan",
        "etcd://host:2379/bookkeeper/x?connect_timeout_s=inf",
        "etcd://host:2379/bookkeeper/x?op_timeout_s=soon",
        "memory:///bookkeeper/x?op_timeout_s=-1",
        "etcd://[::1/bookkeeper/x",
    ],
)
def test_bad_urls_raise_invalid_url(url: str) -> None:
    with pytest.raises(InvalidUrl):
        parse_url(url)


def test_ledger_keys_sort_numerically_and_parse_back() -> None:
    keys = ClusterKeys("/bookkeeper/c1")
    assert keys.ledger(42) == "/bookkeeper/c1/ledgers/0000000000000000042"
    ids = [0, 9, 10, 2**63 - 1, 123456]
    assert sorted(keys.ledger(i) for i in ids) == [keys.ledger(i) for i in sorted(ids)]
    assert keys.ledger_id_of(keys.ledger(2**63 - 1)) == 2**63 - 1
    with pytest.raises(InvalidMetadata):
        keys.ledger_id_of("/bookkeeper/c1/ledgers/abc")
    assert keys.bookie("writable", "127.0.0.1:3181") == "/bookkeeper/c1/bookies/writable/127.0.0.1:3181"
    with pytest.raises(InvalidMetadata):
        keys.bookie("writable", "a/b")


def test_security_options_of_the_etcd_url() -> None:
    url = parse_url(
        "etcd://etcd1:2379/bookkeeper/x?ca_file=/etc/bk/ca.pem&cert_file=c.pem&key_file=k.pem"
        "&user=bookie&password_file=/etc/bk/etcd-password&op_timeout_s=3"
    )
    assert (url.ca_file, url.cert_file, url.key_file) == ("/etc/bk/ca.pem", "c.pem", "k.pem")
    assert (url.user, url.password_file, url.op_timeout_s, url.tls) == (
        "bookie",
        "/etc/bk/etcd-password",
        3.0,
        False,
    )
    assert parse_url("etcd://etcd1/bookkeeper/x?tls=1").tls
    for bad in ("tls=yes", "cert_file=c.pem", "user=bookie", "password=plain"):
        with pytest.raises(InvalidUrl):
            parse_url(f"etcd://etcd1/bookkeeper/x?{bad}")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"format_version": 2, "instance_id": "i", "created_ms": 1}, "unsupported format_version 2"),
        ({"format_version": 1, "created_ms": 1}, "'instance_id' or 'created_ms' missing"),
        ({"format_version": 1, "instance_id": "i", "created_ms": "soon"}, "of wrong type"),
    ],
)
async def test_cluster_info_of_a_newer_format_or_broken_is_refused(
    body: dict[str, object], message: str
) -> None:
    store = MemoryStore()
    await store.put(ClusterKeys("/r").cluster, msgpack.packb(body))
    with pytest.raises(MetadataFormatError, match=message):
        await read_cluster_info(store, "/r")
    with pytest.raises(MetadataFormatError, match=message):
        await ensure_cluster(store, "/r")


async def test_cluster_info_roundtrips() -> None:
    store = MemoryStore()
    created = await ensure_cluster(store, "/r")
    assert await read_cluster_info(store, "/r") == created
    assert await ensure_cluster(store, "/r") == created
