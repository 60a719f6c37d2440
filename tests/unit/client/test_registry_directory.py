"""The client's view of the writable bookies (``RegistryDirectory``): callers share listings, so a
burst of ensemble changes lists the registrations about once, and none gets a listing sent before
it asked."""

from __future__ import annotations

import asyncio
from typing import Any

from bookkeeper_aio.client.bookkeeper import RegistryDirectory
from metadata.bookies import BookieInfo, BookieRegistration
from metadata.errors import MetadataUnavailable
from metadata.memory import MemoryStore

ROOT = "/bookkeeper/directory"


class CountingStore(MemoryStore):
    """Lists take a round trip; ``fail`` makes them raise MetadataUnavailable."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    async def list(self, *args: Any, **kwargs: Any) -> Any:
        if self.fail:
            raise MetadataUnavailable("etcd is away")
        page = await super().list(*args, **kwargs)  # the snapshot, then the way back
        await asyncio.sleep(0.01)
        return page


async def _registered(store: MemoryStore, names: list[str]) -> list[BookieRegistration]:
    registrations = []
    for i, name in enumerate(names):
        registration = BookieRegistration(store, ROOT, BookieInfo(name, "127.0.0.1", 6000 + i), ttl_s=5)
        await registration.start()
        registrations.append(registration)
    return registrations


async def test_a_burst_of_callers_shares_one_listing() -> None:
    store = CountingStore()
    registrations = await _registered(store, ["c", "a", "b"])
    directory = RegistryDirectory(store, ROOT)
    try:
        results = await asyncio.gather(*(directory.writable_bookies() for _ in range(1000)))
        assert all(list(r) == ["a", "b", "c"] for r in results)
        assert directory.listings == 1
        # callers arriving while a listing is in flight share the next one
        first = asyncio.ensure_future(directory.writable_bookies())
        await asyncio.sleep(0.005)  # sent, not answered
        later = await asyncio.gather(*(directory.writable_bookies() for _ in range(100)))
        assert list(await first) == ["a", "b", "c"]
        assert all(list(r) == ["a", "b", "c"] for r in later)
        assert directory.listings == 3
        # the next caller after it finished lists again (no cache: a new bookie shows up at once)
        more = await _registered(store, ["d"])
        registrations += more
        assert list(await directory.writable_bookies()) == ["a", "b", "c", "d"]
        assert directory.listings == 4
        assert await directory.resolve("d") == ("127.0.0.1", 6000)
    finally:
        for registration in registrations:
            await registration.close()


async def test_a_cancelled_caller_leaves_the_listing_to_the_others() -> None:
    store = CountingStore()
    registrations = await _registered(store, ["a", "b"])
    directory = RegistryDirectory(store, ROOT)
    try:
        first = asyncio.ensure_future(directory.writable_bookies())
        second = asyncio.ensure_future(directory.writable_bookies())
        await asyncio.sleep(0)
        first.cancel()
        assert list(await second) == ["a", "b"]
        assert first.cancelled()
        assert directory.listings == 1
    finally:
        for registration in registrations:
            await registration.close()


async def test_a_failed_listing_fails_every_caller_and_the_next_one_lists_again() -> None:
    store = CountingStore()
    registrations = await _registered(store, ["a", "b"])
    directory = RegistryDirectory(store, ROOT)
    try:
        store.fail = True
        results = await asyncio.gather(
            *(directory.writable_bookies() for _ in range(10)), return_exceptions=True
        )
        assert all(isinstance(r, MetadataUnavailable) for r in results)
        assert directory.listings == 1
        store.fail = False
        assert list(await directory.writable_bookies()) == ["a", "b"]
    finally:
        for registration in registrations:
            await registration.close()


async def test_a_bookie_registered_while_a_listing_is_in_flight_is_in_the_next_callers_answer() -> None:
    store = CountingStore()
    registrations = await _registered(store, ["a", "b"])
    directory = RegistryDirectory(store, ROOT)
    try:
        in_flight = asyncio.ensure_future(directory.writable_bookies())
        await asyncio.sleep(0.005)  # its snapshot is taken: it will not hold "c"
        registrations += await _registered(store, ["c"])
        assert list(await directory.writable_bookies()) == ["a", "b", "c"]
        assert list(await in_flight) == ["a", "b"]
    finally:
        for registration in registrations:
            await registration.close()
