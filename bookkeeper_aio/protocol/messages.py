"""Requests and responses: msgpack arrays with positional fields (fast on the hot path).

A request is ``[op, request_id, *fields]``; a response ``[op, request_id, status, message, *fields]``
where ``message`` is a human-readable error text or nil. Rules (docs/protocol.md):

- Each field is validated by type and range on decode; a wrong value raises :class:`ProtocolError`
  carrying the request id and op when those were readable, so the peer gets an EBADREQ answer.
- Trailing fields beyond the ones known are ignored (room to evolve without a version bump).
- A response whose status is not EOK may end right after ``message``; the missing fields take their
  defaults. Fields a response does carry are checked as for EOK.
- ``bool`` is never accepted where an integer is expected.
"""

from __future__ import annotations

import functools
import reprlib
import struct
from collections.abc import Callable
from typing import Any, NamedTuple

import crc32c
import msgpack

from bookkeeper_aio.protocol.codes import (
    ADD_ACKS_IDS_MAX,
    AUTH_PAYLOAD_BYTES_MAX,
    BATCH_READ_COUNT_MAX,
    BATCH_READ_STEP_MAX,
    FEATURES_MAX,
    FRAME_BYTES_MAX,
    ID_MAX,
    LONG_POLL_TIMEOUT_MS_MAX,
    MASTER_KEY_BYTES_MAX,
    NO_ENTRY,
    REQUEST_ID_MAX,
    STATUS_VALUES,
    OpCode,
    ReadFlag,
    StatusCode,
)
from bookkeeper_aio.protocol.digest import DIGEST_BYTES, HEADER, HEADER_BYTES, DigestType
from bookkeeper_aio.protocol.errors import ProtocolError, RequestTooComplex
from bookkeeper_aio.protocol.framing import LENGTH, LENGTH_BYTES


class _ShortRepr(reprlib.Repr):
    """``reprlib``'s bounded repr, bytes cut before their repr is built (reprlib builds a bytes
    object's full repr, then cuts it: a MiB for a MiB value in an error message)."""

    def repr_bytes(self, x: bytes, level: int) -> str:
        return repr(x[: self.maxstring]) + ("..." if len(x) > self.maxstring else "")


_SHORT = _ShortRepr()


def _short(value: Any) -> str:
    """A value in an error message: at most about 80 characters, whatever its size, built without
    the whole value's repr."""
    return _SHORT.repr(value)[:80]


_SECRET_FIELDS = frozenset(("master_key", "payload"))
"""Fields whose rejected value an error message does not show (a ledger's key, an AUTH step's
token or credentials): the message goes to the bookie's log and back to the peer."""


def _shown(name: str, value: Any) -> str:
    """``value`` of field ``name`` in an error message: its type and length only for a secret."""
    if name not in _SECRET_FIELDS:
        return _short(value)
    size = f" of length {len(value)}" if isinstance(value, (bytes, str, list, dict)) else ""
    return f"(not shown) {type(value).__name__}{size}"


TEXT_CHARS_MAX = 1024
"""Names, ids and messages on the wire are short; a longer string is a malformed message."""
INFO_KEYS_MAX = 64
RANGES_MAX = 1_000_000
"""GET_LIST_OF_ENTRIES_OF_LEDGER answers with at most this many [first, last] ranges."""

# ---------------------------------------------------------------- field checkers
Check = Callable[[Any], bool]


def _int_in(low: int, high: int) -> Check:
    return lambda v: type(v) is int and low <= v <= high


def _bytes_max(limit: int) -> Check:
    return lambda v: type(v) is bytes and len(v) <= limit


def _or_none(check: Check) -> Check:
    return lambda v: v is None or check(v)


def _text(v: Any) -> bool:
    return type(v) is str and len(v) <= TEXT_CHARS_MAX


def _bodies(v: Any) -> bool:
    return type(v) is list and len(v) <= BATCH_READ_COUNT_MAX and all(type(b) is bytes for b in v)


def _ranges(v: Any) -> bool:
    return (
        type(v) is list
        and len(v) <= RANGES_MAX
        and all(
            type(r) is list and len(r) == 2 and _entry_id(r[0]) and _entry_id(r[1]) and r[0] <= r[1]
            for r in v
        )
    )


def _info(v: Any) -> bool:
    return (
        type(v) is dict
        and len(v) <= INFO_KEYS_MAX
        and all(type(k) is str and (type(x) is int or _text(x)) for k, x in v.items())
    )


_request_id = _int_in(0, REQUEST_ID_MAX)
_ledger_id = _int_in(0, ID_MAX)
_entry_id = _int_in(0, ID_MAX)
_read_entry_id = _int_in(NO_ENTRY, ID_MAX)
_lac = _int_in(NO_ENTRY, ID_MAX)
_length = _int_in(0, ID_MAX)
_flags = _int_in(0, 0xFF)
_key = _bytes_max(MASTER_KEY_BYTES_MAX)
_body = _bytes_max(FRAME_BYTES_MAX)
_version = _int_in(0, 0xFFFF)
_timeout_ms = _int_in(0, LONG_POLL_TIMEOUT_MS_MAX)
_count = _int_in(1, BATCH_READ_COUNT_MAX)
_step = _int_in(1, BATCH_READ_STEP_MAX)
_max_bytes = _int_in(1, FRAME_BYTES_MAX)
_status: Check = lambda v: type(v) is int and v in STATUS_VALUES  # noqa: E731
_features = _int_in(0, FEATURES_MAX)
_auth_payload = _bytes_max(AUTH_PAYLOAD_BYTES_MAX)
_complete = _int_in(0, 1)
_bool: Check = lambda v: type(v) is bool  # noqa: E731


def _request_ids(v: Any) -> bool:
    return (
        type(v) is list
        and 0 < len(v) <= ADD_ACKS_IDS_MAX
        and all(type(r) is int and 0 <= r <= REQUEST_ID_MAX for r in v)
    )


# ---------------------------------------------------------------- requests
class HelloRequest(NamedTuple):
    request_id: int
    protocol_version: int
    client_name: str
    features: int = 0
    """``FEATURE_*`` bits the client supports (optional: a client that sends none gets none)."""


class AuthRequest(NamedTuple):
    """One step of the authentication handshake: ``provider`` names the auth provider (``"token"``
    built in), ``payload`` is its opaque data (the token; the answer to a challenge)."""

    request_id: int
    provider: str
    payload: bytes


