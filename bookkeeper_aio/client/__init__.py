"""The client floor: ledger handles, reads, tailing, recovery, and the one replication primitive.

It stands on the wire codec (:mod:`bookkeeper_aio.protocol`), the ground floor
(:mod:`bookkeeper_aio.common`, :mod:`bookkeeper_aio.errors`) and :mod:`metadata`; it never imports
:mod:`bookie`. Applications use the names :mod:`bookkeeper_aio` re-exports (docs/api.md).
"""

import sys as _sys

import structlog as _structlog

from bookkeeper_aio.common.logging_setup import LoggingConfigError as _LoggingConfigError
from bookkeeper_aio.common.logging_setup import configure_logging as _configure_logging

if not _structlog.is_configured():
    # structlog's unconfigured default prints every level to stdout; a library must not write to
    # an application's stdout. Warnings and errors go to stderr until the application configures
    # structlog itself (or calls bookkeeper_aio.common.logging_setup.configure_logging).
    try:
        _configure_logging(level="warning")
    except _LoggingConfigError:  # a bad $BKAIO_LOG_FORMAT is the application's to report, not an import's
        _configure_logging(level="warning", json=not _sys.stderr.isatty())
