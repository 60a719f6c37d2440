"""BookieRegistration.start() and a key already under its bookie id: a registration its judge
(``is_previous_self``) recognises is replaced at once, anything else is waited for and refused."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from metadata.bookies import BookieInfo, BookieRegistration, BookieState, RegistrationHeld, list_bookies
from metadata.store import MetadataStore

BOOKIE_ID = "b-takeover"


def info(port: int, incarnation: str, state: BookieState = BookieState.WRITABLE) -> BookieInfo:
    return BookieInfo(BOOKIE_ID, "127.0.0.1", port, state, attributes={"incarnation": incarnation})


def judge_same(incarnation: str) -> Callable[[BookieInfo], bool]:
    def is_previous_self(found: BookieInfo) -> bool:
        return found.attributes.get("incarnation") == incarnation

    return is_previous_self


async def test_previous_self_is_replaced_at_once(store: MetadataStore, root: str) -> None:
    dead = BookieRegistration(store, root, info(4001, "x"), ttl_s=30)
    await dead.start()
    await dead.abort()  # like kill -9: the key stays until its 30 s lease expires
    restarted = BookieRegistration(
        store, root, info(4002, "x"), ttl_s=30, stale_wait_s=60, is_previous_self=judge_same("x")
    )
    loop = asyncio.get_running_loop()
    started = loop.time()
    await restarted.start()
    try:
        assert loop.time() - started < 2.0  # not the 30 s lease
        listed = await list_bookies(store, root)
        assert listed.writable[BOOKIE_ID].port == 4002
        assert restarted.lease_id != dead.lease_id
        assert (await store.get(restarted.key)).lease_id == restarted.lease_id  # type: ignore[union-attr]
    finally:
        await restarted.close()


async def test_previous_self_left_in_the_other_set_is_removed(store: MetadataStore, root: str) -> None:
    dead = BookieRegistration(store, root, info(4001, "x"), ttl_s=30)
    await dead.start()
    await dead.set_state(BookieState.READONLY)
    await dead.abort()  # killed while read-only: readonly/<id> lingers
    restarted = BookieRegistration(store, root, info(4001, "x"), ttl_s=30, is_previous_self=judge_same("x"))
    await restarted.start()
    try:
        listed = await list_bookies(store, root)
        assert BOOKIE_ID in listed.writable
        assert BOOKIE_ID not in listed.readonly
    finally:
        await restarted.close()


async def test_another_incarnation_is_waited_for_then_refused(store: MetadataStore, root: str) -> None:
    live = BookieRegistration(store, root, info(4001, "x"), ttl_s=2, is_previous_self=judge_same("x"))
    await live.start()
    try:
        impostor = BookieRegistration(
            store, root, info(4002, "y"), ttl_s=2, stale_wait_s=0.6, is_previous_self=judge_same("y")
        )
        with pytest.raises(RegistrationHeld) as refused:
            await impostor.start()
        assert refused.value.holder is not None
        assert refused.value.holder.port == 4001
        assert (await store.get(live.key)).lease_id == live.lease_id  # type: ignore[union-attr]
    finally:
        await live.close()


async def test_without_a_judge_a_dead_incarnation_is_waited_out(store: MetadataStore, root: str) -> None:
    dead = BookieRegistration(store, root, info(4001, "x"), ttl_s=2)
    await dead.start()
    await dead.abort()
    restarted = BookieRegistration(store, root, info(4001, "x"), ttl_s=2, stale_wait_s=10)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await restarted.start()  # after the old lease expired (<= 2 s), as before
    try:
        assert loop.time() - started > 0.5
        assert (await list_bookies(store, root)).writable[BOOKIE_ID].port == 4001
    finally:
        await restarted.close()
