"""The simulated world: real bookie servers, real clients, the in-memory metadata store, one seed.

Every node runs the production code: :class:`bookie.server.BookieServer` over the simulated disk
(:mod:`tests.simulation.disk`), thread seam (:mod:`tests.simulation.threads`) and network
(:mod:`tests.simulation.network`); :class:`bookkeeper_aio.BookKeeper` clients whose connections go
through the same network; :class:`metadata.memory.MemoryStore` for metadata. Each node's code runs
in a context whose :data:`~tests.simulation.loop.NODE` is the node's incarnation, so a crash drops
everything it had scheduled (see the loop).

Randomness: one RNG per concern (scheduling, network, disk, faults, workload), each derived from
the seed, so a change in one (say, a new fault kind) does not reshuffle the others.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import json
import os
import random
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import structlog

from bookie.config import BookieConfig
from bookie.cookie import COOKIE_FILE, LAYOUT_VERSION
from bookie.registration import MetadataRegistration
from bookie.server import BookieServer
from bookkeeper_aio import BookKeeper, ClientConfig, RandomPlacement
from bookkeeper_aio.client.keys import NewLedgerKeys
from bookkeeper_aio.protocol.digest import KEY_SALT_BYTES, ledger_keys
from metadata import ledger_metadata
from metadata.cluster import MetadataConnection
from metadata.keys import ClusterKeys
from metadata.ledger_manager import LedgerManager
from metadata.ledger_metadata import LedgerMetadata
from metadata.memory import MemoryStore
from metadata.store import Guards
from tests.faults.history import History
from tests.simulation.disk import Disk, SimFileIO, healthy_disk
from tests.simulation.loop import NODE, Incarnation, SimLoop
from tests.simulation.network import PORT, Network
from tests.simulation.threads import SimThreads, _InlineExecutor

T = TypeVar("T")

ROOT = "/sim"
KEYS = ClusterKeys(ROOT)
PASSWORD = b"sim"

CLIENT_CONFIG = ClientConfig(
    add_timeout_s=1.0,
    read_timeout_s=1.0,
    connect_timeout_s=0.5,
    reconnect_backoff_initial_s=0.02,
    reconnect_backoff_max_s=0.2,
    explicit_lac_interval_ms=50,
    speculative_read_delay_ms=50,
    metadata_timeout_s=2.0,
)


REGISTRATION_TTL_S = 2
"""The bookies' registration leases where bookies register (the autorecovery profile): the
shortest the store allows, so a crashed bookie is seen gone soon."""
POWER_CUT = "power cut"
PROCESS_KILL = "process kill"
PROCESS_KILL_PROBABILITY = 0.5
"""The share of the fault phase's bookie crashes that are process kills (:meth:`World.crash_kind`)."""
KILL_STEPS_MAX = 4
"""A process kill lands on one of the first this many steps of the journal group in flight (a
group's steps: its write, its fdatasync, the synced mark's write, then whatever else it does), or
after the group if it has fewer."""
ROT_FINAL_GROUP = os.environ.get("SIM_ROT_FINAL_GROUP", "") == "1"
"""``rot_disk`` may draw its byte in a journal's final group too (which replay cannot tell from a
torn write, so it cuts it); bookies then put what a cut may have touched in limbo (bookie/limbo.py).
Off, no profile rots a final group: every cut is a torn, never synced write, and limbo is off."""


class LoopClock:
    """The clock seam read from the simulated loop."""

    __slots__ = ("monotonic", "wall")

    def __init__(self, loop: SimLoop) -> None:
        self.monotonic: Callable[[], float] = loop.time  # the loop's own method: one call, not two
        self.wall: Callable[[], float] = loop.time


class Trace:
    """The run's story, one line per event, stamped with virtual time (byte-identical per seed)."""

    def __init__(self, loop: SimLoop) -> None:
        self._loop = loop
        self._lines: list[tuple[float, str]] = []

    def __call__(self, line: str) -> None:
        self._lines.append((self._loop._now_s, line))  # the time is formatted in text()

    def text(self) -> str:
        return "".join([f"{at:11.6f} {line}\n" for at, line in self._lines])