class AddEntryRequest(NamedTuple):
    request_id: int
    ledger_id: int
    entry_id: int
    flags: int
    master_key: bytes
    body: bytes


class ReadEntryRequest(NamedTuple):
    """Read one entry. ``entry_id`` -1 reads the last entry. With ``LONG_POLL``: wait until the
    LAC passes ``previous_lac`` (or ``timeout_ms``); with ``ENTRY_PIGGYBACK`` also return
    ``entry_id`` (normally ``previous_lac + 1``). ``master_key``: the ledger's; a bookie refuses a
    read without it (EUA), and the codec refuses ``FENCE_LEDGER`` without it (EBADREQ)."""

    request_id: int
    ledger_id: int
    entry_id: int
    flags: int = 0
    master_key: bytes | None = None
    previous_lac: int = NO_ENTRY
    timeout_ms: int = 0


class ReadLacRequest(NamedTuple):
    request_id: int
    ledger_id: int
    master_key: bytes | None = None
    """The ledger's (added after version 1 shipped: optional on the wire; a bookie refuses a read
    without it, EUA)."""


class WriteLacRequest(NamedTuple):
    request_id: int
    ledger_id: int
    master_key: bytes
    lac: int


class ForceLedgerRequest(NamedTuple):
    request_id: int
    ledger_id: int
    master_key: bytes


class BatchReadRequest(NamedTuple):
    """Entries ``start_entry_id``, ``+ step``, ``+ 2 step`` ..., stopping at the first one missing,
    at ``max_count`` entries, or before the response would exceed ``max_bytes``. ``step`` > 1 reads
    one bookie's share of a striped ledger (every E-th entry); a bookie that knows it echoes it in
    the response (an older one ignores it and answers consecutive entries, without the echo)."""

    request_id: int
    ledger_id: int
    start_entry_id: int
    max_count: int
    max_bytes: int
    flags: int = 0
    master_key: bytes | None = None
    step: int = 1


class GetBookieInfoRequest(NamedTuple):
    request_id: int


class GetListOfEntriesRequest(NamedTuple):
    request_id: int
    ledger_id: int
    master_key: bytes | None = None
    """As :class:`ReadLacRequest`'s."""


Request = (
    HelloRequest
    | AuthRequest
    | AddEntryRequest
    | ReadEntryRequest
    | ReadLacRequest
    | WriteLacRequest
    | ForceLedgerRequest
    | BatchReadRequest
    | GetBookieInfoRequest
    | GetListOfEntriesRequest
)


# ---------------------------------------------------------------- responses
class HelloResponse(NamedTuple):
    request_id: int
    status: int
    message: str | None = None
    protocol_version: int = 0
    bookie_id: str = ""
    frame_bytes_max: int = FRAME_BYTES_MAX
    features: int = 0
    """``FEATURE_*`` bits the bookie will use on this connection: a subset of the client's."""


class AuthResponse(NamedTuple):
    """EOK with ``complete`` 1: authenticated. EOK with ``complete`` 0: ``payload`` is a challenge
    the client answers with another AUTH. EUA: refused (the bookie closes the connection)."""

    request_id: int
    status: int
    message: str | None = None
    provider: str = ""
    payload: bytes = b""
    complete: int = 0


class AddEntryResponse(NamedTuple):
    request_id: int
    status: int
    message: str | None = None
    ledger_id: int = 0
    entry_id: int = 0


class ReadEntryResponse(NamedTuple):
    """``body`` is the entry asked for (for entry -1: the last entry; ``entry_id`` says which),
    or nil (no such entry, or a long poll that timed out). ``lac`` is the bookie's LAC.

    ``unreadable`` (a trailing field added after version 1): only in the EOK answer to a fencing
    read of entry -1 whose last entry (``entry_id``) the bookie stores but cannot read (corrupt, or
    an I/O error): the fence is durable, ``body`` is nil, and the entry is *not* absent
    (docs/protocol.md §7.2)."""

    request_id: int
    status: int
    message: str | None = None
    ledger_id: int = 0
    entry_id: int = NO_ENTRY
    body: bytes | None = None
    lac: int = NO_ENTRY
    unreadable: bool = False


class ReadLacResponse(NamedTuple):
    request_id: int
    status: int
    message: str | None = None
    ledger_id: int = 0
    lac: int = NO_ENTRY


class WriteLacResponse(NamedTuple):
    request_id: int
    status: int
    message: str | None = None
    ledger_id: int = 0


class ForceLedgerResponse(NamedTuple):
    request_id: int
    status: int
    message: str | None = None
    ledger_id: int = 0


class BatchReadResponse(NamedTuple):
    """``bodies[i]`` is entry ``start_entry_id + i * step``; ``step`` is the request's, echoed."""

    request_id: int
    status: int
    message: str | None = None
    ledger_id: int = 0
    start_entry_id: int = 0
    bodies: list[bytes] = []
    lac: int = NO_ENTRY
    step: int = 1


class GetBookieInfoResponse(NamedTuple):
    """``info``: ``free_disk_bytes``, ``total_disk_bytes`` (of the bookie's last disk check; absent
    before the first, or when it failed), ``journal_bytes``, ``ledgers``, ``ledger_id_max`` (the
    highest ledger id held, 0: none), ``state`` ("writable" | "readonly"), more keys may be added."""

    request_id: int
    status: int
    message: str | None = None
    info: dict[str, int | str] = {}


class AddAcksResponse(NamedTuple):
    """EOK answers of the ADD_ENTRY requests ``request_ids`` (op ADD_ACKS, only to a client that
    asked for FEATURE_ADD_ACKS). ``request_id`` is 0 and matches nothing."""

    request_id: int
    status: int
    message: str | None = None
    request_ids: list[int] = []


class GetListOfEntriesResponse(NamedTuple):
    """``ranges``: sorted, disjoint ``[first, last]`` entry id ranges this bookie stores."""

    request_id: int
    status: int
    message: str | None = None
    ledger_id: int = 0
    ranges: list[list[int]] = []


Response = (
    HelloResponse
    | AuthResponse
    | AddEntryResponse
    | ReadEntryResponse
    | ReadLacResponse
    | WriteLacResponse
    | ForceLedgerResponse
    | BatchReadResponse
    | GetBookieInfoResponse
    | GetListOfEntriesResponse
    | AddAcksResponse
)

