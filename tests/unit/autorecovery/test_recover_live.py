"""``bkaio recover`` on a running bookie, and the way out of what a recover left: a bookie that is
registered and writable is refused without ``--force`` (its marks would stay until every ledger
on it was copied elsewhere: no command removed them), ``bkaio recover --cancel BOOKIE`` drops the
marks made for ``operator`` alone, and a recover whose every ledger left fails for what needs the
operator stops early and says what to do. In process, on the memory store."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import pytest

import metadata
from bookkeeper_aio.autorecovery.worker import ReplicationWorker
from bookkeeper_aio.cli import autorecovery_commands
from metadata.bookies import BookieInfo, BookieRegistration, BookieState
from metadata.memory import MemoryStore
from metadata.underreplication import UnderReplicationManager
from tests.unit.autorecovery.commands import command_args, command_connection, heal_without_password

ROOT = "/bookkeeper/recover-live"
BOOKIE = "b3"


@pytest.fixture
async def meta(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[metadata.MetadataConnection]:
    store, connection = await command_connection(monkeypatch, ROOT, BOOKIE)
    yield connection
    await store.close()


def _args(*argv: str) -> argparse.Namespace:
    return command_args("recover", ROOT, *argv)


async def _registered(store: MemoryStore) -> BookieRegistration:
    registration = BookieRegistration(store, ROOT, BookieInfo(BOOKIE, "127.0.0.1", 4300), ttl_s=5)
    await registration.start()
    return registration


async def test_a_writable_bookie_is_refused_unless_forced(
    meta: metadata.MetadataConnection, monkeypatch: pytest.MonkeyPatch
) -> None:
    urm = UnderReplicationManager(meta.store, meta.root)
    await meta.ledger_manager().create(("b1", "b2", BOOKIE), write_quorum=2, ack_quorum=2)
    ran: list[str] = []

    async def recovered(*args: object, reason: str, **kwargs: object) -> int:
        ran.append(reason)
        return 0

    monkeypatch.setattr(autorecovery_commands, "_recover", recovered)
    registration = await _registered(meta.store)  # type: ignore[arg-type]
    try:
        with pytest.raises(SystemExit) as refused:
            await autorecovery_commands.cmd_recover(_args(BOOKIE))
        assert "registered and writable" in str(refused.value.code)
        assert f"bkaio decommission {BOOKIE}" in str(refused.value.code)
        assert "--force" in str(refused.value.code)
        assert (ran, await urm.count()) == ([], 0)  # nothing marked
        assert await autorecovery_commands.cmd_recover(_args(BOOKIE, "--force")) == 0
        assert ran == ["operator"]
        await registration.set_state(BookieState.READONLY)  # read-only (disk full): not refused
        assert await autorecovery_commands.cmd_recover(_args(BOOKIE)) == 0
        assert ran == ["operator", "operator"]
    finally:
        await registration.close()
    assert await autorecovery_commands.cmd_recover(_args(BOOKIE)) == 0  # gone: the usual case


async def test_cancel_drops_the_marks_made_for_operator_alone(
    meta: metadata.MetadataConnection, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bookie leaves the marks that list it for ``operator`` alone (the key goes when no bookie
    is left); a mark listing it for another reason too keeps it, and other bookies stay."""
    urm = UnderReplicationManager(meta.store, meta.root)
    await urm.mark(1, [BOOKIE], reason="operator")
    await urm.mark(2, [BOOKIE], reason="operator")
    await urm.mark(2, [BOOKIE], reason="lost")
    await urm.mark(3, [BOOKIE], reason="operator")
    await urm.mark(3, ["b2"], reason="lost")
    await urm.mark(4, ["b2"], reason="operator")  # another bookie's recover
    assert await autorecovery_commands.cmd_recover(_args("--cancel", BOOKIE, "--json")) == 0
    assert '"marks_dropped": 2' in capsys.readouterr().out
    assert await urm.get(1) is None
    two = await urm.get(2)
    assert two is not None
    assert (two.missing, two.reasons_of(BOOKIE)) == ((BOOKIE,), ("lost", "operator"))
    three = await urm.get(3)
    assert three is not None
    assert (three.missing, three.reasons_of("b2")) == (("b2",), ("lost",))
    four = await urm.get(4)
    assert four is not None
    assert four.missing == ("b2",)
    assert await autorecovery_commands.cmd_recover(_args("--cancel", BOOKIE)) == 0  # nothing left: same


async def test_a_recover_stuck_on_what_needs_the_operator_stops_and_says_what_to_do(
    meta: metadata.MetadataConnection, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    await meta.ledger_manager().create(("b1", "b2", BOOKIE), write_quorum=2, ack_quorum=2)

    monkeypatch.setattr(ReplicationWorker, "heal", heal_without_password)
    monkeypatch.setattr(autorecovery_commands, "HEAL_RETRY_S", 0.05)
    monkeypatch.setattr(autorecovery_commands, "STUCK_S", 0.2)
    assert await autorecovery_commands.cmd_recover(_args(BOOKIE, "--timeout", "600")) == 1
    err = capsys.readouterr().err
    assert "stopped before --timeout" in err
    assert "NoPasswordForLedger: give the ledger's password (--password PW" in err
