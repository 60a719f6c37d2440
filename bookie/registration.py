"""The bookie's presence in metadata: the cookie check and a lease-bound registration.

Plugs into :class:`bookie.server.BookieServer`:

- ``verify(bookie_id, instance_id, data_dir)`` runs once the bookie holds its data dir's lock and its
  listening socket, and *before* it serves anything (so a bookie that cannot bind its port never
  claims the id: a retry elsewhere must not meet a cookie it wrote). The metadata cookie
  ``cookies/<bookie id>`` records which data directory (its instance id, from the local COOKIE file)
  the bookie id was first started with. A bookie whose data directory was wiped or replaced comes
  back with a new instance id and is refused: otherwise it would answer "no such entry" for entries
  it used to hold, and recovery could count that as proof an acknowledged entry never existed.
  After a disk loss an operator runs ``bkaio bookie format BOOKIE_ID`` to forget the old cookie.
  The data directory's COOKIE names the cluster it registered with (:func:`bookie.cookie.
  bind_cluster`): a start against another cluster is refused (:class:`ClusterMismatch`), and so is a
  data directory holding data at a root that has no cookie for it (a wrong root, or a cluster whose
  metadata was re-initialised): the bookie's GC would otherwise take its ledgers for deleted ones.
- ``start(bookie_id, address)`` registers under ``bookies/writable/`` bound to a lease (re-registered
  after a lease loss by :class:`metadata.BookieRegistration`); ``close()`` deregisters. The value
  carries ``instance_id`` (the data directory's) and ``data_dir_lock`` (:func:`bookie.cookie.
  lock_identity`: that directory's lock file on this machine's running kernel) and, with the admin
  endpoint enabled, ``admin`` (its ``host:port``, for ``bkaio bookie gc``).
- A registration found under our id (a bookie killed with -9 leaves its key until its lease expires)
  is replaced at once when it is provably our own dead previous incarnation: it names our instance
  id *and* our ``data_dir_lock``, so its process held the very lock file we hold now, which the kernel
  gives to one process at a time and frees only when it dies. Anything else (another data directory,
  a copy of ours, another machine, a reboot, an older bookie without these attributes) is waited for
  as before (2 TTLs) and then refused with :class:`BookieIdInUse`.
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
from bookie.cookie import bind_cluster, holds_data, lock_identity, read_cluster_binding
from bookie.fileio import OS_FILE_IO, FileIO
from metadata.bookies import RegistrationHeld

log = structlog.get_logger(__name__)


class ClusterNotInitialised(RuntimeError):
    """The metadata root has no cluster: run ``bkaio cluster init`` first."""


class MetadataCookieMismatch(RuntimeError):
    """The metadata says this bookie id belongs to another data directory."""


class ClusterMismatch(RuntimeError):
    """The data directory belongs to another cluster than the one at the metadata URL."""


class BookieIdInUse(RuntimeError):
    """Another live bookie keeps this bookie id registered."""


class MetadataRegistration:
    def __init__(
        self,
        url: str,
        ttl_s: int = metadata.bookies.REGISTRATION_TTL_S_DEFAULT,
        fileio: FileIO = OS_FILE_IO,
        connection: metadata.MetadataConnection | None = None,
    ) -> None:
        """``connection``: an open connection for ``url`` to use instead of connecting (the
        deterministic simulation's in-memory store); ``close()`` closes it all the same."""
        self._url = url
        self._fileio = fileio
        self._ttl_s = ttl_s
        self._connection: metadata.MetadataConnection | None = connection
        self._registration: metadata.BookieRegistration | None = None
        self._read_only = False
        self._instance_id = ""
        self._lock_identity = ""

    def _connect(self) -> metadata.MetadataConnection:
        if self._connection is None:
            self._connection = metadata.connect(self._url)
        return self._connection

    async def verify(self, bookie_id: str, instance_id: str, data_dir: str) -> None:
        """Check (or create) the metadata cookie. Raises ClusterNotInitialised, MetadataCookieMismatch."""
        self._instance_id = instance_id
        self._lock_identity = lock_identity(data_dir)
        conn = self._connect()
        cluster = await metadata.read_cluster_info(conn.store, conn.root)
        if cluster is None:
            raise ClusterNotInitialised(
                f"no cluster at {self._url}: run `bkaio cluster init --metadata {self._url}` first"
            )
        bound = read_cluster_binding(self._fileio, data_dir)
        if bound is not None and bound != cluster.instance_id:
            raise ClusterMismatch(
                f"data dir {data_dir} belongs to cluster {bound}, but {self._url} holds cluster "
                f"{cluster.instance_id} (a wrong --metadata root, or a re-initialised or restored "
                "metadata store): refusing to start, its garbage collection would take this bookie's "
                "ledgers for deleted ones. Point it at its own cluster"
            )
        stored = await metadata.read_cookie(conn.store, conn.root, bookie_id)
        if stored is None:
            if holds_data(self._fileio, data_dir):
                raise ClusterMismatch(
                    f"data dir {data_dir} holds data, but the cluster at {self._url} has no cookie for "
                    f"bookie {bookie_id!r}: it never registered here (a wrong --metadata root?) or its "
                    "cookie was removed (`bkaio bookie format`: then the cluster counts this data as "
                    "lost; wipe the data dir to rejoin empty). Refusing to start"
                )
            cookie = metadata.Cookie(bookie_id, instance_id, (data_dir,), (data_dir,))
            await metadata.write_cookie(conn.store, conn.root, cookie, expected_version=None)
            bind_cluster(self._fileio, data_dir, cluster.instance_id)
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
        if bound is None:  # registered before bookies recorded their cluster: record it now
            bind_cluster(self._fileio, data_dir, cluster.instance_id)

    async def start(self, bookie_id: str, address: str, admin_address: str | None = None) -> None:
        conn = self._connect()
        host, _, port = address.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")  # an IPv6 address is published bare
        state = metadata.BookieState.READONLY if self._read_only else metadata.BookieState.WRITABLE
        attributes = {"instance_id": self._instance_id, "data_dir_lock": self._lock_identity}
        if admin_address is not None:
            attributes["admin"] = admin_address  # `bkaio bookie gc BOOKIE_ID` finds the endpoint here
        info = metadata.BookieInfo(bookie_id, host, int(port), state, attributes)
        registration = metadata.BookieRegistration(
            conn.store, conn.root, info, ttl_s=self._ttl_s, is_previous_self=self._is_previous_self
        )
        try:
            await registration.start()
        except RegistrationHeld as exc:
            holder = exc.holder
            where = "another bookie" if holder is None else f"the bookie at {holder.host}:{holder.port}"
            raise BookieIdInUse(
                f"bookie id {bookie_id!r} is registered by {where}, which kept its lease alive for "
                f"{self._ttl_s * metadata.bookies.STALE_KEY_WAIT_TTLS}s: two running bookies cannot share "
                "an id. Stop that bookie first, or start this one with another --bookie-id"
            ) from None
        self._registration = registration
        log.info("bookie.registered", bookie_id=bookie_id, address=address, root=conn.root, state=state.value)

    def _is_previous_self(self, found: metadata.BookieInfo) -> bool:
        """Whether a registration under our id was left by this bookie's dead previous incarnation."""
        return (
            bool(self._lock_identity)
            and found.attributes.get("instance_id") == self._instance_id
            and found.attributes.get("data_dir_lock") == self._lock_identity
        )

    async def set_read_only(self, read_only: bool) -> None:
        """Move the registration to ``bookies/readonly/`` (True) or ``bookies/writable/`` (False).

        Raises :class:`metadata.MetadataError` when the store does not answer (the caller retries).
        """
        self._read_only = read_only
        if self._registration is not None:
            state = metadata.BookieState.READONLY if read_only else metadata.BookieState.WRITABLE
            await self._registration.set_state(state)

    @property
    def failure(self) -> BaseException | None:
        return None if self._registration is None else self._registration.failure

    async def close(self) -> None:
        if self._registration is not None:
            await self._registration.close()
            self._registration = None
        if self._connection is not None:
            await self._connection.close()
            self._connection = None
