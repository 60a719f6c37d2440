"""Issue acceptance 1-4 for autorecovery (slow): real bookie processes that register themselves
(cookies, lease TTL 3 s), real etcd, daemons as ``bkaio autorecovery run`` processes, kill -9.

1. 5 bookies, 200 closed ledgers E3/Qw2/Qa2 and 5 open ones; kill -9 a bookie: within the delay +
   a bound every ledger is fully replicated on live bookies (every entry read from every replica
   metadata lists); writers that keep writing move on by themselves, idle ones are fenced only
   after the grace period.
2. Two daemons: exactly one auditor; kill -9 it, the other takes over within the lease.
3. A daemon killed mid-copy leaves its ledgers to the other, which completes them; sampled while
   healing, no fragment lists a live bookie that lacks its first/last entry.
4. Decommission of a live bookie under write load: afterwards no ledger references it, nothing
   acknowledged is lost, its cookie is gone.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bookkeeper_aio import BookKeeper, ClientConfig
from bookkeeper_aio.autorecovery.auditor import check_ledger
from bookkeeper_aio.client.keys import codec_for
from bookkeeper_aio.client.ledger import LedgerHandle
from bookkeeper_aio.errors import BKError, LedgerFenced
from metadata.bookies import list_bookies
from metadata.cluster import MetadataConnection, ensure_cluster
from metadata.cluster import connect as metadata_connect
from metadata.ledger_metadata import LedgerState
from metadata.underreplication import UnderReplicationManager
from tests.harness.bookie_proc import BookieProcess
from tests.harness.etcd import EtcdCluster
from tests.integration.autorecovery.conftest import verify_every_replica
from tests.unit.autorecovery.waiting import wait_until

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

PASSWORD = b"acceptance"
CONFIG = ClientConfig(add_timeout_s=2.0, read_timeout_s=2.0, reconnect_backoff_max_s=0.5)
REGISTRATION_TTL_S = 3
DELAY_S = 3.0
GRACE_S = 6.0
LEASE_TTL_S = 3


def _get_json(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url, timeout=5) as answer:
        body: dict[str, object] = json.loads(answer.read())
        return body


@dataclass
class SelfCluster:
    url: str
    root: str
    base: Path
    meta: MetadataConnection
    bookies: dict[str, BookieProcess] = field(default_factory=dict)
    daemons: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)

    async def start_bookies(self, n: int) -> None:
        await ensure_cluster(self.meta.store, self.root)
        for i in range(n):
            proc = BookieProcess(
                self.base / f"b{i}",
                bookie_id=f"b{i}",
                extra_args=[
                    "--metadata", self.url, "--registration-ttl-s", str(REGISTRATION_TTL_S),
                    "--admin-port", "0",
                ],
            )  # fmt: skip
            await asyncio.to_thread(proc.start)
            self.bookies[f"b{i}"] = proc

        async def registered() -> bool:
            return len((await list_bookies(self.meta.store, self.root)).writable) == n

        await wait_until(registered, timeout_s=30)

    async def start_daemon(self, daemon_id: str, *extra: str) -> None:
        log = (self.base / f"{daemon_id}.log").open("w")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bookkeeper_aio.cli.main", "--log-level", "info", "autorecovery", "run",
            "--metadata", self.url, "--id", daemon_id, "--password", PASSWORD.decode(),
            "--lost-bookie-delay", str(DELAY_S), "--open-ledger-grace", str(GRACE_S),
            "--audit-interval", "0.3", "--lease-ttl", str(LEASE_TTL_S), *extra,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
        )  # fmt: skip
        log.close()
        assert proc.stdout is not None
        ready = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert ready.startswith(f"READY autorecovery {daemon_id}"), ready
        self.daemons[daemon_id] = proc

    async def kill_daemon(self, daemon_id: str) -> None:
        proc = self.daemons.pop(daemon_id)
        proc.kill()
        await proc.wait()

    async def close(self) -> None:
        for proc in self.daemons.values():
            proc.kill()
            await proc.wait()
        for bookie in self.bookies.values():
            bookie.cleanup()
        await self.meta.close()


@pytest.fixture
async def sc(etcd_server: EtcdCluster, tmp_path: Path) -> AsyncIterator[SelfCluster]:
    root = f"/bookkeeper/acceptance-{random.getrandbits(40):010x}"
    url = etcd_server.url(root)
    cluster = SelfCluster(url, root, tmp_path, metadata_connect(url))
    try:
        yield cluster
    finally:
        await cluster.close()


async def _closed(bk: BookKeeper, count: int, entries: int, size: int = 64) -> dict[int, list[bytes]]:
    written: dict[int, list[bytes]] = {}

    async def one() -> None:
        handle = await bk.create_ledger(3, 2, 2, password=PASSWORD)
        payloads = [(f"{handle.id}:{i}:".encode() * size)[:size] for i in range(entries)]
        futures = [await handle.append_async(payload) for payload in payloads]
        await asyncio.gather(*futures)
        await handle.close()
        written[handle.id] = payloads

    for start in range(0, count, 20):
        await asyncio.gather(*(one() for _ in range(min(20, count - start))))
    return written


@dataclass
class Writer:
    handle: LedgerHandle
    acked: list[bytes] = field(default_factory=list)
    attempted: list[bytes] = field(default_factory=list)
    fenced_at: float | None = None
    error: BaseException | None = None

    async def write(self, count: int | None, interval_s: float) -> None:
        i = 0
        while count is None or i < count:
            payload = f"{self.handle.id}:open:{i}".encode()
            self.attempted.append(payload)
            try:
                await self.handle.append(payload)
            except LedgerFenced:
                self.fenced_at = time.monotonic()
                return
            except BKError as error:
                self.error = error
                return
            self.acked.append(payload)
            i += 1
            await asyncio.sleep(interval_s)


async def _references(bk: BookKeeper, ledger_ids: list[int], bookie_id: str) -> list[int]:
    found = []
    for ledger_id in ledger_ids:
        md = (await bk.context.ledgers.read(ledger_id)).metadata
        if any(bookie_id in ensemble for _, ensemble in md.ensembles):
            found.append(ledger_id)
    return found


async def _verify_writer(bk: BookKeeper, writer: Writer, absent: list[str]) -> None:
    md = (await bk.context.ledgers.read(writer.handle.id)).metadata
    assert md.state is LedgerState.CLOSED
    assert md.last_entry_id is not None
    count = md.last_entry_id + 1
    assert count >= len(writer.acked)  # nothing acknowledged is lost (recovery may keep one more)
    await verify_every_replica(bk, writer.handle.id, PASSWORD, writer.attempted[:count], absent=absent)


async def test_acceptance_1_a_lost_bookie_is_healed_and_open_ledgers_follow_the_rules(
    sc: SelfCluster,
) -> None:
    await sc.start_bookies(5)
    async with BookKeeper.connect(sc.url, config=CONFIG) as bk:
        closed = await _closed(bk, 200, 10)
        writers = [Writer(await bk.create_ledger(3, 2, 2, password=PASSWORD)) for _ in range(5)]
        # the victim: a bookie of at least 3 open ledgers (15 places on 5 bookies: one has >= 3)
        ensembles = [w.handle.metadata.current_ensemble for w in writers]
        victim = max(sc.bookies, key=lambda b: sum(b in e for e in ensembles))
        for writer in writers:
            for _ in range(5):
                payload = f"{writer.handle.id}:open:{len(writer.attempted)}".encode()
                writer.attempted.append(payload)
                await writer.handle.append(payload)
                writer.acked.append(payload)
        # three keep writing, two stay idle (left to the grace period, then fenced)
        on_victim = [w for w in writers if victim in w.handle.metadata.current_ensemble]
        assert len(on_victim) >= 3
        idle = on_victim[:2]
        active = [w for w in writers if w not in idle]
        await sc.start_daemon("d1")
        tasks = [asyncio.create_task(w.write(None, 0.05)) for w in active]
        await asyncio.sleep(0.5)
        killed = time.monotonic()
        sc.bookies[victim].kill()
        all_ids = list(closed) + [w.handle.id for w in writers]
        urm = UnderReplicationManager(sc.meta.store, sc.root)
        left_open_at: dict[int, float] = {}

        async def watch_idle() -> None:  # when each idle ledger stops being OPEN (the fence)
            while len(left_open_at) < len(idle):
                for writer in idle:
                    if writer.handle.id not in left_open_at:
                        md = (await bk.context.ledgers.read(writer.handle.id)).metadata
                        if md.state is not LedgerState.OPEN:
                            left_open_at[writer.handle.id] = time.monotonic()
                await asyncio.sleep(0.1)

        watcher = asyncio.create_task(watch_idle())

        async def healed() -> bool:
            return await urm.count() == 0 and not await _references(bk, all_ids, victim)

        await wait_until(healed, timeout_s=REGISTRATION_TTL_S + DELAY_S + GRACE_S + 90)
        took = time.monotonic() - killed
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for writer in active:
            assert writer.fenced_at is None, "a writer that kept writing was fenced"
            assert writer.error is None, writer.error
            await writer.handle.close()
        for writer in idle:
            with pytest.raises(LedgerFenced):
                await writer.handle.append(b"late")
        fenced = [w for w in idle if victim in w.handle.metadata.current_ensemble]
        await asyncio.wait_for(watcher, 10)
        for writer in fenced:  # fenced only after the delay and then the grace
            assert left_open_at[writer.handle.id] - killed >= DELAY_S + GRACE_S, left_open_at
        for writer in writers:
            await _verify_writer(bk, writer, [victim])
        reads = 0
        for ledger_id, payloads in closed.items():
            reads += await verify_every_replica(bk, ledger_id, PASSWORD, payloads, absent=[victim])
        assert reads == 200 * 10 * 2
        assert took >= REGISTRATION_TTL_S + DELAY_S * 0.9
        assert fenced  # the idle writers were chosen on the victim
        status = (await urm.statuses())["d1"]
        assert status["ledgers_healed"] >= 1
        print(
            f"\nacceptance 1: healed {status['ledgers_healed']} ledgers, "
            f"{status['bytes_copied']} bytes in {took:.1f} s"
        )


async def test_acceptance_2_one_auditor_and_a_takeover_within_the_lease(sc: SelfCluster) -> None:
    await sc.start_bookies(3)
    await sc.start_daemon("d1")
    await sc.start_daemon("d2")
    urm = UnderReplicationManager(sc.meta.store, sc.root)

    async def both_published() -> bool:
        return {"d1", "d2"} <= set(await urm.statuses())

    await wait_until(both_published)

    async def one_leads() -> bool:
        return sum(bool(s["is_auditor"]) for s in (await urm.statuses()).values()) == 1

    await wait_until(one_leads)
    await asyncio.sleep(2.5)  # a status round later: still exactly one
    statuses = await urm.statuses()
    leaders = [name for name, status in statuses.items() if status["is_auditor"]]
    assert len(leaders) == 1
    leader = leaders[0]
    key = await sc.meta.store.get(sc.meta.keys.auditor)
    assert key is not None
    assert key.value.decode() == leader
    other = "d2" if leader == "d1" else "d1"
    killed = time.monotonic()
    await sc.kill_daemon(leader)

    async def taken_over() -> bool:
        current = await sc.meta.store.get(sc.meta.keys.auditor)
        return current is not None and current.value.decode() == other

    await wait_until(taken_over, timeout_s=LEASE_TTL_S * 3)
    took = time.monotonic() - killed
    assert took <= LEASE_TTL_S + 2.0, took
    print(f"\nacceptance 2: {other} took over {took:.2f} s after the kill (lease {LEASE_TTL_S} s)")


async def test_acceptance_3_a_daemon_killed_mid_copy_leaves_its_ledgers_to_the_other(sc: SelfCluster) -> None:
    await sc.start_bookies(5)
    async with BookKeeper.connect(sc.url, config=CONFIG) as bk:
        closed = await _closed(bk, 40, 300, size=2048)
        victim = "b1"
        ids = await _references(bk, list(closed), victim)
        assert len(ids) >= 10
        await sc.start_daemon("d1", "--workers", "2")
        await sc.start_daemon("d2", "--workers", "2")
        urm = UnderReplicationManager(sc.meta.store, sc.root)
        sc.bookies[victim].kill()
        overlaps: list[int] = []
        problems: list[str] = []
        stop = asyncio.Event()

        async def sample() -> None:  # while healing: locks exclusive, listed replicas hold entries
            slots = asyncio.Semaphore(16)
            while not stop.is_set():
                locks = await urm.locks()
                seen = [lock.ledger_id for lock in locks]
                overlaps.extend(i for i in set(seen) if seen.count(i) > 1)
                bookies = await list_bookies(sc.meta.store, sc.root)
                live = set(bookies.writable) | set(bookies.readonly)
                for ledger_id in random.sample(ids, 5):
                    md = (await bk.context.ledgers.read(ledger_id)).metadata
                    lacking = await check_ledger(bk.context, md, live, slots, codec_for(md, PASSWORD))
                    if lacking:
                        problems.append(f"ledger {ledger_id}: {lacking} listed without entries")
                await asyncio.sleep(0.2)

        sampler = asyncio.create_task(sample())

        async def copying() -> bool:
            return any(lock.owner.startswith("d1-") for lock in await urm.locks())

        await wait_until(copying, timeout_s=REGISTRATION_TTL_S + DELAY_S + 30)
        await sc.kill_daemon("d1")  # kill -9 while it holds at least one ledger

        async def healed() -> bool:
            return await urm.count() == 0 and not await _references(bk, ids, victim)

        await wait_until(healed, timeout_s=120)
        stop.set()
        await sampler
        assert overlaps == []
        assert problems == []
        for ledger_id, payloads in closed.items():
            await verify_every_replica(bk, ledger_id, PASSWORD, payloads, absent=[victim])
        status = (await urm.statuses())["d2"]
        assert status["ledgers_healed"] >= 1
        print(f"\nacceptance 3: d2 healed {status['ledgers_healed']} of {len(ids)} ledgers after d1's kill")


async def test_acceptance_4_decommission_of_a_live_bookie_under_write_load(sc: SelfCluster) -> None:
    await sc.start_bookies(5)
    leaving = "b3"
    admin = f"{':'.join(map(str, await asyncio.to_thread(sc.bookies[leaving].admin_address)))}"
    registered = (await list_bookies(sc.meta.store, sc.root)).writable[leaving]
    assert registered.attributes.get("admin") == admin
    async with BookKeeper.connect(sc.url, config=CONFIG) as bk:
        closed = await _closed(bk, 30, 20)
        writers = [Writer(await bk.create_ledger(3, 2, 2, password=PASSWORD)) for _ in range(4)]
        tasks = [asyncio.create_task(w.write(None, 0.02)) for w in writers]
        await asyncio.sleep(0.5)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bookkeeper_aio.cli.main", "decommission", leaving, "--metadata", sc.url,
            "--password", PASSWORD.decode(), "--json",  # the admin endpoint: from its registration
            "--open-ledger-grace", "600", "--timeout", "120",
            "--admin-token-file", str(sc.bookies[leaving].data_dir / "admin.token"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 180)
        assert proc.returncode == 0, err.decode()[-3000:]
        summary = json.loads(out.decode().strip().splitlines()[-1])
        assert summary["left"] == []
        more_ledgers = await _closed(bk, 5, 5)  # written after: never placed on it
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for writer in writers:
            assert writer.error is None, writer.error
            assert writer.fenced_at is None  # a writer under load moves off by itself (read-only)
            await writer.handle.close()
        every = [*closed, *more_ledgers, *(w.handle.id for w in writers)]
        assert await _references(bk, every, leaving) == []
        for ledger_id, payloads in {**closed, **more_ledgers}.items():
            await verify_every_replica(bk, ledger_id, PASSWORD, payloads, absent=[leaving])
        for writer in writers:
            await _verify_writer(bk, writer, [leaving])
            assert len(writer.acked) > 10
        assert await sc.meta.store.get(sc.meta.keys.cookie(leaving)) is None
        mode = await asyncio.to_thread(_get_json, f"http://{admin}/readonly")
        assert mode["manual"] is True  # made read-only through the endpoint its registration names
        assert await UnderReplicationManager(sc.meta.store, sc.root).decommissioning() == set()
