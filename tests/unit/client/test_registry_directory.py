"""The client's view of the writable bookies (``RegistryDirectory``): callers that ask while a
listing is in flight share it, so a burst of ensemble changes lists the registrations once."""

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
        await asyncio.sleep(0.01)  # a round trip: callers arriving meanwhile join it
        if self.fail:
            raise MetadataUnavailable("etcd is away")
        return await super().list(*args, **kwargs)


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
        # the next caller after it finished lists again (no cache: a new bookie shows up at once)
        more = await _registered(store, ["d"])
        registrations += more
        assert list(await directory.writable_bookies()) == ["a", "b", "c", "d"]
        assert directory.listings == 2
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
