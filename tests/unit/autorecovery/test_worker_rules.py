"""The worker's pure rules: fragment ranges, which fragment may be touched now, the password
chosen by the metadata's hash; the configuration's typed errors; the Prometheus exposition."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from bookkeeper_aio.autorecovery.config import AutorecoveryConfig
from bookkeeper_aio.autorecovery.errors import NoPasswordForLedger
from bookkeeper_aio.autorecovery.metrics import AutorecoveryCollector, AutorecoveryMetrics
from bookkeeper_aio.autorecovery.worker import _next_fragment, fragment_ranges, password_for
from bookkeeper_aio.client.bookkeeper import password_hash
from bookkeeper_aio.errors import BKInterfaceError
from metadata.ledger_metadata import LedgerMetadata


def _ledger(password: bytes = b"") -> LedgerMetadata:
    md = LedgerMetadata.new(
        4, ("a", "b", "c"), write_quorum=2, ack_quorum=2, password_hash=password_hash(password)
    )
    return md.with_ensemble_change(10, ("a", "d", "c")).with_ensemble_change(25, ("e", "d", "c"))


def test_fragment_ranges_of_open_and_closed_ledgers() -> None:
    md = _ledger()
    assert fragment_ranges(md) == [
        (0, 9, ("a", "b", "c")),
        (10, 24, ("a", "d", "c")),
        (25, -1, ("e", "d", "c")),
    ]
    assert fragment_ranges(md.closed(30, 100))[-1] == (25, 30, ("e", "d", "c"))
    assert fragment_ranges(md.closed(24, 100))[-1] == (25, 24, ("e", "d", "c"))  # empty last fragment


def test_the_last_fragment_of_an_open_ledger_is_never_next() -> None:
    md = _ledger()
    assert _next_fragment(md, {"b"}) == (0, 9, ("a", "b", "c"))
    assert _next_fragment(md, {"d"}) == (10, 24, ("a", "d", "c"))
    assert _next_fragment(md, {"e"}) is None  # only in the writer's fragment
    assert _next_fragment(md.in_recovery(), {"e"}) is None
    assert _next_fragment(md.closed(30, 100), {"e"}) == (25, 30, ("e", "d", "c"))
    assert _next_fragment(md, {"zzz"}) is None


def test_password_is_the_one_whose_hash_the_ledger_stores() -> None:
    md = _ledger(b"second")
    assert password_for(md, [b"first", b"second"]) == b"second"
    with pytest.raises(NoPasswordForLedger, match="--password"):
        password_for(md, [b"first"])
    unprotected = LedgerMetadata.new(5, ("a",), write_quorum=1, ack_quorum=1)
    assert password_for(unprotected, [b"x", b"y"]) == b"x"


def test_bad_configuration_is_a_typed_error_naming_the_values() -> None:
    with pytest.raises(BKInterfaceError, match="lease_ttl_s"):
        AutorecoveryConfig(lease_ttl_s=1)
    with pytest.raises(BKInterfaceError, match="passwords"):
        AutorecoveryConfig(passwords=())
    with pytest.raises(BKInterfaceError, match="open_ledger_grace_s"):
        AutorecoveryConfig(open_ledger_grace_s=-1)


def test_prometheus_exposition_names_and_values() -> None:
    metrics = AutorecoveryMetrics(under_replicated_ledgers=3, bytes_copied=4096, is_auditor=True)
    metrics.healed(2.5)
    metrics.healed(1.0)
    registry = CollectorRegistry()
    registry.register(AutorecoveryCollector(metrics))
    text = generate_latest(registry).decode()
    assert "bookkeeper_autorecovery_under_replicated_ledgers 3.0" in text
    assert "bookkeeper_autorecovery_auditor 1.0" in text
    assert "bookkeeper_autorecovery_copied_bytes_total 4096.0" in text
    assert "bookkeeper_autorecovery_ledgers_healed_total 2.0" in text
    assert "bookkeeper_autorecovery_heal_seconds_total 3.5" in text
    assert metrics.heal_seconds_max == 2.5
    assert metrics.heal_seconds_last == 1.0
