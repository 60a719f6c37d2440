"""Ledger keys are derived off the event loop: PBKDF2 (~5 ms) on the loop would stall every append
in flight, e.g. a log writer's while its roll creates the next ledger (docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from bookkeeper_aio import BookKeeper, RandomPlacement, Unauthorized
from bookkeeper_aio.client import keys
from bookkeeper_aio.client.context import StaticDirectory
from bookkeeper_aio.protocol.digest import ledger_keys, master_key, password_secret, salted_ledger_keys
from metadata.ledger_manager import LedgerManager
from metadata.ledger_metadata import LedgerMetadata
from tests.unit.client.conftest import FAST


class RecordingExecutor(ThreadPoolExecutor):
    """A real worker thread that records the thread each submitted call ran on."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.threads: list[str] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        def run() -> Any:
            self.threads.append(threading.current_thread().name)
            return fn(*args, **kwargs)

        return super().submit(run)


async def test_derive_keys_runs_pbkdf2_in_the_executor_once_per_salt() -> None:
    executor = RecordingExecutor()
    salt = random.randbytes(16)
    first = await keys.derive_keys(b"pw", salt, 1000, executor)
    again = await keys.derive_keys(b"pw", salt, 1000, executor)
    other = await keys.derive_keys(b"other", salt, 1000, executor)
    executor.shutdown()
    assert first == again != other
    assert len(executor.threads) == 2  # the second derivation of the same triple is cached
    assert threading.current_thread().name not in executor.threads
    assert first == ledger_keys(b"pw", salt, 1000)


async def test_create_and_open_derive_in_the_clients_executor(
    ledgers: LedgerManager, directory: StaticDirectory
) -> None:
    executor = RecordingExecutor()
    keys.clear_cache()  # a fresh process
    bk = BookKeeper(
        ledgers,
        directory,
        config=FAST,
        placement=RandomPlacement(random.Random(3)),
        key_executor=executor,
    )
    try:
        lh = await bk.create_ledger(3, 2, 2, password=b"secret")
        await lh.append(b"x")
        await lh.close()
        keys.clear_cache()  # as in another process: the open derives again
        rh = await bk.open_ledger(lh.id, password=b"secret")
        assert [e.payload async for e in rh.read(0, 0)] == [b"x"]
        with pytest.raises(Unauthorized):
            await bk.open_ledger(lh.id, password=b"wrong")
    finally:
        await bk.close()
        executor.shutdown()
    assert len(executor.threads) == 3  # create, open, the wrong password's open
    assert threading.current_thread().name not in executor.threads


async def test_key_format_3_runs_pbkdf2_once_per_client_and_password_with_keys_per_ledger(
    ledgers: LedgerManager, directory: StaticDirectory
) -> None:
    """Many creates with one password: one PBKDF2 run (the client's salt), yet each ledger has its
    own salt, master key and check value, and a reader in another process opens them with one
    PBKDF2 run too; a wrong password is refused; another password gets a salt of its own."""
    executor = RecordingExecutor()
    keys.clear_cache()
    bk = BookKeeper(ledgers, directory, config=FAST, key_executor=executor)
    try:
        handles = list(
            await asyncio.gather(*(bk.create_ledger(3, 2, 2, password=b"secret") for _ in range(4)))
        )
        assert len(executor.threads) == 1  # at once: they wait for the one run under way
        stored = [(await ledgers.read(lh.id)).metadata for lh in handles]
        assert len({md.key_salt for md in stored}) == 1  # the client's, for this password
        assert len({md.key_ledger_salt for md in stored}) == 4
        assert len({md.password_hash for md in stored}) == 4
        assert len({lh._master_key for lh in handles}) == 4  # distinct keys at the bookies
        for lh in handles:
            await lh.append(lh.id.to_bytes(8, "big"))
            await lh.close()
        other = await bk.create_ledger(3, 2, 2, password=b"other")
        assert (await ledgers.read(other.id)).metadata.key_salt != stored[0].key_salt
        await other.close()
        assert len(executor.threads) == 2
        keys.clear_cache()  # a reader in another process
        for lh in handles:
            rh = await bk.open_ledger(lh.id, password=b"secret")
            assert [e.payload async for e in rh.read(0, 0)] == [lh.id.to_bytes(8, "big")]
        assert len(executor.threads) == 3
        with pytest.raises(Unauthorized):
            await bk.open_ledger(handles[0].id, password=b"wrong")
    finally:
        await bk.close()
        executor.shutdown()


def test_key_formats_2_and_1_still_check_out() -> None:
    salt = random.randbytes(16)
    format2 = ledger_keys(b"pw", salt, 10)
    md = LedgerMetadata.new(
        1,
        ["a", "b"],
        write_quorum=2,
        ack_quorum=2,
        password_hash=format2.key_check,
        key_salt=salt,
        key_iterations=10,
    )
    assert keys.check_password(md, b"pw") == format2.master_key
    with pytest.raises(Unauthorized):
        keys.check_password(md, b"pW")
    format3 = dataclasses.replace(md, key_ledger_salt=b"L" * 16)  # the same salts read as format 3
    with pytest.raises(Unauthorized):  # another derivation: format 2's check value does not match
        keys.check_password(format3, b"pw")
    secret = password_secret(b"pw", salt, 10)
    assert salted_ledger_keys(secret, b"L" * 16).master_key != format2.master_key
    format1 = LedgerMetadata.new(
        2, ["a", "b"], write_quorum=2, ack_quorum=2, password_hash=keys.password_hash(b"pw")
    )
    assert keys.check_password(format1, b"pw") == master_key(b"pw")


async def test_a_derivation_waiting_for_another_survives_its_cancellation() -> None:
    """Derivations of one triple at once share one PBKDF2 run; the first caller cancelled, the
    others still get the secret (a run of their own)."""
    executor = RecordingExecutor()
    keys.clear_cache()
    salt = random.randbytes(16)
    first = asyncio.ensure_future(keys.derive_secret(b"pw", salt, 200_000, executor))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(keys.derive_secret(b"pw", salt, 200_000, executor))
    third = asyncio.ensure_future(keys.derive_secret(b"pw", salt, 200_000, executor))
    await asyncio.sleep(0)
    first.cancel()
    secrets = await asyncio.gather(second, third)
    executor.shutdown()
    assert first.cancelled()
    assert secrets == [password_secret(b"pw", salt, 200_000)] * 2
    # one run for both waiters, after the cancelled one (which the thread may not have started)
    assert 1 <= len(executor.threads) <= 2