_REQUESTS: dict[int, tuple[type[Any], tuple[Check, ...]]] = {
    OpCode.HELLO: (HelloRequest, (_request_id, _version, _text, _features)),
    OpCode.AUTH: (AuthRequest, (_request_id, _text, _auth_payload)),
    OpCode.ADD_ENTRY: (AddEntryRequest, (_request_id, _ledger_id, _entry_id, _flags, _key, _body)),
    OpCode.READ_ENTRY: (
        ReadEntryRequest,
        (_request_id, _ledger_id, _read_entry_id, _flags, _or_none(_key), _lac, _timeout_ms),
    ),
    OpCode.READ_LAC: (ReadLacRequest, (_request_id, _ledger_id, _or_none(_key))),
    OpCode.WRITE_LAC: (WriteLacRequest, (_request_id, _ledger_id, _key, _lac)),
    OpCode.FORCE_LEDGER: (ForceLedgerRequest, (_request_id, _ledger_id, _key)),
    OpCode.BATCH_READ: (
        BatchReadRequest,
        (_request_id, _ledger_id, _entry_id, _count, _max_bytes, _flags, _or_none(_key), _step),
    ),
    OpCode.GET_BOOKIE_INFO: (GetBookieInfoRequest, (_request_id,)),
    OpCode.GET_LIST_OF_ENTRIES_OF_LEDGER: (
        GetListOfEntriesRequest,
        (_request_id, _ledger_id, _or_none(_key)),
    ),
}

_RESPONSE_HEAD = (_request_id, _status, _or_none(_text))
_RESPONSES: dict[int, tuple[type[Any], tuple[Check, ...]]] = {
    OpCode.HELLO: (HelloResponse, (*_RESPONSE_HEAD, _version, _text, _max_bytes, _features)),
    OpCode.AUTH: (AuthResponse, (*_RESPONSE_HEAD, _text, _auth_payload, _complete)),
    OpCode.ADD_ENTRY: (AddEntryResponse, (*_RESPONSE_HEAD, _ledger_id, _entry_id)),
    OpCode.READ_ENTRY: (
        ReadEntryResponse,
        (*_RESPONSE_HEAD, _ledger_id, _read_entry_id, _or_none(_body), _lac, _bool),
    ),
    OpCode.READ_LAC: (ReadLacResponse, (*_RESPONSE_HEAD, _ledger_id, _lac)),
    OpCode.WRITE_LAC: (WriteLacResponse, (*_RESPONSE_HEAD, _ledger_id)),
    OpCode.FORCE_LEDGER: (ForceLedgerResponse, (*_RESPONSE_HEAD, _ledger_id)),
    OpCode.BATCH_READ: (
        BatchReadResponse,
        (*_RESPONSE_HEAD, _ledger_id, _entry_id, _bodies, _lac, _step),
    ),
    OpCode.GET_BOOKIE_INFO: (GetBookieInfoResponse, (*_RESPONSE_HEAD, _info)),
    OpCode.GET_LIST_OF_ENTRIES_OF_LEDGER: (GetListOfEntriesResponse, (*_RESPONSE_HEAD, _ledger_id, _ranges)),
    OpCode.ADD_ACKS: (AddAcksResponse, (*_RESPONSE_HEAD, _request_ids)),
}

_OPTIONAL_FIELDS: dict[type[Any], int] = {
    HelloRequest: 1,
    HelloResponse: 1,
    BatchReadRequest: 1,
    BatchReadResponse: 1,
    ReadLacRequest: 1,
    GetListOfEntriesRequest: 1,
    ReadEntryResponse: 1,
}
"""Trailing fields added after version 1 shipped (docs/protocol.md §8): a peer may omit them."""

REQUEST_OP: dict[type[Any], int] = {cls: op for op, (cls, _) in _REQUESTS.items()}
RESPONSE_OP: dict[type[Any], int] = {cls: op for op, (cls, _) in _RESPONSES.items()}
_OP_OF = {**REQUEST_OP, **RESPONSE_OP}
"""Every message class's op (no class is both a request and a response)."""

_Spec = tuple[type[Any], tuple[Check, ...], int, int]
"""What :func:`_validate` checks a message against: its class, its fields' checks, their number,
and how many of them must be there (all but the optional trailing ones)."""


def _specs(table: dict[int, tuple[type[Any], tuple[Check, ...]]]) -> dict[int, _Spec]:
    return {
        op: (cls, checks, len(checks), len(checks) - _OPTIONAL_FIELDS.get(cls, 0))
        for op, (cls, checks) in table.items()
    }


_REQUEST_SPECS = _specs(_REQUESTS)
_RESPONSE_SPECS = _specs(_RESPONSES)


# ---------------------------------------------------------------- codec
_UNPACK_ERRORS = (ValueError, TypeError, OverflowError, msgpack.UnpackException)
_TAKE_ERRORS = (*_UNPACK_ERRORS, IndexError)
"""What :meth:`AddRequests.take` refuses a frame for (IndexError: one shorter than two bytes)."""


def _unpack(body: bytes | memoryview) -> Any:
    try:
        # unpackb bounds every declared length by the size of ``body`` and nesting by a fixed
        # stack, so a length bomb cannot allocate. It does not bound the number of objects (each
        # costs >= 1 byte on the wire but 50-80 bytes in Python): see _unpack_request.
        return msgpack.unpackb(body)
    except _UNPACK_ERRORS as exc:
        raise ProtocolError(f"frame is not one valid msgpack value: {exc!r}") from None


REQUEST_ITEMS_MAX = 64
"""A request array, and any array or map inside one (none is defined yet: room for evolution),
holds at most this many items; a request frame over :data:`UNCOUNTED_REQUEST_BYTES_MAX` holds at
most this many arrays, maps and extension values in all."""
PLAIN_REQUEST_BYTES_MAX = 64 * 1024
"""The largest frame the ADD shortcut (:meth:`AddRequests.take`) unpacks: without counting, so the
add hot path stays hook-free (a frame it refuses is decoded again, counted)."""
UNCOUNTED_REQUEST_BYTES_MAX = 128
"""Up to this size a request frame is unpacked without counting its arrays, maps and extension
values: every request but an ADD or an AUTH fits (a READ_ENTRY with a 64-byte key and the largest
ids is 99 bytes), and the most such a frame builds costs ~25 µs (40 extension values). A larger one
is counted: nested empty arrays cost ~150 ns a byte to build (a 54 KB READ_ENTRY frame held the
event loop 6-8 ms), extension values ~180 ns a byte."""


