"""``bookie`` command: run one bookie until SIGTERM/SIGINT.

Prints ``READY <host>:<port>`` on stdout (flushed) once it serves, so harnesses started with
``--port 0`` can find it (then ``ADMIN <host>:<port>`` when the admin endpoint is enabled: a
second line, so readers of the first are unchanged); logs go to stderr (structlog). Exit codes:
0 clean shutdown, 2 bad configuration, 3 refused to start (data dir guard, corrupt
journal/checkpoint, cannot listen, no cluster, metadata cookie of another data dir, bookie id held
by another running bookie), with one ``bookie: refusing to start: ...`` line saying what to do.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import gc
import signal
import sys
from pathlib import Path

import structlog
import uvloop

from bookie.admin import AdminTokenError
from bookie.auth import AuthConfigError
from bookie.checkpoint import CheckpointCorrupt
from bookie.config import BookieConfig, ConfigError, effective_toml, load
from bookie.cookie import CookieMismatch, read_cluster_binding
from bookie.fileio import OS_FILE_IO
from bookie.gc import MetadataCatalog
from bookie.journal_format import JournalCorrupt
from bookie.malloc import keep_big_buffers
from bookie.registration import (
    BookieIdInUse,
    ClusterMismatch,
    ClusterNotInitialised,
    MetadataCookieMismatch,
    MetadataRegistration,
)
from bookie.server import BookieServer, ListenError
from bookkeeper_aio.common.logging_setup import LoggingConfigError, configure_logging
from bookkeeper_aio.common.tls import TlsConfigError
from metadata import MetadataError, MetadataUnavailable

log = structlog.get_logger("bookie")

EXIT_CONFIG = 2
EXIT_REFUSED = 3


async def serve(config: BookieConfig) -> int:
    registration = (
        MetadataRegistration(config.metadata, config.registration_ttl_s) if config.metadata else None
    )
    catalog = (
        MetadataCatalog(
            config.metadata,
            cluster_id=functools.partial(read_cluster_binding, OS_FILE_IO, config.data_dir),
            scan_ledgers_per_s=config.gc_over_replicated_scan_ledgers_per_s,
        )
        if config.metadata
        else None
    )
    server = BookieServer(config, registration, catalog=catalog, replicas=catalog)
    refusals = (
        *(CookieMismatch, JournalCorrupt, CheckpointCorrupt, ListenError, BlockingIOError, OSError),
        *(
            AdminTokenError,
            ClusterNotInitialised,
            ClusterMismatch,
            MetadataCookieMismatch,
            BookieIdInUse,
            MetadataError,
        ),
    )
    try:
        await server.start()
    except refusals as exc:
        if registration is not None:
            await registration.close()
        if catalog is not None:
            await catalog.close()
        reason = _refusal(exc, config)
        log.error("bookie.refused_to_start", reason=reason, error_type=type(exc).__name__)  # noqa: TRY400
        print(f"bookie: refusing to start: {reason}", file=sys.stderr, flush=True)
        return EXIT_REFUSED
    # Everything alive now (modules, recovered state) lives as long as the process: keep it out of
    # every future collection, so a full GC walks only what the traffic creates.
    gc.collect()
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    assert server.address is not None
    host, port = server.address
    print(f"READY {host}:{port}", flush=True)
    if server.admin_address is not None:
        print(f"ADMIN {server.admin_address}", flush=True)
    await stop.wait()
    log.info("bookie.stopping", bookie_id=config.bookie_id)
    await server.close()
    return 0


def _refusal(exc: BaseException, config: BookieConfig) -> str:
    """What is wrong and what to do, for the ``refusing to start`` line."""
    if isinstance(exc, BlockingIOError):
        return f"data dir {config.data_dir} is locked by another running bookie: stop it first"
    if isinstance(exc, MetadataUnavailable):
        return (
            f"{exc}; check that etcd runs at the metadata URL's HOST:PORT ({config.metadata}) and that "
            "the URL's TLS options match it (the bookie registers itself there)"
        )
    if isinstance(exc, ListenError) or not isinstance(exc, OSError):
        return str(exc)
    if exc.errno == errno.EADDRINUSE:  # the bookie port's is a ListenError: this is the admin port's
        port = config.admin_port
        return (
            f"cannot listen on the admin endpoint {config.admin_host}:{port}: address in use "
            f"(`ss -ltnp 'sport = :{port}'` shows which process): stop it, or start this bookie with "
            "another --admin-port (0 picks a free one, -1 disables the endpoint)"
        )
    data_dir = Path(config.data_dir).absolute()
    failed = Path(exc.filename).absolute() if exc.filename else None
    if failed is not None and (data_dir in (failed, *failed.parents) or failed in data_dir.parents):
        if data_dir.exists() and not data_dir.is_dir():
            problem = "is a file, not a directory"
        else:
            problem = f"cannot be used: {exc.strerror or exc} ({exc.filename})"
        return f"data dir {data_dir} {problem}: point --data-dir at a directory this user can write"
    return str(exc)


def main(argv: list[str] | None = None) -> None:
    try:
        config, args = load(argv)
    except ConfigError as exc:
        print(f"bookie: configuration error: {exc}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    if args.print_config:
        print(effective_toml(config, args.sources), end="")
        return
    try:
        config.tls_context()  # the certificate, key, CA and token files load, or we say why now
        config.auth_providers_loaded()
    except (TlsConfigError, AuthConfigError) as exc:
        print(f"bookie: configuration error: {exc}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    try:
        configure_logging(level=config.log_level)
    except LoggingConfigError as exc:  # $BKAIO_LOG_FORMAT
        print(f"bookie: configuration error: {exc}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    keep_big_buffers()  # batch reads' frames reused from the heap (bookie/malloc.py)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        code = runner.run(serve(config))
    sys.exit(code)


if __name__ == "__main__":
    main()
