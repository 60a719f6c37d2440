"""A history recorder and checker for ledgers (pure Python; the simulation reuses it).

Writers record each add as they see it: invoked with a unique value, then ``ok`` (acknowledged at
an entry id), ``fail`` (definitely not written: a `BKError` whose ``outcome_unknown`` is False) or
``info`` (indeterminate: it may be there). After the faults heal, every ledger is recovered by one
or more recoverers (each reports the last entry it found) and read back whole by several
independent readers. `check` then reports every violation of:

1. no acknowledged add is lost: each ``ok`` value is read at the entry id its ack returned;
2. all readers agree, entry for entry;
3. acknowledged entry ids are unique, and per writer in invoke order within a ledger;
4. no phantom: every value read was invoked by a writer of that ledger, at most once, and no
   ``fail`` add is read;
5. no ack above a ledger's final last entry (what recovery closed it at);
6. all recoverers of a ledger report the same last entry;
7. every LAC a reader observed is monotonic and never beyond the final last entry;
8. every failed add failed typed (a `BKError`).
"""

from __future__ import annotations

import enum
import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bookkeeper_aio.errors import BKError

SHOWN_MAX = 20


class Outcome(enum.Enum):
    OK = "ok"
    FAIL = "fail"
    INFO = "info"


# As module names for the per-add paths: on Python 3.11 ``Outcome.OK`` goes through
# ``EnumType.__getattr__``'s slow attribute path (about 0.3 us each).
_OK, _FAIL, _INFO = Outcome.OK, Outcome.FAIL, Outcome.INFO


def outcome_of(error: BaseException) -> Outcome:
    if isinstance(error, BKError) and not error.outcome_unknown:
        return Outcome.FAIL
    return Outcome.INFO


@dataclass(slots=True)
class AddOp:
    writer: str
    ledger_id: int
    value: bytes
    invoked_s: float
    outcome: Outcome | None = None  # None: still pending (the writer stopped before an answer)
    entry_id: int | None = None
    completed_s: float | None = None
    error: str | None = None  # the failure's type: every one must be a BKError (typed)


