"""What the in-process CPU harnesses share (``client_cpu``, ``bookie_cpu``): a transport that
takes the place of a socket, and the walk over the length-prefixed frames written to it."""

from __future__ import annotations

import struct
from collections.abc import Iterator

_LENGTH = struct.Struct(">I")


class FakeTransport:
    """The parts of ``asyncio.Transport`` a connection calls besides ``write``: no-ops."""

    def get_extra_info(self, name: str) -> None:
        return None

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    abort = close

    def pause_reading(self) -> None:
        pass

    resume_reading = pause_reading

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0  # everything written was taken at once


def frame_bodies(data: bytes) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each frame body in ``data`` (whole frames, as the harnesses write them)."""
    pos, size = 0, len(data)
    while pos < size:
        (length,) = _LENGTH.unpack_from(data, pos)
        yield pos + 4, pos + 4 + length
        pos += 4 + length
