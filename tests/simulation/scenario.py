"""One seed's run: workload + faults, then heal, recover, read back and check.

Phases (all in virtual time):

1. **Faults** (``FAULT_S``): writer clients create ledgers of random shapes and pipeline unique values
   into them (every add in the history); a recoverer opens ledgers with recovery while their writer
   still writes (fencing races); a nemesis crashes bookies (sometimes two at once: a rack's power),
   restarts them from their crashed disk images, partitions clients from bookies, resets
   connections, and crashes a writer client. The invariants are checked after every fault step.
2. **Heal**: every bookie back, every partition gone. Liveness is demanded: every ledger must be
   recovered and closed within ``HEAL_S``, by two racing recoverers on fresh clients.
3. **Check**: two fresh readers read every ledger back; the history checker
   (tests/faults/history.py) and the final-state invariants (tests/simulation/invariants.py) judge.

The shape of a seed (bookies, writers, entries, faults) is drawn from the seed itself, small enough
that hundreds of seeds run in the default test set.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import random
import time
import traceback
from dataclasses import dataclass, field

import structlog

from bookie.connection_handler import ServerConnection
from bookkeeper_aio import BKError
from bookkeeper_aio.client import bookkeeper as client_bookkeeper
from bookkeeper_aio.client import keys as client_keys
from bookkeeper_aio.client.ledger import LedgerHandle
from bookkeeper_aio.common import backoff, failpoints
from bookkeeper_aio.log.reader import open_log_reader
from bookkeeper_aio.log.writer import open_log_writer
from metadata.ledger_metadata import LedgerMetadata
from tests.faults.history import AddOp
from tests.harness.log_history import AppendRecord, LogHistory
from tests.harness.log_history import Outcome as LogOutcome
from tests.harness.log_history import outcome_of as log_outcome_of
from tests.simulation import invariants
from tests.simulation.loop import Cut, Deadlock, Livelock
from tests.simulation.network import stable_hash
from tests.simulation.world import PASSWORD, SimBookie, SimClient, SimLedgerKeys, World, capture_logs

SHAPES = [(3, 2, 2), (3, 3, 2), (3, 3, 3), (4, 3, 2), (4, 2, 2)]
WINDOW = 8
LOG = "simlog"
THINK_PROBABILITY = 0.5
THINK_S_MAX = 0.03
FAULT_S = 2.0
HEAL_S = 30.0
RUN_S_MAX = 120.0
RECOVERY_ATTEMPTS_MAX = 40
WORKLOAD_END_S_MAX = 30.0
FAULTS = [
    "crash",
    "crash_syncing",
    "crash_syncing",
    "crash2",
    "partition",
    "kill",
    "kill_client",
    "metadata_down",
    "metadata_unknown",
    "slow_link",
]
CRASH_AFTER_ENSEMBLE_CHANGE_PROBABILITY = 0.3
SYNC_WAIT_POLL_S = 0.0005
SYNC_WAIT_POLLS_MAX = 400


@dataclass
class Outcome:
    seed: int
    trace: str
    problems: list[str]
    simulated_s: float
    wall_s: float
    acked: int
    ledgers: int
    callbacks: int = 0
    cpu_s: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    cut: bool = False
    """Exhaustive mode: the run ended at a state already explored (no final checks)."""


class Scenario:
    def __init__(self, world: World) -> None:
        self.world = world
        rng = world.rng_for("shape")
        self.rng = rng
        self.bookie_count = rng.randint(4, 5)
        self.writer_count = rng.randint(1, 2)
        self.ledgers_per_writer = rng.randint(2, 4)
        self.entries_max = rng.randint(20, 80)
        self.fault_steps = rng.randint(2, 6)
        self.log_writer_count = rng.choice([0, 0, 1, 2])
        self.log_history = LogHistory()
        self.ledgers: list[int] = []
        self.problems: list[str] = []
        self.fragments_checked: dict[int, tuple[LedgerMetadata, list[str]]] = {}
        """Ledger id -> the metadata value :func:`invariants.check_step` last checked the fragments
        of, and what it found (a value is checked once, however many steps find it unchanged)."""
        self.stop = asyncio.Event()
        self.handles: dict[int, LedgerHandle] = {}
        self.tail_reads: list[tuple[int, int, list[tuple[int, bytes]]]] = []
        self.current: dict[str, int] = {}
        """Writer client -> the ledger it writes now."""
        self.think_probability = THINK_PROBABILITY
        self.think_s_max = THINK_S_MAX
        self.faults = FAULTS
        self.gone: set[str] = set()
        """Bookies lost for good: never restarted."""

    def describe(self) -> str:
        return (
            f"bookies={self.bookie_count} writers={self.writer_count} "
            f"ledgers/writer={self.ledgers_per_writer} "
            f"entries<={self.entries_max} fault_steps={self.fault_steps} log_writers={self.log_writer_count}"
        )

    # ------------------------------------------------------------------ workload
    async def writer(self, client: SimClient, rng: random.Random) -> None:
        world = self.world
        history = world.history
        sequence = 0
        for _ in range(self.ledgers_per_writer):
            if self.stop.is_set():
                return
            ensemble, wq, aq = rng.choice(SHAPES)
            try:
                handle = await client.bk.create_ledger(ensemble, wq, aq, password=PASSWORD)
            except BKError as error:
                world.trace(f"{client.name} create {ensemble}/{wq}/{aq} failed: {type(error).__name__}")
                await asyncio.sleep(0.1)
                continue
            lid = handle.id
            self.ledgers.append(lid)
            self.handles[lid] = handle
            self.current[client.name] = lid
            world.trace(
                f"{client.name} created ledger {lid} {ensemble}/{wq}/{aq} "
                f"on {list(handle.metadata.current_ensemble)}"
            )
            pending: set[asyncio.Future[int]] = set()
            sent: list[asyncio.Future[int]] = []
            for _ in range(rng.randint(1, self.entries_max)):
                if self.stop.is_set():
                    break
                value = f"{client.name}-{sequence}".encode()
                sequence += 1
                op = history.invoke(client.name, lid, value)
                try:
                    future = await handle.append_async(value)
                except BKError as error:
                    history.failed(op, error)
                    self.problems += invariants.invalid_proposal(error, f"{client.name}'s add to {lid}")
                    break
                sent.append(future)
                future.add_done_callback(functools.partial(self._done, op, lid, sent, len(sent) - 1))
                pending.add(future)
                future.add_done_callback(pending.discard)
                if len(pending) >= WINDOW or rng.random() < 0.2:
                    done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    if any(not f.cancelled() and f.exception() is not None for f in done):
                        break
                if rng.random() < self.think_probability:  # spread the writes over the fault phase
                    await asyncio.sleep(rng.uniform(0.0, self.think_s_max))
            if pending:
                await asyncio.wait(pending)
            if rng.random() < 0.5:
                try:
                    await handle.close()
                    world.trace(f"{client.name} closed ledger {lid} at {handle.last_add_confirmed}")
                    self.closed_by_writer[lid] = handle.last_add_confirmed
                except BKError as error:
                    world.trace(f"{client.name} close of {lid} failed: {type(error).__name__}")
            else:
                handle.abort()
                world.trace(f"{client.name} left ledger {lid} open")

    closed_by_writer: dict[int, int]

    def _done(
        self, op: AddOp, lid: int, sent: list[asyncio.Future[int]], index: int, future: asyncio.Future[int]
    ) -> None:
        """Record the outcome; an ack while an earlier add of the handle is still pending breaks
        NoOutOfOrderEntries (completion must follow entry order)."""
        history = self.world.history
        if future.cancelled():
            return
        error = future.exception()
        if error is None:
            entry_id = future.result()
            if any(not f.done() for f in sent[:index]):
                self.problems.append(
                    f"NoOutOfOrderEntries: ledger {lid} acked entry {entry_id} "
                    "before an earlier add completed"
                )
            history.ok(op, entry_id)
        else:
            history.failed(op, error)
            self.problems += invariants.invalid_proposal(error, f"{op.writer}'s add to {lid}")

    async def recoverer(self, client: SimClient, rng: random.Random) -> None:
        """Opens ledgers with recovery while their writers may still write."""
        while not self.stop.is_set():
            await asyncio.sleep(rng.uniform(0.2, 1.0))
            if not self.ledgers or self.stop.is_set():
                continue
            lid = rng.choice(self.ledgers)
            try:
                handle = await client.bk.open_ledger(lid, password=PASSWORD, recovery=True)
            except BKError as error:
                self.world.trace(f"{client.name} recovery of {lid} failed: {type(error).__name__}")
                self.problems += invariants.invalid_proposal(error, f"{client.name}'s recovery of {lid}")
                continue
            self.world.trace(f"{client.name} recovered ledger {lid} at {handle.last_add_confirmed}")
            self.world.history.recovered_at(lid, handle.last_add_confirmed)

    async def tailer(self, client: SimClient, rng: random.Random) -> None:
        """Opens ledgers without recovery and reads up to the LAC while writers write: whatever a
        reader sees must still be there, unchanged, once the ledger is closed (checked at the end)."""
        while not self.stop.is_set():
            await asyncio.sleep(rng.uniform(0.05, 0.4))
            if not self.ledgers or self.stop.is_set():
                continue
            lid = rng.choice(self.ledgers)
            try:
                handle = await client.bk.open_ledger(lid, password=PASSWORD)
                lac = handle.last_add_confirmed
                first = rng.randint(0, max(lac, 0))
                entries = [] if lac < 0 else [(e.entry_id, e.payload) async for e in handle.read(first, lac)]
            except BKError as error:
                self.world.trace(f"{client.name} read of {lid} failed: {type(error).__name__}")
                continue
            self.world.trace(f"{client.name} read ledger {lid} [{first}, {lac}]")
            self.tail_reads.append((lid, lac, entries))

    async def log_writer(self, client: SimClient, rng: random.Random) -> None:
        """Becomes the log's writer (fencing the other one) and appends until fenced, then fights
        for the leadership again; every append goes into the log history."""
        sequence = 0
        while not self.stop.is_set():
            try:
                writer = await open_log_writer(
                    client.bk, LOG, password=PASSWORD, roll_entries_max=rng.randint(3, 12)
                )
            except BKError as error:
                self.world.trace(f"{client.name} could not open the log: {type(error).__name__}")
                self.problems += invariants.invalid_proposal(error, f"{client.name}'s open of the log")
                await asyncio.sleep(rng.uniform(0.05, 0.3))
                continue
            self.world.trace(f"{client.name} leads the log (ledger {writer.ledger_id})")
            while not self.stop.is_set():
                record = AppendRecord(client.name, sequence, LogOutcome.INDETERMINATE)
                sequence += 1
                self.log_history.add(record)
                try:
                    position = await writer.append(record.value)
                except BKError as error:
                    record.outcome, record.error = log_outcome_of(error), repr(error)
                    self.world.trace(f"{client.name} log append failed: {type(error).__name__}")
                    break  # fenced (another writer leads) or broken: open the log again
                if position is not None:
                    record.outcome, record.position = LogOutcome.OK, position
                if rng.random() < THINK_PROBABILITY:
                    await asyncio.sleep(rng.uniform(0.0, THINK_S_MAX * 3))
            await asyncio.sleep(rng.uniform(0.0, 0.3))

    def sample_log(self) -> None:
        md = invariants.log_metadata_of(self)
        if md is not None:
            self.log_history.sample(md)

    # ------------------------------------------------------------------ faults
    async def nemesis(self, rng: random.Random, writers: list[SimClient]) -> None:
        world = self.world
        restarts: list[asyncio.Task[None]] = []
        for _ in range(self.fault_steps):
            await asyncio.sleep(rng.uniform(0.05, FAULT_S / self.fault_steps))
            up = [b for b in world.bookies if b.up]
            kind = rng.choice(self.faults)
            if kind == "crash_syncing":  # the durability window: a bookie with a group in flight
                for _ in range(SYNC_WAIT_POLLS_MAX):
                    syncing = [b for b in world.bookies if b.syncing]
                    if syncing:
                        break
                    await asyncio.sleep(SYNC_WAIT_POLL_S)
                up = syncing or up
                kind = "crash"
            if kind in ("crash", "crash2") and up:
                victims = rng.sample(up, min(len(up), 1 if kind == "crash" else 2))
                for bookie in victims:
                    bookie.crash(world.crash_kind())
                    restarts.append(asyncio.create_task(self._restart_later(bookie, rng.uniform(0.05, 0.8))))
            elif kind == "partition":
                client = rng.choice(world.clients)
                bookie = rng.choice(world.bookies)
                world.network.partition(client.name, bookie.name)
                world.trace(f"partition {client.name} | {bookie.name}")
                restarts.append(
                    asyncio.create_task(
                        self._unpartition_later(client.name, bookie.name, rng.uniform(0.1, 1.5))
                    )
                )
            elif kind == "kill":
                conns = list(world.network.connections_of_all())
                if conns:
                    conn = rng.choice(conns)
                    world.trace(f"reset connection {conn.client.node} -> {conn.server.node}")
                    world.network.kill_connection(conn)
            elif kind == "kill_client":
                live = [w for w in writers if w.up]
                if live and rng.random() < 0.5:
                    rng.choice(live).crash()
            elif kind == "slow_link":  # one direction between a client and a bookie gets slow
                ends = [rng.choice(world.clients).name, rng.choice(world.bookies).name]
                rng.shuffle(ends)
                world.network.slow[ends[0], ends[1]] = rng.uniform(0.05, 0.5)
                world.trace(f"slow link {ends[0]} -> {ends[1]}")
                restarts.append(
                    asyncio.create_task(self._fast_later(ends[0], ends[1], rng.uniform(0.2, 1.5)))
                )
            elif kind == "metadata_down":
                world.store.set_unavailable(True)
                world.trace("metadata unavailable")
                restarts.append(asyncio.create_task(self._metadata_back_later(rng.uniform(0.05, 0.5))))
            elif kind == "metadata_unknown":
                applied = rng.random() < 0.5
                world.store.lose_next_write_result(applied=applied)
                world.trace(
                    f"metadata: the next write's answer is lost ({'applied' if applied else 'not applied'})"
                )
            elif kind not in FAULTS:
                self.other_fault(kind, rng, restarts)
            self.check_step()
        await asyncio.gather(*restarts)

    def other_fault(self, kind: str, rng: random.Random, restarts: list[asyncio.Task[None]]) -> None:
        """A fault kind of a profile's own (``self.faults``); its undoing goes to ``restarts``."""
        raise ValueError(f"unknown fault kind {kind!r}")

    async def _restart_later(self, bookie: SimBookie, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        if not bookie.up:
            await self._restart(bookie)

    async def _restart(self, bookie: SimBookie) -> None:
        if bookie.name in self.gone:
            return
        try:
            await bookie.restart()
        except Exception as error:
            self.problems.append(f"bookie {bookie.name} failed to restart from its crashed disk: {error!r}")
            self.world.trace(f"bookie {bookie.name} restart FAILED: {error!r}")

    async def _fast_later(self, sender: str, receiver: str, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        self.world.network.slow.pop((sender, receiver), None)

    async def _metadata_back_later(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        self.world.store.set_unavailable(False)
        self.world.trace("metadata available")

    async def _unpartition_later(self, a: str, b: str, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        self.world.network.unpartition(a, b)
        self.world.trace(f"healed {a} | {b}")

    def check_step(self) -> None:
        self.problems.extend(invariants.check_step(self))
        self.sample_log()

    # ------------------------------------------------------------------ heal and check
    async def heal(self) -> None:
        world = self.world
        world.network.heal()
        world.store.set_unavailable(False)
        world.store.crash_after_ensemble_change_probability = 0.0
        for bookie in world.bookies:
            if not bookie.up:
                await self._restart(bookie)
        world.trace("healed: all bookies up, no partitions")
        recoverers = [world.add_client(f"h{i}") for i in range(2)]
        for lid in sorted(self.ledgers):
            results = await asyncio.gather(
                *(c.spawn(self._recover_until_done(c, lid), f"heal {lid}") for c in recoverers)
            )
            for last in results:
                if last is not None:
                    world.history.recovered_at(lid, last)
        if self.log_writer_count:
            await recoverers[0].spawn(self._log_heal(recoverers[0]), "log heal")
        readers = [world.add_client(f"r{i}") for i in range(2)]
        for lid in sorted(self.ledgers):
            for reader in readers:
                await reader.spawn(self._read_back(reader, lid), f"read {lid}")

    async def _log_heal(self, client: SimClient) -> None:
        """Liveness for the log: a new writer takes it over and appends; then it is read whole."""
        for _ in range(RECOVERY_ATTEMPTS_MAX):
            try:
                writer = await open_log_writer(client.bk, LOG, password=PASSWORD)
                record = AppendRecord(client.name, 0, LogOutcome.INDETERMINATE)
                self.log_history.add(record)
                position = await writer.append(record.value)
                record.outcome, record.position = LogOutcome.OK, position
                await writer.close()
                break
            except BKError as error:
                self.world.trace(f"{client.name} log takeover failed: {type(error).__name__}: {error}")
                self.problems += invariants.invalid_proposal(error, f"{client.name}'s log takeover")
                await asyncio.sleep(0.2)
        else:
            self.problems.append(f"liveness: the log was not writable after {RECOVERY_ATTEMPTS_MAX} attempts")
            return
        self.sample_log()
        try:
            read = [record async for record in await open_log_reader(client.bk, LOG, password=PASSWORD)]
        except BKError as error:
            self.problems.append(f"log: reading it back failed: {error!r}")
            return
        result = self.log_history.check(read, open_max=2)
        self.world.trace(f"log: {result.summary()}")
        self.problems.extend(f"log: {violation}" for violation in result.violations)

    async def _recover_until_done(self, client: SimClient, lid: int) -> int | None:
        for _ in range(RECOVERY_ATTEMPTS_MAX):
            try:
                handle = await client.bk.open_ledger(lid, password=PASSWORD, recovery=True)
            except BKError as error:
                self.world.trace(f"{client.name} recovery of {lid} failed: {type(error).__name__}: {error}")
                self.problems += invariants.invalid_proposal(error, f"{client.name}'s recovery of {lid}")
                await asyncio.sleep(0.2)
                continue
            self.world.trace(f"{client.name} recovered ledger {lid} at {handle.last_add_confirmed}")
            return handle.last_add_confirmed
        self.problems.append(f"liveness: ledger {lid} not recovered after {RECOVERY_ATTEMPTS_MAX} attempts")
        return None

    async def _read_back(self, client: SimClient, lid: int) -> None:
        history = self.world.history
        try:
            reader = await client.bk.open_ledger(lid, password=PASSWORD)
            history.lac_seen(lid, reader.last_add_confirmed)
            last = reader.last_add_confirmed
            entries = [] if last < 0 else [(e.entry_id, e.payload) async for e in reader.read(0, last)]
        except BKError as error:
            self.problems.append(f"AllAckedEntriesAreReadable: reading ledger {lid} failed: {error!r}")
            return
        history.read_back(lid, entries)

    async def run(self) -> None:
        world = self.world
        self.closed_by_writer = {}
        await self.start_world()
        writers = [world.add_client(f"w{i}") for i in range(self.writer_count)]
        recoverer = world.add_client("rec")
        tasks = [(w, w.spawn(self.writer(w, world.rng_for("writer", w.name)), "writer")) for w in writers]
        recovering = recoverer.spawn(self.recoverer(recoverer, world.rng_for("recoverer")), "recoverer")
        log_writers = [world.add_client(f"lw{i}") for i in range(self.log_writer_count)]
        logging_tasks = [
            (w, w.spawn(self.log_writer(w, world.rng_for("log writer", w.name)), "log writer"))
            for w in log_writers
        ]
        tailer = world.add_client("tail")
        tailing = tailer.spawn(self.tailer(tailer, world.rng_for("tailer")), "tailer")
        world.store.crash_after_ensemble_change_probability = CRASH_AFTER_ENSEMBLE_CHANGE_PROBABILITY
        await self.nemesis(world.rng_for("nemesis"), [*writers, *log_writers])
        await asyncio.sleep(0.2)
        self.stop.set()
        for writer, task in tasks:  # a crashed writer's task never ends: wait for the live ones only
            if writer.up:
                await self._finish(task, f"writer {writer.name}")
        await self._finish(recovering, "recoverer")
        await self._finish(tailing, "tailer")
        for writer, task in logging_tasks:
            if writer.up:
                await self._finish(task, f"log writer {writer.name}")
        await self.heal()
        self.problems.extend(await invariants.check_final(self))

    async def start_world(self) -> None:
        for _ in range(self.bookie_count):
            await self.world.add_bookie().start()

    async def _finish(self, task: asyncio.Task[None], what: str) -> None:
        done, _ = await asyncio.wait([task], timeout=WORKLOAD_END_S_MAX)
        if not done:
            self.problems.append(f"liveness: {what} still busy {WORKLOAD_END_S_MAX} s after the faults")
        elif task.exception() is not None:
            self.problems.append(f"{what} crashed: {task.exception()!r}")


def run_seed(
    seed: int,
    bugs: tuple[str, ...] = (),
    profile: type[Scenario] | None = None,
    *,
    process_kills: bool = True,
) -> Outcome:
    """Run one seed to the end; never raises for what the simulated system did (problems do).
    ``bugs``: ``bug.*`` failpoint switches to plant (bookkeeper_aio/common/failpoints.py);
    ``profile``: the scenario class (default :class:`Scenario`; tests/simulation/race.py);
    ``process_kills``: off, every crash is a power cut (the seeds found before process kills existed
    replay that way)."""
    # What earlier seeds left (their worlds, unreachable once run_seed returned: all in the young
    # generations, see below) is finalized now, outside this seed's trace.
    gc.collect(1)
    world = World(seed)
    if not process_kills:
        world.process_kill_probability = 0.0
    scenario = (profile or Scenario)(world)
    world.trace(
        f"seed {seed}: {scenario.describe()}"
        + (f" bugs={','.join(bugs)}" if bugs else "")
        + ("" if process_kills else " (power cuts only)")
    )
    saved_logs = capture_logs(world.trace)
    saved_failpoints = ",".join(f"{name}={action}" for name, action in failpoints._active.items())
    failpoints.configure(",".join(f"{bug}=on" for bug in bugs))
    saved_keys = client_bookkeeper.NewLedgerKeys
    saved_hash = ServerConnection.__dict__.get("__hash__")
    ServerConnection.__hash__ = stable_hash  # type: ignore[method-assign,assignment]
    client_keys.clear_cache()  # process-wide: a derivation cached by an earlier run skips a loop step
    client_bookkeeper.NewLedgerKeys = SimLedgerKeys(world)  # type: ignore[misc,assignment]
    backoff._SHARED_RNG.seed(f"{seed}/backoff")  # the one process-wide RNG of the production code
    asyncio.set_event_loop(world.loop)
    # The garbage collector runs no finalizer in the middle of a seed: when it ran depended on what
    # the process had allocated before (earlier seeds), and a collected coroutine's `finally` (or an
    # earlier seed's, collected now) could log into this trace or touch this loop: the same seed gave
    # another trace after other seeds (general seed 64 after 40..63, with a low GC threshold).
    # Everything a seed leaves is collected at its end, at a fixed point. With the collector off,
    # every object of the seed is still in the youngest generation then: collecting that one is
    # enough (a full collection of the process's objects twice a seed was a quarter of its CPU).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    wall_start = time.perf_counter()
    cpu_start = time.process_time()
    cut = False
    try:
        main = world.loop.create_task(scenario.run(), name="scenario")
        try:
            world.loop.run_until_complete(asyncio.wait_for(main, RUN_S_MAX))
        except Cut:
            cut = True
        except (Deadlock, Livelock) as error:
            scenario.problems.append(f"liveness: {type(error).__name__.lower()} ({error})")
        except TimeoutError:
            scenario.problems.append(f"liveness: the run did not end within {RUN_S_MAX} simulated seconds")
        except Exception as error:  # the scenario itself (or an unexpected error class) broke: report it
            scenario.problems.append(f"scenario: {''.join(traceback.format_exception(error))}")
        _shutdown(world)
        gc.collect(0)
    finally:
        if gc_was_enabled:
            gc.enable()
        wall_s = time.perf_counter() - wall_start
        cpu_s = time.process_time() - cpu_start
        structlog.configure(**saved_logs)
        failpoints.configure(saved_failpoints)
        client_bookkeeper.NewLedgerKeys = saved_keys  # type: ignore[misc]
        if saved_hash is None:
            del ServerConnection.__hash__  # inherited again
        else:
            ServerConnection.__hash__ = saved_hash  # type: ignore[method-assign]
        asyncio.set_event_loop(None)
    problems = scenario.problems + [f"loop: {e}" for e in world.loop.errors]
    if not cut:  # a cut run stopped mid-way: its adds are not over, nothing to judge
        problems += history_problems(world)
    counts = world.history.counts()
    world.trace(f"end: {counts} problems={len(problems)}")
    for problem in problems:
        world.trace(f"PROBLEM {problem}")
    return Outcome(
        seed,
        world.trace.text(),
        problems,
        world.loop.time(),
        wall_s,
        counts["ok"],
        len(scenario.ledgers),
        callbacks=world.loop.callbacks_run,
        counts=counts,
        cpu_s=cpu_s,
        cut=cut,
    )


def history_problems(world: World) -> list[str]:
    return [f"history: {p}" for p in world.history.check()]


def _shutdown(world: World) -> None:
    """End every node without running its code further (no graceful close: the world just stops).
    Each unfinished coroutine is closed here, at a fixed point after the trace is complete, rather
    than by the garbage collector later."""
    for node in [*world.bookies, *world.clients]:
        node.incarnation.dead = True
    loop = world.loop
    for task in asyncio.all_tasks(loop):
        with contextlib.suppress(BaseException):
            task.get_coro().close()
    loop.dropped.clear()
    loop.close()