def _unpack_request(body: bytes | memoryview) -> Any:
    """Unpack a request frame with the object count bounded: a 5 MiB frame of empty arrays would
    otherwise build ~5 million lists (~320 MiB, seconds of event-loop CPU) before validation.

    A frame that is one readable request followed by trailing bytes, or one whose strings are not
    valid UTF-8, raises :class:`ProtocolError` carrying the request id and op when its head
    ``[op, request_id, ...]`` can be read (docs/protocol.md §1: the bookie answers EBADREQ)."""
    try:
        return _unpack_bounded(body, "strict")
    except msgpack.ExtraData as exc:
        raise _with_head(
            getattr(exc, "unpacked", None),
            f"{len(getattr(exc, 'extra', b''))} trailing bytes after the request",
        ) from None
    except UnicodeDecodeError as exc:
        reason = f"a string is not valid UTF-8: {exc.reason} at byte {exc.start}"  # not its repr: it
        # holds the whole string (a frame's worth), built before any cut
        try:
            readable = _unpack_bounded(body, "surrogateescape")
        except msgpack.ExtraData as extra:
            readable = getattr(extra, "unpacked", None)
        except (*_UNPACK_ERRORS, ProtocolError):
            raise ProtocolError(f"frame is not one valid msgpack value: {exc!r}") from None
        raise _with_head(readable, reason) from None
    except _UNPACK_ERRORS as exc:
        raise ProtocolError(f"frame is not one valid msgpack value: {exc!r}") from None


def _with_head(obj: Any, reason: str) -> ProtocolError:
    """The error for a frame whose decoded value ``obj`` is unusable for ``reason``, with its request
    id and op when ``obj`` starts like a request."""
    if type(obj) is list and len(obj) >= 2 and _request_id(obj[1]):
        op = obj[0] if type(obj[0]) is int and 0 <= obj[0] <= 0xFF else None
        return ProtocolError(reason, request_id=obj[1], op=op)
    return ProtocolError(reason)


def _unpack_bounded(body: bytes | memoryview, unicode_errors: str) -> Any:
    if len(body) <= UNCOUNTED_REQUEST_BYTES_MAX:
        return msgpack.unpackb(
            body,
            max_array_len=REQUEST_ITEMS_MAX,
            max_map_len=REQUEST_ITEMS_MAX,
            unicode_errors=unicode_errors,
        )
    built = 0

    def count(value: Any) -> Any:
        nonlocal built
        built += 1
        if built > REQUEST_ITEMS_MAX:
            raise RequestTooComplex(
                f"request frame holds more than {REQUEST_ITEMS_MAX} arrays, maps and extension values"
            )
        return value

    return msgpack.unpackb(
        body,
        max_array_len=REQUEST_ITEMS_MAX,
        max_map_len=REQUEST_ITEMS_MAX,
        list_hook=count,
        object_hook=count,
        ext_hook=lambda code, data: count(msgpack.ExtType(code, data)),
        unicode_errors=unicode_errors,
    )


def _validate(fields: list[Any], spec: _Spec, op: int, rid: int, lenient: bool) -> Any:
    cls, checks, count, required = spec
    # Error responses may stop after the message; everything else needs every field but the
    # optional trailing ones.
    if len(fields) < required and not (lenient and len(fields) >= 3):
        raise ProtocolError(f"op {op}: {len(fields)} fields, expected {count}", request_id=rid, op=op)
    for check, value in zip(checks, fields, strict=False):
        if not check(value):
            raise _bad_field(spec, fields, op, rid)
    if len(fields) >= count:  # every field there: no defaults to fill in
        return _new_tuple(cls, fields[:count])
    return cls(*fields)


def _bad_field(spec: _Spec, fields: list[Any], op: int, rid: int) -> ProtocolError:
    """The error for the first of ``fields`` its check refuses (:func:`_validate` found one)."""
    cls, checks = spec[0], spec[1]
    for name, check, value in zip(cls._fields, checks, fields, strict=False):
        if not check(value):
            reason = f"op {op}: bad value for {name}: {_shown(name, value)}"
            return ProtocolError(reason, request_id=rid, op=op)
    raise AssertionError("every field passes its check")


def _head(obj: Any, what: str) -> tuple[int, int]:
    if type(obj) is not list or len(obj) < 2:
        raise ProtocolError(f"a {what} must be an array [op, request_id, ...]")
    op, rid = obj[0], obj[1]
    if not _request_id(rid):
        raise ProtocolError(f"{what}: bad request id {rid!r:.40}")
    if type(op) is not int:
        raise ProtocolError(f"{what}: bad op {op!r:.40}", request_id=rid)
    return op, rid


_ADD = int(OpCode.ADD_ENTRY)
_FENCING_OPS = frozenset((int(OpCode.READ_ENTRY), int(OpCode.BATCH_READ)))
_FENCE = int(ReadFlag.FENCE_LEDGER)
_new_tuple = tuple.__new__  # NamedTuple construction without the generated __new__ (3x faster)


_unpackb = msgpack.unpackb


