"""Exhaustive mode: every delivery order of a tiny world, with state hashing (a TLC-like check of
the real code).

The world: 3 bookies, a writer that creates a ledger (E = Qw = 3, Qa = 2) and pipelines 1 or 2
entries, and a recoverer that opens it with recovery as soon as it exists (the bookies' start and
the ledger's creation run in one fixed order; the exploration starts once the ledger exists) —
under a fault plan: none, or the recoverer's first message to one bookie is lost with its
connection (a lost fence), one search per plan. Nothing else is
random: network and disk latencies are fixed, every RNG of the world gives constants.

What is enumerated: the loop's choice points. Whenever callbacks of several parties are ready at
once, the explorer picks which party runs next (a party is one node's ready callbacks, in their
FIFO order, or one connection's delivery); the others stay ready: every interleaving of deliveries
and processing steps across nodes and connections, not the (equivalent) orders of one node's own
ready callbacks. The
search is a depth-first walk over choice sequences, each run re-executed from scratch (stateless
model checking): the first run takes choice 0 everywhere, each next run the next untried
alternative of the deepest choice point.

State hashing: at each choice point reached past the replayed prefix, a digest of the global
state — every bookie's ledgers (fenced bit, LAC, entry ids), the metadata store, the bytes in
flight on each connection, each bookie's file sizes (written, synced) and journal queue, the
virtual time, the number of callbacks run so far, the ready callbacks and the timers (which party, what
code), every live task's coroutine stack (function and line: where the
code is, though not whose), the writer's and the history's outcomes — is looked up; a digest seen before
ends the run there (its continuations were, or are being, explored). The digest abstracts: local
variables and protocol objects' fields are not in it, so two states that differ only there count as one
(the price of a search that ends).

Each complete run then heals (recovery by a fresh client, in a fixed order) and runs the same
final invariants and history checks as the seeded sweeps; each new state runs the step
invariants. With ``bug.recovery_read_without_fence`` (#2614) switched on it must find the
acknowledged entry a recovery truncated.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import random
import time
from dataclasses import dataclass, field
from typing import Any

from bookkeeper_aio import BKError
from tests.simulation import invariants
from tests.simulation.loop import NODE, Cut, SimLoop
from tests.simulation.network import Pipe
from tests.simulation.scenario import Scenario, run_seed
from tests.simulation.world import PASSWORD, SimClient, World

WRITE_QUORUM = 3
ACK_QUORUM = 2
BOOKIES = 3


class ConstantRandom(random.Random):
    """An RNG that always says the same: the exhaustive world's only choices are the explorer's."""

    def random(self) -> float:
        return 0.5

    def getrandbits(self, k: int) -> int:
        return 0

    def _randbelow(self, n: int) -> int:  # type: ignore[override]
        return 0


@dataclass
class Search:
    """The state of one exploration, shared by its runs."""

    visited: dict[bytes, int] = field(default_factory=dict)
    """State digest -> the most deviations still allowed when it was reached (a state reached
    again with no more allowed has nothing new below it)."""
    states: int = 0
    """Choice points reached in new territory (each one's state hashed)."""
    cuts: int = 0
    """Runs ended at a state already explored."""


class Explorer:
    """The choices of one run: ``prefix`` replayed, then choice 0; records what it took."""

    def __init__(self, search: Search, prefix: list[int], deviations_max: int) -> None:
        self.search = search
        self.prefix = prefix
        self.deviations_max = deviations_max
        self.taken: list[tuple[int, int]] = []
        self.scenario: ExhaustiveScenario | None = None

    def deviations(self) -> int:
        return sum(1 for choice, _ in self.taken if choice)

    def choose(self, n: int) -> int:
        depth = len(self.taken)
        choice = self.prefix[depth] if depth < len(self.prefix) else 0
        self.taken.append((choice, n))
        return choice

    def order(self, loop: SimLoop, batch: list[Any]) -> list[Any]:
        """What of a ready batch runs now: one party's callbacks (in their FIFO order), chosen;
        the other parties' stay ready for the next step (before anything scheduled meanwhile).
        One party per step, with the state looked up before each: two independent steps taken
        in either order reach the same state, and the second way in is cut there."""
        parties: dict[str, list[Any]] = {}
        for handle in batch:
            parties.setdefault(_party(handle), []).append(handle)
        if len(parties) == 1:
            return batch
        if len(self.taken) >= len(self.prefix):  # past the replay: a new state, or a known one
            self._visit(loop)
        names = sorted(parties)
        chosen = names[self.choose(len(names))]
        loop._ready.extend(h for h in batch if _party(h) != chosen)
        return parties[chosen]

    def _visit(self, loop: SimLoop) -> None:
        assert self.scenario is not None
        digest = state_digest(self.scenario, loop)
        search = self.search
        left = self.deviations_max - self.deviations()
        seen = search.visited.get(digest)
        if seen is not None and seen >= left:
            search.cuts += 1
            raise Cut("state already explored")
        if seen is None:
            search.states += 1
        search.visited[digest] = left
        self.scenario.problems.extend(invariants.check_step(self.scenario))


def _party(handle: Any) -> str:
    callback = handle._callback
    owner = getattr(callback, "__self__", None)
    if isinstance(owner, Pipe):
        return f"net {owner.sender.node}>{owner.receiver.node}"
    context = handle._context
    node = context.get(NODE) if context is not None else None
    return f"node {node.name if node is not None else '-'}"


def _stack(coro: Any) -> tuple[tuple[str, int], ...]:
    frames = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        if frame is None:
            break
        frames.append((frame.f_code.co_qualname, frame.f_lineno))
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
    return tuple(frames)


def _name(callback: Any) -> str:
    owner = getattr(callback, "__self__", None)
    if isinstance(owner, asyncio.Task):
        return "step " + repr(_stack(owner.get_coro()))
    return getattr(callback, "__qualname__", type(callback).__name__)


def state_digest(scenario: Scenario, loop: SimLoop) -> bytes:
    """The abstract global state (see the module docstring) as a digest."""
    world = scenario.world
    parts: list[Any] = []
    for bookie in world.bookies:
        server = bookie.server
        ledgers = []
        if bookie.up and server is not None and server.storage is not None:
            for lid, state in sorted(server.storage.ledgers.items()):
                index = state.index
                entries = tuple(e for e in range(index.last_entry_id + 1) if index.get(e) is not None)
                ledgers.append((lid, state.fenced, state.lac, entries))
        files = tuple(sorted((path, len(f.data), len(f.synced)) for path, f in bookie.disk.files.items()))
        queued = tuple(len(w._queue) for w in bookie.threads.workers) if bookie.threads else ()
        parts.append((bookie.name, bookie.up, tuple(ledgers), files, queued))
    parts.append(tuple(sorted((key, kv.version, kv.value) for key, kv in world.store._data.items())))
    wire = []
    for conn in world.network.connections_of_all():
        for pipe in (conn.to_server, conn.to_client):
            queued = tuple(data if isinstance(data, bytes) else repr(type(data)) for _, data in pipe.queue)
            wire.append((pipe.sender.node, pipe.receiver.node, pipe.closed, queued))
    parts.append(tuple(sorted(wire, key=repr)))
    # where each task's code is (Python 3.11 gives no task's context: the stacks say whose)
    parts.append(tuple(sorted((_stack(task.get_coro()) for task in asyncio.all_tasks(loop)), key=repr)))
    parts.append(tuple((op.writer, op.value, op.outcome, op.entry_id) for op in world.history.adds))
    # what is about to run, and when: the ready callbacks and the timers (virtual time included:
    # fixed latencies make it the count of sequential disk syncs and timeouts on the path)
    parts.append(round(loop.time(), 9))
    parts.append(loop.callbacks_run)  # progress: the same events in another order count the same
    parts.append(tuple(sorted((_party(h), _name(h._callback)) for h in loop._ready if not h._cancelled)))
    timers = (
        (round(t._when, 9), _party(t), _name(t._callback))
        for t in (due.handle for due in loop._scheduled)
        if not t._cancelled
    )
    parts.append(tuple(sorted(timers)))
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


class ExhaustiveScenario(Scenario):
    """The tiny world (module docstring). ``explorer`` and ``entries`` are set per run."""

    PROFILE = "exhaustive"
    explorer: Explorer | None = None
    entries = 1
    lost: str | None = None
    """The fault plan: the bookie whose first message from the recoverer is lost (its fence)."""

    def __init__(self, world: World) -> None:
        constant = ConstantRandom()
        world.rng_for = lambda *what: ConstantRandom()  # type: ignore[method-assign]
        world.network.rng = constant
        super().__init__(world)
        self.bookie_count = BOOKIES
        self.log_writer_count = 0
        explorer = type(self).explorer
        assert explorer is not None
        explorer.scenario = self

    def describe(self) -> str:
        return (
            f"profile=exhaustive bookies={BOOKIES} entries={self.entries} qw={WRITE_QUORUM} qa={ACK_QUORUM}"
        )

    async def run(self) -> None:
        world = self.world
        self.closed_by_writer = {}
        for _ in range(BOOKIES):
            await world.add_bookie().start()
        writer = world.add_client("w0")
        recoverer = world.add_client("rec")
        created = asyncio.Event()
        writing = writer.spawn(self._write(writer, created), "writer")
        recovering = recoverer.spawn(self._recover(recoverer, created), "recoverer")
        await asyncio.wait([writing, recovering])
        world.loop.explorer = None  # the heal and the checks run in one fixed order
        for task, what in ((writing, "writer"), (recovering, "recoverer")):
            if task.exception() is not None:
                self.problems.append(f"{what} crashed: {task.exception()!r}")
        handle = self.handles.get(self.ledgers[0]) if self.ledgers else None
        if handle is not None:
            handle.abort()
        await self.heal()
        self.problems.extend(await invariants.check_final(self))

    async def _write(self, client: SimClient, created: asyncio.Event) -> None:
        world = self.world
        handle = await client.bk.create_ledger(BOOKIES, WRITE_QUORUM, ACK_QUORUM, password=PASSWORD)
        self.ledgers.append(handle.id)
        self.handles[handle.id] = handle
        self.current[client.name] = handle.id
        self.world.loop.explorer = type(self).explorer  # the race starts: explore from here on
        created.set()
        sent: list[asyncio.Future[int]] = []
        for i in range(self.entries):
            op = world.history.invoke(client.name, handle.id, f"{client.name}-{i}".encode())
            try:
                future = await handle.append_async(op.value)
            except BKError as error:
                world.history.failed(op, error)
                break
            sent.append(future)
            future.add_done_callback(functools.partial(self._done, op, handle.id, sent, len(sent) - 1))
        if sent:
            await asyncio.wait(sent)

    async def _recover(self, client: SimClient, created: asyncio.Event) -> None:
        await created.wait()
        lid = self.ledgers[0]
        if self.lost is not None:
            self.world.network.lose_next(client.name, self.lost)
        try:
            handle = await client.bk.open_ledger(lid, password=PASSWORD, recovery=True)
        except BKError as error:
            self.world.trace(f"{client.name} recovery of {lid} failed: {type(error).__name__}")
            self.problems += invariants.invalid_proposal(error, f"{client.name}'s recovery of {lid}")
            return
        self.world.history.recovered_at(lid, handle.last_add_confirmed)


@dataclass
class Report:
    entries: int
    bugs: tuple[str, ...]
    lost: str | None
    deviations_max: int
    runs: int = 0
    complete_runs: int = 0
    states: int = 0
    cuts: int = 0
    complete: bool = False
    """The whole tree was walked within the bound."""
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    choices: list[int] = field(default_factory=list)
    """The choice sequence of the first run with a problem (replay with explore_one)."""
    trace: str = ""

    def summary(self) -> str:
        end = "the whole tree" if self.complete else "stopped at the bound"
        found = f", FOUND after {self.runs} runs: {self.problems[:2]}" if self.problems else ""
        return (
            f"exhaustive entries={self.entries} lost={self.lost} deviations<={self.deviations_max} "
            f"bugs={list(self.bugs)}: {self.runs} runs "
            f"({self.complete_runs} to the end, {self.cuts} cut at a known state), {self.states} distinct "
            f"states, {end}, {self.seconds:.1f} s{found}"
        )


def explore_one(
    search: Search,
    prefix: list[int],
    entries: int,
    bugs: tuple[str, ...],
    lost: str | None,
    deviations_max: int,
) -> Any:
    """One run along ``prefix``; returns (outcome, explorer)."""
    explorer = Explorer(search, prefix, deviations_max)
    ExhaustiveScenario.explorer = explorer
    ExhaustiveScenario.entries = entries
    ExhaustiveScenario.lost = lost
    try:
        outcome = run_seed(0, bugs, ExhaustiveScenario)
    finally:
        ExhaustiveScenario.explorer = None
    return outcome, explorer


def explore(
    entries: int = 1,
    bugs: tuple[str, ...] = (),
    *,
    runs_max: int = 1000,
    lost: str | None = None,
    deviations_max: int = 1_000_000,
) -> Report:
    """Depth-first over choice sequences until the tree is walked, a problem is found, or
    ``runs_max`` runs (see the module docstring). ``lost``: the fault plan (a bookie whose first
    message from the recoverer is lost), fixed for the whole search. ``deviations_max`` bounds the
    choices other than the first (0) along a run — CHESS's preemption bounding: all schedules
    within k deviations of the default one, which finds bugs needing few (raise it step by step)."""
    report = Report(entries, bugs, lost, deviations_max)
    search = Search()
    started = time.perf_counter()
    prefix: list[int] = []
    while report.runs < runs_max:
        outcome, explorer = explore_one(search, prefix, entries, bugs, lost, deviations_max)
        report.runs += 1
        report.complete_runs += not outcome.cut
        if outcome.problems:
            report.problems = outcome.problems
            report.choices = [choice for choice, _ in explorer.taken]
            report.trace = outcome.trace
            break
        taken = explorer.taken
        used = [0]
        for choice, _ in taken:
            used.append(used[-1] + (choice != 0))
        depth = len(taken) - 1
        while depth >= 0 and (
            taken[depth][0] + 1 >= taken[depth][1]
            or used[depth] + 1 > deviations_max  # the next alternative deviates: within the budget?
        ):
            depth -= 1
        if depth < 0:
            report.complete = True
            break
        prefix = [choice for choice, _ in taken[:depth]] + [taken[depth][0] + 1]
    report.states, report.cuts = search.states, search.cuts
    report.seconds = time.perf_counter() - started
    return report


def main(argv: list[str] | None = None) -> int:
    """``make simulate-exhaustive``: every fault plan, 1 and 2 entries, up to DEVIATIONS."""

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deviations", type=int, default=2)
    parser.add_argument("--runs-max", type=int, default=20_000)
    parser.add_argument("--entries", default="1,2")
    parser.add_argument("--bugs", default="", help="bug.* switches to plant (comma-separated)")
    args = parser.parse_args(argv)
    bugs = tuple(b for b in args.bugs.split(",") if b)
    found = False
    for entries in (int(e) for e in args.entries.split(",")):
        for lost in (None, *(f"b{i}" for i in range(BOOKIES))):
            report = explore(entries, bugs, runs_max=args.runs_max, lost=lost, deviations_max=args.deviations)
            print(report.summary(), flush=True)
            if report.problems:
                found = True
                print(f"  choices: {report.choices}")
    return 1 if found and not bugs else 0


if __name__ == "__main__":
    raise SystemExit(main())
