"""A history checker for logs (docs/replication.md §7, docs/api.md "Logs").

Writers record every append they start with a unique value (``<writer>-<sequence>``: the sequence
grows with each append a writer starts, across every writer session of that process) and its outcome:

- ``ok``: acknowledged, at the returned position;
- ``fail``: definitely not written (a `BKError` with ``outcome_unknown`` False: nothing was sent);
- ``indeterminate``: may or may not be in the log (``outcome_unknown`` True, any other exception, or
  no answer at all: the writer process died).

Samples of the log's ledger list (every revision from a metadata watch, or polled) are recorded
alongside. `LogHistory.check` takes what a reader returned (from "earliest") and reports every
violation of:

1. every acknowledged append is read exactly once, at the position its ack returned;
2. nothing is read that was not appended, and no ``fail`` append is read;
3. an ``indeterminate`` append is read at most once;
4. per writer, values come out in the order the writer started them (sequence order);
5. positions come out strictly increasing;
6. in every sampled ledger list, at most ``open_max`` ledgers are OPEN and the OPEN ones are the
   last ones (a suffix); the list only grows at its end (apart from ledgers dropped at the front); a
   ledger never goes back from CLOSED to OPEN;
7. every record read lies in a ledger of the last sampled list.

Acknowledged appends in ledgers a truncation removed (``truncated_before``) are not required.

The module only depends on the public log API types, so a fault suite can reuse it with its own
writers (in-process tasks or worker processes that dump `AppendRecord` rows as JSON).
"""

from __future__ import annotations

import enum
import itertools
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from bookkeeper_aio.errors import BKError
from bookkeeper_aio.log.position import LogPosition, LogRecord
from metadata.log_metadata import LogLedgerState, LogMetadata

VIOLATIONS_SHOWN_MAX = 20


class Outcome(enum.Enum):
    OK = "ok"
    FAIL = "fail"
    INDETERMINATE = "indeterminate"


def outcome_of(error: BaseException) -> Outcome:
    """``fail`` only for a `BKError` that says nothing was sent; anything else may have been written."""
    if isinstance(error, BKError) and not error.outcome_unknown:
        return Outcome.FAIL
    return Outcome.INDETERMINATE


def value_of(writer: str, sequence: int) -> bytes:
    return f"{writer}-{sequence}".encode()


def parse_value(value: bytes) -> tuple[str, int] | None:
    """``(writer, sequence)`` of a value made by `value_of`, None for anything else."""
    writer, sep, sequence = value.decode(errors="replace").rpartition("-")
    if not sep or not sequence.isdigit():
        return None
    return writer, int(sequence)


@dataclass(slots=True)
class AppendRecord:
    """One append as its writer saw it. ``position`` only for ``ok``; times are the writer's
    ``time.monotonic()`` (only compared within one process)."""

    writer: str
    sequence: int
    outcome: Outcome
    position: LogPosition | None = None
    invoked_s: float = 0.0
    completed_s: float = 0.0
    error: str = ""

    @property
    def value(self) -> bytes:
        return value_of(self.writer, self.sequence)

    def to_json(self) -> str:
        row = asdict(self)
        row["outcome"] = self.outcome.value
        row["position"] = None if self.position is None else list(self.position)
        return json.dumps(row)

    @classmethod
    def from_json(cls, line: str) -> AppendRecord:
        row: dict[str, Any] = json.loads(line)
        row["outcome"] = Outcome(row["outcome"])
        if row["position"] is not None:
            row["position"] = LogPosition(*row["position"])
        return cls(**row)


def latest_rows(text: str) -> list[AppendRecord]:
    """`AppendRecord` JSON lines where an append may appear more than once (written when it starts,
    again when it completes): the last row of each (writer, sequence) counts. A last line without
    its newline is the row a SIGKILL cut short: left out (the append's earlier row, if any, counts;
    one with no row was never sent)."""
    latest: dict[tuple[str, int], AppendRecord] = {}
    lines = text.split("\n")  # the last item: a cut row, or "" after a complete one
    for line in lines[:-1]:
        if line.strip():
            record = AppendRecord.from_json(line)
            latest[(record.writer, record.sequence)] = record
    return list(latest.values())


