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
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bookkeeper_aio.errors import BKError

SHOWN_MAX = 20


class Outcome(enum.Enum):
    OK = "ok"
    FAIL = "fail"
    INFO = "info"


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
    clock: Callable[[], float] = time.monotonic
    """When ops are invoked and complete (the simulation passes its own: no wall clock there)."""

    # ------------------------------------------------------------------ recording
    def invoke(self, writer: str, ledger_id: int, value: bytes) -> AddOp:
        op = AddOp(writer, ledger_id, value, self.clock())
        self.adds.append(op)
        return op

    def ok(self, op: AddOp, entry_id: int) -> None:
        op.outcome, op.entry_id, op.completed_s = Outcome.OK, entry_id, self.clock()

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
        result = {"ok": 0, "fail": 0, "info": 0}
        for op in self.adds:
            result[(op.outcome or Outcome.INFO).value] += 1
        return result

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
        lost = sum("LOST" in p or "never read back" in p for p in problems)
        duplicated = sum("twice" in p for p in problems)
        return {
            **counts,
            "acked": counts["ok"],
            "lost": lost,
            "duplicated": duplicated,
            "inconsistent": len(problems) - lost - duplicated,
            "violations": len(problems),
        }

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
            return [f"{where}: never read back"] if any(op.outcome is Outcome.OK for op in adds) else []
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
            if op.outcome is not Outcome.OK:
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
        seen: set[bytes] = set()
        for entry_id, value in first:
            op = invoked.get(value)
            if op is None:
                problems.append(f"{where}: phantom value {value!r} at {entry_id}")
            elif op.outcome is Outcome.FAIL:
                problems.append(f"{where}: {value!r} failed (nothing sent) yet was read at {entry_id}")
            if value in seen:
                problems.append(f"{where}: value {value!r} read twice")
            seen.add(value)
        lacs = self.lacs.get(ledger_id, [])
        if lacs != sorted(lacs):
            problems.append(f"{where}: observed LACs went back: {lacs[:20]}")
        if lacs and max(lacs) > final_last:
            problems.append(
                f"{where}: an observed LAC {max(lacs)} is beyond the final last entry {final_last}"
            )
        return problems


def _diff(a: list[tuple[int, bytes]], b: list[tuple[int, bytes]]) -> str:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"first difference at entry {index}: {x!r} vs {y!r}"
    return f"lengths {len(a)} vs {len(b)}"
