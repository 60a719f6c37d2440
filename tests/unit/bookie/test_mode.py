"""bookie.mode: the WRITABLE/READONLY state machine (thresholds, hysteresis, manual toggle, journal
failure, what a read-only bookie still accepts), the config keys, and the admin ``/readonly`` route;
then an in-process BookieServer started read-only, driven over the wire."""

from __future__ import annotations

import dataclasses
import errno
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bookie.admin import AdminServer, parse_query
from bookie.config import BookieConfig, ConfigError
from bookie.mode import DiskThresholds, Mode, ModeMachine, ReadOnly
from bookie.processor import status_for
from bookie.server import BookieServer
from bookkeeper_aio.protocol.codes import StatusCode
from tests.harness.admin_http import get_json, http_get
from tests.integration.bookie.wire import WireClient

from .test_metrics import make_snapshot

MiB = 1024 * 1024
T = DiskThresholds(free_bytes_min=100 * MiB, free_bytes_writable=150 * MiB, reserve_bytes=20 * MiB)


class Changes:
    def __init__(self) -> None:
        self.seen: list[tuple[Mode, Mode, str]] = []

    def __call__(self, old: Mode, new: Mode, reason: str) -> None:
        self.seen.append((old, new, reason))


def machine() -> tuple[ModeMachine, Changes]:
    changes = Changes()
    return ModeMachine(T, changes), changes


# ---------------------------------------------------------------------- thresholds and hysteresis
def test_starts_writable_and_stays_above_the_minimum() -> None:
    mode, changes = machine()
    assert mode.mode is Mode.WRITABLE
    assert mode.reason is None
    mode.observe_disk(100 * MiB)  # exactly the minimum is still writable
    assert mode.mode is Mode.WRITABLE
    assert changes.seen == []
    mode.check_add(recovery=False)  # no error


def test_below_minimum__read_only_with_the_numbers_in_the_reason() -> None:
    mode, changes = machine()
    mode.observe_disk(100 * MiB - 1)
    assert mode.read_only
    assert changes.seen == [
        (Mode.WRITABLE, Mode.READONLY, f"disk free {100 * MiB - 1} bytes < disk_free_bytes_min {100 * MiB}")
    ]
    with pytest.raises(ReadOnly, match=r"disk free .* < disk_free_bytes_min"):
        mode.check_add(recovery=False)
    assert status_for(ReadOnly("x")) == StatusCode.EREADONLY


def test_hysteresis__writable_only_at_the_upper_threshold() -> None:
    mode, changes = machine()
    mode.observe_disk(50 * MiB)
    for free in (100 * MiB, 120 * MiB, 150 * MiB - 1):  # between the thresholds: no flapping
        mode.observe_disk(free)
        assert mode.read_only, free
        assert "read-only until disk_free_bytes_writable" in (mode.reason or "")
    mode.observe_disk(150 * MiB)
    assert mode.mode is Mode.WRITABLE
    assert [(old, new) for old, new, _ in changes.seen] == [
        (Mode.WRITABLE, Mode.READONLY),
        (Mode.READONLY, Mode.WRITABLE),
    ]
    assert mode.transitions == 2
    mode.observe_disk(120 * MiB)  # back in the band from above: still writable
    assert not mode.read_only


def test_recovery_adds__accepted_above_the_reserve_only() -> None:
    mode, _ = machine()
    mode.observe_disk(20 * MiB + 1)
    mode.check_add(recovery=True)  # within the reserve's margin: accepted
    mode.observe_disk(20 * MiB)
    with pytest.raises(ReadOnly, match="reserve is used up"):
        mode.check_add(recovery=True)
    mode.observe_disk(None, "data dir unusable: statvfs: EIO")  # free space unknown: refused too
    with pytest.raises(ReadOnly):
        mode.check_add(recovery=True)


def test_disk_problem__read_only_until_a_good_observation() -> None:
    mode, _ = machine()
    mode.observe_disk(None, "data dir is read-only")
    assert mode.read_only
    assert mode.reason == "data dir is read-only"
    mode.observe_disk(500 * MiB)
    assert not mode.read_only