# Hot-path shortcuts: one flat check for the common, well-formed message. Anything they do not
# accept goes through the generic validator, which also produces the precise error.
class AddRequests:
    """ADD_ENTRY requests decoded by :meth:`take`: ``fields`` holds one list per request,
    ``[op, request_id, ledger_id, entry_id, flags, master_key, body]``, the list msgpack unpacked
    (one append per request and no object of ours: a NamedTuple per request, built and unpacked
    again, cost more than the rest of the shortcut, and a list per field an append each).
    :meth:`take` is the one fast ADD decoder (:func:`decode_add_request` is built on it); tests
    pin it to the generic validator."""

    __slots__ = ("fields",)

    def __init__(self) -> None:
        self.fields: list[list[Any]] = []

    def __len__(self) -> int:
        return len(self.fields)

    def take(self, body: bytes | memoryview) -> int:
        """Append the ADD_ENTRY request in ``body`` and return its request id if it is a
        well-formed one of at most ``PLAIN_REQUEST_BYTES_MAX`` bytes with exactly its six fields;
        else append nothing and return -1 (:func:`decode_request` decodes it, or says precisely
        what is wrong)."""
        if len(body) > PLAIN_REQUEST_BYTES_MAX:
            return -1
        try:
            # Byte 1 is the op as encoders write an ADD (after the fixarray's one byte): a frame
            # with another op there (a read's) is not unpacked here only to fail (an ADD encoded
            # unusually goes the generic way too). A frame under two bytes raises IndexError.
            if body[1] != _ADD:
                return -1
            # No keyword limits (parsing them cost ~15% of this call): the frame is at most
            # PLAIN_REQUEST_BYTES_MAX, which bounds what it can build, and anything but an array
            # of exactly seven items fails the unpacking below or the type checks (a map's keys are
            # str or bytes, never the int op; a string's items are not ints and bytes). Anything
            # else (another op's request, a malformed one) is the generic path's, with its bounds.
            fields = _unpackb(body)
            _, rid, lid, eid, flags, key, entry = fields
        except _TAKE_ERRORS:
            return -1
        # The op needs no test: of the values of seven items with 0x01 for byte 1, a fixarray has
        # it as its first item (the int 1), a fixmap as an int key (refused by the unpacker), a
        # fixstr's items are no ints (an array or map with a 16 or 32-bit count has 0x00 there,
        # a bin or str8 of one byte is one item). No test of ``rid <= REQUEST_ID_MAX``: msgpack has
        # no int above 2**64 - 1 (and the compare with a two-digit int is not a specialised one).
        if (
            type(rid) is int
            and type(lid) is int
            and type(eid) is int
            and type(flags) is int
            and type(key) is bytes
            and type(entry) is bytes
            and rid >= 0
            and 0 <= lid <= ID_MAX
            and 0 <= eid <= ID_MAX
            and 0 <= flags <= 0xFF
            and len(key) <= MASTER_KEY_BYTES_MAX
        ):
            self.fields.append(fields)  # a list: an array of seven unpacked to seven names
            return rid
        return -1

    def append(self, request: AddEntryRequest) -> None:
        """Append a request decoded otherwise (by the generic validator)."""
        self.fields.append([_ADD, *request])

    def drop_last(self) -> None:
        """Forget the last request appended (one the caller refuses: a duplicate request id)."""
        self.fields.pop()

    def request(self, i: int) -> AddEntryRequest:
        return _new_tuple(AddEntryRequest, self.fields[i][1:])


def decode_add_request(body: bytes | memoryview) -> AddEntryRequest | None:
    """The ADD_ENTRY request in ``body`` if :meth:`AddRequests.take` takes it, else None."""
    requests = AddRequests()
    return requests.request(0) if requests.take(body) >= 0 else None


def _fast_add_response(obj: list[Any]) -> AddEntryResponse | None:
    if len(obj) != 6:
        return None
    _, rid, status, message, lid, eid = obj
    if (
        type(rid) is int
        and status == 0
        and type(status) is int
        and message is None
        and type(lid) is int
        and type(eid) is int
        and 0 <= rid <= REQUEST_ID_MAX
        and 0 <= lid <= ID_MAX
        and 0 <= eid <= ID_MAX
    ):
        return _new_tuple(AddEntryResponse, (rid, 0, None, lid, eid))
    return None


def decode_request(body: bytes | memoryview) -> Request:
    """Decode one request frame body. Raises :class:`ProtocolError` (with request_id/op if known)."""
    fast = decode_add_request(body)
    if fast is not None:
        return fast
    return decode_request_generic(body)


def decode_request_generic(body: bytes | memoryview) -> Request:
    """:func:`decode_request` without the ADD shortcut: every field through its checker (the
    bookie's decoder for a frame its :meth:`AddRequests.take` already saw), after its shortcuts:
    :func:`_read_request`, :func:`_batch_read_request`, :func:`_hello_request`."""
    obj = _unpack_request(body)
    read: ReadEntryRequest | BatchReadRequest | HelloRequest | None = _read_request(obj)
    if read is None:
        read = _batch_read_request(obj)
        if read is None:
            read = _hello_request(obj)
    if read is not None:
        return read
    return _checked_request(obj)


def _read_request(obj: Any) -> ReadEntryRequest | None:
    """The unpacked ``obj`` as a READ_ENTRY request if it has all its fields and a key (every read a
    client sends: fences and recovery reads are most of a recovery's requests), checked in one flat
    test as strictly as the checkers (ints, not bools, in range); else None (:func:`_checked_request`
    decodes it, or says precisely what is wrong)."""
    if (  # [READ_ENTRY, request_id, ledger_id, entry_id, flags, master_key, previous_lac, timeout_ms]
        type(obj) is list
        and len(obj) == 8
        and obj[0] == _READ_ENTRY
        and type(obj[0]) is type(rid := obj[1]) is type(lid := obj[2]) is type(eid := obj[3]) is int
        and type(flags := obj[4]) is type(previous := obj[6]) is type(timeout := obj[7]) is int
        and type(key := obj[5]) is bytes
        and 0 <= rid <= REQUEST_ID_MAX
        and 0 <= lid <= ID_MAX
        and NO_ENTRY <= eid <= ID_MAX
        and 0 <= flags <= 0xFF
        and len(key) <= MASTER_KEY_BYTES_MAX
        and NO_ENTRY <= previous <= ID_MAX
        and 0 <= timeout <= LONG_POLL_TIMEOUT_MS_MAX
    ):
        return _new_tuple(ReadEntryRequest, obj[1:])
    return None


def _batch_read_request(obj: Any) -> BatchReadRequest | None:
    """As :func:`_read_request`, for a BATCH_READ request with all its fields and a key."""
    if (  # [BATCH_READ, request_id, ledger_id, start_entry_id, max_count, max_bytes, flags, master_key, step]
        type(obj) is list
        and len(obj) == 9
        and obj[0] == _BATCH_READ
        and type(obj[0]) is type(rid := obj[1]) is type(lid := obj[2]) is type(start := obj[3]) is int
        and type(count := obj[4]) is type(size := obj[5]) is int
        and type(flags := obj[6]) is type(step := obj[8]) is int
        and type(key := obj[7]) is bytes
        and 0 <= rid <= REQUEST_ID_MAX
        and 0 <= lid <= ID_MAX
        and 0 <= start <= ID_MAX
        and 1 <= count <= BATCH_READ_COUNT_MAX
        and 1 <= size <= FRAME_BYTES_MAX
        and 0 <= flags <= 0xFF
        and len(key) <= MASTER_KEY_BYTES_MAX
        and 1 <= step <= BATCH_READ_STEP_MAX
    ):
        return _new_tuple(BatchReadRequest, obj[1:])
    return None


