"""configure_logging: a log line that cannot be written is dropped, never raised into the caller."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import structlog

from bookkeeper_aio.common import logging_setup


@pytest.fixture
def restore_structlog() -> Iterator[None]:
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


class _BrokenPipe(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.usefixtures("restore_structlog")
@pytest.mark.parametrize("kind", ["closed", "broken_pipe", "closed_fd"])
def test_an_unwritable_stream_drops_lines_instead_of_raising(kind: str) -> None:
    if kind == "closed":
        stream: io.TextIOBase = io.StringIO()
        stream.close()
    elif kind == "broken_pipe":
        stream = _BrokenPipe()
    else:
        read_end, write_end = os.pipe()
        os.close(read_end)  # writing now gets EPIPE (SIGPIPE is ignored by Python)
        stream = os.fdopen(write_end, "w")
    logging_setup.configure_logging(level="info", json=True, stream=stream)
    before = logging_setup._DroppingPrintLogger.dropped_lines
    log = structlog.get_logger("test")
    log.info("event.one", n=1)
    log.error("event.two", n=2)
    assert logging_setup._DroppingPrintLogger.dropped_lines == before + 2
    if kind == "closed_fd":
        with contextlib.suppress(OSError):
            stream.close()  # its buffer may still hold the line it could not flush


@pytest.mark.usefixtures("restore_structlog")
def test_a_writable_stream_gets_json_lines() -> None:
    stream = io.StringIO()
    logging_setup.configure_logging(level="warning", json=True, stream=stream)
    log = structlog.get_logger("test")
    log.info("below.level")
    log.warning("kept", answer=42)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    assert '"event": "kept"' in lines[0]
    assert '"answer": 42' in lines[0]


@pytest.mark.usefixtures("restore_structlog")
@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"BKAIO_LOG_LEVEL": "loud"}, "$BKAIO_LOG_LEVEL='loud': use one of debug, info, warning, error"),
        ({"BKAIO_LOG_FORMAT": "xml"}, "$BKAIO_LOG_FORMAT='xml': use one of json, console"),
    ],
)
def test_an_unknown_level_or_format_in_the_environment_is_refused(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], said: str
) -> None:
    """Before, ``$BKAIO_LOG_FORMAT=xml`` was ignored silently (console or JSON by the TTY)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(logging_setup.LoggingConfigError) as raised:
        logging_setup.configure_logging(stream=io.StringIO())
    assert str(raised.value) == said


@pytest.mark.usefixtures("restore_structlog")
def test_the_environment_is_case_insensitive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BKAIO_LOG_LEVEL", "WARNING")
    monkeypatch.setenv("BKAIO_LOG_FORMAT", "JSON")
    stream = io.StringIO()
    logging_setup.configure_logging(stream=stream)
    structlog.get_logger("test").info("below.level")
    structlog.get_logger("test").warning("kept")
    assert stream.getvalue().startswith("{")
    assert '"kept"' in stream.getvalue()
    assert "below.level" not in stream.getvalue()


def test_the_library_imports_despite_a_bad_format_in_the_environment() -> None:
    """The client configures a default on import: the application reports a bad variable, not the
    import of the library."""
    result = subprocess.run(
        [sys.executable, "-c", "import bookkeeper_aio.client"],
        env={**os.environ, "BKAIO_LOG_FORMAT": "xml"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
