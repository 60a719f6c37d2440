"""``bkaio``: the sandbox cluster and the operator shell.

Every command that talks to a cluster takes ``--metadata etcd://HOST:PORT[,HOST:PORT]/ROOT``
(or ``$BKAIO_METADATA``); without either it uses the running sandbox's state file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import uvloop

import metadata
from bookkeeper_aio.cli import shell, state
from bookkeeper_aio.common.logging_setup import configure_logging
from bookkeeper_aio.errors import BKError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bkaio", description="The sandbox cluster and the operator shell.")
    parser.add_argument("--log-level", default=None, help="debug | info | warning | error (default: warning)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sandbox = sub.add_parser(
        "sandbox",
        help="start etcd + N bookies on this machine, run a demo, serve until Ctrl-C",
        description="Start a real cluster on this machine (etcd + bookie processes), print its "
        "connection string, run a short demo, and keep serving until Ctrl-C.",
    )
    sandbox.add_argument("--bookies", type=int, default=3, help="number of bookie processes (default 3)")
    sandbox.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="where etcd and the bookies keep data (default ~/.bkaio/sandbox)",
    )
    sandbox.add_argument("--no-demo", action="store_true", help="skip the demo")
    sandbox.add_argument(
        "--demo-entries", type=int, default=20_000, help="entries the demo writes (default 20000)"
    )
    sandbox.add_argument("--fresh", action="store_true", help="wipe the data dir first")
    sandbox.add_argument("--no-serve", action="store_true", help="stop right after the demo (for scripts)")
    sandbox.set_defaults(func=None)
    shell.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging(args.log_level or "warning")
    try:
        if args.func is not None:
            code: int = uvloop.run(args.func(args))
            return code
        if args.command == "sandbox":
            from bookkeeper_aio.cli import sandbox

            if args.bookies < 1:
                raise SystemExit("bkaio sandbox: --bookies must be >= 1")
            data_dir = args.data_dir or state.home() / "sandbox"
            return sandbox.run(
                data_dir.resolve(),
                args.bookies,
                0 if args.no_demo else args.demo_entries,
                args.fresh,
                not args.no_serve,
            )
    except (state.NoClusterConfigured, BKError, metadata.MetadataError) as exc:
        print(f"bkaio {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