def _hello_request(obj: Any) -> HelloRequest | None:
    """As :func:`_read_request`, for a HELLO request with all its fields (every client's first frame)."""
    if (  # [HELLO, request_id, protocol_version, client_name, features]
        type(obj) is list
        and len(obj) == 5
        and obj[0] == _HELLO
        and type(obj[0]) is type(rid := obj[1]) is type(version := obj[2]) is type(features := obj[4]) is int
        and type(name := obj[3]) is str
        and 0 <= rid <= REQUEST_ID_MAX
        and 0 <= version <= 0xFFFF
        and len(name) <= TEXT_CHARS_MAX
        and 0 <= features <= FEATURES_MAX
    ):
        return _new_tuple(HelloRequest, obj[1:])
    return None


def _checked_request(obj: Any) -> Request:
    """The unpacked ``obj`` as a request, every field through its checker."""
    op, rid = _head(obj, "request")
    spec = _REQUEST_SPECS.get(op)
    if spec is None:
        raise ProtocolError(f"unknown op {op}", request_id=rid, op=op)
    result: Request = _validate(obj[1:], spec, op, rid, lenient=False)
    if op in _FENCING_OPS and result.master_key is None and result.flags & _FENCE:  # type: ignore[union-attr]
        raise ProtocolError(f"op {op}: FENCE_LEDGER needs a master_key", request_id=rid, op=op)
    return result


def decode_response(body: bytes | memoryview) -> Response:
    """Decode one response frame body. Raises :class:`ProtocolError`."""
    return decode_response_object(_unpack(body))


def decode_response_object(obj: Any) -> Response:
    """Validate one unpacked response frame body (for callers that unpack themselves). Raises
    :class:`ProtocolError`."""
    if (
        type(obj) is list
        and obj
        and type(obj[0]) is int
        and obj[0] == _ADD
        and (fast := _fast_add_response(obj))
    ):
        return fast
    op, rid = _head(obj, "response")
    spec = _RESPONSE_SPECS.get(op)
    if spec is None:
        raise ProtocolError(f"response for unknown op {op}", request_id=rid, op=op)
    lenient = len(obj) > 2 and obj[2] != StatusCode.EOK
    result: Response = _validate(obj[1:], spec, op, rid, lenient=lenient)
    if op == _ADD_ACKS and (rid != 0 or obj[2] != StatusCode.EOK):
        # docs/protocol.md §3.9: ADD_ACKS carries EOK answers only, under request id 0; a failed add
        # is answered on its own. Anything else must not be read as the success of its ids.
        raise ProtocolError(f"op {op}: ADD_ACKS must be [{op}, 0, 0, nil, ids], got {_short(obj)}", op=op)
    return result


_packb = msgpack.Packer(use_bin_type=True, autoreset=True).pack


def encode(msg: Request | Response) -> bytes:
    """One message as a whole frame (length prefix included)."""
    body = _packb((_OP_OF[type(msg)], *msg))
    return LENGTH.pack(len(body)) + body


_ADD_ACKS = int(OpCode.ADD_ACKS)
_SHORT_FRAME_PREFIX = [LENGTH.pack(size) for size in range(64)]
"""Length prefixes of the short frames an ADD answer is (its body is at most 31 bytes)."""


def encode_add_ok(request_id: int, ledger_id: int, entry_id: int) -> bytes:
    """``encode(AddEntryResponse(request_id, EOK, None, ledger_id, entry_id))`` without the
    NamedTuple and lookups (the bookie's answer to an add when ADD_ACKS was not agreed; a unit
    test pins the two to the same bytes)."""
    body = _packb((_ADD, request_id, 0, None, ledger_id, entry_id))
    return _SHORT_FRAME_PREFIX[len(body)] + body


def encode_add_acks(request_ids: list[int]) -> list[bytes]:
    """EOK answers of the ADD_ENTRY requests ``request_ids`` as ADD_ACKS frames (length prefix
    included), at most ``ADD_ACKS_IDS_MAX`` ids each; ``[]`` for no ids."""
    frames = []
    for start in range(0, len(request_ids), ADD_ACKS_IDS_MAX):
        body = _packb((_ADD_ACKS, 0, 0, None, request_ids[start : start + ADD_ACKS_IDS_MAX]))
        frames.append(LENGTH.pack(len(body)) + body)
    return frames


_BATCH_READ = int(OpCode.BATCH_READ)
_HELLO = int(OpCode.HELLO)
_ARRAY9 = b"\x99"  # fixarray of 9: a BATCH_READ response with all its fields
_ARRAY16 = struct.Struct(">BH").pack
_ARRAY32 = struct.Struct(">BI").pack


def _array_header(count: int) -> bytes:
    """msgpack's array header for ``count`` items (the smallest form, as the packer writes it)."""
    if count < 16:
        return bytes((0x90 | count,))
    return _ARRAY16(0xDC, count) if count < 0x10000 else _ARRAY32(0xDD, count)


def encode_batch_read_ok(
    request_id: int,
    ledger_id: int,
    start_entry_id: int,
    bodies: list[bytes] | list[memoryview],
    lac: int,
    step: int,
) -> bytes:
    """``encode(BatchReadResponse(request_id, EOK, None, ledger_id, start_entry_id, bodies, lac,
    step))`` in one join: each body (bytes, or a view of what the bookie read) is copied once,
    into the frame. The packer copies each twice (its buffer, then the frame) and costs ~4x as
    much per body at 1 KiB (docs/benchmarks.md); a unit test pins the two to the same bytes."""
    head = _packb((_BATCH_READ, request_id, 0, None, ledger_id, start_entry_id))
    count = len(bodies)
    parts: list[bytes | memoryview] = [
        b"",  # the length prefix, once the size is known
        _ARRAY9,
        head[1:],  # the head's items without its own array header
        _array_header(count),
    ]
    headers: dict[int, bytes] = {}  # bin header by body size: a batch's entries often share one
    for body in bodies:
        size = len(body)
        header = headers.get(size)
        if header is None:
            header = headers[size] = _bin_header(size)
        parts += (header, body)
    parts += (_packb(lac), _packb(step))
    parts[0] = LENGTH.pack(sum(map(len, parts)))
    return b"".join(parts)


