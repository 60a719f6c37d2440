"""The tarpit: connections refused at accept are held unread for a while, then reset.

A peer over ``connections_per_address_max`` that connects again as soon as it is refused makes a
bookie that resets at once accept and reset connections at the pace of the peer's loop: 64 loops
that wait 50 ms after each refusal (issue 20's TLS handshake flood) are about 1,300 accepts and
resets a second, each a wake-up of the bookie, of the kernel's TCP work and of the peer, beside the
clients being served (their p99 went to 2.5x with the bookie at 15 % of a core: not the bookie's
CPU, the wake-ups). Held for :data:`HOLD_S` instead — accepted, never read, no TLS or protocol
object made, then reset — the same loops run at the tarpit's pace: one connection per loop per
hold.

Rules:

- Only connections that are refused anyway are held, so nobody is locked out by the tarpit: the
  connections of other addresses are accepted and served as before.
- Bounded per address (:data:`PER_ADDRESS_MAX`) and in total (:data:`TOTAL_MAX`): a held socket is a
  descriptor and a little kernel memory. Beyond either bound a refused connection is reset at once,
  as without the tarpit.
- Every held socket waits the same :data:`HOLD_S`, so they expire in the order they came: one
  queue, one timer. At most :data:`RESETS_PER_TURN` are reset per turn of the event loop, so a
  burst of them expiring together does not hold the loop.
- Reset, not closed: ``SO_LINGER`` 0 sends an RST, so the bookie keeps no ``TIME_WAIT`` for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections import Counter, deque
from collections.abc import Callable

HOLD_S = 2.0
"""How long a refused connection is held before its reset. Longer holds slow a reconnect loop
more, and cost a descriptor each for longer (bounded by :data:`TOTAL_MAX`)."""
PER_ADDRESS_MAX = 64
"""Connections of one peer address held at once (beyond: reset at once)."""
TOTAL_MAX = 256
"""Connections held at once, all addresses together (descriptors: beyond, reset at once)."""
RESETS_PER_TURN = 16


def reset(sock: socket.socket) -> None:
    """Close an accepted socket with a reset (SO_LINGER 0): no FIN exchange, no TIME_WAIT left
    behind for the bookie to hold, whatever the peer does."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    sock.close()


_LINGER_RESET = struct.pack("ii", 1, 0)


class Tarpit:
    """Refused connections held unread for ``hold_s``, then reset (the module doc)."""

    __slots__ = ("_held", "_per_address", "_timer", "held_total", "hold_s", "per_address_max", "total_max")

    def __init__(
        self, hold_s: float = HOLD_S, per_address_max: int = PER_ADDRESS_MAX, total_max: int = TOTAL_MAX
    ) -> None:
        self.hold_s = hold_s
        self.per_address_max = per_address_max
        self.total_max = total_max
        self._held: deque[tuple[float, Callable[[], None], str]] = deque()  # (reset at, reset, address)
        self._per_address: Counter[str] = Counter()
        self._timer: asyncio.Handle | None = None
        self.held_total = 0
        """Connections held since start (the metric ``bookie_connections_tarpitted``)."""

    @property
    def held(self) -> int:
        """Connections held now."""
        return len(self._held)

    def hold(self, address: str, reset_now: Callable[[], None]) -> bool:
        """Hold a connection accepted from ``address`` and refused, until ``reset_now`` is called
        (a raw socket's :func:`reset`, a transport's ``abort``); False: the tarpit is full for that
        address or in total, and the caller resets it at once."""
        if len(self._held) >= self.total_max or self._per_address[address] >= self.per_address_max:
            return False
        loop = asyncio.get_running_loop()
        self._held.append((loop.time() + self.hold_s, reset_now, address))
        self._per_address[address] += 1
        self.held_total += 1
        if self._timer is None:
            self._timer = loop.call_later(self.hold_s, self._expire)
        return True

    def _expire(self) -> None:
        """Reset the sockets whose hold is over (:data:`RESETS_PER_TURN` at most, the rest at the
        next turn), and set the timer for the next one."""
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        held = self._held
        for _ in range(RESETS_PER_TURN):
            if not held or held[0][0] > now:
                break
            _, reset_now, address = held.popleft()
            self._release(address)
            reset_now()
        if not held:
            return
        if held[0][0] <= now:
            self._timer = loop.call_soon(self._expire)
        else:
            self._timer = loop.call_later(held[0][0] - now, self._expire)

    def _release(self, address: str) -> None:
        count = self._per_address[address] - 1
        if count > 0:
            self._per_address[address] = count
        else:
            del self._per_address[address]

    def close(self) -> None:
        """Reset everything held (the server stops)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        held, self._held = self._held, deque()
        self._per_address.clear()
        for _, reset_now, _address in held:
            reset_now()
