"""Connecting by URL, initialising a cluster root, and the list/show helpers the ``bkaio`` CLI calls.

URL forms:
- ``etcd://host1:2379,host2:2379/bookkeeper/<cluster>`` (port defaults to 2379; root defaults to
  ``/bookkeeper/default``). Query options: ``op_timeout_s``, ``connect_timeout_s``; security
  (docs/security.md): ``tls=1`` (TLS with the system's CAs), ``ca_file``, ``cert_file`` +
  ``key_file`` (each turns TLS on; the pair is a client certificate), ``user`` + ``password_file``
  (etcd authentication; the password never goes in the URL).
- ``memory://`` or ``memory:///bookkeeper/<cluster>``: a fresh in-process `MemoryStore` per connect.
"""

from __future__ import annotations

import math
import time
import urllib.parse
import uuid
from dataclasses import dataclass
from typing import Any

import msgpack

from metadata import ledger_metadata as serde
from metadata.bookies import BookieSet, list_bookies
from metadata.envelope import unpack_map
from metadata.errors import InvalidUrl, MetadataFormatError, NodeExists
from metadata.etcd import EtcdConfig, EtcdStore
from metadata.keys import ClusterKeys, validate_root
from metadata.ledger_manager import LedgerIdPage, LedgerManager
from metadata.memory import MemoryStore
from metadata.store import MetadataStore

DEFAULT_ROOT = "/bookkeeper/default"
DEFAULT_ETCD_PORT = 2379
CLUSTER_FORMAT_VERSION = 1
CLUSTER_INFO_BYTES_MAX = 64 * 1024
ENDPOINTS_MAX = 32


@dataclass(frozen=True, slots=True)
class MetadataUrl:
    scheme: str
    endpoints: tuple[tuple[str, int], ...]
    root: str
    op_timeout_s: float = 5.0
    connect_timeout_s: float = 1.0
    tls: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    user: str = ""
    password_file: str = ""


_FLOAT_OPTIONS = frozenset({"op_timeout_s", "connect_timeout_s"})
_TEXT_OPTIONS = frozenset({"ca_file", "cert_file", "key_file", "user", "password_file"})


def parse_url(url: str) -> MetadataUrl:
    """Parse a metadata service URL (see module docstring). Raises `InvalidUrl`."""
    try:
        parsed = urllib.parse.urlsplit(url)  # ValueError: an unclosed [IPv6 address
        root = parsed.path or DEFAULT_ROOT
        validate_root(root)
        options = _options(urllib.parse.parse_qsl(parsed.query, strict_parsing=bool(parsed.query)))
    except ValueError as error:
        raise InvalidUrl(f"bad metadata URL {url!r}: {error}") from error
    if bool(options.get("cert_file")) != bool(options.get("key_file")):
        raise InvalidUrl(f"bad metadata URL {url!r}: cert_file and key_file go together")
    if bool(options.get("user")) != bool(options.get("password_file")):
        raise InvalidUrl(f"bad metadata URL {url!r}: user and password_file go together")
    if parsed.scheme == "memory":
        return MetadataUrl("memory", (), root, **options)
    if parsed.scheme != "etcd":
        raise InvalidUrl(f"bad metadata URL {url!r}: scheme must be etcd:// or memory://")
    endpoints = tuple(_endpoint(url, part) for part in parsed.netloc.split(",") if part)
    if not 1 <= len(endpoints) <= ENDPOINTS_MAX:
        raise InvalidUrl(f"bad metadata URL {url!r}: need 1..{ENDPOINTS_MAX} host:port endpoints")
    return MetadataUrl("etcd", endpoints, root, **options)