_READ_ENTRY = int(OpCode.READ_ENTRY)
_FALSE = _packb(False)


def encode_read_ok(
    request_id: int, ledger_id: int, entry_id: int, body: bytes | memoryview, lac: int
) -> bytes:
    """``encode(ReadEntryResponse(request_id, EOK, None, ledger_id, entry_id, bytes(body), lac))``
    in one join: the body (bytes, or a view of what the bookie read) is copied once, into the
    frame, instead of three times (``bytes``, the packer's buffer, the frame); a unit test pins the
    two to the same bytes."""
    head = _packb((_READ_ENTRY, request_id, 0, None, ledger_id, entry_id))
    parts = [b"", _ARRAY9, head[1:], _bin_header(len(body)), body, _packb(lac), _FALSE]
    parts[0] = LENGTH.pack(sum(map(len, parts)))
    return b"".join(parts)


def encode_error(op: int, request_id: int, status: StatusCode, message: str) -> bytes:
    """A short error response ``[op, request_id, status, message]`` as a whole frame."""
    body = _packb((op, request_id, int(status), message[:TEXT_CHARS_MAX]))
    return LENGTH.pack(len(body)) + body


# ---------------------------------------------------------------- client hot paths
# The client's per-entry encode and per-ack decode, kept here next to the generic codec they must
# agree with (tests/unit/protocol/test_client_fast_paths.py pins them byte for byte / value for
# value). Measured on the client_cpu benchmark: packing the 7-tuple instead of building the
# NamedTuple, and one join for a CRC32C frame instead of body + frame (one payload copy fewer),
# are each a few percent of the client's CPU per entry.
_pack = msgpack.Packer(use_bin_type=True, autoreset=True).pack
_unpack_answer = msgpack.unpackb
_ADD_HEAD = bytes((0x97, _ADD))  # fixarray of 7, then the op (a positive fixint)
_CRC32C_BODY_PREFIX_BYTES = HEADER_BYTES + DIGEST_BYTES[DigestType.CRC32C]
_entry_header = HEADER.pack
_u32 = struct.Struct(">I").pack
_crc32c = crc32c.crc32c
_BIN8 = struct.Struct(">BB").pack
_BIN16 = struct.Struct(">BH").pack
_BIN32 = struct.Struct(">BI").pack
_UINT32 = b"\xce"  # msgpack's uint32, four bytes follow
_BIN16_TYPE = b"\xc5"  # msgpack's bin16, a two-byte length follows
_ADD_HEAD_U32 = _ADD_HEAD + _UINT32
_U32_MAX = 0xFFFFFFFF
_U16_MAX = 0xFFFF
_UINT_BYTES = {0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9}
"""Bytes of a msgpack unsigned int by its first byte (a positive fixint, below 0x80, is 1)."""


def _bin_header(size: int) -> bytes:
    """msgpack's bin header for ``size`` bytes (the smallest form, as the packer writes it)."""
    if size < 0x100:
        return _BIN8(0xC4, size)
    if size < 0x10000:
        return _BIN16(0xC5, size)
    return _BIN32(0xC6, size)


def encode_add_request(
    request_id: int, ledger_id: int, entry_id: int, flags: int, key: bytes, body: bytes
) -> bytes:
    """``encode(AddEntryRequest(...))`` without building the NamedTuple (same bytes)."""
    packed = _pack((_ADD, request_id, ledger_id, entry_id, flags, key, body))
    return LENGTH.pack(len(packed)) + packed


def _uint_bytes(first: int) -> int:
    return 1 if first < 0x80 else _UINT_BYTES[first]


def add_request_with_id(frame: bytes, request_id: int) -> bytes:
    """The ADD_ENTRY frame ``frame`` (as encoded here) under another request id: the same entry
    re-sent to another bookie, without unpacking it."""
    rest = memoryview(frame)[6 + _uint_bytes(frame[6]) :]  # [len:4][0x97][op][request id]...
    request_id_packed = _pack(request_id)
    return b"".join((LENGTH.pack(2 + len(request_id_packed) + len(rest)), _ADD_HEAD, request_id_packed, rest))


@functools.lru_cache(maxsize=64)
def _add_head(ledger_id_bytes: int, tail_bytes: int) -> tuple[Callable[..., bytes], int]:
    """The pack of a CRC32C ADD frame's head with uint32 ids, and the frame's bytes after its length
    prefix less the payload, for a packed ledger id and a flags-and-key tail of these sizes: one
    ``Struct`` per size shared by every ledger's encoder (one each was ~650 bytes per open ledger)."""
    head = struct.Struct(f">I3sI{ledger_id_bytes}sI{tail_bytes}sH{HEADER_BYTES}sI")
    return head.pack, head.size - LENGTH_BYTES


class AddFrameEncoder:
    """ADD_ENTRY frames of one ledger, written by its one writer: the bytes common to every entry
    (ledger id, flags, master key) are packed once.

    :meth:`crc32c_frame` writes the request and entry ids as msgpack uint32 (``0xce`` and four
    bytes) and the body's length as bin16 whenever they fit (the smallest forms only from 65,536,
    resp. 256, on): then everything before the payload is one ``struct`` call with the ledger's
    constant bytes in it, instead of a packer call per id, a struct call per length and a join of
    ten parts (docs/benchmarks.md, issue 19; docs/protocol.md §2). Any msgpack decoder reads the
    longer forms as the same values; the bookie's decoder does."""

    __slots__ = (
        "_head",
        "_head_bytes",
        "_ledger_id",
        "_ledger_id_then_u32",
        "_master_key",
        "_tail_then_bin16",
    )

    def __init__(self, ledger_id: int, master_key: bytes) -> None:
        self._ledger_id = ledger_id
        self._master_key = master_key
        # [len][0x97 op 0xce][request id][ledger id 0xce][entry id][flags key 0xc5][bin len][header][crc]
        self._ledger_id_then_u32 = _pack(ledger_id) + _UINT32
        self._tail_then_bin16 = _pack(0) + _pack(master_key) + _BIN16_TYPE  # flags (none), the key
        self._head, self._head_bytes = _add_head(len(self._ledger_id_then_u32), len(self._tail_then_bin16))

    def frame(self, request_id: int, entry_id: int, body: bytes) -> bytes:
        """The frame of an entry whose body (any digest) is already encoded."""
        return encode_add_request(request_id, self._ledger_id, entry_id, 0, self._master_key, body)

    def crc32c_frame(self, request_id: int, entry_id: int, lac: int, length: int, payload: bytes) -> bytes:
        """The frame of a CRC32C entry, one copy of the payload: it decodes as
        ``frame(request_id, entry_id, EntryCodec(CRC32C, ...).encode(...))`` does, and is those
        bytes but for the widths of the ids and of the body's length (see the class)."""
        header = _entry_header(self._ledger_id, entry_id, lac, length)
        crc = _crc32c(payload, _crc32c(header))
        body_len = _CRC32C_BODY_PREFIX_BYTES + len(payload)
        if (request_id | entry_id) <= _U32_MAX and body_len <= _U16_MAX:  # both ids are >= 0
            head = self._head(
                self._head_bytes + len(payload),
                _ADD_HEAD_U32,
                request_id,
                self._ledger_id_then_u32,
                entry_id,
                self._tail_then_bin16,
                body_len,
                header,
                crc,
            )
            return head + payload
        # an id beyond 32 bits or a body beyond 64 KiB: every field in its smallest form
        return encode_add_request(
            request_id, self._ledger_id, entry_id, 0, self._master_key, header + _u32(crc) + payload
        )


