"""The race profile: a small world with dense faults around recoveries racing their writers.

The general scenario (tests/simulation/scenario.py) spreads faults over many ledgers and clients.
The two protocol bugs BookKeeper's TLA+ model found (#2614, #2615) need several things at once,
around one recovery, which a sparse schedule seldom lines up. This profile is the TLA+ model's
ground instead: one writer at a time, short ledgers, and every fault aimed at the ledger being
written or recovered:

- **Failover**: a recoverer watches the writer and recovers its ledger once an add has been stuck
  for ``stuck_s`` (drawn per seed), or now and then at random: recovery races a live writer that
  is still adding.
- **Writer faults**: partitions and slow links between the writer and members of its ensemble
  (its adds stall on some bookies and arrive later; a partitioned member's network is often flaky
  for the recoverer too: its next message there is lost), crashes of one or two members (ensemble
  changes replacing one or two bookies at once), and the writer dying right after the CAS of an
  ensemble change (a last fragment with nothing in it).
- **Disk faults**: a member's next journal write or fdatasync fails (EIO, ENOSPC): its journal
  fails, what it had not acknowledged is refused, and it goes read-only until the heal restarts it
  from a power-cut image of its disk.
- **Bit rot**: a byte of one stored entry on one member reads back flipped (at most one replica
  of an entry; often a member's last entry of the ledger, which a fence then meets): the bookie
  must answer EIO, never "no such entry", and readers use another one; its fence still counts.
- **Recovery faults** (armed as each recovery starts, like FoundationDB's buggify): the next
  message from the recoverer to a member of the last fragment is lost with its connection (a
  lost fence), and members answer the recoverer slowly.
- The client's speculative read delay (0 asks every replica at once) and its first reconnect
  backoff are drawn per seed, and so is the latency of the failover client's links (it runs in
  another zone: up to ``remote_s`` each way).

A crashed writer is replaced by a fresh writer client, so a seed keeps writing through its fault
phase. The heal, the read-back and the checks are the general scenario's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import functools
import os
import random

from bookie.journal_format import segment_name
from bookkeeper_aio import BKError
from bookkeeper_aio.client.ledger import HandleState
from metadata.ledger_metadata import LedgerState
from tests.simulation import invariants
from tests.simulation.loop import NODE
from tests.simulation.scenario import Scenario
from tests.simulation.world import PASSWORD, SimClient, World

_WRITABLE = HandleState.WRITABLE  # once: an enum member is a slow lookup on Python 3.11

RACE_FAULTS = [
    "partition_writer",
    "partition_writer",
    "slow_writer",
    "crash",
    "crash2",
    "kill",
    "kill_writer",
    "disk_error",
    "bit_rot",
]
CRASH_AFTER_ENSEMBLE_CHANGE_PROBABILITY = 0.8
LOSE_PROBABILITY = 0.8
SLOW_PROBABILITY = 0.6
FLAP_PROBABILITY = 0.5
FLAKY_PROBABILITY = 0.5
RANDOM_RECOVERY_PROBABILITY = 0.02
WRITER_RESTARTS_MAX = 6
LEDGERS_MAX = 100
RECOVER_ON_NEW_FRAGMENT_PROBABILITY = 0.5


class RaceScenario(Scenario):
    PROFILE = "race"

    def __init__(self, world: World) -> None:
        super().__init__(world)
        rng = world.rng_for("race shape")
        self.rng = rng
        self.bookie_count = rng.randint(4, 5)
        self.writer_count = 1
        self.ledgers_per_writer = LEDGERS_MAX  # until the fault phase ends
        self.entries_max = rng.randint(4, 30)
        self.think_probability = rng.uniform(0.2, 0.9)
        self.think_s_max = rng.uniform(0.005, 0.06)
        self.fault_steps = rng.randint(10, 30)
        self.fault_s = rng.uniform(1.0, 2.5)
        self.log_writer_count = 0
        self.stuck_s = rng.uniform(0.01, 0.3)
        self.poll_s = rng.uniform(0.005, 0.03)
        self.speculative_ms = rng.choice([0, 2, 10, 50])
        self.reconnect_s = rng.choice([0.001, 0.005, 0.02])
        self.remote_s = rng.choice([0.002, 0.01, 0.03])
        world.disk_check_interval_s = rng.uniform(0.05, 0.5)
        world.client_config = dataclasses.replace(
            world.client_config,
            speculative_read_delay_ms=self.speculative_ms,
            reconnect_backoff_initial_s=self.reconnect_s,
        )
        self.writers: list[SimClient] = []
        self.failover_client: SimClient | None = None
        self.rotten_entries: dict[tuple[int, int], tuple[str, str, int]] = {}
        """(ledger, entry) -> (bookie, journal segment path, offset) of its one rotten replica."""
        self.failover_rng = world.rng_for("new fragment")

    def describe(self) -> str:
        return (
            f"profile=race bookies={self.bookie_count} entries<={self.entries_max} "
            f"think_s<={self.think_s_max:.3f} fault_steps={self.fault_steps} fault_s={self.fault_s:.2f} "
            f"stuck_s={self.stuck_s:.3f} speculative_ms={self.speculative_ms} reconnect_s={self.reconnect_s} "
            f"remote_s={self.remote_s}"
        )

    # ------------------------------------------------------------------ the writer, restarted
    async def writer_process(self) -> None:
        """One writer client at a time; a crashed one is replaced by a new client."""
        world = self.world
        for generation in range(WRITER_RESTARTS_MAX):
            if self.stop.is_set():
                return
            client = world.add_client(f"w{generation}")
            self.writers.append(client)
            writing = self.writer(client, world.rng_for("writer", client.name))
            try:  # a crashed client's task never ends: run_alive returns at its crash
                if await client.run_alive(writing, "writer"):
                    return
            except Exception as error:
                self.problems.append(f"writer {client.name} crashed: {error!r}")
                return
            await asyncio.sleep(0.02)

    # ------------------------------------------------------------------ failover
    def _writing(self) -> list[tuple[str, int]]:
        """(writer, ledger) of every live writer's open handle with adds outstanding or not."""
        out = []
        for client in self.writers:
            lid = self.current.get(client.name)
            handle = self.handles.get(lid) if lid is not None else None
            if client.up and handle is not None and handle.state is _WRITABLE:
                out.append((client.name, handle.id))
        return out

    async def failover(self, client: SimClient, rng: random.Random) -> None:
        """Recover the ledger of a writer that looks stuck (or, now and then, any open one)."""
        watched: dict[int, tuple[int, float]] = {}  # ledger -> (LAC, when it last moved)
        loop = self.world.loop
        while not self.stop.is_set():
            await asyncio.sleep(self.poll_s)
            target = None
            for _, lid in self._writing():
                handle = self.handles[lid]
                lac, since = watched.get(lid, (handle.last_add_confirmed, loop.time()))
                if handle.last_add_confirmed != lac or not handle.pending_adds:
                    lac, since = handle.last_add_confirmed, loop.time()
                watched[lid] = (lac, since)
                if loop.time() - since >= self.stuck_s:
                    target = lid
            if target is None and self.ledgers and rng.random() < RANDOM_RECOVERY_PROBABILITY:
                target = rng.choice(self.ledgers)
            if target is None:
                continue
            if await self.recover(client, target, rng):
                watched.pop(target, None)

    async def recover(self, client: SimClient, lid: int, rng: random.Random) -> bool:
        md = invariants.metadata_of(self, lid)
        if md is None or md.state is LedgerState.CLOSED:
            return False
        self.arm_recovery_faults(client.name, md.current_ensemble, rng)
        try:
            handle = await client.bk.open_ledger(lid, password=PASSWORD, recovery=True)
        except BKError as error:
            self.world.trace(f"{client.name} recovery of {lid} failed: {type(error).__name__}: {error}")
            self.problems += invariants.invalid_proposal(error, f"{client.name}'s recovery of {lid}")
            return False
        self.world.trace(f"{client.name} recovered ledger {lid} at {handle.last_add_confirmed}")
        self.world.history.recovered_at(lid, handle.last_add_confirmed)
        return True

    def new_fragment(self, key: str) -> None:
        """A writer's ensemble change just landed: now and then a recovery starts at once, racing
        the writer's re-sends to the new bookies."""
        client, rng = self.failover_client, self.failover_rng
        node = NODE.get()
        if client is None or self.stop.is_set() or node is None or not node.name.startswith("w"):
            return
        if rng.random() < RECOVER_ON_NEW_FRAGMENT_PROBABILITY:
            lid = int(key.rsplit("/", 1)[1])
            self.world.trace(f"{client.name} recovers ledger {lid} as its new fragment lands")
            client.spawn(self.recover(client, lid, rng), f"recover {lid}")

    def arm_recovery_faults(self, recoverer: str, ensemble: tuple[str, ...], rng: random.Random) -> None:
        """A member with a flaky network: the recoverer's next message to it is lost (its
        connection resets), and its links to the writers stall for a moment (what the writers
        had in flight to it arrives late); other members answer the recoverer slowly."""
        network = self.world.network
        if rng.random() < LOSE_PROBABILITY:
            bookie = rng.choice(ensemble)
            network.lose_next(recoverer, bookie)
            self.world.trace(f"armed: the next message {recoverer} -> {bookie} is lost")
            if rng.random() < FLAP_PROBABILITY:
                flap_s = rng.uniform(0.002, 0.2)
                for writer in self.writers:
                    if writer.up:
                        network.partition(writer.name, bookie)
                        self.world.trace(f"partition {writer.name} | {bookie} for {flap_s:.3f} s")
                        self.later(flap_s, functools.partial(network.unpartition, writer.name, bookie))
        if rng.random() < SLOW_PROBABILITY:
            bookie = rng.choice(ensemble)
            network.slow[bookie, recoverer] = rng.uniform(0.02, 0.3)
            self.world.trace(f"slow link {bookie} -> {recoverer}")
            self.later(rng.uniform(0.1, 0.6), functools.partial(self._remote_again, bookie, recoverer))

    def _remote_again(self, bookie: str, recoverer: str) -> None:
        if not self.stop.is_set():
            self.world.network.slow[bookie, recoverer] = self.remote_s

    # ------------------------------------------------------------------ faults
    def later(self, delay_s: float, action: object) -> None:
        assert callable(action)
        self.world.loop.call_later(delay_s, action)

    async def nemesis(self, rng: random.Random, writers: list[SimClient]) -> None:
        world = self.world
        restarts: list[asyncio.Task[None]] = []
        for _ in range(self.fault_steps):
            await asyncio.sleep(rng.uniform(0.01, 2 * self.fault_s / self.fault_steps))
            writing = self._writing()
            members: list[str] = []
            writer = None
            if writing:
                writer, lid = rng.choice(writing)
                md = invariants.metadata_of(self, lid)
                if md is not None:
                    members = list(md.current_ensemble)
            if not members:
                members = [b.name for b in world.bookies]
            kind = rng.choice(RACE_FAULTS)
            if kind in ("partition_writer", "slow_writer", "kill_writer") and writer is None:
                kind = "crash"
            if kind == "partition_writer":
                assert writer is not None
                bookie = rng.choice(members)
                world.network.partition(writer, bookie)
                world.trace(f"partition {writer} | {bookie}")
                if rng.random() < FLAKY_PROBABILITY:  # the bookie's network is flaky for others too
                    world.network.lose_next("rec", bookie)
                    world.trace(f"armed: the next message rec -> {bookie} is lost")
                restarts.append(
                    asyncio.create_task(self._unpartition_later(writer, bookie, rng.uniform(0.05, 0.8)))
                )
            elif kind == "slow_writer":
                assert writer is not None
                bookie = rng.choice(members)
                world.network.slow[writer, bookie] = rng.uniform(0.05, 0.6)
                world.trace(f"slow link {writer} -> {bookie}")
                restarts.append(asyncio.create_task(self._fast_later(writer, bookie, rng.uniform(0.1, 1.0))))
            elif kind in ("crash", "crash2"):
                up = [b for b in world.bookies if b.up and b.name in members]
                victims = rng.sample(up, min(len(up), 1 if kind == "crash" else 2))
                for bookie in victims:
                    bookie.crash(world.crash_kind())
                    restarts.append(asyncio.create_task(self._restart_later(bookie, rng.uniform(0.05, 0.8))))
            elif kind == "kill_writer":  # the writer's connection to a member resets: it replaces it
                conns = [c for c in world.network.connections_of(writer or "") if c.server.node in members]
                if conns:
                    conn = rng.choice(conns)
                    world.trace(f"reset connection {conn.client.node} -> {conn.server.node}")
                    world.network.kill_connection(conn)
            elif kind == "disk_error":  # a member's next journal write or fdatasync fails
                up = [b for b in world.bookies if b.up and b.name in members and b.fileio is not None]
                if up:
                    bookie = rng.choice(up)
                    step, code = rng.choice(["write", "sync"]), rng.choice([errno.EIO, errno.ENOSPC])
                    assert bookie.fileio is not None
                    bookie.fileio.fail_next = (step, code)
                    world.trace(
                        f"disk of {bookie.name}: the next journal {step} fails ({errno.errorcode[code]})"
                    )
            elif kind == "bit_rot":
                self.rot_one(rng, members)
            elif kind == "kill":
                conns = list(world.network.connections_of_all())
                if conns:
                    conn = rng.choice(conns)
                    world.trace(f"reset connection {conn.client.node} -> {conn.server.node}")
                    world.network.kill_connection(conn)
            self.check_step()
        await asyncio.gather(*restarts)

    def rot_one(self, rng: random.Random, members: list[str]) -> None:
        """Flip a byte of one stored entry on one member, as its reads see it; one replica of an
        entry at most (another must stay readable), any number of entries and bookies per ledger.
        Half the time the entry is the member's last one of the ledger: a fence then finds that
        bookie's last entry unreadable. Before docs/protocol.md §7.2's fenced-but-unreadable
        answer such a bookie answered the fence EIO, proving nothing, and two of them in a
        3-bookie ensemble left a ledger no recovery could fence (race seed 22 of the first
        version; the profile kept one rotten bookie per ledger until the fix)."""
        candidates = []
        last_entries = []
        for bookie in self.world.bookies:
            server = bookie.server
            if not bookie.up or bookie.name not in members or server is None or server.storage is None:
                continue
            for lid in sorted(server.storage.ledgers):
                if lid not in self.handles:
                    continue
                index = server.storage.ledgers[lid].index
                last = index.last_entry_id
                for entry_id in range(max(last, -1) + 1):
                    location = index.get(entry_id)
                    if location is not None and (lid, entry_id) not in self.rotten_entries:
                        candidates.append((bookie, lid, entry_id, location))
                        if entry_id == last:
                            last_entries.append(candidates[-1])
        if not candidates:
            return
        if last_entries and rng.random() < 0.5:
            candidates = last_entries
        bookie, lid, entry_id, location = rng.choice(candidates)
        assert bookie.server is not None
        assert bookie.server.storage is not None
        path = os.path.join(bookie.server.storage._journal_dir, segment_name(location.segment_id))
        at = location.offset + rng.randrange(location.length)
        bookie.disk.rot.setdefault(path, set()).add(at)
        self.rotten_entries[lid, entry_id] = (bookie.name, path, at)
        self.world.trace(f"bit rot: {bookie.name} ledger {lid} entry {entry_id} (byte {at} of {path})")

    async def heal(self) -> None:
        """A bookie whose journal failed stays read-only until it restarts: the operator restarts
        it (from what its disk holds after a power cut: what the failed sync did not make durable
        may be gone), then the general heal. A disk fault armed in the fault phase that has not
        fired yet is disarmed first: the heal injects nothing (race seed 67: an EIO armed on b0
        fired on the heal's fence, after the restarts, and b0 stayed unfenceable for good)."""
        for bookie in self.world.bookies:
            if bookie.fileio is not None:
                bookie.fileio.fail_next = None
            if bookie.up and bookie.fileio is not None and bookie.fileio.errors_raised:
                bookie.crash()
        await super().heal()

    # ------------------------------------------------------------------ the run
    async def run(self) -> None:
        world = self.world
        self.closed_by_writer = {}
        for _ in range(self.bookie_count):
            await world.add_bookie().start()
        writing = asyncio.ensure_future(self.writer_process())
        failover = self.failover_client = world.add_client("rec")
        for bookie in world.bookies:  # the failover client is in another zone: slower, uneven links
            world.network.slow[bookie.name, failover.name] = self.remote_s
            world.network.slow[failover.name, bookie.name] = self.remote_s
        world.store.on_new_fragment = self.new_fragment
        failing_over = failover.spawn(self.failover(failover, world.rng_for("failover")), "failover")
        world.store.crash_after_ensemble_change_probability = CRASH_AFTER_ENSEMBLE_CHANGE_PROBABILITY
        await self.nemesis(world.rng_for("race nemesis"), [])
        await asyncio.sleep(0.1)
        self.stop.set()
        await self._finish(writing, "writers")  # type: ignore[arg-type]
        await self._finish(failing_over, "failover")
        await self.heal()
        self.problems.extend(await invariants.check_final(self))
        self.problems.extend(await invariants.rot_problems(self, self.rotten_entries))
