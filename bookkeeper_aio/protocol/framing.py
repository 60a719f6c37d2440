"""Length-prefixed framing: a 4-byte big-endian unsigned length, then that many bytes of msgpack.

Sans-I/O: :class:`FrameDecoder` is fed bytes and hands out whole frames. The declared length is
checked against the maximum *before* anything is buffered for it, so a hostile prefix costs
nothing. After a :class:`FrameTooLarge` the stream cannot be resynchronised: close it.
"""

from __future__ import annotations

import struct

from bookkeeper_aio.protocol.codes import FRAME_BYTES_MAX
from bookkeeper_aio.protocol.errors import FrameTooLarge

LENGTH = struct.Struct(">I")
LENGTH_BYTES = LENGTH.size


def encode_frame(body: bytes) -> bytes:
    """Prefix ``body`` (one packed msgpack value) with its length."""
    return LENGTH.pack(len(body)) + body


class FrameDecoder:
    """Turns a byte stream into frames.

    Usage: ``feed(data)`` then ``next_frame()`` until it returns ``None`` (more bytes needed).
    Buffered bytes are bounded by ``frame_bytes_max + 4`` plus one read's worth of data.
    """

    __slots__ = ("_buf", "_pos", "frame_bytes_max")

    def __init__(self, frame_bytes_max: int = FRAME_BYTES_MAX) -> None:
        if frame_bytes_max <= 0:
            raise ValueError("frame_bytes_max must be positive")
        self.frame_bytes_max = frame_bytes_max
        self._buf = bytearray()
        self._pos = 0

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._buf += data

    @property
    def buffered_bytes(self) -> int:
        return len(self._buf) - self._pos

    def pending_frame_started(self) -> bool:
        """True when part of a frame is buffered (used for per-frame read deadlines)."""
        return len(self._buf) > self._pos

    def next_frame(self) -> bytes | None:
        """The next whole frame's body, or ``None`` when more bytes are needed.

        Raises :class:`FrameTooLarge` when the declared length exceeds the maximum.
        """
        buf, pos = self._buf, self._pos
        avail = len(buf) - pos
        if avail < LENGTH_BYTES:
            self._compact()
            return None
        (size,) = LENGTH.unpack_from(buf, pos)
        if size > self.frame_bytes_max:
            raise FrameTooLarge(size, self.frame_bytes_max)
        end = pos + LENGTH_BYTES + size
        if end > len(buf):
            self._compact()
            return None
        body = bytes(buf[pos + LENGTH_BYTES : end])
        self._pos = end
        return body

    def _compact(self) -> None:
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
