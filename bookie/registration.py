"""The bookie's presence in metadata: the cookie check and a lease-bound registration.

Plugs into :class:`bookie.server.BookieServer`:

- ``verify(bookie_id, instance_id, data_dir)`` runs *before* the bookie listens. The metadata cookie
  ``cookies/<bookie id>`` records which data directory (its instance id, from the local COOKIE file)
  the bookie id was first started with. A bookie whose data directory was wiped or replaced comes
  back with a new instance id and is refused: otherwise it would answer "no such entry" for entries
  it used to hold, and recovery could count that as proof an acknowledged entry never existed.
  After a disk loss an operator runs ``bkaio bookie format BOOKIE_ID`` to forget the old cookie.
- ``start(bookie_id, address)`` registers under ``bookies/writable/`` bound to a lease (re-registered
  after a lease loss by :class:`metadata.BookieRegistration`); ``close()`` deregisters.
- ``set_read_only(flag)`` moves the key between ``bookies/writable/`` and ``bookies/readonly/``
  (same lease; read-only mode, :mod:`bookie.mode`). Called before ``start`` it only records the
  state, and ``start`` registers straight into it (a bookie that starts with a full disk never
  appears writable).

The cluster root must exist (``bkaio cluster init`` or the sandbox creates it): a bookie never
creates a cluster by itself, so a typo in the root fails loudly instead of starting an empty cluster.
"""

from __future__ import annotations

import structlog

import metadata

log = structlog.get_logger(__name__)


class ClusterNotInitialised(RuntimeError):
    """The metadata root has no cluster: run ``bkaio cluster init`` first."""


class MetadataCookieMismatch(RuntimeError):
    """The metadata says this bookie id belongs to another data directory."""


class MetadataRegistration:
    def __init__(self, url: str, ttl_s: int = metadata.bookies.REGISTRATION_TTL_S_DEFAULT) -> None:
        self._url = url
        self._ttl_s = ttl_s
        self._connection: metadata.MetadataConnection | None = None
        self._registration: metadata.BookieRegistration | None = None
        self._read_only = False

    def _connect(self) -> metadata.MetadataConnection:
        if self._connection is None:
            self._connection = metadata.connect(self._url)
        return self._connection

    async def verify(self, bookie_id: str, instance_id: str, data_dir: str) -> None:
        """Check (or create) the metadata cookie. Raises ClusterNotInitialised, MetadataCookieMismatch."""
        conn = self._connect()
        if await metadata.read_cluster_info(conn.store, conn.root) is None:
            raise ClusterNotInitialised(
                f"no cluster at {self._url}: run `bkaio cluster init --metadata {self._url}` first"
            )
        stored = await metadata.read_cookie(conn.store, conn.root, bookie_id)
        if stored is None:
            cookie = metadata.Cookie(bookie_id, instance_id, (data_dir,), (data_dir,))
            await metadata.write_cookie(conn.store, conn.root, cookie, expected_version=None)
            log.info("bookie.cookie_created", bookie_id=bookie_id, instance_id=instance_id)
            return
        cookie, _ = stored
        if cookie.instance_id != instance_id:
            raise MetadataCookieMismatch(
                f"bookie id {bookie_id!r} was started with data directory instance {cookie.instance_id} "
                f"({', '.join(cookie.ledger_dirs)}), but {data_dir} is instance {instance_id}: its data "
                "may be lost. Start it on its original data directory; if that data is really gone, run "
                f"`bkaio bookie format {bookie_id}` to forget the old cookie (the cluster then treats "
                "its entries as lost replicas)"
            )

    async def start(self, bookie_id: str, address: str) -> None:
        conn = self._connect()
        host, _, port = address.rpartition(":")
        state = metadata.BookieState.READONLY if self._read_only else metadata.BookieState.WRITABLE
        info = metadata.BookieInfo(bookie_id=bookie_id, host=host, port=int(port), state=state)
        self._registration = metadata.BookieRegistration(conn.store, conn.root, info, ttl_s=self._ttl_s)
        await self._registration.start()
        log.info("bookie.registered", bookie_id=bookie_id, address=address, root=conn.root, state=state.value)

    async def set_read_only(self, read_only: bool) -> None:
        """Move the registration to ``bookies/readonly/`` (True) or ``bookies/writable/`` (False).

        Raises :class:`metadata.MetadataError` when the store does not answer (the caller retries).
        """
        self._read_only = read_only
        if self._registration is not None:
            state = metadata.BookieState.READONLY if read_only else metadata.BookieState.WRITABLE
            await self._registration.set_state(state)

    async def close(self) -> None:
        if self._registration is not None:
            await self._registration.close()
            self._registration = None
        if self._connection is not None:
            await self._connection.close()
            self._connection = None
