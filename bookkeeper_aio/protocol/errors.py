"""Errors of the pure protocol layer: the peer sent bytes or values we cannot accept."""

from __future__ import annotations

from bookkeeper_aio.errors import BKError


class ProtocolError(BKError):
    """Bytes or values that do not follow docs/protocol.md.

    ``request_id`` and ``op`` are set when they could be recovered from the bad message, so the
    receiver can answer with an error response instead of closing the connection.
    """

    def __init__(self, message: str, *, request_id: int | None = None, op: int | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.op = op


class FrameTooLarge(ProtocolError):
    """A length prefix above the agreed maximum: the stream must be closed."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame of {size} bytes exceeds the maximum of {limit} bytes")
        self.size = size
        self.limit = limit


class RequestTooComplex(ProtocolError):
    """A request frame holding more arrays, maps and extension values than ``REQUEST_ITEMS_MAX``
    (docs/protocol.md, request size limits): refused part way through its decoding, no request id
    recovered. Abusive: no request defines a nested value, and a frame of them is the costliest to
    decode per byte."""


class DigestMismatch(ProtocolError):
    """An entry whose digest does not match its bytes: corrupt, or not the entry we asked for."""
