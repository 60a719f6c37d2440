"""Log metadata (docs/replication.md §7, docs/metadata.md "Logs"): a pure model and its serde.

A log is a name and an ordered list of ledgers; only the last ledgers may still be OPEN (as far as
the log knows: the ledger's own metadata is the truth). The list is changed only by CAS
(`metadata.log_manager.LogManager`).

Stored value: ``MAGIC`` + a msgpack map carrying ``format_version``; a decoder rejects versions newer
than `FORMAT_VERSION` and any malformed value with `MetadataFormatError` naming the key and the log.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import msgpack

from metadata.envelope import open_envelope
from metadata.errors import InvalidMetadata, MetadataFormatError
from metadata.keys import validate_name

FORMAT_VERSION = 1
MAGIC = b"BKLG"
LEDGER_ID_MAX = 2**63 - 1
LEDGERS_MAX = 100_000
ENCODED_BYTES_MAX = 1024 * 1024


class LogLedgerState(enum.Enum):
    """A ledger's state as far as the log knows (the ledger's metadata may be ahead)."""

    OPEN = "open"
    CLOSED = "closed"


class LogLedger(NamedTuple):
    ledger_id: int
    state: LogLedgerState


@dataclass(frozen=True, slots=True)
class LogMetadata:
    name: str
    ledgers: tuple[LogLedger, ...] = ()
    ctime_ms: int = 0
    format_version: int = field(default=FORMAT_VERSION)

    def __post_init__(self) -> None:
        validate(self)

    @property
    def ledger_ids(self) -> tuple[int, ...]:
        return tuple(entry.ledger_id for entry in self.ledgers)

    def index_of(self, ledger_id: int) -> int | None:
        for index, entry in enumerate(self.ledgers):
            if entry.ledger_id == ledger_id:
                return index
        return None

    def with_ledger_appended(self, ledger_id: int) -> LogMetadata:
        """The list with ``ledger_id`` appended as OPEN. Raises `InvalidMetadata` if already listed."""
        return replace(self, ledgers=(*self.ledgers, LogLedger(ledger_id, LogLedgerState.OPEN)))

    def with_closed(self, *ledger_ids: int) -> LogMetadata:
        """The list with the given ledgers marked CLOSED (others unchanged, unknown ids ignored)."""
        closing = set(ledger_ids)
        return replace(
            self,
            ledgers=tuple(
                LogLedger(e.ledger_id, LogLedgerState.CLOSED) if e.ledger_id in closing else e
                for e in self.ledgers
            ),
        )


def validate(md: LogMetadata) -> None:
    problem = _first_problem(md)
    if problem is not None:
        raise InvalidMetadata(f"invalid metadata for log {md.name!r}: {problem}")


def _first_problem(md: LogMetadata) -> str | None:
    name: object = md.name
    if not isinstance(name, str):
        return "name must be a string"
    try:
        validate_name(md.name, "log name")
    except InvalidMetadata as error:
        return str(error)
    if not isinstance(md.format_version, int) or not 1 <= md.format_version <= FORMAT_VERSION:
        return f"format_version {md.format_version!r} unsupported"
    if not isinstance(md.ctime_ms, int) or isinstance(md.ctime_ms, bool) or md.ctime_ms < 0:
        return f"ctime_ms must be an int >= 0, got {md.ctime_ms!r}"
    if len(md.ledgers) > LEDGERS_MAX:
        return f"{len(md.ledgers)} ledgers > {LEDGERS_MAX}"
    seen: set[int] = set()
    entries: tuple[object, ...] = md.ledgers
    for entry in entries:
        if not isinstance(entry, LogLedger) or not isinstance(entry.state, LogLedgerState):
            return f"bad ledger entry {entry!r}"
        lid = entry.ledger_id
        if not isinstance(lid, int) or isinstance(lid, bool) or not 0 <= lid <= LEDGER_ID_MAX:
            return f"bad ledger id {lid!r}"
        if lid in seen:
            return f"ledger {lid} listed twice"
        seen.add(lid)
    return None


def encode(md: LogMetadata) -> bytes:
    """``MAGIC`` + msgpack map. Raises `InvalidMetadata` when the result exceeds `ENCODED_BYTES_MAX`."""
    body = {
        "format_version": md.format_version,
        "name": md.name,
        "ledgers": [[e.ledger_id, e.state.value] for e in md.ledgers],
        "ctime_ms": md.ctime_ms,
    }
    data = MAGIC + msgpack.packb(body, use_bin_type=True)
    if len(data) > ENCODED_BYTES_MAX:
        raise InvalidMetadata(f"log {md.name!r}: encoded metadata is {len(data)} bytes > {ENCODED_BYTES_MAX}")
    return data


def decode(data: bytes, *, key: str, name: str) -> LogMetadata:
    """Parse a stored log; raise `MetadataFormatError` naming ``key`` and the log on any problem."""
    who = f"log {name!r}"
    body = open_envelope(
        data,
        key=key,
        who=who,
        what="log metadata",
        magic=MAGIC,
        bytes_max=ENCODED_BYTES_MAX,
        format_version_max=FORMAT_VERSION,
        field_types={"name": str, "ledgers": list, "ctime_ms": int},
    )
    if body["name"] != name:
        raise MetadataFormatError(key, f"{who}: value names log {body['name']!r}")
    try:
        ledgers = tuple(_ledger(item) for item in body["ledgers"])
        return LogMetadata(name, ledgers, body["ctime_ms"], body["format_version"])
    except (InvalidMetadata, TypeError, ValueError) as error:
        raise MetadataFormatError(key, f"{who}: {error}") from error


def _ledger(item: object) -> LogLedger:
    if not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], int):
        raise ValueError(f"bad ledger entry {item!r}")
    return LogLedger(item[0], LogLedgerState(item[1]))