def decode_answer(body: bytes | memoryview) -> int | Response:
    """One response frame body, decoded on the client's hot path (an add's, a read's, a batch
    read's or a HELLO's answer in one flat test each; anything else by
    :func:`decode_response_object`).

    A successful ADD_ENTRY answer ``[ADD_ENTRY, request_id, EOK, nil, ledger_id, entry_id]`` comes
    back as its request id alone (an ``int``: no object per ack); anything else as
    :func:`decode_response` returns it. Checked as strictly as the generic decoder (ints, not
    bools, in range): msgpack ints are below 2^64 (``REQUEST_ID_MAX``), and for ints >= 0,
    ``a | b <= ID_MAX`` iff both are. Raises :class:`ProtocolError`.
    """
    try:
        obj = _unpack_answer(body)
    except _UNPACK_ERRORS as exc:
        raise ProtocolError(f"frame is not one valid msgpack value: {exc!r}") from None
    if (
        type(obj) is list
        and len(obj) == 6
        and obj[0] == _ADD
        and obj[2] == 0
        and obj[3] is None
        and type(obj[0]) is type(rid := obj[1]) is type(obj[2]) is int
        and type(lid := obj[4]) is type(eid := obj[5]) is int
        and rid >= 0
        and 0 <= lid | eid <= ID_MAX
    ):
        return rid
    if (  # [ADD_ACKS, 0, EOK, nil, [request_id, ...]]: one per journal group, ids checked below
        type(obj) is list
        and len(obj) == 5
        and obj[0] == _ADD_ACKS
        and obj[1] == 0
        and obj[2] == 0
        and obj[3] is None
        and type(obj[0]) is type(obj[1]) is type(obj[2]) is int
        and type(rids := obj[4]) is list
        and 0 < len(rids) <= ADD_ACKS_IDS_MAX
    ):
        for request_id in rids:
            if type(request_id) is not int or request_id < 0:
                raise ProtocolError(f"op {_ADD_ACKS}: bad value for request_ids: {_short(rids)}")
        return _new_tuple(AddAcksResponse, (0, 0, None, rids))
    if (  # [READ_ENTRY, request_id, status, message, ledger_id, entry_id, body, lac, unreadable]: a
        # read's answer, its entry or its refusal (recovery reads past the end are refused ENOENTRY)
        type(obj) is list
        and len(obj) == 9
        and obj[0] == _READ_ENTRY
        and type(obj[0]) is type(rid := obj[1]) is type(status := obj[2]) is int
        and status in STATUS_VALUES
        and ((message := obj[3]) is None or (type(message) is str and len(message) <= TEXT_CHARS_MAX))
        and type(lid := obj[4]) is type(eid := obj[5]) is type(lac := obj[7]) is int
        and ((entry := obj[6]) is None or (type(entry) is bytes and len(entry) <= FRAME_BYTES_MAX))
        and type(obj[8]) is bool
        and rid >= 0
        and 0 <= lid <= ID_MAX
        and NO_ENTRY <= eid <= ID_MAX
        and NO_ENTRY <= lac <= ID_MAX
    ):
        return _new_tuple(ReadEntryResponse, obj[1:])
    if (  # [BATCH_READ, request_id, status, message, ledger_id, start_entry_id, bodies, lac, step]
        type(obj) is list
        and len(obj) == 9
        and obj[0] == _BATCH_READ
        and type(obj[0]) is type(rid := obj[1]) is type(status := obj[2]) is int
        and status in STATUS_VALUES
        and ((message := obj[3]) is None or (type(message) is str and len(message) <= TEXT_CHARS_MAX))
        and type(lid := obj[4]) is type(start := obj[5]) is type(lac := obj[7]) is type(step := obj[8]) is int
        and _bodies(obj[6])
        and rid >= 0
        and 0 <= lid <= ID_MAX
        and 0 <= start <= ID_MAX
        and NO_ENTRY <= lac <= ID_MAX
        and 1 <= step <= BATCH_READ_STEP_MAX
    ):
        return _new_tuple(BatchReadResponse, obj[1:])
    if (  # [HELLO, request_id, status, message, protocol_version, bookie_id, frame_bytes_max, features]
        type(obj) is list
        and len(obj) == 8
        and obj[0] == _HELLO
        and type(obj[0]) is type(rid := obj[1]) is type(status := obj[2]) is int
        and status in STATUS_VALUES
        and ((message := obj[3]) is None or (type(message) is str and len(message) <= TEXT_CHARS_MAX))
        and type(version := obj[4]) is type(size := obj[6]) is type(features := obj[7]) is int
        and type(bookie_id := obj[5]) is str
        and rid >= 0
        and 0 <= version <= 0xFFFF
        and len(bookie_id) <= TEXT_CHARS_MAX
        and 1 <= size <= FRAME_BYTES_MAX
        and 0 <= features <= FEATURES_MAX
    ):
        return _new_tuple(HelloResponse, obj[1:])
    return decode_response_object(obj)
