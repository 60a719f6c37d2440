"""structlog set up once per process: console lines on a TTY, JSON lines otherwise.

Every process (bookie, CLI, sandbox, benchmarks) calls :func:`configure_logging` once at start.
Libraries only call ``structlog.get_logger(__name__)`` and bind identifiers as fields
(``log.info("ensemble.changed", ledger_id=..., bookie=...)``); nothing per entry at INFO.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
LEVELS = tuple(_LEVELS)
"""The log levels every process takes (``--log-level``, ``$BKAIO_LOG_LEVEL``, a bookie's ``log_level``)."""
FORMATS = ("json", "console")
"""The values of ``$BKAIO_LOG_FORMAT``."""
LEVEL_ENV = "BKAIO_LOG_LEVEL"
FORMAT_ENV = "BKAIO_LOG_FORMAT"


class LoggingConfigError(ValueError):
    """A log level or format that is none of the known ones; the message names where it came from."""


def env_log_level() -> str | None:
    """``$BKAIO_LOG_LEVEL``, lower-cased, or None when unset or empty; raises `LoggingConfigError`
    for a value that is no level (a typo must not silently log at another level)."""
    return _env_choice(LEVEL_ENV, LEVELS)


def env_log_format() -> str | None:
    """``$BKAIO_LOG_FORMAT``, lower-cased, or None when unset or empty; raises `LoggingConfigError`."""
    return _env_choice(FORMAT_ENV, FORMATS)


def _env_choice(name: str, choices: tuple[str, ...]) -> str | None:
    value = os.environ.get(name, "")
    if not value:
        return None
    if value.lower() not in choices:
        raise LoggingConfigError(f"${name}={value!r}: use one of {', '.join(choices)}")
    return value.lower()


class _DroppingPrintLogger(structlog.PrintLogger):
    """A PrintLogger whose failed writes (a closed stream, a broken pipe, a full disk under the log
    file) drop the line instead of raising into the caller: a log call sits inside acks, journal
    completions and read answers, and must never stop them (the stdlib's handlers behave the same).
    Dropped lines are counted in ``dropped_lines``."""

    dropped_lines = 0

    def msg(self, message: str) -> None:
        try:
            super().msg(message)
        except (OSError, ValueError):  # ValueError: "I/O operation on closed file"
            _DroppingPrintLogger.dropped_lines += 1

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


class _DroppingPrintLoggerFactory:
    def __init__(self, file: Any) -> None:
        self._file = file

    def __call__(self, *args: Any) -> _DroppingPrintLogger:
        return _DroppingPrintLogger(self._file)


def configure_logging(level: str | None = None, json: bool | None = None, stream: Any = None) -> None:
    """Configure structlog for this process.

    ``level`` defaults to ``$BKAIO_LOG_LEVEL`` or ``info``; ``json`` defaults to "stream is not a
    TTY" (``$BKAIO_LOG_FORMAT=json|console`` overrides). Raises `LoggingConfigError` for a level,
    or either variable, that is none of the known values.
    """
    out = stream if stream is not None else sys.stderr
    name = level.lower() if level else env_log_level() or "info"
    if name not in _LEVELS:
        raise LoggingConfigError(f"log level {level!r}: use one of {', '.join(LEVELS)}")
    if json is None:
        fmt = env_log_format()
        json = fmt == "json" or (fmt is None and not out.isatty())
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[name]),
        logger_factory=_DroppingPrintLoggerFactory(out),
        cache_logger_on_first_use=True,
    )