@dataclass
class History:
    adds: list[AddOp] = field(default_factory=list)
    recovered: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    reads: dict[int, list[list[tuple[int, bytes]]]] = field(default_factory=lambda: defaultdict(list))
    lacs: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    acked_max: dict[int, int] = field(default_factory=dict)
    """Ledger id -> the highest entry id acknowledged so far (kept by :meth:`ok`), for every
    ledger with an ack."""
    clock: Callable[[], float] = time.monotonic
    """When ops are invoked and complete (the simulation passes its own: no wall clock there)."""

    # ------------------------------------------------------------------ recording
    def invoke(self, writer: str, ledger_id: int, value: bytes) -> AddOp:
        op = AddOp(writer, ledger_id, value, self.clock())
        self.adds.append(op)
        return op

    def ok(self, op: AddOp, entry_id: int) -> None:
        op.outcome, op.entry_id, op.completed_s = _OK, entry_id, self.clock()
        if entry_id > self.acked_max.get(op.ledger_id, -1):
            self.acked_max[op.ledger_id] = entry_id

    def failed(self, op: AddOp, error: BaseException) -> None:
        op.outcome, op.completed_s = outcome_of(error), self.clock()
        op.error = type(error).__name__ if isinstance(error, BKError) else f"untyped {type(error).__name__}"

    def recovered_at(self, ledger_id: int, last_entry_id: int) -> None:
        self.recovered[ledger_id].append(last_entry_id)

    def read_back(self, ledger_id: int, entries: Iterable[tuple[int, bytes]]) -> None:
        self.reads[ledger_id].append(list(entries))

    def lac_seen(self, ledger_id: int, lac: int) -> None:
        self.lacs[ledger_id].append(lac)

    def counts(self) -> dict[str, int]:
        """Jepsen-style figures: ops by outcome (pending ones count as info)."""
        return _outcome_counts(self.adds)

    def figures(self) -> dict[str, int]:
        """Jepsen-style figures of the whole history: ops by outcome, ``acked`` (ok adds), and the
        violations by kind: ``lost`` (an acked add not read where acked), ``duplicated`` (a value
        read twice or an entry acked twice), ``inconsistent`` (readers or recoverers disagree, an
        ack or LAC beyond the final last entry, ids out of order, a phantom), ``violations`` (all)."""
        counts = self.counts()
        by_ledger: dict[int, list[AddOp]] = defaultdict(list)
        for op in self.adds:
            by_ledger[op.ledger_id].append(op)
        problems = [
            problem
            for ledger_id in sorted(set(by_ledger) | set(self.reads))
            for problem in self._check_ledger(ledger_id, by_ledger.get(ledger_id, []))
        ]
        return _tally(counts, problems, lost=sum("LOST" in p or "never read back" in p for p in problems))

    def dump(self, path: Path) -> None:
        """The history as JSON lines, kept with the data dirs when a check fails."""
        with path.open("w") as out:
            for op in self.adds:
                row = asdict(op)
                row["value"] = op.value.decode(errors="replace")
                row["outcome"] = None if op.outcome is None else op.outcome.value
                out.write(json.dumps(row) + "\n")
            out.write(json.dumps({"recovered": self.recovered, "lacs": self.lacs}) + "\n")

    # ------------------------------------------------------------------ checking
    def check(self) -> list[str]:
        """Every violation found (empty: the history is consistent)."""
        problems: list[str] = []
        by_ledger: dict[int, list[AddOp]] = defaultdict(list)
        for op in self.adds:
            by_ledger[op.ledger_id].append(op)
        for ledger_id in sorted(set(by_ledger) | set(self.reads)):
            problems += self._check_ledger(ledger_id, by_ledger.get(ledger_id, []))
        return problems[:SHOWN_MAX] + (
            [f"... and {len(problems) - SHOWN_MAX} more"] if len(problems) > SHOWN_MAX else []
        )

    def _check_ledger(self, ledger_id: int, adds: list[AddOp]) -> list[str]:
        problems: list[str] = []
        where = f"ledger {ledger_id}"
        reads = self.reads.get(ledger_id, [])
        if not reads:
            return [f"{where}: never read back"] if any(op.outcome is _OK for op in adds) else []
        first = reads[0]
        for index, other in enumerate(reads[1:], start=2):
            if other != first:
                problems.append(f"{where}: reader {index} disagrees with reader 1 ({_diff(first, other)})")
        recovered = self.recovered.get(ledger_id, [])
        if len(set(recovered)) > 1:
            problems.append(f"{where}: recoverers disagree on the last entry: {sorted(set(recovered))}")
        final_last = recovered[0] if recovered else (first[-1][0] if first else -1)
        read_ids = [entry_id for entry_id, _ in first]
        if read_ids != list(range(len(read_ids))):
            problems.append(f"{where}: entry ids read are not 0..n-1: {read_ids[:10]}...")
        if recovered and len(first) != final_last + 1:
            problems.append(f"{where}: read {len(first)} entries, recovery closed it at {final_last}")
        at = dict(first)
        invoked: dict[bytes, AddOp] = {}
        for op in adds:
            if op.value in invoked:
                problems.append(f"{where}: value {op.value!r} invoked twice (test bug)")
            invoked[op.value] = op
        problems += [
            f"{where}: {op.value!r} failed with an {op.error} (not a BKError)"
            for op in adds
            if op.error is not None and op.error.startswith("untyped")
        ]
        acked_ids: dict[int, AddOp] = {}
        for op in adds:
            if op.outcome is not _OK:
                continue
            assert op.entry_id is not None
            if op.entry_id in acked_ids:
                first_value = acked_ids[op.entry_id].value
                problems.append(f"{where}: entry {op.entry_id} acked twice ({first_value!r}, {op.value!r})")
            acked_ids[op.entry_id] = op
            if op.entry_id > final_last:
                problems.append(f"{where}: entry {op.entry_id} acked above the final last entry {final_last}")
            if at.get(op.entry_id) != op.value:
                problems.append(
                    f"{where}: acked {op.value!r} at {op.entry_id} LOST (read {at.get(op.entry_id)!r})"
                )
        per_writer: dict[str, list[AddOp]] = defaultdict(list)
        for op in sorted(acked_ids.values(), key=lambda o: o.invoked_s):
            per_writer[op.writer].append(op)
        for writer, ops in per_writer.items():
            ids = [op.entry_id for op in ops]
            if ids != sorted(ids):  # type: ignore[type-var]
                problems.append(
                    f"{where}: writer {writer}'s acked entries are not in invoke order: {ids[:10]}"
                )
        problems += _value_problems(where, first, invoked)
        lacs = self.lacs.get(ledger_id, [])
        if lacs != sorted(lacs):
            problems.append(f"{where}: observed LACs went back: {lacs[:20]}")
        if lacs and max(lacs) > final_last:
            problems.append(
                f"{where}: an observed LAC {max(lacs)} is beyond the final last entry {final_last}"
            )
        return problems


