"""Ledger passwords for the commands that take them, without putting them in the process table.

A password on the command line (``--password``) is in ``/proc/PID/cmdline``: any local user reads it
with ``ps`` for the life of the process (the autorecovery daemon's: every tenant's, for good). Two
other sources, for every command that takes ``--password``:

- ``--password-file PATH``: one password per line (a final newline ends the last line; an empty
  line is the empty password). Refused unless only its owner may read or write it (``chmod 600``).
- ``$BKAIO_PASSWORDS``: the same lines, in the environment (only the process's user and root read
  a process's environment). Used only when neither option is given.

``--password`` and ``--password-file`` add up. A command that takes one password (``ledger read``,
``ledger delete``, ``log tail``, ``log truncate``) refuses more than one, whatever their source;
with none, it uses the empty password, and the autorecovery daemon tries only the empty one.
"""

from __future__ import annotations

import argparse
import os
import stat

from bookkeeper_aio.errors import BKInterfaceError

PASSWORDS_ENV = "BKAIO_PASSWORDS"
PASSWORD_FILE_BYTES_MAX = 1 << 20
"""A password file larger than this is refused (a wrong path, not a list of passwords)."""


class PasswordSourceError(BKInterfaceError):
    """A password file that cannot be used (unreadable, open to others, too large), or more
    passwords than the command takes."""


def add_options(parser: argparse.ArgumentParser, *, many: bool, what: str) -> None:
    """``--password`` (repeatable when ``many``) and ``--password-file`` on ``parser``; ``what``
    says whose password(s) it is, for the help."""
    parser.add_argument(
        "--password",
        action="append",
        default=None,
        help=f"{what}{' (repeat for several)' if many else ''}. Visible to every local user in `ps`: "
        f"prefer --password-file or ${PASSWORDS_ENV}",
    )
    parser.add_argument(
        "--password-file",
        metavar="PATH",
        default=None,
        help="read the password(s) from this file, one per line (an empty line is the empty "
        "password); refused unless only its owner may read it (chmod 600)",
    )


def split_lines(text: str) -> list[str]:
    """The passwords of a file or of the environment variable: its lines, a final newline ending
    the last one (so ``"pw\\n"`` is one password, ``"\\npw\\n"`` the empty one and ``pw``)."""
    if not text:
        return []
    if text.endswith("\n"):
        text = text[:-1]
    return text.split("\n")


def read_password_file(path: str) -> list[str]:
    """The passwords in ``path``. Raises :class:`PasswordSourceError` when others may read or write
    it, when it is too large, not a regular file or not UTF-8; ``OSError`` (with the path) when it
    cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO is refused, not waited on
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)  # the file opened, not whatever the path names a moment later
        if not stat.S_ISREG(info.st_mode):
            raise PasswordSourceError(f"password file {path} is not a regular file")
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o077:
            raise PasswordSourceError(
                f"password file {path} may be read or written by its group or others (mode {mode:#o}): "
                f"run `chmod 600 {path}` (and change the passwords if others could read them)"
            )
        data = handle.read(PASSWORD_FILE_BYTES_MAX + 1)
    if len(data) > PASSWORD_FILE_BYTES_MAX:
        raise PasswordSourceError(f"password file {path} is over {PASSWORD_FILE_BYTES_MAX} bytes")
    try:
        return split_lines(data.decode())
    except UnicodeDecodeError:
        raise PasswordSourceError(f"password file {path} is not UTF-8 text") from None


def passwords(args: argparse.Namespace, *, many: bool) -> tuple[bytes, ...]:
    """The passwords ``args`` give (:func:`add_options`), then ``$BKAIO_PASSWORDS`` if neither
    option was given; ``(b"",)`` when none is given anywhere. Raises :class:`PasswordSourceError`
    (a bad file, or more than one password where the command takes one) and ``OSError``."""
    given: list[str] = list(args.password or [])
    source = "--password"
    path = getattr(args, "password_file", None)
    if path is not None:
        from_file = read_password_file(path)
        if not from_file:
            raise PasswordSourceError(f"password file {path} holds no password (an empty file)")
        given += from_file
        source = "--password and --password-file" if args.password else f"password file {path}"
    if not given:
        env = os.environ.get(PASSWORDS_ENV)
        if env:
            given = split_lines(env)
            source = f"${PASSWORDS_ENV}"
    if not given:
        return (b"",)
    if not many and len(given) > 1:
        raise PasswordSourceError(
            f"{source} gave {len(given)} passwords; this command takes one (one --password, or a "
            f"file or ${PASSWORDS_ENV} of one line)"
        )
    return tuple(dict.fromkeys(p.encode() for p in given))


def password(args: argparse.Namespace) -> bytes:
    """The one password of a single-password command (:func:`passwords`)."""
    return passwords(args, many=False)[0]