# ---------------------------------------------------------------------- manual toggle
def test_manual__sticks_until_cleared_even_with_a_free_disk() -> None:
    mode, changes = machine()
    mode.observe_disk(500 * MiB)
    mode.set_manual(True)
    assert mode.read_only
    assert mode.manual
    assert "operator" in (mode.reason or "")
    mode.observe_disk(900 * MiB)
    assert mode.read_only
    mode.check_add(recovery=True)  # recovery adds still pass: the disk has room
    with pytest.raises(ReadOnly, match="operator"):
        mode.check_add(recovery=False)
    mode.set_manual(False)
    assert not mode.read_only
    assert len(changes.seen) == 2


def test_manual_cleared_while_the_disk_is_low__stays_read_only_for_the_disk() -> None:
    mode, changes = machine()
    mode.set_manual(True)
    mode.observe_disk(10 * MiB)
    assert "operator" in (mode.reason or "")
    assert "disk free" in (mode.reason or "")
    mode.set_manual(False)
    assert mode.read_only
    assert mode.reason == f"disk free {10 * MiB} bytes < disk_free_bytes_min {100 * MiB}"
    assert len(changes.seen) == 1  # no transition: only the reason changed


def test_journal_failure__read_only_for_good_recovery_adds_left_to_the_journal() -> None:
    mode, _ = machine()
    mode.observe_disk(500 * MiB)
    mode.observe_journal(None)
    assert not mode.read_only
    mode.observe_journal(OSError(errno.ENOSPC, "No space left on device"))
    assert mode.read_only
    assert "journal failed" in (mode.reason or "")
    mode.check_add(recovery=True)  # not refused here: the journal answers EIO itself
    mode.observe_disk(900 * MiB)
    assert mode.read_only


def test_thresholds_validation() -> None:
    with pytest.raises(ValueError, match="disk_free_bytes_writable"):
        DiskThresholds(100, 99, 0).validate()
    with pytest.raises(ValueError, match="disk_reserve_bytes"):
        DiskThresholds(100, 100, 101).validate()
    with pytest.raises(ValueError, match=">= 0"):
        DiskThresholds(100, 100, -1).validate()
    DiskThresholds(100, 100, 100).validate()


def test_config__keys_defaults_and_validation(tmp_path: Path) -> None:
    config = BookieConfig(data_dir=str(tmp_path)).validate()
    assert config.disk_thresholds() == DiskThresholds(512 * MiB, 768 * MiB, 128 * MiB)
    assert config.disk_check_interval_s == 1.0
    with pytest.raises(ConfigError, match="disk_free_bytes_writable"):
        BookieConfig(data_dir=str(tmp_path), disk_free_bytes_writable=1).validate()
    with pytest.raises(ConfigError, match="disk_check_interval_s"):
        BookieConfig(data_dir=str(tmp_path), disk_check_interval_s=0).validate()


# ---------------------------------------------------------------------- admin /readonly
def test_parse_query() -> None:
    assert parse_query(b"GET /readonly?set=1&x= HTTP/1.1\r\n") == {"set": "1", "x": ""}
    assert parse_query(b"GET /readonly HTTP/1.1\r\n") == {}


@pytest.fixture
async def admin_with_toggle() -> AsyncIterator[tuple[list[bool | None], str, int]]:
    calls: list[bool | None] = []

    def toggle(value: bool | None) -> dict[str, object]:
        calls.append(value)
        return {"mode": "readonly" if value else "writable"}

    server = AdminServer(lambda: make_snapshot(), "127.0.0.1", 0, read_only=toggle, token=b"tok")
    await server.start()
    assert server.address is not None
    yield calls, *server.address
    await server.close()