def _outcome_counts(ops: Iterable[AddOp | LogAppend]) -> dict[str, int]:
    """Ops by outcome (pending ones count as info)."""
    result = {"ok": 0, "fail": 0, "info": 0}
    for op in ops:
        result[(op.outcome or _INFO).value] += 1
    return result


def _tally(counts: dict[str, int], problems: list[str], *, lost: int) -> dict[str, int]:
    """A history's figures: its outcome counts, and its problems as lost, duplicated and the rest."""
    duplicated = sum("twice" in p for p in problems)
    return {
        **counts,
        "acked": counts["ok"],
        "lost": lost,
        "duplicated": duplicated,
        "inconsistent": len(problems) - lost - duplicated,
        "violations": len(problems),
    }


def _value_problems(
    where: str, read: Iterable[tuple[object, bytes]], invoked: Mapping[bytes, AddOp | LogAppend]
) -> list[str]:
    """Each value read (at its place): one that was invoked, not failed before it was sent, read
    once."""
    problems: list[str] = []
    seen: set[bytes] = set()
    for place, value in read:
        op = invoked.get(value)
        if op is None:
            problems.append(f"{where}: phantom value {value!r} at {place}")
        elif op.outcome is _FAIL:
            problems.append(f"{where}: {value!r} failed (nothing sent) yet was read at {place}")
        if value in seen:
            problems.append(f"{where}: value {value!r} read twice")
        seen.add(value)
    return problems


def _diff(a: Sequence[object], b: Sequence[object]) -> str:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"first difference at entry {index}: {x!r} vs {y!r}"
    return f"lengths {len(a)} vs {len(b)}"


# ====================================================================== logs
@dataclass(slots=True)
class LogAppend:
    """One append to a log by one writer (a process incarnation): its outcome and, when acked,
    the position (ledger id, entry id) the ack returned."""

    writer: str
    value: bytes
    invoked_s: float
    outcome: Outcome | None = None  # None: pending when the writer stopped (or was killed): info
    position: tuple[int, int] | None = None
    completed_s: float | None = None
    error: str | None = None


ListView = tuple[tuple[int, bool, int | None], ...]
"""An observed version of a log's ledger list: (ledger id, OPEN?, last entry id as marked)."""
Record = tuple[tuple[int, int], bytes]
"""A record a log reader handed out: (position, payload)."""