ListSample = tuple[tuple[int, LogLedgerState], ...]


@dataclass
class CheckResult:
    violations: list[str]
    read: int
    acked: int
    failed: int
    indeterminate: int
    indeterminate_read: int
    samples: int
    open_max_seen: int
    ledgers: int

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        head = (
            f"{self.read} read; {self.acked} acked, {self.failed} failed, {self.indeterminate} "
            f"indeterminate ({self.indeterminate_read} of them read); {self.samples} list samples, "
            f"at most {self.open_max_seen} OPEN, {self.ledgers} ledgers"
        )
        if not self.violations:
            return head
        shown = self.violations[:VIOLATIONS_SHOWN_MAX]
        more = len(self.violations) - len(shown)
        tail = f"\n  ... and {more} more" if more else ""
        return head + f"\n{len(self.violations)} violations:\n  " + "\n  ".join(shown) + tail


@dataclass
class LogHistory:
    """Appends (by value) and ledger-list samples of one log."""

    appends: dict[bytes, AppendRecord] = field(default_factory=dict)
    samples: list[ListSample] = field(default_factory=list)

    # ------------------------------------------------------------------ recording
    def add(self, record: AppendRecord) -> None:
        if record.value in self.appends:
            raise ValueError(f"value {record.value!r} recorded twice: values must be unique")
        self.appends[record.value] = record

    def extend(self, records: Iterable[AppendRecord]) -> None:
        for record in records:
            self.add(record)

    def load_jsonl(self, text: str) -> None:
        self.extend(AppendRecord.from_json(line) for line in text.splitlines() if line.strip())

    def sample(self, metadata: LogMetadata) -> None:
        ledgers: ListSample = tuple((entry.ledger_id, entry.state) for entry in metadata.ledgers)
        if not self.samples or self.samples[-1] != ledgers:
            self.samples.append(ledgers)

    # ------------------------------------------------------------------ checking
    def check(
        self, read: Sequence[LogRecord], *, open_max: int = 1, truncated_before: int = 0
    ) -> CheckResult:
        """``truncated_before``: the log was truncated before that ledger id (docs/api.md "Logs"):
        acknowledged appends in lower ledgers are gone legitimately, so not required."""
        violations: list[str] = []
        violations += self._check_records(read, truncated_before)
        violations += self._check_samples(open_max)
        by_outcome = Counter(r.outcome for r in self.appends.values())
        read_values = {record.payload for record in read}
        indeterminate_read = sum(
            1
            for value, r in self.appends.items()
            if r.outcome is Outcome.INDETERMINATE and value in read_values
        )
        open_seen = max((_open_count(s) for s in self.samples), default=0)
        return CheckResult(
            violations=violations,
            read=len(read),
            acked=by_outcome[Outcome.OK],
            failed=by_outcome[Outcome.FAIL],
            indeterminate=by_outcome[Outcome.INDETERMINATE],
            indeterminate_read=indeterminate_read,
            samples=len(self.samples),
            open_max_seen=open_seen,
            ledgers=len(self.samples[-1]) if self.samples else 0,
        )

    def _check_records(self, read: Sequence[LogRecord], truncated_before: int) -> list[str]:
        out: list[str] = []
        seen: Counter[bytes] = Counter(record.payload for record in read)
        where: dict[bytes, LogPosition] = {}
        previous: LogPosition | None = None
        last_sequence: dict[str, tuple[int, LogPosition]] = {}
        for index, record in enumerate(read):
            value, position = record.payload, record.position
            where.setdefault(value, position)
            if previous is not None and not position > previous:
                out.append(f"record {index} at {tuple(position)} does not follow {tuple(previous)}")
            previous = position
            appended = self.appends.get(value)
            if appended is None:
                out.append(f"read {value!r} at {tuple(position)}: never appended")
                continue
            if appended.outcome is Outcome.FAIL:
                out.append(f"read {value!r} at {tuple(position)}: its append failed ({appended.error})")
            writer_before = last_sequence.get(appended.writer)
            if writer_before is not None and appended.sequence <= writer_before[0]:
                out.append(
                    f"writer {appended.writer}: sequence {appended.sequence} at {tuple(position)} read "
                    f"after sequence {writer_before[0]} at {tuple(writer_before[1])}"
                )
            last_sequence[appended.writer] = (appended.sequence, position)
        for value, count in seen.items():
            if count > 1:
                out.append(f"read {value!r} {count} times")
        for value, appended in self.appends.items():
            if appended.outcome is not Outcome.OK:
                continue
            got = where.get(value)
            if (
                got is None
                and appended.position is not None
                and appended.position.ledger_id < truncated_before
            ):
                continue  # truncated
            if got is None:
                out.append(f"acked {value!r} at {_pos(appended.position)} was not read (lost)")
            elif got != appended.position:
                out.append(f"acked {value!r} at {_pos(appended.position)} was read at {tuple(got)}")
        if self.samples and read:
            listed = {ledger_id for ledger_id, _ in self.samples[-1]}
            strays = sorted({r.position.ledger_id for r in read} - listed)
            if strays:
                out.append(f"records read from ledgers not in the last list sample: {strays}")
        return out

    def _check_samples(self, open_max: int) -> list[str]:
        out: list[str] = []
        closed: set[int] = set()
        previous: ListSample = ()
        for index, sample in enumerate(self.samples):
            states = [state for _, state in sample]
            count = _open_count(sample)
            if count > open_max:
                out.append(f"list sample {index}: {count} OPEN ledgers > {open_max}: {_show(sample)}")
            if LogLedgerState.OPEN in states:
                first_open = states.index(LogLedgerState.OPEN)
                if LogLedgerState.CLOSED in states[first_open:]:
                    out.append(f"list sample {index}: an OPEN ledger before a CLOSED one: {_show(sample)}")
            ids = [ledger_id for ledger_id, _ in sample]
            before = [ledger_id for ledger_id, _ in previous]
            kept = [ledger_id for ledger_id in before if ledger_id in set(ids)]
            if kept != before[len(before) - len(kept) :] or ids[: len(kept)] != kept:
                out.append(f"list sample {index}: not the previous list grown at its end: {_show(sample)}")
            for ledger_id, state in sample:
                if state is LogLedgerState.OPEN and ledger_id in closed:
                    out.append(f"list sample {index}: ledger {ledger_id} is OPEN again after CLOSED")
                if state is LogLedgerState.CLOSED:
                    closed.add(ledger_id)
            previous = sample
        return out