class Node:
    """A named process of the world with its current incarnation."""

    def __init__(self, world: World, name: str) -> None:
        self.world = world
        self.name = name
        self.incarnation = Incarnation(name)
        self.context = self._new_context()
        self._ended: list[asyncio.Future[None]] = []

    def _new_context(self) -> contextvars.Context:
        context = contextvars.copy_context()
        context.run(NODE.set, self.incarnation)
        return context

    def spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """Run ``coro`` as this node's code."""
        return self.world.loop.create_task(coro, name=f"{self.name}:{name}", context=self.context)

    async def run_alive(self, coro: Coroutine[Any, Any, None], name: str) -> bool:
        """Run ``coro`` as this node's code and wait for it, or for the node's crash (a task of a
        crashed node never ends: awaiting it alone would hang the caller, and its cancellation with
        it). True when it finished (its exception raised here), False when the node crashed."""
        task = self.spawn(coro, name)
        ended = self.world.loop.create_future()
        self._ended.append(ended)

        def finished(_: object) -> None:
            if not ended.done():
                ended.set_result(None)

        task.add_done_callback(finished)
        try:
            await ended
        finally:
            self._ended.remove(ended)
        if not task.done():
            return False
        task.result()
        return True

    @property
    def up(self) -> bool:
        return not self.incarnation.dead

    def _die(self) -> None:
        self.incarnation.dead = True
        self.world.network.crash_node(self.name)
        for ended in self._ended:
            if not ended.done():
                ended.set_result(None)

    def _reincarnate(self) -> None:
        self.incarnation = Incarnation(self.name)
        self.context = self._new_context()