async def test_admin_readonly_route(admin_with_toggle: tuple[list[bool | None], str, int]) -> None:
    calls, host, port = admin_with_toggle
    assert await get_json(host, port, "/readonly") == (200, {"mode": "writable"})
    status, _, _ = await http_get(host, port, "/readonly?set=1", method="POST", token="tok")
    assert status == 200
    status, _, _ = await http_get(host, port, "/readonly?set=0", method="POST", token="tok")
    assert status == 200
    status, _, _ = await http_get(host, port, "/readonly?set=1", method="HEAD")  # HEAD never changes
    assert status == 200
    # A state change by GET (cross-site triggerable), or a POST without the token: refused, nothing changes.
    status, headers, _ = await http_get(host, port, "/readonly?set=1", token="tok")
    assert (status, headers["allow"]) == (405, "GET, HEAD, POST")
    status, headers, _ = await http_get(host, port, "/readonly?set=1", method="POST")
    assert status == 401
    status, _, body = await http_get(host, port, "/readonly?set=1", method="POST", token="wrong")
    assert (status, body) == (403, b"wrong admin token\n")
    status, _, body = await http_get(host, port, "/readonly?set=maybe")
    assert (status, body) == (400, b"set must be 1 or 0\n")
    status, headers, _ = await http_get(host, port, "/readonly?set=1", method="DELETE")
    assert status == 405
    assert headers["allow"] == "GET, HEAD, POST"
    assert calls == [None, True, False, None]  # the refused requests never reached the toggle


async def test_admin_without_a_token_refuses_every_state_change() -> None:
    calls: list[bool | None] = []
    server = AdminServer(
        lambda: make_snapshot(), "127.0.0.1", 0, read_only=lambda v: {"set": calls.append(v)}
    )
    await server.start()
    assert server.address is not None
    try:
        status, _, _ = await http_get(*server.address, "/readonly?set=1", method="POST", token="anything")
        assert status == 403
        assert calls == []
    finally:
        await server.close()


async def test_admin_without_toggle__no_readonly_route() -> None:
    server = AdminServer(lambda: make_snapshot(), "127.0.0.1", 0)
    await server.start()
    assert server.address is not None
    try:
        status, _, _ = await http_get(*server.address, "/readonly?set=1")
        assert status == 404
    finally:
        await server.close()


# ---------------------------------------------------------------------- a real server, in process
def _config(tmp_path: Path, **changes: object) -> BookieConfig:
    base = BookieConfig(
        data_dir=str(tmp_path / "data"), bookie_id="mode-test", port=0, disk_check_interval_s=0.05
    )
    return dataclasses.replace(base, **changes).validate()  # type: ignore[arg-type]


async def test_server__starts_read_only_when_the_disk_is_below_the_minimum(tmp_path: Path) -> None:
    huge = 1 << 60  # more than any disk has free
    server = BookieServer(_config(tmp_path, disk_free_bytes_min=huge, disk_free_bytes_writable=huge))
    await server.start()
    client = await WireClient.connect(*server.address)  # type: ignore[misc]
    try:
        assert server.mode.read_only
        refused = await client.add(1, 0, b"x")
        assert refused.status == StatusCode.EREADONLY
        assert "disk_free_bytes_min" in refused.message
        assert (await client.add(1, 0, b"x", recovery=True)).status == StatusCode.EOK
        assert (await client.read(1, 0)).status == StatusCode.EOK
        assert (await client.write_lac(1, 0)).status == StatusCode.EOK  # a ledger it holds
        assert (await client.write_lac(2, 0)).status == StatusCode.EREADONLY  # a new one
        assert (await client.fence(1)).status == StatusCode.EOK
        assert server.snapshot().state.value == "read_only"
        assert server.processor is not None
        assert server.processor.errors[StatusCode.EREADONLY] == 2
    finally:
        client.close()
        await server.close()


async def test_server__manual_toggle_and_back(tmp_path: Path) -> None:
    server = BookieServer(
        _config(tmp_path, disk_free_bytes_min=0, disk_free_bytes_writable=0, disk_reserve_bytes=0)
    )
    await server.start()
    client = await WireClient.connect(*server.address)  # type: ignore[misc]
    try:
        assert (await client.add(1, 0, b"x")).status == StatusCode.EOK
        answer = server.set_read_only(True)
        assert answer["mode"] == "readonly"
        assert answer["manual"] is True
        refused = await client.add(1, 1, b"x")
        assert refused.status == StatusCode.EREADONLY
        assert "operator" in refused.message
        await server.check_mode()  # a free disk does not clear a manual read-only
        assert server.mode.read_only
        assert server.set_read_only(None)["mode"] == "readonly"
        assert server.set_read_only(False)["mode"] == "writable"
        assert (await client.add(1, 1, b"x")).status == StatusCode.EOK
    finally:
        client.close()
        await server.close()
