"""The bookie's presence in metadata: a lease-bound registration under ``bookies/writable/``.

Plugs into :class:`bookie.server.BookieServer` (``start(bookie_id, address)`` / ``close()``). The
cluster root must exist (``bkaio cluster init`` or the sandbox creates it): a bookie never creates
a cluster by itself, so a typo in the root fails loudly instead of starting an empty cluster.
Lease loss (etcd outage, a long pause) is handled by :class:`metadata.BookieRegistration`, which
re-registers when it can.
"""

from __future__ import annotations

import structlog

import metadata

log = structlog.get_logger(__name__)


class ClusterNotInitialised(RuntimeError):
    """The metadata root has no cluster: run ``bkaio cluster init`` first."""


class MetadataRegistration:
    def __init__(self, url: str, ttl_s: int = metadata.bookies.REGISTRATION_TTL_S_DEFAULT) -> None:
        self._url = url
        self._ttl_s = ttl_s
        self._connection: metadata.MetadataConnection | None = None
        self._registration: metadata.BookieRegistration | None = None

    async def start(self, bookie_id: str, address: str) -> None:
        connection = metadata.connect(self._url)
        self._connection = connection
        if await metadata.read_cluster_info(connection.store, connection.root) is None:
            raise ClusterNotInitialised(
                f"no cluster at {self._url}: run `bkaio cluster init --metadata {self._url}` first"
            )
        host, _, port = address.rpartition(":")
        info = metadata.BookieInfo(bookie_id=bookie_id, host=host, port=int(port))
        self._registration = metadata.BookieRegistration(
            connection.store, connection.root, info, ttl_s=self._ttl_s
        )
        await self._registration.start()
        log.info("bookie.registered", bookie_id=bookie_id, address=address, root=connection.root)

    async def close(self) -> None:
        if self._registration is not None:
            await self._registration.close()
            self._registration = None
        if self._connection is not None:
            await self._connection.close()
            self._connection = None