class SimBookie(Node):
    def __init__(self, world: World, name: str) -> None:
        super().__init__(world, name)
        self.disk = Disk()
        self.server: BookieServer | None = None
        self.threads: SimThreads | None = None
        self.fileio: SimFileIO | None = None
        self.starts = 0
        self.kills = 0
        """Process kills so far (each keeps the boot: :meth:`crash`)."""

    def config(self) -> BookieConfig:
        return BookieConfig(
            data_dir=f"/{self.name}",
            bookie_id=self.name,
            host=self.name,
            port=PORT,
            admin_port=-1,
            frame_bytes_max=16 * 1024,
            journal_segment_bytes=64 * 1024,
            checkpoint_interval_s=self.world.rng_for("checkpoint", self.name).uniform(0.2, 2.0),
            disk_check_interval_s=self.world.disk_check_interval_s,
            gc_interval_s=3600.0,
            limbo_after_cut=int(self.world.limbo_after_cut),
        )

    async def start(self) -> None:
        world = self.world
        self.starts += 1
        rng = world.rng_for("disk", self.name, self.starts)
        self.threads = SimThreads(world.loop, rng)
        self.fileio = SimFileIO(self.disk)
        server = self.context.run(
            BookieServer,
            self.config(),
            self._registration() if world.bookies_register else None,
            threads=self.threads,
            clock=LoopClock(world.loop),
            fileio=self.fileio,
            disk_probe=healthy_disk,
            **self.server_options(),
        )
        if world.bookies_register:  # registering may wait a lease out: a crash may come first
            if not await self.run_alive(server.start(), "start"):
                world.trace(f"bookie {self.name} crashed while starting (start {self.starts})")
                return
        else:
            await self.spawn(server.start(), "start")
        self.server = server
        world.trace(f"bookie {self.name} started (start {self.starts})")

    def server_options(self) -> dict[str, Any]:
        """More arguments of its :class:`BookieServer` (made once :attr:`fileio` is): none here; a
        subclass gives a metadata catalog (tests/simulation/gc_sweep.py)."""
        return {}

    def _registration(self) -> MetadataRegistration:
        """The production registration (cookie check, lease-bound key) on the world's store. A
        fresh disk is formatted first with a cookie naming a deterministic instance id (the
        bookie's own would be a random uuid, which its log line would print into the trace)."""
        assert self.fileio is not None
        data_dir = f"/{self.name}"
        cookie = os.path.join(data_dir, COOKIE_FILE)
        if not self.fileio.exists(cookie):
            self.fileio.makedirs(data_dir)
            body = {"bookie_id": self.name, "instance_id": f"{self.name}-1", "layout_version": LAYOUT_VERSION}
            self.fileio.write_file_atomic(cookie, json.dumps(body, sort_keys=True).encode())
        return MetadataRegistration(
            f"memory://{ROOT}",
            ttl_s=REGISTRATION_TTL_S,
            fileio=self.fileio,
            connection=SimMetadata(self.world, self.name),
        )

    @property
    def syncing(self) -> bool:
        return self.up and self.threads is not None and self.threads.syncing

    def crash(self, kind: str = POWER_CUT) -> None:
        """A crash of ``kind``; the process is gone either way.

        - :data:`POWER_CUT`: every unsynced byte may be gone too. A journal group in flight is cut
          mid-write: its bytes reach the disk as pending writes, its fdatasync never happens; the
          disk keeps a random prefix of what is pending (:meth:`Disk.crash`), and a new boot starts.
        - :data:`PROCESS_KILL` (kill -9, the OOM killer): the page cache survives, so the disk keeps
          every byte written and the boot goes on; a journal group in flight stops at a random step
          (:meth:`SimFileIO.kill_during`), a write there torn."""
        self._die()
        threads, fileio = self.threads, self.fileio
        syncing = threads is not None and threads.syncing
        note = " mid-write" if syncing else ""
        if kind == PROCESS_KILL:
            if syncing and threads is not None and fileio is not None:
                rng = self.world.rng_for("kill", self.name, self.starts)
                fileio.kill_during(rng.randint(1, KILL_STEPS_MAX), rng)
                for worker in threads.workers:
                    self.context.run(worker.interrupt)  # its completion dies with the incarnation
                note = f" mid-write, {fileio.kill_note}"
            self.kills += 1
        else:
            if syncing and threads is not None and fileio is not None:
                fileio.syncs_lost = True
                for worker in threads.workers:
                    self.context.run(worker.interrupt)  # its completion dies with the incarnation
            self.disk.crash(self.world.rng_for("crash", self.name, self.starts))
        self.server = None
        self.world.trace(
            f"bookie {self.name} crashed{' (process kill)' if kind == PROCESS_KILL else ''}{note}"
        )

    async def restart(self) -> None:
        self._reincarnate()
        await self.start()


class SimDirectory:
    """Who is writable: the bookies that are up and not read-only (registration with an instant
    lease expiry, and a read-only bookie moved to the read-only set at once)."""

    def __init__(self, world: World) -> None:
        self._world = world

    async def writable_bookies(self) -> Sequence[str]:
        await asyncio.sleep(0)
        return [
            b.name
            for b in self._world.bookies
            if b.server is not None and b.server.ready and not b.server.mode.read_only
        ]


class SimMetadata(MetadataConnection):
    """A connection to the world's metadata store for a node's production code (a bookie's
    registration, an autorecovery daemon), whose ledger manager reads the virtual clock and
    draws from a seeded RNG."""

    def __init__(self, world: World, node: str) -> None:
        super().__init__(world.store, ROOT)
        self.world = world
        self.node = node

    def ledger_manager(self) -> LedgerManager:
        world = self.world
        return LedgerManager(self.store, ROOT, now_ms=world.now_ms, rng=world.rng_for("ids", self.node))


class SimResolver:
    async def resolve(self, bookie_id: str) -> tuple[str, int]:
        return bookie_id, PORT


