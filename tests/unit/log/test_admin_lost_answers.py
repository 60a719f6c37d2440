"""Log operations (delete_log, cursors of a recreated log) against lost answers and half-done
deletes, on fake bookies and MemoryStore."""

from __future__ import annotations

import pytest

from bookkeeper_aio import (
    BookKeeper,
    LogPosition,
    MetadataConflict,
    NoSuchLog,
    commit_cursor,
    delete_log,
    describe_log,
    open_log_writer,
    read_cursors,
    truncate_log,
)
from bookkeeper_aio.log import admin
from metadata.errors import BadVersion, CasResultUnknown
from metadata.log_manager import LogManager
from tests.unit.client.conftest import ROOT
from tests.unit.log.fakes import world


class _LostDelete(LogManager):
    """The first delete of the log's key loses its answer: after it applied (``applies``) or
    before."""

    def __init__(self, *args: object, applies: bool, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.applies = applies
        self.armed = True

    async def delete(self, name: str, expected_version: int | None = None) -> None:
        if self.armed:
            self.armed = False
            if self.applies:
                await super().delete(name, expected_version)
            raise CasResultUnknown(self.keys.log(name), "etcd DEADLINE_EXCEEDED")
        await super().delete(name, expected_version)


async def _log_with_cursor(bk: BookKeeper, name: str) -> list[int]:
    writer = await open_log_writer(bk, name)
    position = await writer.append(b"x")
    await writer.roll()
    await writer.append(b"y")
    await commit_cursor(bk, name, "consumer", position)
    await writer.close()
    return list(writer.ledger_ids)


@pytest.mark.parametrize("applies", [True, False])
async def test_a_delete_whose_answer_was_lost_still_deletes_the_ledgers_and_cursors(
    monkeypatch: pytest.MonkeyPatch, applies: bool
) -> None:
    """The key's delete applied (or not) and its answer was lost: delete_log reads the log back and
    finishes (a retry would get NoSuchLog and never delete them: orphans, and a stale cursor
    capping every cut of a new log of that name)."""
    async with world(clients=1) as w:
        (bk,) = w.clients
        ledger_ids = await _log_with_cursor(bk, "d")
        manager = _LostDelete(w.store, ROOT, applies=applies)
        monkeypatch.setattr(admin, "log_manager", lambda _bk: manager)
        await delete_log(bk, "d")
        assert not manager.armed
        assert [i for i in ledger_ids if await bk.context.ledgers.exists(i)] == []
        assert await manager.read_cursors("d") == {}
        with pytest.raises(NoSuchLog):
            await delete_log(bk, "d")


class _Rolling(LogManager):
    """Every delete of the log's key finds the list moved on (a writer that keeps rolling)."""

    async def delete(self, name: str, expected_version: int | None = None) -> None:
        assert expected_version is not None
        raise BadVersion(self.keys.log(name), expected_version, expected_version + 1)


async def test_a_delete_that_fails_leaves_the_log_its_cursors(monkeypatch: pytest.MonkeyPatch) -> None:
    """delete_log gives up (MetadataConflict) and the log stays: its cursors stay too, or its
    retention and truncation would cut what its consumers have not read."""
    async with world(clients=1) as w:
        (bk,) = w.clients
        await _log_with_cursor(bk, "d")
        cursors = await read_cursors(bk, "d")
        assert list(cursors) == ["consumer"]
        monkeypatch.setattr(admin, "log_manager", lambda _bk: _Rolling(w.store, ROOT))
        with pytest.raises(MetadataConflict):
            await delete_log(bk, "d")
        monkeypatch.undo()
        assert (await describe_log(bk, "d")).name == "d"
        assert await read_cursors(bk, "d") == cursors


class _LostThenRecreated(_LostDelete):
    """The first delete applies and its answer is lost; before delete_log reads the log back, a
    new log of that name is created and a consumer commits a cursor to it."""

    def __init__(self, *args: object, bk: BookKeeper, **kwargs: object) -> None:
        super().__init__(*args, applies=True, **kwargs)
        self.bk = bk

    async def delete(self, name: str, expected_version: int | None = None) -> None:
        try:
            await super().delete(name, expected_version)
        except CasResultUnknown:
            writer = await open_log_writer(self.bk, name)
            await commit_cursor(self.bk, name, "new-consumer", await writer.append(b"new"))
            await writer.close()
            raise


async def test_a_delete_settled_by_a_new_log_leaves_the_new_logs_cursors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cursors go after the key's delete; when the read back finds a new log, they are the new
    log's (its create cleared the deleted one's) and stay."""
    async with world(clients=1) as w:
        (bk,) = w.clients
        ledger_ids = await _log_with_cursor(bk, "d")
        manager = _LostThenRecreated(w.store, ROOT, bk=bk)
        monkeypatch.setattr(admin, "log_manager", lambda _bk: manager)
        await delete_log(bk, "d")
        assert not manager.armed
        assert [i for i in ledger_ids if await bk.context.ledgers.exists(i)] == []
        assert list(await read_cursors(bk, "d")) == ["new-consumer"]


async def test_a_new_log_does_not_inherit_the_cursors_a_deleted_one_left() -> None:
    """A cursor left by a deleted log of the same name (a delete_log that stopped half way, or a
    commit racing it) would cap every truncation of the new log."""
    async with world(clients=1) as w:
        (bk,) = w.clients
        manager = LogManager(w.store, ROOT)
        await manager.write_cursor("d", "consumer", 1, 0)  # what a deleted log "d" left
        writer = await open_log_writer(bk, "d")
        for i in range(3):
            await writer.append(b"n%d" % i)
            await writer.roll()
        assert await read_cursors(bk, "d") == {}
        last = writer.ledger_id
        assert await truncate_log(bk, "d", LogPosition(last, 0)) == LogPosition(last, 0)
        assert [ledger.ledger_id for ledger in (await describe_log(bk, "d")).ledgers] == [last]
        await writer.close()