@dataclass
class LogHistory:
    """The history of one log under writers fighting for its leadership (tests/faults/test_logs.py).

    Recorded: every append (invoke / ok at a position / fail / info), which writer created which
    ledger (``owners``: at a takeover or a roll), every version of the ledger list a metadata watch
    saw, what tailing readers handed out during the run, the whole log read from "earliest" by
    independent readers after heal, and each listed ledger's last entry per its own (closed) ledger
    metadata. `check` reports every violation of:

    1. at most one OPEN ledger in any version of the list, except a roll's: the last two, both
       created by one writer (a roll lists the new ledger before it closes the old one);
    2. no acked data outside the list: every acked position lies in a ledger of the final list, at
       or below the last entry the list marks it CLOSED at; each mark equals the ledger's metadata;
    3. every acked append read exactly once, at the position its ack returned, by every reader from
       "earliest"; readers agree; positions strictly increase, and each ledger is read 0..last;
    4. per writer, acked positions increase in invoke order;
    5. nothing read that was not appended (no phantom, no ``fail`` append read);
    6. tailing readers handed out only records the final read has at the same position, each once,
       in order;
    7. every failed append failed typed (a `BKError`);
    8. liveness: after heal the log was writable (``writable_after_heal``) and, at the end, every
       listed ledger is CLOSED.
    """

    appends: list[LogAppend] = field(default_factory=list)
    owners: dict[int, str] = field(default_factory=dict)
    tenures: int = 0
    versions: list[tuple[int, ListView]] = field(default_factory=list)
    tails: list[list[Record]] = field(default_factory=list)
    reads: list[list[Record]] = field(default_factory=list)
    ledger_ends: dict[int, int | None] = field(default_factory=dict)
    writable_after_heal: bool | None = None  # None: not checked (e.g. a unit test of the checker)
    clock: Callable[[], float] = time.monotonic

    # ------------------------------------------------------------------ recording
    def invoke(self, writer: str, value: bytes) -> LogAppend:
        op = LogAppend(writer, value, self.clock())
        self.appends.append(op)
        return op

    def ok(self, op: LogAppend, position: tuple[int, int]) -> None:
        op.outcome, op.position, op.completed_s = Outcome.OK, (position[0], position[1]), self.clock()

    def failed(self, op: LogAppend, error: BaseException) -> None:
        op.outcome, op.completed_s = outcome_of(error), self.clock()
        op.error = type(error).__name__ if isinstance(error, BKError) else f"untyped {type(error).__name__}"

    def leader(self, writer: str, ledger_id: int) -> None:
        """``writer`` opened the log as leader on ``ledger_id`` (a takeover)."""
        self.tenures += 1
        self.owned(writer, ledger_id)

    def owned(self, writer: str, ledger_id: int) -> None:
        """``writer`` created ``ledger_id`` and listed it (a takeover or a roll)."""
        self.owners[ledger_id] = writer

    def list_seen(self, version: int, ledgers: Iterable[tuple[int, bool, int | None]]) -> None:
        self.versions.append((version, tuple(ledgers)))

    def tailed(self, records: Iterable[Record]) -> None:
        self.tails.append(list(records))

    def read_back(self, records: Iterable[Record]) -> None:
        self.reads.append(list(records))

    def ledger_end(self, ledger_id: int, last_entry_id: int | None) -> None:
        """The ledger's last entry per its own metadata (None: still open)."""
        self.ledger_ends[ledger_id] = last_entry_id

    def counts(self) -> dict[str, int]:
        return _outcome_counts(self.appends)

    def figures(self) -> dict[str, int]:
        """As `History.figures`, plus ``takeovers`` (leader tenures), ``versions`` (of the list
        observed) and ``two_open`` (versions inside a roll: two OPEN ledgers of one writer)."""
        counts = self.counts()
        problems = self._problems()
        return {
            **_tally(counts, problems, lost=sum("LOST" in p for p in problems)),
            "takeovers": self.tenures,
            "versions": len(self.versions),
            "two_open": sum(sum(is_open for _, is_open, _ in view) == 2 for _, view in self.versions),
        }

    def dump(self, path: Path) -> None:
        with path.open("w") as out:
            for op in self.appends:
                row = asdict(op)
                row["value"] = op.value.decode(errors="replace")
                row["outcome"] = None if op.outcome is None else op.outcome.value
                out.write(json.dumps(row) + "\n")
            out.write(json.dumps({"owners": self.owners, "versions": self.versions}) + "\n")
            out.write(json.dumps({"ledger_ends": self.ledger_ends}) + "\n")
            for read in [*self.reads, *self.tails]:
                rows = [[position, value.decode(errors="replace")] for position, value in read]
                out.write(json.dumps({"read": rows}) + "\n")

    # ------------------------------------------------------------------ checking
    def check(self) -> list[str]:
        """Every violation found (empty: the history is consistent)."""
        problems = self._problems()
        return problems[:SHOWN_MAX] + (
            [f"... and {len(problems) - SHOWN_MAX} more"] if len(problems) > SHOWN_MAX else []
        )

    def _problems(self) -> list[str]:
        problems = self._check_versions()
        final = self.versions[-1][1] if self.versions else ()
        marks = {ledger_id: last for ledger_id, _, last in final}
        problems += [f"log: ledger {ledger_id} is still OPEN at the end" for ledger_id, o, _ in final if o]
        for ledger_id, last in marks.items():
            end = self.ledger_ends.get(ledger_id, last)
            if last is not None and end != last:
                problems.append(
                    f"log: the list marks ledger {ledger_id} CLOSED at {last}, its metadata at {end}"
                )
        if self.writable_after_heal is False:
            problems.append("log: not writable again after heal")
        problems += [
            f"log: {op.value!r} failed with an {op.error} (not a BKError)"
            for op in self.appends
            if op.error is not None and op.error.startswith("untyped")
        ]
        invoked: dict[bytes, LogAppend] = {}
        for op in self.appends:
            if op.value in invoked:
                problems.append(f"log: value {op.value!r} invoked twice (test bug)")
            invoked[op.value] = op
        acked = [op for op in self.appends if op.outcome is Outcome.OK]
        by_position: dict[tuple[int, int], LogAppend] = {}
        for op in acked:
            assert op.position is not None
            ledger_id, entry_id = op.position
            if op.position in by_position:
                earlier = by_position[op.position].value
                problems.append(f"log: position {op.position} acked twice ({earlier!r}, {op.value!r})")
            by_position[op.position] = op
            if ledger_id not in marks:
                problems.append(f"log: {op.value!r} acked at {op.position}, outside the list")
            elif marks[ledger_id] is not None and entry_id > marks[ledger_id]:  # type: ignore[operator]
                problems.append(
                    f"log: {op.value!r} acked at {op.position}, above the ledger's end {marks[ledger_id]}"
                )
        per_writer: dict[str, list[LogAppend]] = defaultdict(list)
        for op in sorted(acked, key=lambda o: o.invoked_s):
            per_writer[op.writer].append(op)
        for writer, ops in per_writer.items():
            positions = [op.position for op in ops]
            if positions != sorted(positions):  # type: ignore[type-var]
                problems.append(
                    f"log: writer {writer}'s acked positions are not in invoke order: {positions[:10]}"
                )
        if not self.reads:
            return problems + (["log: never read back"] if acked else [])
        first = self.reads[0]
        for index, other in enumerate(self.reads[1:], start=2):
            if other != first:
                problems.append(f"log: reader {index} disagrees with reader 1 ({_diff(first, other)})")
        problems += self._check_read(first, marks, invoked)
        at = dict(first)
        for op in acked:
            assert op.position is not None
            if at.get(op.position) != op.value:
                problems.append(
                    f"log: acked {op.value!r} at {op.position} LOST (read {at.get(op.position)!r})"
                )
        for index, tail in enumerate(self.tails, start=1):
            positions = [position for position, _ in tail]
            if positions != sorted(set(positions)):
                problems.append(f"log: tailing reader {index} went back or repeated: {positions[:10]}...")
            for position, value in tail:
                if at.get(position) != value:
                    problems.append(
                        f"log: tailing reader {index} read {value!r} at {position}, "
                        f"the final read has {at.get(position)!r} there"
                    )
                    break
        return problems

    def _check_versions(self) -> list[str]:
        problems: list[str] = []
        for version, view in self.versions:
            opened = [index for index, (_, is_open, _) in enumerate(view) if is_open]
            ids = [view[index][0] for index in opened]
            if len(opened) <= 1:
                continue
            rolling = len(opened) == 2 and opened == [len(view) - 2, len(view) - 1]
            owners = {self.owners.get(ledger_id) for ledger_id in ids}
            if not rolling or (None not in owners and len(owners) > 1):
                who = [self.owners.get(ledger_id, "?") for ledger_id in ids]
                problems.append(
                    f"log: version {version} lists {len(ids)} OPEN ledgers {ids} (created by {who})"
                )
        return problems

    @staticmethod
    def _check_read(
        read: list[Record], marks: dict[int, int | None], invoked: dict[bytes, LogAppend]
    ) -> list[str]:
        problems: list[str] = []
        positions = [position for position, _ in read]
        if positions != sorted(set(positions)):
            problems.append(f"log: the read's positions do not strictly increase: {positions[:10]}...")
        per_ledger: dict[int, list[int]] = defaultdict(list)
        for ledger_id, entry_id in positions:
            per_ledger[ledger_id].append(entry_id)
        for ledger_id, last in marks.items():
            got = per_ledger.pop(ledger_id, [])
            if last is not None and got != list(range(last + 1)):
                problems.append(f"log: ledger {ledger_id} (CLOSED at {last}) read as entries {got[:10]}...")
        problems += [
            f"log: read entries of ledger {ledger_id}, which is not in the list" for ledger_id in per_ledger
        ]
        return problems + _value_problems("log", read, invoked)