class SimClient(Node):
    """A client process with one BookKeeper (made on its node, where its tasks live)."""

    def __init__(self, world: World, name: str) -> None:
        super().__init__(world, name)
        self.bk: BookKeeper = self.context.run(self._make)

    def _make(self) -> BookKeeper:
        world = self.world
        ledgers = LedgerManager(
            world.store, ROOT, rng=world.rng_for("ids", self.name), now_ms=world.now_ms, id_block_size=10
        )
        return BookKeeper(
            ledgers,
            SimDirectory(world),
            config=world.client_config,
            resolver=SimResolver(),
            placement=RandomPlacement(world.rng_for("placement", self.name)),
            key_executor=_InlineExecutor(),  # no threads in the simulation
        )

    def crash(self) -> None:
        self._die()
        self.world.trace(f"client {self.name} crashed")


SIM_KEY_ITERATIONS = 1
"""PBKDF2 rounds of the simulation's ledgers: the salted key format is the same, but 20,000 rounds
per new ledger were 16% of a seed's CPU time."""


class SimLedgerKeys:
    """What ``bookkeeper_aio.client.bookkeeper`` calls ``NewLedgerKeys`` during a run (run_seed puts
    it in place): the salt from the seed (not ``os.urandom``), one round of PBKDF2, derived inline."""

    def __init__(self, world: World) -> None:
        self._rng = world.rng_for("key salt")

    async def make(self, password: bytes, iterations: int = 0, executor: Any = None) -> NewLedgerKeys:
        salt = self._rng.randbytes(KEY_SALT_BYTES)
        return NewLedgerKeys(salt, SIM_KEY_ITERATIONS, ledger_keys(password, salt, SIM_KEY_ITERATIONS))


class SimStore(MemoryStore):
    """The metadata twin, plus one fault of the world's: a writer may crash right after the CAS of
    an ensemble change was applied, before it acts on the answer (its new fragment then holds
    nothing), with ``crash_after_ensemble_change_probability``."""

    def __init__(self, world: World) -> None:
        super().__init__()
        self._world = world
        self._rng = world.rng_for("store")
        self.crash_after_ensemble_change_probability = 0.0
        self.on_new_fragment: Callable[[str], None] | None = None
        """Called with the ledger's key when a CAS adds a fragment (before the writer learns it)."""
        self.on_ledger_cas: Callable[[str, bytes, bytes], None] | None = None
        """Called with (key, old value, new value) after every applied CAS of a ledger."""
        self._decoded: dict[tuple[str, bytes], LedgerMetadata] = {}

    def ledger(self, key: str, value: bytes) -> LedgerMetadata:
        """``value`` (stored under ``key``) decoded, once per distinct value: the checks decode
        every ledger after every step, and most have not changed (metadata is immutable)."""
        md = self._decoded.get((key, value))
        if md is None:
            md = self._decoded[key, value] = ledger_metadata.decode(value, key=key)
        return md

    async def compare_and_set(
        self, key: str, value: bytes, expected_version: int, *, guards: Guards = ()
    ) -> int:
        old = self._data.get(key)
        version = await super().compare_and_set(key, value, expected_version, guards=guards)
        node = NODE.get()
        new_fragment = (
            (self.crash_after_ensemble_change_probability or self.on_new_fragment is not None)
            and old is not None
            and key.startswith(KEYS.ledgers_prefix)
            and len(self.ledger(key, old.value).ensembles) < len(self.ledger(key, value).ensembles)
        )
        if self.on_ledger_cas is not None and old is not None and key.startswith(KEYS.ledgers_prefix):
            self.on_ledger_cas(key, old.value, value)
        if new_fragment and self.on_new_fragment is not None:
            self.on_new_fragment(key)
        if (
            node is not None
            and new_fragment
            and self.crash_after_ensemble_change_probability
            and self._rng.random() < self.crash_after_ensemble_change_probability
        ):
            for client in self._world.clients:
                if client.incarnation is node and client.name.startswith("w"):
                    client.crash()
                    self._world.trace(f"client {client.name} crashed right after an ensemble change of {key}")
        return version


