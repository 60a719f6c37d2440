"""The nemeses of the fault suite: one fault cycle each on a `FaultCluster`, drawn from a seeded rng."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

from tests.faults.cluster import FaultCluster
from tests.faults.proxy import Mode

Nemesis = Callable[[FaultCluster, random.Random], Awaitable[None]]


async def kill_restart(cluster: FaultCluster, rng: random.Random) -> None:
    async with cluster.claimed(rng) as index:
        await cluster.kill(index)
        await asyncio.sleep(rng.uniform(0.05, 0.4))
        await cluster.restart(index)


async def pause_resume(cluster: FaultCluster, rng: random.Random) -> None:
    async with cluster.claimed(rng) as index:
        cluster.bookies[index].pause()
        await asyncio.sleep(rng.uniform(0.3, 2.0))  # across the add timeout too, sometimes
        cluster.bookies[index].resume()


async def partition(cluster: FaultCluster, rng: random.Random) -> None:
    async with cluster.claimed(rng) as index:
        proxy = cluster.proxies[index]
        proxy.set(rng.choice([Mode.BLACKHOLE, Mode.BLACKHOLE_DOWN, Mode.RESET]))
        await asyncio.sleep(rng.uniform(0.3, 2.0))
        proxy.set(Mode.PASS)


async def etcd_member_loss(cluster: FaultCluster, rng: random.Random) -> None:
    """SIGKILL one etcd member of three; while it is down a bookie is killed too (the ensemble
    change's CAS goes to the two left); then both come back."""
    assert cluster.etcd is not None
    member = rng.choice(cluster.etcd.members)
    member.kill9()
    await asyncio.sleep(rng.uniform(0.2, 1.0))
    await kill_restart(cluster, rng)
    await asyncio.sleep(rng.uniform(0.2, 1.0))
    member.start()
    await asyncio.to_thread(member.wait_ready)


async def etcd_quorum_loss(cluster: FaultCluster, rng: random.Random) -> None:
    """SIGKILL two etcd members of three (no quorum: metadata writes fail, typed), then restart them."""
    assert cluster.etcd is not None
    members = rng.sample(cluster.etcd.members, 2)
    for member in members:
        member.kill9()
    await asyncio.sleep(rng.uniform(1.0, 2.5))  # below the registrations' 5 s lease
    for member in members:
        member.start()
    await asyncio.gather(*(asyncio.to_thread(member.wait_ready) for member in members))
