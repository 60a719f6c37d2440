"""What every ledger handle of one client shares: connections, metadata, placement, config.

Also the two small seams the client needs from the outside world beyond the metadata package:
:class:`BookieDirectory` (who is writable now) and the pool's address resolver.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from bookkeeper_aio.client.add_budget import AddBudget
from bookkeeper_aio.client.bookie_client import BookiePool
from bookkeeper_aio.client.config import ClientConfig
from bookkeeper_aio.client.metrics import ClientMetrics
from bookkeeper_aio.client.placement import PlacementPolicy
from bookkeeper_aio.client.timer_wheel import TimerWheel
from metadata.ledger_manager import LedgerManager


class BookieDirectory(Protocol):
    async def writable_bookies(self) -> Sequence[str]:
        """Ids of the bookies registered as writable now (read-only ones excluded)."""
        ...


class StaticDirectory:
    """A fixed, mutable list of writable bookies (tests, fake bookies)."""

    def __init__(self, writable: Sequence[str]) -> None:
        self.writable = list(writable)

    async def writable_bookies(self) -> Sequence[str]:
        return list(self.writable)


@dataclass(slots=True)
class ClientContext:
    config: ClientConfig
    pool: BookiePool
    ledgers: LedgerManager
    directory: BookieDirectory
    placement: PlacementPolicy
    metrics: ClientMetrics | None = None
    """Metrics hooks (:mod:`bookkeeper_aio.client.metrics`); None: no call is made at all."""
    lac_timers: TimerWheel = field(default_factory=TimerWheel)
    """The explicit-LAC checks of every write handle, on one loop timer (10 ms ticks)."""
    add_budget: AddBudget = field(init=False)
    """The client-wide permits of adds in flight (``config.adds_in_flight_max``)."""

    def __post_init__(self) -> None:
        self.add_budget = AddBudget(self.config.adds_in_flight_max)