class World:
    limbo_after_cut = ROT_FINAL_GROUP
    """Bookies put what a torn-tail cut may have touched in limbo (bookie/limbo.py): on with
    ``SIM_ROT_FINAL_GROUP=1``, where a cut may be of synced bytes (rot), and in the test that a
    process kill's tear needs no limbo."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.loop = SimLoop(self.rng_for("schedule"))
        self.network = Network(self.loop, self.rng_for("network"))
        self.trace = Trace(self.loop)
        self.network.trace = self.trace
        self.store = SimStore(self)
        self.client_config = CLIENT_CONFIG
        self.bookies_register = False
        """Bookies register in the store with the production registration (the autorecovery
        profile: the auditor watches registrations); otherwise :class:`SimDirectory` stands in."""
        self.disk_check_interval_s = 3600.0
        """How often bookies look at their disk and journal (a failed journal makes a bookie
        read-only at the next look)."""
        self.bookies: list[SimBookie] = []
        self.bookie_class: type[SimBookie] = SimBookie
        """What :meth:`add_bookie` makes (tests/simulation/gc_sweep.py's bookies run GC on metadata)."""
        self.clients: list[SimClient] = []
        self.process_kill_probability = PROCESS_KILL_PROBABILITY
        """0 makes every crash of the fault phase a power cut (as before process kills existed)."""
        self._crash_kinds = self.rng_for("crash kind")
        self._sequence = itertools.count()
        self.history = History(clock=self._next_op_time)

    def rng_for(self, *what: object) -> random.Random:
        return random.Random("/".join(map(str, (self.seed, *what))))

    def now_ms(self) -> int:
        return int(self.loop.time() * 1000)

    def crash_kind(self) -> str:
        """A fault-phase crash's kind: a process kill with ``process_kill_probability``, else a
        power cut (drawn from an RNG of its own: the other faults' draws stay as they were)."""
        if self.process_kill_probability and self._crash_kinds.random() < self.process_kill_probability:
            return PROCESS_KILL
        return POWER_CUT

    def _next_op_time(self) -> float:
        return float(next(self._sequence))

    def ledger_manager(self) -> LedgerManager:
        return LedgerManager(self.store, ROOT, now_ms=self.now_ms, rng=self.rng_for("ids", "checker"))

    def add_bookie(self) -> SimBookie:
        bookie = self.bookie_class(self, f"b{len(self.bookies)}")
        self.bookies.append(bookie)
        return bookie

    def add_client(self, name: str) -> SimClient:
        client = SimClient(self, name)
        self.clients.append(client)
        return client


def _log_sink(trace: Trace) -> Any:
    """A structlog processor chain end that writes the production code's events into the trace."""

    def sink(logger: Any, method: str, event: dict[str, Any]) -> str:
        name = event.pop("event", "?")
        fields = " ".join([f"{k}={event[k]}" for k in sorted(event) if k != "exc_info"])
        node = NODE.get()
        trace(f"[{node.name if node else '-'}] {method} {name} {fields}".rstrip())
        return ""  # handed to the wrapped logger, which drops it (_Discard)

    return sink


def capture_logs(trace: Trace) -> dict[str, Any]:
    """Route structlog into the trace; returns the configuration to restore."""
    saved = structlog.get_config()
    structlog.configure(
        processors=[_log_sink(trace)],
        wrapper_class=structlog.make_filtering_bound_logger(20),
        logger_factory=_no_logger,
        cache_logger_on_first_use=False,
    )
    return saved


class _Discard:
    """What the bound loggers wrap during a run: a logger whose every method does nothing. The
    sink has written the event into the trace and hands it an empty line (raising ``DropEvent``
    instead unwound three frames per event)."""

    def _nothing(self, *args: Any, **kw: Any) -> None:
        return None

    msg = log = debug = info = warning = warn = error = exception = critical = fatal = _nothing


_DISCARD = _Discard()


def _no_logger(*args: Any) -> Any:
    """The logger factory during a run: the one :class:`_Discard`. Uncached loggers are bound anew
    at each call, and the default factory made a ``PrintLogger`` (a lock lookup) every time."""
    return _DISCARD