def _options(pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """The URL's query options, typed; raises ``ValueError`` naming a bad one."""
    options: dict[str, Any] = {}
    for name, value in pairs:
        if name in _FLOAT_OPTIONS:
            try:
                seconds = float(value)
            except ValueError:
                seconds = math.nan
            if not (math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"{name}={value!r}: must be a positive number of seconds")
            options[name] = seconds
        elif name in _TEXT_OPTIONS:
            options[name] = value
        elif name == "tls" and value in ("0", "1", "true", "false"):
            options[name] = value in ("1", "true")
        elif name == "tls":
            raise ValueError(f"tls={value!r}: use 1 or 0")
        else:
            raise ValueError(f"unknown option {name!r}")
    return options


def _endpoint(url: str, part: str) -> tuple[str, int]:
    host, _, port = part.rpartition(":") if ":" in part else (part, "", str(DEFAULT_ETCD_PORT))
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidUrl(f"bad metadata URL {url!r}: bad endpoint {part!r}")
    return host.strip("[]"), int(port)


@dataclass(slots=True)
class MetadataConnection:
    """A store plus the cluster root it serves; owns the store (``close()`` closes it)."""

    store: MetadataStore
    root: str

    @property
    def keys(self) -> ClusterKeys:
        return ClusterKeys(self.root)

    def ledger_manager(self) -> LedgerManager:
        return LedgerManager(self.store, self.root)

    async def close(self) -> None:
        await self.store.close()

    async def __aenter__(self) -> MetadataConnection:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def connect(url: str) -> MetadataConnection:
    """A connection for ``url``; the etcd driver connects lazily on the first call."""
    parsed = parse_url(url)
    if parsed.scheme == "memory":
        return MetadataConnection(MemoryStore(), parsed.root)
    config = EtcdConfig(
        parsed.endpoints,
        op_timeout_s=parsed.op_timeout_s,
        connect_timeout_s=parsed.connect_timeout_s,
        tls=parsed.tls,
        ca_file=parsed.ca_file,
        cert_file=parsed.cert_file,
        key_file=parsed.key_file,
        user=parsed.user,
        password_file=parsed.password_file,
    )
    return MetadataConnection(EtcdStore(config), parsed.root)


# ---- cluster admin (called by the bkaio CLI) -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClusterInfo:
    instance_id: str
    created_ms: int
    format_version: int = CLUSTER_FORMAT_VERSION


async def init_cluster(store: MetadataStore, root: str, *, instance_id: str | None = None) -> ClusterInfo:
    """Create ``<root>/cluster`` with a fresh instance id. Raises `NodeExists` if already initialised."""
    info = ClusterInfo(instance_id or uuid.uuid4().hex, time.time_ns() // 1_000_000)
    body = {
        "format_version": info.format_version,
        "instance_id": info.instance_id,
        "created_ms": info.created_ms,
    }
    await store.create(ClusterKeys(root).cluster, msgpack.packb(body, use_bin_type=True))
    return info


async def read_cluster_info(store: MetadataStore, root: str) -> ClusterInfo | None:
    """The cluster's identity, or None if the root was never initialised."""
    key = ClusterKeys(root).cluster
    current = await store.get(key)
    if current is None:
        return None
    # A newer format_version is refused: this software may misread a layout written by a newer one.
    body = unpack_map(
        key, current.value, bytes_max=CLUSTER_INFO_BYTES_MAX, format_version_max=CLUSTER_FORMAT_VERSION
    )
    instance_id, created_ms = body.get("instance_id"), body.get("created_ms")
    if not isinstance(instance_id, str) or type(created_ms) is not int:
        raise MetadataFormatError(
            key, "bad cluster info: 'instance_id' or 'created_ms' missing or of wrong type"
        )
    return ClusterInfo(instance_id, created_ms, int(body["format_version"]))


async def ensure_cluster(store: MetadataStore, root: str) -> ClusterInfo:
    """The cluster info, initialising the root first if needed (idempotent, race-safe)."""
    existing = await read_cluster_info(store, root)
    if existing is not None:
        return existing
    try:
        return await init_cluster(store, root)
    except NodeExists:
        again = await read_cluster_info(store, root)
        assert again is not None
        return again


async def list_ledgers(
    store: MetadataStore, root: str, *, start_after: int | None = None, limit: int = 1000
) -> LedgerIdPage:
    """One page of ledger ids in increasing order."""
    return await LedgerManager(store, root).list_page(start_after=start_after, limit=limit)


def describe_ledger(md: serde.LedgerMetadata, version: int) -> dict[str, Any]:
    """Plain (JSON-friendly) view of ledger metadata; the password hash is shown only by length."""
    return {
        "ledger_id": md.ledger_id,
        "version": version,
        "state": md.state.value,
        "ensemble_size": md.ensemble_size,
        "write_quorum": md.write_quorum,
        "ack_quorum": md.ack_quorum,
        "last_entry_id": md.last_entry_id,
        "length": md.length,
        "ensembles": [{"first_entry_id": first, "bookies": list(bookies)} for first, bookies in md.ensembles],
        "digest_type": md.digest_type,
        "password_hash_bytes": len(md.password_hash),
        "custom_metadata": {k: v.hex() for k, v in md.custom_metadata.items()},
        "ctime_ms": md.ctime_ms,
        "format_version": md.format_version,
        "replaced_bookies": [
            list(r) for r in md.replaced_bookies
        ],  # [first_entry, bookie, replacement, time_ms]
    }


async def show_ledger(store: MetadataStore, root: str, ledger_id: int) -> dict[str, Any]:
    """`describe_ledger` of the stored ledger. Raises `NoSuchLedger`, `MetadataFormatError`."""
    current = await LedgerManager(store, root).read(ledger_id)
    return describe_ledger(current.metadata, current.version)


async def show_bookies(store: MetadataStore, root: str) -> BookieSet:
    """The registered bookies (writable and read-only)."""
    return await list_bookies(store, root)
