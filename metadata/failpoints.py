"""Named failpoints on every durability step (DESIGN.md §9): the one engine for the whole project.

It lives here because ``metadata`` is the package everything else may import (``bookkeeper_aio``
and ``bookie`` re-export it from :mod:`bookkeeper_aio.failpoints`, which also lists their names).

Enabled only through the environment variable ``BKAIO_FAILPOINTS``, a comma-separated list of
``name=action`` pairs, read once at import (tests that start subprocesses set it in their env;
in-process tests call :func:`configure`). Actions:

- ``kill``                the process dies at once (``os._exit``), like a power cut for its state;
- ``sleep:<ms>``          block the calling thread that long (a stall inside the step);
- ``eio`` / ``enospc``    raise ``OSError`` with that errno, as the disk would;
- ``partial:<n>``         the step writes only its first ``n`` bytes, then the process dies;
- ``unavailable``         raise `MetadataUnavailable` (before a metadata write: nothing applied);
- ``unknown``             raise `CasResultUnknown` (after a metadata write: applied, answer lost);
- ``count:<k>:<action>``  the action fires on the k-th hit only (1-based); earlier hits pass.

    BKAIO_FAILPOINTS="metadata.cas_after=count:3:kill" python -m ...   # die right after the 3rd CAS

With nothing enabled :func:`hit` is one truth test of an empty dict.
"""

from __future__ import annotations

import errno
import os
import time

from metadata.errors import CasResultUnknown, MetadataUnavailable

ENV_VAR = "BKAIO_FAILPOINTS"
CAS_BEFORE = "metadata.cas_before"  # before a ledger create / CAS is sent
CAS_AFTER = "metadata.cas_after"  # after it was applied, before the caller learns it

_ACTIONS = frozenset({"kill", "sleep", "eio", "enospc", "partial", "unavailable", "unknown", "count"})
_active: dict[str, str] = {}
_hits: dict[str, int] = {}


class FailpointError(ValueError):
    """A failpoint specification that cannot be parsed (a typo must not silently disable a fault)."""


def _parse(spec: str) -> dict[str, str]:
    table: dict[str, str] = {}
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        name, sep, action = (part.strip() for part in item.partition("="))
        if not sep or not name or not action:
            raise FailpointError(f"failpoint {item!r}: expected name=action")
        kind = action.split(":", 1)[0]
        if kind not in _ACTIONS:
            raise FailpointError(f"failpoint {item!r}: unknown action {kind!r}")
        table[name] = action
    return table


def configure(spec: str | None) -> None:
    """Replace the active failpoints (``None`` or ``""`` disables all)."""
    table = _parse(spec) if spec else {}
    _active.clear()
    _hits.clear()
    _active.update(table)


def hit(name: str, data_len: int = 0, *, key: str = "") -> int | None:
    """Pass the failpoint ``name`` (``key``: what is being written, for error messages).

    Returns ``None`` normally; for a ``partial:<n>`` action returns how many bytes of a write of
    ``data_len`` bytes the caller must perform before calling :func:`die`.
    """
    if not _active:
        return None
    action = _active.get(name)
    if action is None:
        return None
    count = _hits.get(name, 0) + 1
    _hits[name] = count
    return _fire(name, action, count, data_len, key)


def _fire(name: str, action: str, count: int, data_len: int, key: str) -> int | None:
    kind, _, arg = action.partition(":")
    if kind == "count":
        wanted, _, inner = arg.partition(":")
        return _fire(name, inner, 1, data_len, key) if count == int(wanted) else None
    if kind == "kill":
        die()
    if kind == "sleep":
        time.sleep(float(arg or "1000") / 1000.0)
        return None
    if kind in ("eio", "enospc"):
        code = errno.EIO if kind == "eio" else errno.ENOSPC
        raise OSError(code, f"failpoint {name}: injected {kind.upper()}")
    if kind == "partial":
        return min(int(arg or "0"), data_len)
    if kind == "unavailable":
        raise MetadataUnavailable(f"failpoint {name}: injected unavailability writing {key!r}")
    if kind == "unknown":
        raise CasResultUnknown(key, f"failpoint {name}: injected lost answer")
    raise FailpointError(f"unknown failpoint action {action!r}")


def die() -> None:
    """End the process now, without flushing or cleanup (a crash)."""
    os._exit(137)


configure(os.environ.get(ENV_VAR))
