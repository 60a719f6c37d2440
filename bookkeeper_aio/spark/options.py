"""The data source's options, parsed and checked before any work starts (pure: no Spark, no I/O).

Spark hands a data source its options as a case-insensitive map of strings (the keys lower-cased),
plus ``path`` for the argument of ``load(...)`` / ``save(...)``. Each mode (batch read, batch
write, streaming read, streaming write) accepts its own set; an option no mode knows, or one the
mode does not use, is refused rather than ignored, so that a typo (``maxEntriesPerPartiton``) is
an error and not a silently different job. Every error is a :class:`SparkOptionError` naming the
option in the spelling docs/spark.md uses, with what would be accepted.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from bookkeeper_aio import BKInterfaceError, LogPosition

# The documented spelling of each option; Spark lower-cases the keys it passes.
METADATA = "metadata"
PATH = "path"
LEDGERS = "ledgers"
PASSWORD = "password"
STARTING_POSITION = "startingPosition"
ENDING_POSITION = "endingPosition"
MAX_ENTRIES_PER_PARTITION = "maxEntriesPerPartition"
MAX_ENTRIES_PER_TRIGGER = "maxEntriesPerTrigger"
CURSOR = "cursor"
PAYLOAD_COLUMN = "payloadColumn"
ENSEMBLE = "ensemble"
WRITE_QUORUM = "writeQuorum"
ACK_QUORUM = "ackQuorum"
WRITER_ID = "writerId"

READ_OPTIONS = frozenset(
    {METADATA, PATH, LEDGERS, PASSWORD, STARTING_POSITION, ENDING_POSITION, MAX_ENTRIES_PER_PARTITION}
)
STREAM_READ_OPTIONS = frozenset(
    {METADATA, PATH, PASSWORD, STARTING_POSITION, MAX_ENTRIES_PER_TRIGGER, MAX_ENTRIES_PER_PARTITION, CURSOR}
)
WRITE_OPTIONS = frozenset({METADATA, PATH, PASSWORD, PAYLOAD_COLUMN, ENSEMBLE, WRITE_QUORUM, ACK_QUORUM})
CHECKPOINT_LOCATION = "checkpointLocation"
"""Spark's own option of a streaming sink, which it passes on to the sink: accepted, not used."""
STREAM_WRITE_OPTIONS = WRITE_OPTIONS | {WRITER_ID, CHECKPOINT_LOCATION}
ALL_OPTIONS = READ_OPTIONS | STREAM_READ_OPTIONS | WRITE_OPTIONS | STREAM_WRITE_OPTIONS

MAX_ENTRIES_PER_PARTITION_DEFAULT = 100_000
"""One input partition reads at most this many entries (100 MiB of 1 KiB entries): enough to keep
a task's set-up (a client, a ledger open) under 1% of its time, small enough that a log of a few
big ledgers still spreads over the cores."""

ENTRIES_MAX = 2**63 - 1
LEDGER_ID_MAX = 2**63 - 1

_POSITION_FORM = '"earliest", "latest" or a JSON position like {"ledger_id": 12, "entry_id": 0}'


