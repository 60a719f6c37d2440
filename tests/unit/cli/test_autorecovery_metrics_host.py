"""`autorecovery run --metrics-port` listens on loopback unless --metrics-host widens it (it bound
prometheus_client's default, every interface, before), like a bookie's admin endpoint."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from bookkeeper_aio.autorecovery.metrics import AutorecoveryMetrics
from bookkeeper_aio.cli.autorecovery_commands import serve_metrics
from bookkeeper_aio.cli.main import _parser
from bookkeeper_aio.errors import BKInterfaceError


def test_the_metrics_endpoint_binds_loopback_by_default_and_serves() -> None:
    args = _parser().parse_args(["autorecovery", "run", "--metrics-port", "0"])
    assert args.metrics_host == "127.0.0.1"
    metrics = AutorecoveryMetrics()
    metrics.ledgers_healed = 7
    server = serve_metrics(metrics, args.metrics_host, args.metrics_port)
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            body = response.read().decode()
        assert "bookkeeper_autorecovery" in body
        assert any(line.endswith(" 7.0") for line in body.splitlines() if "healed" in line), body
    finally:
        server.shutdown()
        server.server_close()


def test_metrics_host_widens_it_when_asked() -> None:
    args = _parser().parse_args(["autorecovery", "run", "--metrics-port", "0", "--metrics-host", "0.0.0.0"])
    server = serve_metrics(AutorecoveryMetrics(), args.metrics_host, args.metrics_port)
    try:
        assert server.server_address[0] == "0.0.0.0"
    finally:
        server.shutdown()
        server.server_close()


def test_a_port_out_of_range_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("99999", "-1", "http"):
        with pytest.raises(SystemExit) as exited:
            _parser().parse_args(["autorecovery", "run", "--metrics-port", bad])
        assert exited.value.code == 2
        assert "--metrics-port" in capsys.readouterr().err


def test_a_port_in_use_names_the_port_and_what_to_do() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BKInterfaceError, match=rf"127\.0\.0\.1:{port}: .*choose another --metrics-port"):
            serve_metrics(AutorecoveryMetrics(), "127.0.0.1", port)