def _open_count(sample: ListSample) -> int:
    return sum(1 for _, state in sample if state is LogLedgerState.OPEN)


def _show(sample: ListSample) -> str:
    return "[" + ", ".join(f"{ledger_id}:{state.value}" for ledger_id, state in sample) + "]"


def _pos(position: LogPosition | None) -> str:
    return "?" if position is None else str(tuple(position))


@dataclass
class PauseReport:
    """Gaps between consecutive append completions, and append latencies (seconds)."""

    max_gap_s: float
    max_gap_at_s: float
    max_latency_s: float
    max_latency_at_s: float


def pauses(records: Iterable[AppendRecord]) -> PauseReport:
    """The longest gap between consecutive completions and the longest append latency."""
    done = sorted((r for r in records if r.outcome is Outcome.OK), key=lambda r: r.completed_s)
    gap, gap_at = 0.0, 0.0
    for before, after in itertools.pairwise(done):
        if after.completed_s - before.completed_s > gap:
            gap, gap_at = after.completed_s - before.completed_s, before.completed_s
    slowest = max(done, key=lambda r: r.completed_s - r.invoked_s, default=None)
    if slowest is None:
        return PauseReport(0.0, 0.0, 0.0, 0.0)
    return PauseReport(gap, gap_at, slowest.completed_s - slowest.invoked_s, slowest.invoked_s)
