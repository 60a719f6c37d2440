"""A ``bkaio decommission`` that fails or is interrupted leaves no bookie stuck in
``R/replication/decommissioning/`` (never a replacement again, its open ledgers' writers fenced):
a failure before this run marked anything ends the decommission it started; one left in
progress (a timeout, an interrupt, a ledger that could not be healed) is finished by running the
command again, or ended by ``bkaio decommission --cancel BOOKIE``. In process, on the memory
store."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import pytest

import metadata
from bookkeeper_aio.cli import autorecovery_commands
from bookkeeper_aio.errors import BKInterfaceError
from metadata.bookies import BookieInfo, BookieRegistration
from metadata.memory import MemoryStore
from metadata.underreplication import UnderReplicationManager
from tests.unit.autorecovery.commands import command_args, command_connection

ROOT = "/bookkeeper/cancel"
BOOKIE = "b3"


@pytest.fixture
async def meta(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[metadata.MetadataConnection]:
    store, connection = await command_connection(monkeypatch, ROOT, BOOKIE)
    monkeypatch.setattr(autorecovery_commands, "check_admin_is", lambda admin, bookie_id: None)
    monkeypatch.setattr(autorecovery_commands, "admin_token", lambda explicit: "token")
    yield connection
    await store.close()


def _args(*argv: str) -> argparse.Namespace:
    return command_args("decommission", ROOT, *argv)


async def _registered(store: MemoryStore) -> BookieRegistration:
    info = BookieInfo(BOOKIE, "127.0.0.1", 4300, attributes={"admin": "127.0.0.1:4399"})
    registration = BookieRegistration(store, ROOT, info, ttl_s=5)
    await registration.start()
    return registration


async def test_a_decommission_whose_read_only_step_fails_is_ended(
    meta: metadata.MetadataConnection, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(admin: str, token: str | None, read_only: bool) -> None:
        raise BKInterfaceError("could not make the bookie read-only: 401")

    monkeypatch.setattr(autorecovery_commands, "_set_read_only", refused)
    registration = await _registered(meta.store)  # type: ignore[arg-type]
    try:
        with pytest.raises(BKInterfaceError):
            await autorecovery_commands.cmd_decommission(_args(BOOKIE))
        assert await UnderReplicationManager(meta.store, meta.root).decommissioning() == set()
    finally:
        await registration.close()


async def test_a_rerun_whose_read_only_step_fails_leaves_the_decommission_in_progress(
    meta: metadata.MetadataConnection, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The re-run the command asks for after an interrupted decommission: its read-only step
    failing must not end the decommission the first run started, whose marks still list the
    bookie (it would be chosen as a replacement again while they move its ledgers off)."""
    urm = UnderReplicationManager(meta.store, meta.root)
    await urm.start_decommission(BOOKIE)  # the first run, interrupted after marking a ledger
    await urm.mark(7, [BOOKIE], reason="decommission")

    def refused(admin: str, token: str | None, read_only: bool) -> None:
        raise BKInterfaceError("could not make the bookie read-only: timed out")

    monkeypatch.setattr(autorecovery_commands, "_set_read_only", refused)
    registration = await _registered(meta.store)  # type: ignore[arg-type]
    try:
        with pytest.raises(BKInterfaceError):
            await autorecovery_commands.cmd_decommission(_args(BOOKIE))
        assert await urm.decommissioning() == {BOOKIE}
        mark = await urm.get(7)
        assert mark is not None
        assert mark.missing == (BOOKIE,)
        assert f"the decommission of {BOOKIE} is still in progress" in capsys.readouterr().err
    finally:
        await registration.close()


async def test_an_interrupted_decommission_stays_in_progress_until_cancelled(
    meta: metadata.MetadataConnection, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Interrupted once its ledgers are marked: in progress (the daemons go on), and the command
    says how to finish it or end it; ``--cancel`` ends it, drops the marks made for it alone,
    keeps a mark for another reason, and makes the bookie writable again."""
    urm = UnderReplicationManager(meta.store, meta.root)
    ledgers = meta.ledger_manager()
    only_leaving = (await ledgers.create(("b1", "b2", BOOKIE), write_quorum=2, ack_quorum=2)).ledger_id
    also_lost = (await ledgers.create(("b1", BOOKIE), write_quorum=2, ack_quorum=2)).ledger_id
    await urm.mark(also_lost, [BOOKIE], reason="lost")
    other = (await ledgers.create(("b1", "b2"), write_quorum=2, ack_quorum=2)).ledger_id
    await urm.mark(other, ["b2"], reason="decommission")  # another bookie's decommission: stays
    modes: list[bool] = []
    monkeypatch.setattr(
        autorecovery_commands, "_set_read_only", lambda admin, token, flag: modes.append(flag)
    )

    async def interrupted(*args: object, **kwargs: object) -> int:
        await autorecovery_commands.mark_ledgers_on(ledgers, urm, {BOOKIE}, reason="decommission")
        raise metadata.MetadataUnavailable("etcd went away mid-way")

    monkeypatch.setattr(autorecovery_commands, "_recover", interrupted)
    registration = await _registered(meta.store)  # type: ignore[arg-type]
    try:
        with pytest.raises(metadata.MetadataUnavailable):
            await autorecovery_commands.cmd_decommission(_args(BOOKIE))
        assert modes == [True]
        assert await urm.decommissioning() == {BOOKIE}  # in progress, and said so
        assert f"bkaio decommission --cancel {BOOKIE}" in capsys.readouterr().err
        mark = await urm.get(also_lost)
        assert mark is not None
        assert mark.reasons_of(BOOKIE) == ("decommission", "lost")

        assert await autorecovery_commands.cmd_decommission(_args("--cancel", BOOKIE)) == 0
        assert modes == [True, False]  # writable again, through its admin endpoint
        assert await urm.decommissioning() == set()
        assert await urm.get(only_leaving) is None
        mark = await urm.get(also_lost)  # lost all the same: still to be healed
        assert mark is not None
        assert mark.missing == (BOOKIE,)
        other_mark = await urm.get(other)
        assert other_mark is not None
        assert other_mark.missing == ("b2",)
        assert await metadata.read_cookie(meta.store, meta.root, BOOKIE) is not None  # still a member
    finally:
        await registration.close()


async def test_cancel_of_a_bookie_that_publishes_no_admin_endpoint_says_what_is_left(
    meta: metadata.MetadataConnection, capsys: pytest.CaptureFixture[str]
) -> None:
    urm = UnderReplicationManager(meta.store, meta.root)
    await urm.start_decommission(BOOKIE)
    assert await autorecovery_commands.cmd_decommission(_args("--cancel", BOOKIE)) == 0
    assert await urm.decommissioning() == set()
    assert "readonly?set=0" in capsys.readouterr().err
    # nothing left to cancel: the same answer, nothing changes
    assert await autorecovery_commands.cmd_decommission(_args("--cancel", BOOKIE)) == 0
