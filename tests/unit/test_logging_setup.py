"""configure_logging: a log line that cannot be written is dropped, never raised into the caller."""

from __future__ import annotations

import contextlib
import io
import os
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