class SparkOptionError(BKInterfaceError):
    """An option of the ``bookkeeper`` data source is missing, unknown or malformed: ``option``
    names it (as docs/spark.md spells it)."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"option {option!r}: {message}")
        self.option = option


class SparkColumnError(BKInterfaceError):
    """A DataFrame written to a log lacks its payload column, or the column has the wrong type or
    a null: ``column`` names it."""

    def __init__(self, column: str, message: str) -> None:
        super().__init__(f"column {column!r}: {message}")
        self.column = column


@dataclass(frozen=True, slots=True)
class Source:
    """Where a job reads or writes: a log by name, or (reads only) explicit ledgers."""

    metadata: str
    log: str | None
    ledgers: tuple[int, ...] | None
    password: bytes = dataclasses.field(repr=False)  # logs and tracebacks print the repr


def check_known(options: Mapping[str, str], allowed: frozenset[str], mode: str) -> None:
    spelled = {name.lower(): name for name in ALL_OPTIONS}
    allowed_lower = {name.lower() for name in allowed}
    for key in options:
        lower = key.lower()
        if lower not in spelled:
            raise SparkOptionError(
                key, f"unknown option of the bookkeeper data source; {mode} accepts {_listed(allowed)}"
            )
        if lower not in allowed_lower:
            raise SparkOptionError(spelled[lower], f"not used by a {mode}; it accepts {_listed(allowed)}")


def _listed(allowed: frozenset[str]) -> list[str]:
    return sorted(allowed - {CHECKPOINT_LOCATION})


def get(options: Mapping[str, str], name: str) -> str | None:
    value = options.get(name.lower())
    if value is None:
        value = options.get(name)
    return value


def parse_source(options: Mapping[str, str], *, allow_ledgers: bool) -> Source:
    metadata = get(options, METADATA)
    if not metadata:
        raise SparkOptionError(
            METADATA,
            'required: the cluster\'s metadata URL, e.g. .option("metadata", "etcd://host:2379/bookkeeper")',
        )
    if not metadata.startswith("etcd://"):
        raise SparkOptionError(METADATA, f"must be an etcd:// URL, got {metadata!r}")
    log = get(options, PATH) or None
    ledgers_text = get(options, LEDGERS)
    ledgers: tuple[int, ...] | None = None
    if ledgers_text is not None:
        if not allow_ledgers:
            raise SparkOptionError(LEDGERS, "only a batch read takes explicit ledgers; name a log instead")
        if log is not None:
            raise SparkOptionError(LEDGERS, f"give either a log (load({log!r})) or ledgers, not both")
        ledgers = parse_ledgers(ledgers_text)
    elif log is None:
        what = 'load("<log>") or .option("ledgers", "12,13")' if allow_ledgers else 'save("<log>")'
        raise SparkOptionError(PATH, f"no log named: use {what}")
    password = (get(options, PASSWORD) or "").encode()
    return Source(metadata=metadata, log=log, ledgers=ledgers, password=password)


def parse_ledgers(text: str) -> tuple[int, ...]:
    ids: list[int] = []
    for part in text.split(","):
        part = part.strip()
        # ASCII only: str.isdigit() also holds for "²", which int() refuses
        if not (part.isascii() and part.isdigit()) or int(part) > LEDGER_ID_MAX:
            raise SparkOptionError(
                LEDGERS, f"a comma-separated list of ledger ids (0..{LEDGER_ID_MAX}), got {text!r}"
            )
        ids.append(int(part))
    if len(set(ids)) != len(ids):
        raise SparkOptionError(LEDGERS, f"ledger ids repeat in {text!r}")
    return tuple(sorted(ids))


def parse_position(
    options: Mapping[str, str], name: str, default: str, allowed: tuple[str, ...]
) -> Literal["earliest", "latest"] | LogPosition:
    """A position option: one of the words in ``allowed`` or a JSON ``{"ledger_id", "entry_id"}``."""
    text = (get(options, name) or default).strip()
    if text.lower() in ("earliest", "latest"):
        word = text.lower()
        if word not in allowed:
            raise SparkOptionError(name, f"{word!r} is not accepted here; use {_allowed(allowed)}")
        return "earliest" if word == "earliest" else "latest"
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise SparkOptionError(name, f"expected {_POSITION_FORM}, got {text!r}") from None
    return position_from_json(name, value)


def position_from_json(name: str, value: object) -> LogPosition:
    if not isinstance(value, dict) or set(value) != {"ledger_id", "entry_id"}:
        raise SparkOptionError(name, f"expected {_POSITION_FORM}, got {value!r}")
    ledger_id, entry_id = value["ledger_id"], value["entry_id"]
    for field, number in (("ledger_id", ledger_id), ("entry_id", entry_id)):
        if isinstance(number, bool) or not isinstance(number, int) or number < 0:
            raise SparkOptionError(name, f"{field} must be an integer >= 0, got {number!r}")
    return LogPosition(ledger_id, entry_id)


def parse_positive_int(options: Mapping[str, str], name: str, default: int | None) -> int | None:
    text = get(options, name)
    if text is None:
        return default
    try:
        value = int(text.strip())
    except ValueError:
        raise SparkOptionError(name, f"an integer >= 1, got {text!r}") from None
    if not 1 <= value <= ENTRIES_MAX:
        raise SparkOptionError(name, f"an integer >= 1, got {text!r}")
    return value


def _allowed(words: tuple[str, ...]) -> str:
    forms = [f'"{word}"' for word in words] + ['a JSON position like {"ledger_id": 12, "entry_id": 0}']
    return " or ".join(forms)
