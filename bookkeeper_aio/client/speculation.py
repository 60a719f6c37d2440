"""Speculative reads, shared by single-entry and batch reads.

A read op asks one replica; if no answer came after ``speculative_delay_s`` it also asks the next
one (and so on, one more replica per delay), and the first valid answer wins. Subclasses keep the
state in their own ``__slots__`` and implement :meth:`send_next`.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol


class _Reader(Protocol):
    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def speculative_delay_s(self) -> float: ...


class SpeculativeOp:
    __slots__ = ("timer",)
    reader: Any  # an EntryReader: has ``loop`` and ``speculative_delay_s`` (see _Reader)
    replicas: tuple[str, ...]
    next_replica: int
    future: asyncio.Future[Any]
    timer: asyncio.TimerHandle | None

    def send_next(self) -> bool:
        """Ask the next replica; False when none is left."""
        raise NotImplementedError

    def arm_speculation(self) -> None:
        reader: _Reader = self.reader
        delay_s = reader.speculative_delay_s
        if delay_s > 0 and self.next_replica < len(self.replicas):
            self.timer = reader.loop.call_later(delay_s, self.speculate)

    def speculate(self) -> None:
        self.timer = None
        if not self.future.done() and self.send_next():
            self.arm_speculation()

    def finish(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
