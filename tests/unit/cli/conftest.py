"""The CLI's unit tests run ``main`` in the test process."""

from __future__ import annotations

import pytest

from bookkeeper_aio.cli import main as cli_main


@pytest.fixture(autouse=True)
def _keep_the_tests_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    """``main`` configures structlog for the whole process, at "error" by default, with loggers
    cached on first use: every later test of the same worker that captures warnings would see
    none. A test that checks the configuration patches it itself."""
    monkeypatch.setattr(cli_main, "configure_logging", lambda level=None: None)
