"""`LedgerMetadata`: the replicated ledger's metadata, its state machine, validation and serde.

Pure: no I/O, no asyncio. The rules come from the BookKeeper replication protocol (docs/replication.md §1):

- E >= Qw >= Qa >= 1 (ensemble size, write quorum, ack quorum).
- Ensembles (fragments) are ``(first_entry_id, bookies)`` pairs in strictly increasing first-entry order,
  the first starting at entry 0; each has exactly E distinct bookies.
- State OPEN -> IN_RECOVERY -> CLOSED, or OPEN -> CLOSED; CLOSED is final (`TRANSITIONS`).
- ``last_entry_id`` is set only when CLOSED (-1: closed empty); ``length`` (bytes) likewise.
- The client stores a *check value* of the ledger's key, never the password nor the key. Key format
  2 (``key_salt`` set): ``password_hash`` is ``SHA-256(prefix + master_key)`` where the master key
  comes from the password and the random ``key_salt`` through ``key_iterations`` rounds of PBKDF2
  (bookkeeper_aio/protocol/digest.py); a bookie can check a presented key against it. Format 3
  (``key_ledger_salt`` set as well): the same check value, of a master key derived from the PBKDF2
  of the password with ``key_salt`` (then the creating client's, shared by its ledgers) and the
  ledger's own random ``key_ledger_salt``. Format 4 (``key_format`` 4, with format 3's salts): the
  same, with the HMAC digest's MAC key derived from the ledger's secret too. Format 1 (no
  ``key_salt``, metadata written before): an unsalted hash of the password, checked by clients.
- ``replaced_bookies``: the history of ensemble changes, one `ReplacedBookie` per bookie replaced
  (the latest `REPLACED_BOOKIES_MAX` kept). A change at a fragment's first entry replaces that
  fragment in place, so without it the metadata would keep no trace of the replaced bookie.

Wire format: ``MAGIC`` + one msgpack map (maps, not arrays: here evolution matters more than speed).
The map carries ``format_version``; a decoder rejects versions newer than `FORMAT_VERSION` and any value
that is not our format with a `MetadataFormatError` naming the key and the ledger id. Optional keys
(``replaced_bookies``, ``key_salt``, ``key_iterations``, ``key_ledger_salt``, ``key_format``) are
written only when non-empty and read as empty when missing, so metadata written before them
decodes, and older decoders ignore them (same ``format_version``). A decoder keeps the keys it does
not know (``unknown_fields``) and `encode` writes them back unchanged: a field a newer version adds
survives a read-modify-write by this one. (Decoders older than this rule drop them: their CAS erases a newer
version's optional fields.)
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import functools
import operator
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack

from metadata.envelope import copy_with, open_envelope
from metadata.errors import InvalidMetadata, MetadataFormatError

FORMAT_VERSION = 1
MAGIC = b"BKLM"
LEDGER_ID_MAX = 2**63 - 1
# Bounds: a ledger's metadata must stay far below etcd's 1.5 MiB request limit.
ENSEMBLE_SIZE_MAX = 64
ENSEMBLES_MAX = 100_000
CUSTOM_METADATA_KEYS_MAX = 64
CUSTOM_METADATA_VALUE_BYTES_MAX = 8 * 1024
PASSWORD_HASH_BYTES_MAX = 128
KEY_SALT_BYTES_MAX = 64
KEY_ITERATIONS_MAX = 10_000_000
"""Bounds what a reader will run: more rounds would let a metadata writer stall every opener."""
KEY_FORMATS = frozenset({0, 4})
"""``key_format`` values: 0 (the salts say 1, 2 or 3) and 4 (docs/protocol.md §6.3)."""
BOOKIE_ID_CHARS_MAX = 256
ENCODED_BYTES_MAX = 1024 * 1024
REPLACED_BOOKIES_MAX = 64
DIGEST_TYPES = frozenset({"crc32c", "hmac-sha256", "none"})


class LedgerState(enum.Enum):
    OPEN = "OPEN"
    IN_RECOVERY = "IN_RECOVERY"
    CLOSED = "CLOSED"


# The states as module names for the code below: on Python 3.11 every ``Enum.MEMBER`` lookup takes
# ``EnumType.__getattr__``'s slow attribute path (about a thousand instructions).
_OPEN, _IN_RECOVERY, _CLOSED = LedgerState.OPEN, LedgerState.IN_RECOVERY, LedgerState.CLOSED

# The one transition table. A recoverer finding IN_RECOVERY proceeds without a transition.
TRANSITIONS: Mapping[LedgerState, frozenset[LedgerState]] = types.MappingProxyType(
    {
        LedgerState.OPEN: frozenset({LedgerState.IN_RECOVERY, LedgerState.CLOSED}),
        LedgerState.IN_RECOVERY: frozenset({LedgerState.CLOSED}),
        LedgerState.CLOSED: frozenset(),
    }
)

Ensemble = tuple[str, ...]
Fragment = tuple[int, Ensemble]


class ReplacedBookie(NamedTuple):
    """One bookie replaced by an ensemble change: in the fragment starting at ``first_entry``,
    ``bookie`` was replaced by ``replacement`` at ``time_ms`` (wall clock, ms since the epoch)."""

    first_entry: int
    bookie: str
    replacement: str
    time_ms: int


@dataclass(frozen=True, slots=True)
class LedgerMetadata:
    """Immutable ledger metadata. Build with `LedgerMetadata.new`, change with the ``with_*`` helpers."""

    ledger_id: int
    ensemble_size: int
    write_quorum: int
    ack_quorum: int
    state: LedgerState
    ensembles: tuple[Fragment, ...]
    digest_type: str = "crc32c"
    password_hash: bytes = b""
    custom_metadata: Mapping[str, bytes] = dataclasses.field(default_factory=dict)
    last_entry_id: int | None = None
    length: int = 0
    ctime_ms: int = 0
    format_version: int = FORMAT_VERSION
    replaced_bookies: tuple[ReplacedBookie, ...] = ()
    key_salt: bytes = b""
    """Key format 2: the per-ledger salt of the master key derivation (empty: format 1)."""
    key_iterations: int = 0
    """Key format 2: PBKDF2 rounds of the derivation."""
    key_ledger_salt: bytes = b""
    """Key format 3: the ledger's own salt, besides ``key_salt`` (then the creating client's)."""
    unknown_fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Fields of the stored map this version does not know (a newer writer's optional fields of
    the same ``format_version``), kept as decoded and written back unchanged by `encode`, so a
    change made by this version does not erase them."""
    key_format: int = 0
    """0: the format the salts imply (1, 2 or 3); 4: format 3's salts, with the HMAC digest's MAC
    key derived from the ledger's secret (not from the password alone) and the keys domain
    separated from format 3's."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ensembles", _ensembles(self.ensembles))
        object.__setattr__(self, "replaced_bookies", _replaced_bookies(self.replaced_bookies))
        object.__setattr__(self, "custom_metadata", _frozen_map(self.custom_metadata))
        object.__setattr__(self, "unknown_fields", _frozen_map(self.unknown_fields))
        validate(self)

    def _replace(self, **changes: Any) -> LedgerMetadata:
        """``dataclasses.replace(self, **changes)`` without its generic machinery: the fields not
        changed are taken as they are (this instance's are normalized already), the changed ones
        are normalized as ``__post_init__`` does, and the result is validated whole."""
        new = copy_with(self, _FIELD_NAMES, changes, _NORMALIZED)
        validate(new)
        return new

    @classmethod
    def new(
        cls,
        ledger_id: int,
        ensemble: Ensemble | list[str],
        *,
        write_quorum: int,
        ack_quorum: int,
        digest_type: str = "crc32c",
        password_hash: bytes = b"",
        custom_metadata: Mapping[str, bytes] | None = None,
        ctime_ms: int = 0,
        key_salt: bytes = b"",
        key_iterations: int = 0,
        key_ledger_salt: bytes = b"",
        key_format: int = 0,
    ) -> LedgerMetadata:
        """An OPEN ledger whose first ensemble starts at entry 0; E is ``len(ensemble)``."""
        return cls(
            ledger_id=ledger_id,
            ensemble_size=len(ensemble),
            write_quorum=write_quorum,
            ack_quorum=ack_quorum,
            state=_OPEN,
            ensembles=((0, tuple(ensemble)),),
            digest_type=digest_type,
            password_hash=password_hash,
            custom_metadata=custom_metadata or {},
            ctime_ms=ctime_ms,
            key_salt=key_salt,
            key_iterations=key_iterations,
            key_ledger_salt=key_ledger_salt,
            key_format=key_format,
        )

    # ---- queries ---------------------------------------------------------------------------------

    @property
    def is_closed(self) -> bool:
        return self.state is _CLOSED

    @property
    def current_ensemble(self) -> Ensemble:
        return self.ensembles[-1][1]

    def ensemble_for(self, entry_id: int) -> Ensemble:
        """The ensemble that stores ``entry_id`` (the last fragment starting at or before it)."""
        if entry_id < 0:
            raise InvalidMetadata(f"entry id must be >= 0, got {entry_id}")
        index = bisect.bisect_right(self.ensembles, entry_id, key=lambda fragment: fragment[0]) - 1
        return self.ensembles[index][1]

    # ---- changes (each returns a new, validated instance) -----------------------------------------

    def _transition(self, target: LedgerState, **changes: Any) -> LedgerMetadata:
        if target not in TRANSITIONS[self.state]:
            raise InvalidMetadata(
                f"ledger {self.ledger_id}: illegal transition {self.state.name} -> {target.name}"
            )
        return self._replace(state=target, **changes)

    def in_recovery(self) -> LedgerMetadata:
        """OPEN -> IN_RECOVERY (a recoverer marks the ledger before fencing)."""
        return self._transition(_IN_RECOVERY)

    def closed(self, last_entry_id: int, length: int) -> LedgerMetadata:
        """OPEN/IN_RECOVERY -> CLOSED at ``last_entry_id`` (-1: empty) with ``length`` bytes."""
        return self._transition(_CLOSED, last_entry_id=last_entry_id, length=length)

    def with_ensemble_change(self, first_entry_id: int, bookies: Ensemble | list[str]) -> LedgerMetadata:
        """A new fragment from ``first_entry_id`` on (replaces the last one if it starts there too)."""
        if self.is_closed:
            raise InvalidMetadata(f"ledger {self.ledger_id}: cannot change the ensemble of a closed ledger")
        last_first = self.ensembles[-1][0]
        if first_entry_id < last_first:
            raise InvalidMetadata(
                f"ledger {self.ledger_id}: ensemble change at entry {first_entry_id} "
                f"precedes the current fragment starting at {last_first}"
            )
        kept = self.ensembles[:-1] if first_entry_id == last_first else self.ensembles
        return self._replace(ensembles=(*kept, (first_entry_id, tuple(bookies))))

    def with_replaced_bookies(self, records: Sequence[ReplacedBookie]) -> LedgerMetadata:
        """``records`` appended to the replaced-bookies history (the latest `REPLACED_BOOKIES_MAX` kept)."""
        if not records:
            return self
        history = (*self.replaced_bookies, *records)[-REPLACED_BOOKIES_MAX:]
        return self._replace(replaced_bookies=history)

    def with_custom_metadata(self, updates: Mapping[str, bytes]) -> LedgerMetadata:
        """Custom metadata with ``updates`` merged in."""
        return self._replace(custom_metadata={**self.custom_metadata, **updates})


def _ensembles(ensembles: Sequence[tuple[int, Sequence[str]]]) -> tuple[Fragment, ...]:
    return tuple((int(first), tuple(bookies)) for first, bookies in ensembles)


def _replaced_bookies(records: Sequence[Sequence[Any]]) -> tuple[ReplacedBookie, ...]:
    return tuple(ReplacedBookie(*record) for record in records)


def _frozen_map(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    return types.MappingProxyType(dict(mapping))


_FIELD_NAMES = tuple(field.name for field in dataclasses.fields(LedgerMetadata))
_NORMALIZED: Mapping[str, Callable[[Any], Any]] = types.MappingProxyType(
    {
        "ensembles": _ensembles,
        "replaced_bookies": _replaced_bookies,
        "custom_metadata": _frozen_map,
        "unknown_fields": _frozen_map,
    }
)
"""What ``__post_init__`` makes of the fields a caller may pass in another shape (lists, dicts)."""


def validate(md: LedgerMetadata) -> None:
    """Raise `InvalidMetadata` naming the first broken invariant."""
    problem = _first_problem(md) or _ensembles_problem(md)
    if problem is not None:
        raise InvalidMetadata(f"invalid metadata for ledger {md.ledger_id}: {problem}")


def _is(value: object, kind: type) -> bool:
    """isinstance for values typed more narrowly than what a decoder may hand us."""
    return isinstance(value, kind)


def _first_problem(md: LedgerMetadata) -> str | None:
    if not 0 <= md.ledger_id <= LEDGER_ID_MAX:
        return f"ledger id {md.ledger_id} out of [0, 2^63-1]"
    if not ENSEMBLE_SIZE_MAX >= md.ensemble_size >= md.write_quorum >= md.ack_quorum >= 1:
        return f"need {ENSEMBLE_SIZE_MAX} >= E >= Qw >= Qa >= 1, got E={md.ensemble_size} " + (
            f"Qw={md.write_quorum} Qa={md.ack_quorum}"
        )
    if not _is(md.state, LedgerState):
        return f"unknown state {md.state!r}"
    if md.state is _CLOSED:
        if md.last_entry_id is None or md.last_entry_id < -1:
            return f"a CLOSED ledger needs last_entry_id >= -1, got {md.last_entry_id}"
        if md.length < 0 or (md.last_entry_id == -1 and md.length != 0):
            return f"bad length {md.length} for last entry {md.last_entry_id}"
    elif md.last_entry_id is not None or md.length != 0:
        return f"last_entry_id/length are set only when CLOSED (state {md.state.name})"
    if md.digest_type not in DIGEST_TYPES:
        return f"digest type {md.digest_type!r} not in {sorted(DIGEST_TYPES)}"
    if len(md.password_hash) > PASSWORD_HASH_BYTES_MAX:
        return f"password hash longer than {PASSWORD_HASH_BYTES_MAX} bytes"
    if len(md.key_salt) > KEY_SALT_BYTES_MAX or not 0 <= md.key_iterations <= KEY_ITERATIONS_MAX:
        return f"key salt over {KEY_SALT_BYTES_MAX} bytes or key iterations outside [0, {KEY_ITERATIONS_MAX}]"
    if bool(md.key_salt) != (md.key_iterations > 0):
        return "key_salt and key_iterations are set together (key format 2) or not at all"
    if md.key_ledger_salt and (not md.key_salt or len(md.key_ledger_salt) > KEY_SALT_BYTES_MAX):
        return f"key_ledger_salt needs key_salt (key format 3) and at most {KEY_SALT_BYTES_MAX} bytes"
    if md.key_format not in KEY_FORMATS or (md.key_format and not md.key_ledger_salt):
        return f"key_format must be one of {sorted(KEY_FORMATS)}, and 4 needs key_ledger_salt"
    if len(md.custom_metadata) > CUSTOM_METADATA_KEYS_MAX:
        return f"more than {CUSTOM_METADATA_KEYS_MAX} custom metadata keys"
    for name, value in md.custom_metadata.items():
        if not _is(name, str) or not _is(value, bytes):
            return f"custom metadata must map str -> bytes, got {name!r}: {type(value).__name__}"
        if len(value) > CUSTOM_METADATA_VALUE_BYTES_MAX:
            return f"custom metadata {name!r} longer than {CUSTOM_METADATA_VALUE_BYTES_MAX} bytes"
    if md.ctime_ms < 0 or md.format_version < 1:
        return "ctime_ms and format_version must be non-negative / >= 1"
    return _replaced_problem(md)


def _replaced_problem(md: LedgerMetadata) -> str | None:
    if len(md.replaced_bookies) > REPLACED_BOOKIES_MAX:
        return f"more than {REPLACED_BOOKIES_MAX} replaced bookies recorded"
    for first, bookie, replacement, time_ms in md.replaced_bookies:
        if not (_is(first, int) and _is(time_ms, int) and first >= 0 and time_ms >= 0):
            return f"bad replaced-bookie record at entry {first!r} (time {time_ms!r})"
        for name in (bookie, replacement):
            if not _is(name, str) or not 0 < len(name) <= BOOKIE_ID_CHARS_MAX:
                return f"bad bookie id {name!r} in the replaced-bookie record at entry {first}"
    return None


def _ensembles_problem(md: LedgerMetadata) -> str | None:
    if not 1 <= len(md.ensembles) <= ENSEMBLES_MAX:
        return f"need 1..{ENSEMBLES_MAX} ensembles, got {len(md.ensembles)}"
    if md.ensembles[0][0] != 0:
        return f"the first ensemble must start at entry 0, starts at {md.ensembles[0][0]}"
    previous = -1
    for first, bookies in md.ensembles:
        if first <= previous:
            return f"ensembles not in strictly increasing first-entry order at entry {first}"
        previous = first
        if len(bookies) != md.ensemble_size:
            return f"ensemble at entry {first} has {len(bookies)} bookies, E is {md.ensemble_size}"
        if len(set(bookies)) != len(bookies):
            return f"ensemble at entry {first} repeats a bookie: {list(bookies)}"
        for bookie in bookies:
            if not _is(bookie, str) or not 0 < len(bookie) <= BOOKIE_ID_CHARS_MAX:
                return f"bad bookie id {bookie!r} in ensemble at entry {first}"
    last = md.last_entry_id
    if last is not None and md.ensembles[-1][0] > last + 1:
        return f"ensemble starting at {md.ensembles[-1][0]} is beyond last entry {last} + 1"
    return None


# ---- serde ---------------------------------------------------------------------------------------


def encode(md: LedgerMetadata) -> bytes:
    """``MAGIC`` + msgpack map. Raises `InvalidMetadata` when the result exceeds `ENCODED_BYTES_MAX`."""
    body = {
        "format_version": md.format_version,
        "ledger_id": md.ledger_id,
        "ensemble_size": md.ensemble_size,
        "write_quorum": md.write_quorum,
        "ack_quorum": md.ack_quorum,
        "state": md.state.value,
        "last_entry_id": md.last_entry_id,
        "length": md.length,
        "ensembles": [[first, list(bookies)] for first, bookies in md.ensembles],
        "digest_type": md.digest_type,
        "password_hash": md.password_hash,
        "custom_metadata": dict(md.custom_metadata),
        "ctime_ms": md.ctime_ms,
    }
    if md.replaced_bookies:  # optional: absent (not empty) keeps older metadata byte-identical
        body["replaced_bookies"] = [list(record) for record in md.replaced_bookies]
    if md.key_salt:  # optional likewise: key format 2
        body["key_salt"] = md.key_salt
        body["key_iterations"] = md.key_iterations
    if md.key_ledger_salt:  # and key format 3
        body["key_ledger_salt"] = md.key_ledger_salt
    for name, value in md.unknown_fields.items():  # a newer writer's fields: kept as they were
        if name not in _KNOWN_FIELDS:
            body[name] = value
    if md.key_format:  # and key format 4
        body["key_format"] = md.key_format
    data = MAGIC + msgpack.packb(body, use_bin_type=True)
    if len(data) > ENCODED_BYTES_MAX:
        raise InvalidMetadata(
            f"ledger {md.ledger_id}: encoded metadata is {len(data)} bytes > {ENCODED_BYTES_MAX}"
        )
    if len(data) <= DECODED_BYTES_MAX and _round_trips(md):
        _keep_decoded(data, md)  # what decode would make of it: a writer reads its value back
    return data


_REPLACED_FIELD = msgpack.packb("replaced_bookies")


def may_record_replaced(data: bytes, bookie_id: str) -> bool:
    """False only when the stored metadata ``data`` (as :func:`encode` makes it) cannot record
    ``bookie_id`` replaced: its history is absent (no ensemble change ever), or the id's bytes
    appear nowhere in it (msgpack stores strings as their UTF-8 bytes). A filter before
    :func:`decode` when scanning many ledgers for one bookie; True says nothing yet."""
    return _REPLACED_FIELD in data and bookie_id.encode() in data


def may_not_hold(data: bytes, bookie_id: str) -> bool:
    """False only when the stored metadata ``data`` (as :func:`encode` makes it) surely names
    ``bookie_id`` and records no ensemble change: the bookie is then in its ensembles (or, rarely,
    its id is also a custom-metadata string: the ledger is then taken as held, which keeps a copy
    and never drops one). True for metadata that may leave the bookie out of every ensemble (its
    id, as the msgpack string :func:`encode` writes, appears nowhere: "b-1" is not found inside
    "b-10") or may record it replaced. A filter before :func:`decode` when scanning many ledgers
    for the copies one bookie holds but may not need; True says nothing yet."""
    return _REPLACED_FIELD in data or _packed_str(bookie_id) not in data


@functools.lru_cache(maxsize=64)
def _packed_str(text: str) -> bytes:
    """``text`` as msgpack stores it (packed once per bookie id, not once per ledger of a scan)."""
    packed: bytes = msgpack.packb(text)
    return packed


_FIELD_TYPES: Mapping[str, type | tuple[type, ...]] = types.MappingProxyType(
    {
        "format_version": int,
        "ledger_id": int,
        "ensemble_size": int,
        "write_quorum": int,
        "ack_quorum": int,
        "state": str,
        "last_entry_id": (int, type(None)),
        "length": int,
        "ensembles": list,
        "digest_type": str,
        "password_hash": bytes,
        "custom_metadata": dict,
        "ctime_ms": int,
    }
)


_OPTIONAL_FIELDS = frozenset(
    {"replaced_bookies", "key_salt", "key_iterations", "key_ledger_salt", "key_format"}
)
_KNOWN_FIELDS = frozenset(_FIELD_TYPES) | _OPTIONAL_FIELDS


DECODED_MAX = 256
"""Values :func:`decode` keeps decoded (a client reads the same value again and again: on open,
before and after each recovery step, on every CAS conflict), :func:`encode`'s among them."""
DECODED_BYTES_MAX = 16 * 1024
"""Larger values are decoded every time (the cache stays small: at most ``DECODED_MAX`` of these)."""
_decoded: dict[bytes, LedgerMetadata] = {}

_ROUND_TRIP_TYPES: Mapping[str, type | tuple[type, ...]] = types.MappingProxyType(
    {
        **{
            name: kind
            for name, kind in _FIELD_TYPES.items()
            if name not in ("state", "ensembles", "custom_metadata")  # validate checks these whole
        },
        "key_salt": bytes,
        "key_iterations": int,
        "key_ledger_salt": bytes,
        "key_format": int,
    }
)

_round_trip_fields = operator.attrgetter(*_ROUND_TRIP_TYPES)
_ROUND_TRIP_KINDS = tuple(_ROUND_TRIP_TYPES.values())


def _round_trips(md: LedgerMetadata) -> bool:
    """Whether :func:`decode` gives ``md`` back from ``encode(md)``, so that :func:`encode` may keep
    it as that value's decoding: no unknown fields (decode makes those anew), a format version
    decode reads, and each field whose type decode checks of that type (validation bounds values,
    not types: a float ledger id passes it, and decode refuses it)."""
    return (
        not md.unknown_fields
        and md.format_version <= FORMAT_VERSION
        and all(map(isinstance, _round_trip_fields(md), _ROUND_TRIP_KINDS))
    )


def _keep_decoded(data: bytes, md: LedgerMetadata) -> None:
    if len(_decoded) >= DECODED_MAX:
        del _decoded[next(iter(_decoded))]  # the oldest
    _decoded[data] = md


def decode(data: bytes, *, key: str, ledger_id: int | None = None) -> LedgerMetadata:
    """Parse stored metadata; raise `MetadataFormatError` naming ``key`` and the ledger on any problem.

    A value decoded before gives the same (immutable) `LedgerMetadata` again: decoding is a pure
    function of the bytes, checked against ``ledger_id`` each time. Only successes are kept, and
    only values whose every field is immutable (no ``unknown_fields``: those may hold lists)."""
    md = _decoded.get(data) if type(data) is bytes else None
    if md is not None and (ledger_id is None or md.ledger_id == ledger_id):
        return md
    md = _decode(data, key=key, ledger_id=ledger_id)
    if type(data) is bytes and len(data) <= DECODED_BYTES_MAX and not md.unknown_fields:
        _keep_decoded(data, md)
    return md


def _decode(data: bytes, *, key: str, ledger_id: int | None) -> LedgerMetadata:
    who = f"ledger {ledger_id}" if ledger_id is not None else "ledger"
    body = open_envelope(
        data,
        key=key,
        who=who,
        what="ledger metadata",
        magic=MAGIC,
        bytes_max=ENCODED_BYTES_MAX,
        format_version_max=FORMAT_VERSION,
        field_types=_FIELD_TYPES,
    )
    if ledger_id is not None and body["ledger_id"] != ledger_id:
        raise MetadataFormatError(key, f"{who}: value names ledger {body['ledger_id']}")
    replaced = body.get("replaced_bookies", [])  # optional: metadata written before it has none
    if not isinstance(replaced, list) or not all(
        isinstance(record, list) and len(record) == len(ReplacedBookie._fields) for record in replaced
    ):
        raise MetadataFormatError(key, f"{who}: field 'replaced_bookies' of wrong type")
    key_salt = body.get("key_salt", b"")  # optional: metadata of key format 1 has neither
    key_iterations = body.get("key_iterations", 0)
    if type(key_salt) is not bytes or type(key_iterations) is not int:
        raise MetadataFormatError(key, f"{who}: field 'key_salt' or 'key_iterations' of wrong type")
    key_ledger_salt = body.get("key_ledger_salt", b"")  # optional: key format 3 only
    if type(key_ledger_salt) is not bytes:
        raise MetadataFormatError(key, f"{who}: field 'key_ledger_salt' of wrong type")
    key_format = body.get("key_format", 0)  # optional: key format 4 only
    if type(key_format) is not int:
        raise MetadataFormatError(key, f"{who}: field 'key_format' of wrong type")
    try:
        return LedgerMetadata(
            ledger_id=body["ledger_id"],
            ensemble_size=body["ensemble_size"],
            write_quorum=body["write_quorum"],
            ack_quorum=body["ack_quorum"],
            state=LedgerState(body["state"]),
            ensembles=tuple((first, tuple(bookies)) for first, bookies in body["ensembles"]),
            digest_type=body["digest_type"],
            password_hash=body["password_hash"],
            custom_metadata=body["custom_metadata"],
            last_entry_id=body["last_entry_id"],
            length=body["length"],
            ctime_ms=body["ctime_ms"],
            format_version=body["format_version"],
            replaced_bookies=tuple(ReplacedBookie(*record) for record in replaced),
            key_salt=key_salt,
            key_iterations=key_iterations,
            key_ledger_salt=key_ledger_salt,
            unknown_fields={name: value for name, value in body.items() if name not in _KNOWN_FIELDS},
            key_format=key_format,
        )
    except (InvalidMetadata, ValueError, TypeError) as error:
        raise MetadataFormatError(key, f"{who}: {error}") from error
