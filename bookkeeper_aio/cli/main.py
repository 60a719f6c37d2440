"""``bkaio``: the sandbox cluster and the operator shell.

Every command that talks to a cluster takes ``--metadata etcd://HOST:PORT[,HOST:PORT]/ROOT``
(or ``$BKAIO_METADATA``); without either it uses the running sandbox's state file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

import uvloop

import metadata
from bookkeeper_aio.cli import bench, log_commands, shell, state
from bookkeeper_aio.cli.bench import BenchFailed, PeerUnavailable
from bookkeeper_aio.cli.netns import NetnsUnavailable
from bookkeeper_aio.cli.procs import ChildFailed
from bookkeeper_aio.client.discovery import CLIENT_CONFIG_ENV
from bookkeeper_aio.common.logging_setup import LEVELS, LoggingConfigError, configure_logging, env_log_level
from bookkeeper_aio.errors import BKError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bkaio", description="The sandbox cluster and the operator shell.")
    parser.add_argument(
        "--log-level",
        default=None,
        type=str.lower,
        choices=LEVELS,
        help="debug | info | warning | error (default: error, so a failure is one clear line; "
        "$BKAIO_LOG_LEVEL sets it too)",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="show the client's log lines too: -v warnings, -vv info, -vvv debug",
    )
    parser.add_argument(
        "--client-config",
        metavar="FILE",
        default=None,
        help="client settings TOML (TLS CA and certificate, auth token: docs/security.md) for every "
        "bookie connection this command makes (default $BKAIO_CLIENT_CONFIG, else the running "
        "sandbox's own)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sandbox = sub.add_parser(
        "sandbox",
        help="start etcd + N bookies on this machine, run a demo, serve until Ctrl-C",
        description="Start a real cluster on this machine (etcd + bookie processes), print its "
        "connection string, run a short demo, and keep serving until Ctrl-C.",
    )
    sandbox.add_argument("--bookies", type=int, default=3, help="number of bookie processes (default 3)")
    sandbox.add_argument(
        "--hosts",
        type=int,
        default=0,
        metavar="N",
        help="N bookies, each on a host of its own: a network namespace with its own IP on a bridge "
        "(needs root and `ip netns`); etcd and the demo stay on this machine and reach them by IP",
    )
    sandbox.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="where etcd and the bookies keep data (default ~/.bkaio/sandbox)",
    )
    sandbox.add_argument("--no-demo", action="store_true", help="skip the demo")
    sandbox.add_argument(
        "--demo-entries",
        type=int,
        default=20_000,
        help="entries the demo writes as fast as it can (default 20000); then a tenth as many "
        "(at least 100) at a fixed rate, for latency",
    )
    sandbox.add_argument("--fresh", action="store_true", help="wipe the data dir first")
    sandbox.add_argument("--no-serve", action="store_true", help="stop right after the demo (for scripts)")
    sandbox.add_argument(
        "--tls",
        action="store_true",
        help="TLS on the bookie port and toward etcd (a throwaway CA made on start), and token "
        "authentication on the bookies (docs/security.md)",
    )
    sandbox.set_defaults(func=None)
    shell.add_commands(sub)
    log_commands.add_commands(sub)
    bench.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
    except BrokenPipeError:
        return _stdout_closed()
    except KeyboardInterrupt:  # Ctrl-C before a command's loop runs (parsing, logging set-up)
        return 130
    return code


def _stdout_closed() -> int:
    """The reader of stdout went away (``bkaio ledgers | head -1``): stop quietly, as a Unix tool
    killed by SIGPIPE does (status 141), with no traceback, here or at interpreter exit."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the flush at exit then writes nowhere
    return 128 + signal.SIGPIPE


