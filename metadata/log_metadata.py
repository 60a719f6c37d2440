"""Log metadata (docs/replication.md §7, docs/metadata.md "Logs"): a pure model and its serde.

A log is a name and an ordered list of ledgers whose ids grow along the list; only the last two
ledgers may still be OPEN (as far as the log knows: the ledger's own metadata is the truth; a roll
lists the new ledger before it closes the previous one). The list is changed only by CAS
(`metadata.log_manager.LogManager`).

Stored value: ``MAGIC`` + a msgpack map carrying ``format_version``; a decoder rejects versions newer
than `FORMAT_VERSION` and any malformed value with `MetadataFormatError` naming the key and the log.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import msgpack

from metadata.envelope import copy_with, open_envelope
from metadata.errors import InvalidMetadata, MetadataFormatError
from metadata.keys import validate_name

FORMAT_VERSION = 2
"""1: ledgers as ``[id, state]``. 2: ledgers as ``[id, state, first_offset, last_entry_id, length,
closed_ms]`` plus ``truncated_before``, ``sequenced`` and ``commits`` (a version-1 value decodes with
the new fields unknown or empty); ``truncated_sequence`` and ``spare`` are optional (absent: None),
``commit_tags`` too (absent: empty; a version-2 decoder that predates it ignores it)."""
MAGIC = b"BKLG"
LEDGER_ID_MAX = 2**63 - 1
ENCODED_BYTES_MAX = 1024 * 1024
"""The cap on a stored list: it bounds the number of ledgers (`has_room`)."""
LEDGER_BYTES_MAX = 53
"""The most one ledger takes in the encoded list: ``[id, "closed", first_offset, last_entry_id,
length, closed_ms]`` with every number a 9-byte msgpack uint64. So a list has room for at least
(`ENCODED_BYTES_MAX` - the rest) / 53 ~ 19,700 ledgers; typical values (ids, offsets and lengths
below 2^32, a millisecond close time) take 33-37 bytes: ~28,000-31,000."""
LEDGER_BYTES_MIN = 11
"""The least one ledger takes (a small id, ``"open"``, four nils)."""
LEDGERS_MAX = ENCODED_BYTES_MAX // LEDGER_BYTES_MIN
"""No list within `ENCODED_BYTES_MAX` holds more (a decoding bound; `has_room` is the limit)."""
COMMITS_MAX = 10_000
IMPORTER_BYTES_MAX = 256
"""The longest importer id of a commit token a change may add, in UTF-8 bytes (as long as a log
name may be). The list's room (`has_room`) counts the tokens' bytes too: without a cap one importer
id could take the room of thousands of ledgers, and a few such ids all of it. A token stored before
the cap existed still decodes (and may get new batch ids)."""
COMMIT_TAG_BYTES_MAX = 64
"""The longest tag of a commit token (`LogMetadata.commit_tags`), in UTF-8 bytes: a Spark query id
(a UUID, 36 bytes) fits."""


class LogLedgerState(enum.Enum):
    """A ledger's state as far as the log knows (the ledger's metadata may be ahead)."""

    OPEN = "open"
    CLOSED = "closed"


class LogLedger(NamedTuple):
    """One ledger of the list. ``first_offset`` is the log-wide offset of the ledger's entry 0 (the
    number of records the log held before it, truncated ones included): known once every earlier
    ledger's last entry is. ``last_entry_id`` (-1: empty), ``length`` (payload bytes) and
    ``closed_ms`` are recorded when the log marks the ledger CLOSED."""

    ledger_id: int
    state: LogLedgerState
    first_offset: int | None = None
    last_entry_id: int | None = None
    length: int | None = None
    closed_ms: int | None = None

    @property
    def entries(self) -> int | None:
        return None if self.last_entry_id is None else self.last_entry_id + 1


@dataclass(frozen=True, slots=True)
class LogMetadata:
    """``truncated_before``: records of ledgers with smaller ids were truncated (0: never).
    ``sequenced``: appends carry a writer-supplied sequence number (docs/api.md "Logs").
    ``commits``: per importer id, the last batch id committed with its ledgers (exactly-once
    imports). ``commit_tags``: per importer id (one of ``commits``), what produced its last committed
    batch (a Spark query id): the same batch id from another producer is not a replay. An importer
    without a tag (one stored before tags existed, or committed without one) has its batch id only.
    ``truncated_sequence``: sequenced logs, the highest sequence number truncation
    removed (a new writer's duplicate check starts there when no record is left). ``spare``: a
    ledger the leader created for its next roll, not part of the log (its id is above every listed
    one); whoever takes the log over deletes it."""

    name: str
    ledgers: tuple[LogLedger, ...] = ()
    ctime_ms: int = 0
    format_version: int = field(default=FORMAT_VERSION)
    truncated_before: int = 0
    sequenced: bool = False
    commits: Mapping[str, int] = field(default_factory=dict)
    truncated_sequence: int | None = None
    spare: int | None = None
    commit_tags: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "commits", types.MappingProxyType(dict(self.commits)))
        object.__setattr__(self, "commit_tags", types.MappingProxyType(dict(self.commit_tags)))
        validate(self)

    def _replace(self, **changes: Any) -> LogMetadata:
        """``dataclasses.replace(self, **changes)``, checking again only what changed: the ledger
        entries and the commits this (valid) instance hands on are not validated twice."""
        new = copy_with(self, _FIELD_NAMES, changes, _NORMALIZED)
        validate(new, valid=self)
        return new

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LogMetadata):
            return NotImplemented
        return _comparable(self) == _comparable(other)

    def __hash__(self) -> int:
        return hash(_comparable(self))

    @property
    def ledger_ids(self) -> tuple[int, ...]:
        return tuple(entry.ledger_id for entry in self.ledgers)

    @property
    def last_ledger_id(self) -> int:
        """The largest id the list ever held (0 for a log that never had a ledger)."""
        return self.ledgers[-1].ledger_id if self.ledgers else max(0, self.truncated_before - 1)

    def index_of(self, ledger_id: int) -> int | None:
        for index, entry in enumerate(self.ledgers):
            if entry.ledger_id == ledger_id:
                return index
        return None

    def with_ledger_appended(self, ledger_id: int) -> LogMetadata:
        """The list with ``ledger_id`` appended as OPEN and no spare recorded (it was this ledger,
        or it is not above the list's end any more). Raises `InvalidMetadata` unless its id is
        larger than every listed one."""
        ledgers = (*self.ledgers, LogLedger(ledger_id, LogLedgerState.OPEN))
        return self._replace(ledgers=_with_offsets(ledgers, self.truncated_before), spare=None)

    def with_spare(self, ledger_id: int | None) -> LogMetadata:
        """The list recording ``ledger_id`` as the leader's spare (None: no spare). Raises
        `InvalidMetadata` unless its id is larger than every listed one."""
        return self._replace(spare=ledger_id)

    def with_closed(
        self,
        ledger_id: int,
        *,
        last_entry_id: int | None = None,
        length: int | None = None,
        closed_ms: int | None = None,
    ) -> LogMetadata:
        """The list with ``ledger_id`` marked CLOSED, with what is known of its end (unknown ids
        ignored); later ledgers' first offsets follow when they can."""
        ledgers = tuple(
            e._replace(
                state=LogLedgerState.CLOSED,
                last_entry_id=e.last_entry_id if last_entry_id is None else last_entry_id,
                length=e.length if length is None else length,
                closed_ms=e.closed_ms if closed_ms is None else closed_ms,
            )
            if e.ledger_id == ledger_id
            else e
            for e in self.ledgers
        )
        return self._replace(ledgers=_with_offsets(ledgers, self.truncated_before))

    def with_truncated_before(self, ledger_id: int, *, sequence: int | None = None) -> LogMetadata:
        """The list without the ledgers whose ids are below ``ledger_id``; ``sequence``: the highest
        sequence number among the records removed (sequenced logs)."""
        floors = [value for value in (self.truncated_sequence, sequence) if value is not None]
        return self._replace(
            ledgers=tuple(e for e in self.ledgers if e.ledger_id >= ledger_id),
            truncated_before=max(self.truncated_before, ledger_id),
            truncated_sequence=max(floors) if floors else None,
        )

    def with_commit(self, importer: str, batch_id: int, tag: str | None = None) -> LogMetadata:
        """The list recording ``batch_id`` as ``importer``'s last committed batch, produced by
        ``tag`` (None: no tag; an earlier batch's tag is dropped)."""
        tags = {name: value for name, value in self.commit_tags.items() if name != importer}
        if tag is not None:
            tags[importer] = tag
        return self._replace(commits={**self.commits, importer: batch_id}, commit_tags=tags)


def _comparable(md: LogMetadata) -> tuple[object, ...]:
    return (
        md.name,
        md.ledgers,
        md.ctime_ms,
        md.format_version,
        md.truncated_before,
        md.sequenced,
        tuple(sorted(md.commits.items())),
        md.truncated_sequence,
        md.spare,
        tuple(sorted(md.commit_tags.items())),
    )


def _with_offsets(entries: tuple[LogLedger, ...], truncated_before: int) -> tuple[LogLedger, ...]:
    """``entries`` with first offsets filled in along the list where the previous ledger's are
    known (the first ledger of a never-truncated log starts at 0)."""
    ledgers = list(entries)
    for index, entry in enumerate(ledgers):
        if entry.first_offset is not None:
            continue
        if index == 0:
            if truncated_before == 0:
                ledgers[0] = entry._replace(first_offset=0)
            continue
        previous = ledgers[index - 1]
        if previous.first_offset is not None and previous.entries is not None:
            ledgers[index] = entry._replace(first_offset=previous.first_offset + previous.entries)
    return tuple(ledgers)


_FIELD_NAMES = tuple(f.name for f in fields(LogMetadata))
_NORMALIZED: Mapping[str, Callable[[Any], Any]] = types.MappingProxyType(
    {
        "commits": lambda commits: types.MappingProxyType(dict(commits)),
        "commit_tags": lambda tags: types.MappingProxyType(dict(tags)),
    }
)
"""What ``__post_init__`` makes of a field a caller may pass in another shape (a dict)."""


def validate(md: LogMetadata, *, valid: LogMetadata | None = None) -> None:
    """Raise `InvalidMetadata` naming the first problem of ``md``. ``valid``: a valid instance
    whose ledger entries and commits ``md`` shares need no second look (immutable, checked)."""
    problem = _first_problem(md, valid)
    if problem is not None:
        raise InvalidMetadata(f"invalid metadata for log {md.name!r}: {problem}")


def _is_int(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= LEDGER_ID_MAX


def _first_problem(md: LogMetadata, valid: LogMetadata | None = None) -> str | None:
    name: object = md.name
    if not isinstance(name, str):
        return "name must be a string"
    try:
        validate_name(md.name, "log name")
    except InvalidMetadata as error:
        return str(error)
    if not isinstance(md.format_version, int) or not 1 <= md.format_version <= FORMAT_VERSION:
        return f"format_version {md.format_version!r} unsupported"
    if not _is_int(md.ctime_ms, 0):
        return f"ctime_ms must be an int >= 0, got {md.ctime_ms!r}"
    if not _is_int(md.truncated_before, 0):
        return f"truncated_before must be an int >= 0, got {md.truncated_before!r}"
    sequenced: object = md.sequenced
    if not isinstance(sequenced, bool):
        return f"sequenced must be a bool, got {sequenced!r}"
    if md.truncated_sequence is not None and not (
        isinstance(md.truncated_sequence, int)
        and not isinstance(md.truncated_sequence, bool)
        and 0 <= md.truncated_sequence < 2**64
    ):
        return f"truncated_sequence must be None or an int in [0, 2^64), got {md.truncated_sequence!r}"
    if md.spare is not None and not (_is_int(md.spare, 0) and md.spare > md.last_ledger_id):
        return f"spare ledger {md.spare!r} is not above the last listed ledger {md.last_ledger_id}"
    if len(md.commits) > COMMITS_MAX:
        return f"{len(md.commits)} commit tokens > {COMMITS_MAX}"
    commits = md.commits.items() if valid is None or md.commits is not valid.commits else ()
    for importer, batch in commits:
        # The cap binds a token a change adds: one stored before the cap (decoded, no ``valid``)
        # stays readable, so its log can still be written, truncated and deleted.
        problem = importer_problem(importer, capped=valid is not None and importer not in valid.commits)
        if problem is not None:
            return problem
        if not _is_int(batch, 0):
            return f"bad commit token {importer!r}: {batch!r}"
    if valid is None or md.commit_tags is not valid.commit_tags:
        for importer, tag in md.commit_tags.items():
            if importer not in md.commits:
                return f"commit tag of importer {importer!r:.60}, which has no commit token"
            problem = commit_tag_problem(tag)
            if problem is not None:
                return problem
    if len(md.ledgers) > LEDGERS_MAX:
        return f"{len(md.ledgers)} ledgers > {LEDGERS_MAX}"
    previous = md.truncated_before - 1
    entries: tuple[object, ...] = md.ledgers
    checked = {id(entry) for entry in valid.ledgers} if valid is not None else set()
    for entry in entries:
        problem = None if id(entry) in checked else _ledger_problem(entry)
        if problem is not None:
            return problem
        assert isinstance(entry, LogLedger)
        if entry.ledger_id <= previous:
            return f"ledger {entry.ledger_id} is not above the one before it ({previous}): ids must grow"
        previous = entry.ledger_id
    return None


def importer_problem(importer: object, *, capped: bool = True) -> str | None:
    """What is wrong with ``importer`` as the importer id of a commit token (None: nothing);
    ``capped``: held to `IMPORTER_BYTES_MAX` too (a new token)."""
    return _text_problem("importer id", importer, IMPORTER_BYTES_MAX if capped else None)


def commit_tag_problem(tag: object) -> str | None:
    """What is wrong with ``tag`` as the tag of a commit token (None: nothing)."""
    return _text_problem("commit tag", tag, COMMIT_TAG_BYTES_MAX)


def _text_problem(what: str, value: object, bytes_max: int | None) -> str | None:
    """What is wrong with ``value`` as a non-empty string of at most ``bytes_max`` UTF-8 bytes
    (None: any length), named ``what`` in the message (None: nothing)."""
    if not isinstance(value, str) or not value:
        return f"bad {what} {value!r:.60}: must be a non-empty string"
    if bytes_max is None:
        return None
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        return f"bad {what} {value!r:.60}: not encodable as UTF-8"
    if size > bytes_max:
        return f"{what} of {size} bytes > {bytes_max} (UTF-8): {value[:40]!r}..."
    return None


def _ledger_problem(entry: object) -> str | None:
    if not isinstance(entry, LogLedger) or not isinstance(entry.state, LogLedgerState):
        return f"bad ledger entry {entry!r}"
    if not _is_int(entry.ledger_id, 0):
        return f"bad ledger id {entry.ledger_id!r}"
    for what, index, minimum in _OPTIONAL_FIELDS:
        value = entry[index]
        if value is not None and not _is_int(value, minimum):
            return f"ledger {entry.ledger_id}: bad {what} {value!r}"
    return None


_OPTIONAL_FIELDS = tuple(
    (what, LogLedger._fields.index(what), minimum)
    for what, minimum in (("first_offset", 0), ("last_entry_id", -1), ("length", 0), ("closed_ms", 0))
)
"""The optional fields of a `LogLedger`: (name, index, minimum)."""


def has_room(md: LogMetadata, ledgers: int = 1) -> bool:
    """Whether ``md`` stays within `ENCODED_BYTES_MAX` with ``ledgers`` more ledgers, whatever
    their values, and the changes that go with adding them: the last two listed ledgers marked
    CLOSED with their ends and a spare recorded. Checked before a ledger is created for the list
    (a roll, a spare, a new writer) or imported into it, so a full list refuses the ledger up front
    and the writer's close and the next takeover still fit."""
    return encoded_size(md) + (ledgers + 2) * LEDGER_BYTES_MAX + 9 <= ENCODED_BYTES_MAX


def encoded_size(md: LogMetadata) -> int:
    """The length of `encode` ``md`` (without its cap check)."""
    return len(MAGIC) + len(_packed(md))


def encode(md: LogMetadata) -> bytes:
    """``MAGIC`` + msgpack map. Raises `InvalidMetadata` when the result exceeds `ENCODED_BYTES_MAX`."""
    data = MAGIC + _packed(md)
    if len(data) > ENCODED_BYTES_MAX:
        raise InvalidMetadata(f"log {md.name!r}: encoded metadata is {len(data)} bytes > {ENCODED_BYTES_MAX}")
    return data


def _packed(md: LogMetadata) -> bytes:
    body = {
        "format_version": FORMAT_VERSION,
        "name": md.name,
        "ledgers": [
            [e.ledger_id, e.state.value, e.first_offset, e.last_entry_id, e.length, e.closed_ms]
            for e in md.ledgers
        ],
        "ctime_ms": md.ctime_ms,
        "truncated_before": md.truncated_before,
        "sequenced": md.sequenced,
        "commits": dict(md.commits),
        "truncated_sequence": md.truncated_sequence,
        "spare": md.spare,
    }
    if md.commit_tags:
        body["commit_tags"] = dict(md.commit_tags)
    return msgpack.packb(body, use_bin_type=True)


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
        commits = _commits(body.get("commits", {}))
        commit_tags = _commits(body.get("commit_tags", {}))
        return LogMetadata(
            name,
            ledgers,
            body["ctime_ms"],
            FORMAT_VERSION,
            truncated_before=body.get("truncated_before", 0),
            sequenced=body.get("sequenced", False),
            commits=commits,
            truncated_sequence=body.get("truncated_sequence"),
            spare=body.get("spare"),
            commit_tags=commit_tags,
        )
    except (InvalidMetadata, TypeError, ValueError) as error:
        raise MetadataFormatError(key, f"{who}: {error}") from error


def _commits(value: object) -> dict[str, Any]:
    """A map of commit tokens or of their tags (its entries are checked by `validate`)."""
    if not isinstance(value, dict):
        raise TypeError(f"commits must be a map, got {type(value).__name__}")
    return value


def _ledger(item: object) -> LogLedger:
    if not isinstance(item, list) or len(item) not in (2, 6) or not isinstance(item[0], int):
        raise ValueError(f"bad ledger entry {item!r}")
    return LogLedger(item[0], LogLedgerState(item[1]), *item[2:])


CURSOR_MAGIC = b"BKCR"
CURSOR_BYTES_MAX = 1024


def encode_cursor(ledger_id: int, entry_id: int, mtime_ms: int) -> bytes:
    """A named cursor's value: the last position it consumed, and when it was committed."""
    if not _is_int(ledger_id, 0) or not _is_int(entry_id, -1):
        raise InvalidMetadata(f"bad cursor position ({ledger_id!r}, {entry_id!r})")
    body = {"format_version": 1, "ledger_id": ledger_id, "entry_id": entry_id, "mtime_ms": mtime_ms}
    return CURSOR_MAGIC + msgpack.packb(body, use_bin_type=True)


def decode_cursor(data: bytes, *, key: str, name: str) -> tuple[int, int]:
    """(ledger id, entry id) of a stored cursor; `MetadataFormatError` naming the key and log."""
    body = open_envelope(
        data,
        key=key,
        who=f"a cursor of log {name!r}",
        what="a log cursor",
        magic=CURSOR_MAGIC,
        bytes_max=CURSOR_BYTES_MAX,
        format_version_max=1,
        field_types={"ledger_id": int, "entry_id": int},
    )
    ledger_id, entry_id = body["ledger_id"], body["entry_id"]
    if not _is_int(ledger_id, 0) or not _is_int(entry_id, -1):
        raise MetadataFormatError(
            key, f"a cursor of log {name!r}: bad position ({ledger_id!r}, {entry_id!r})"
        )
    return ledger_id, entry_id
