"""`bkaio decommission` makes the bookie read-only through an admin endpoint: only one that answers
for that bookie. A registration publishes a loopback admin address by default, which from another
host names that host's own bookie — it must be refused, not made read-only instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from bookkeeper_aio.cli.admin_endpoint import check_admin_is
from bookkeeper_aio.errors import BKInterfaceError
from tests.harness.bookie_proc import BookieProcess


def test_an_admin_endpoint_of_another_bookie_is_refused(tmp_path: Path) -> None:
    with BookieProcess(tmp_path / "b1", "bookie-1", extra_args=["--admin-port", "0"]) as bookie:
        bookie.start()
        host, port = bookie.admin_address()
        check_admin_is(f"{host}:{port}", "bookie-1")  # its own: accepted
        with pytest.raises(BKInterfaceError, match=r"belongs to bookie 'bookie-1', not 'bookie-3'.*host"):
            check_admin_is(f"{host}:{port}", "bookie-3")
        bookie.stop()
        with pytest.raises(BKInterfaceError, match="could not reach bookie-1's admin endpoint"):
            check_admin_is(f"{host}:{port}", "bookie-1")