def _main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `bkaio bench` records its command
    daemon = args.command == "autorecovery" and getattr(args, "autorecovery_command", None) == "run"
    try:
        level = log_level(args.log_level, args.verbose, daemon=daemon)
        configure_logging(level)
    except LoggingConfigError as exc:  # $BKAIO_LOG_LEVEL or $BKAIO_LOG_FORMAT: a usage error
        print(f"bkaio: {exc}", file=sys.stderr)
        return 2
    if args.client_config:
        os.environ[CLIENT_CONFIG_ENV] = args.client_config  # read by every client this command makes
    name = " ".join(filter(None, ["bkaio", args.command, getattr(args, f"{args.command}_command", None)]))
    if args.command == "sandbox" and (args.bookies < 1 or args.hosts < 0):
        raise SystemExit("bkaio sandbox: --bookies must be >= 1 and --hosts >= 0")
    try:
        if args.func is not None:
            return uvloop.run(_interruptible(args.func(args)))
        if args.command == "sandbox":
            from bookkeeper_aio.cli import sandbox

            data_dir = args.data_dir or state.home() / "sandbox"
            return sandbox.run(
                data_dir.resolve(),
                args.hosts or args.bookies,
                0 if args.no_demo else args.demo_entries,
                args.fresh,
                not args.no_serve,
                hosts=args.hosts > 0,
                tls=args.tls,
            )
    except (
        state.NoClusterConfigured,
        shell.NoSuchCluster,
        ChildFailed,
        NetnsUnavailable,
        BenchFailed,
        PeerUnavailable,
    ) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 1
    except (BKError, metadata.MetadataError) as exc:
        print(f"{name}: {type(exc).__name__}: {exc}{_hint(exc)}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        raise  # stdout closed: main() ends quietly
    except TimeoutError:  # before OSError, its base: a bare one has no text to show
        print(f"{name}: TimeoutError: an operation got no answer in time{_CHECK_ETCD}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{name}: {_os_error(exc, args)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130  # Ctrl-C, e.g. of `bkaio log tail --follow`: no traceback
    except Exception as exc:  # noqa: BLE001 -- a bug: one line by default, the traceback on request
        if level.lower() == "debug":
            traceback.print_exc()
        print(
            f"{name}: unexpected {type(exc).__name__}: {exc} (a bug: run it again with --log-level debug "
            "for the traceback, and report it)",
            file=sys.stderr,
        )
        return 1
    return 2


INTERRUPT_GRACE_S = 10.0
"""How long a command interrupted by Ctrl-C may take to close its connections before it exits anyway."""


async def _interruptible(command: Coroutine[Any, Any, int]) -> int:
    """``command``'s exit code, or 130 after Ctrl-C (SIGINT), which cancels it: its ``async with``
    blocks close their connections (the etcd gRPC channel, the bookie connections) while the loop
    still runs. Later SIGINTs are ignored: a second Ctrl-C, or ``timeout -s INT`` (which signals
    the process and its group), used to raise KeyboardInterrupt wherever the process was, in the
    gRPC channel's finaliser or a thread's join at exit, which printed a traceback. A clean-up that
    takes more than `INTERRUPT_GRACE_S` ends with exit 130 all the same. A command started with
    SIGINT ignored (in the background, by a non-interactive shell) keeps ignoring it."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    interrupted = False

    def on_sigint() -> None:
        nonlocal interrupted
        interrupted = True
        loop.remove_signal_handler(signal.SIGINT)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # to the end of the process
        timer = threading.Timer(INTERRUPT_GRACE_S, _exit_interrupted)
        timer.daemon = True
        timer.start()
        main.cancel()

    before = signal.getsignal(signal.SIGINT)
    if before == signal.SIG_IGN:  # started in the background by a non-interactive shell: keep it so
        return await command
    loop.add_signal_handler(signal.SIGINT, on_sigint)
    try:
        code = await command
    except asyncio.CancelledError:
        if not interrupted:
            raise
        return 130
    finally:
        if not interrupted:
            loop.remove_signal_handler(signal.SIGINT)
            signal.signal(signal.SIGINT, before)  # asyncio's, which it restores when the loop ends
    return 130 if interrupted else code


def _exit_interrupted() -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    os._exit(130)


_CHECK_ETCD = (
    " (check that etcd runs at the URL's HOST:PORT, from --metadata, $BKAIO_METADATA or "
    "the running sandbox's state file, and that the URL's TLS options match it; `make run` "
    "starts a sandbox)"
)


def _hint(exc: BaseException) -> str:
    """What to do next after a typed error, where the error itself does not say it."""
    if isinstance(exc, metadata.MetadataUnavailable):
        return _CHECK_ETCD
    if isinstance(exc, metadata.CasResultUnknown):
        return (
            " (the change may or may not have been made: look at the current state, e.g. with "
            "`bkaio ledger show` or `bkaio log show`, before running the command again)"
        )
    return ""


def log_level(given: str | None, verbose: int, *, daemon: bool = False) -> str:
    """``--log-level``, else ``-v`` (warning, info, debug), else ``$BKAIO_LOG_LEVEL``, else error: a
    command that fails prints its one-line error, not the client's log lines leading to it. A
    daemon (``autorecovery run``) logs warnings by default: its log is what an operator reads.
    Raises `LoggingConfigError` for a ``$BKAIO_LOG_LEVEL`` that is no level."""
    if given:
        return given
    if verbose:
        return ("warning", "info", "debug")[min(verbose, 3) - 1]
    return env_log_level() or ("warning" if daemon else "error")


def _os_error(exc: OSError, args: argparse.Namespace) -> str:
    """``exc`` with the configured path it hit and where that path comes from."""
    failed = exc.filename
    reason = exc.strerror or str(exc)
    if failed is None:
        return f"{type(exc).__name__}: {reason}"
    failed_path = Path(failed).absolute()
    for path, origin in _configured_paths(args):
        if failed_path == path:
            return f"{failed} ({origin}): {reason}; fix that path or choose another"
        if path in failed_path.parents:
            return f"{failed} (in {path}, {origin}): {reason}; fix that path or choose another"
    return f"{failed}: {reason}"


def _configured_paths(args: argparse.Namespace) -> list[tuple[Path, str]]:
    """The paths a user configured, most specific first, each with where it was set."""
    paths: list[tuple[Path, str]] = []
    data_dir = getattr(args, "data_dir", None)
    if data_dir:
        paths.append((Path(data_dir).absolute(), "given with --data-dir"))
    elif args.command == "sandbox":
        paths.append((state.home().absolute() / "sandbox", "the default --data-dir, $BKAIO_HOME/sandbox"))
    origin = "from $BKAIO_HOME" if os.environ.get("BKAIO_HOME") else "the default $BKAIO_HOME"
    paths.append((state.home().absolute(), origin))
    return paths


if __name__ == "__main__":
    sys.exit(main())
