"""Failpoints around metadata writes (DESIGN.md §9), same ``BKAIO_FAILPOINTS`` syntax as the client's.

`metadata` may not import `bookkeeper_aio`, so this reads the same environment variable itself and
acts only on the names below. Actions: ``kill`` (``os._exit(137)``), ``sleep:<ms>`` (stall the event
loop that long), ``unavailable`` (raise `MetadataUnavailable`: before a write, nothing was applied),
``unknown`` (raise `CasResultUnknown`: after a write, it was applied but the answer is lost), and
``count:<k>:<action>`` (only the k-th hit fires). With nothing enabled a hit is one dict lookup.

    BKAIO_FAILPOINTS="metadata.cas_after=count:3:kill" python -m ...   # die right after the 3rd CAS
"""

from __future__ import annotations

import os
import time

from metadata.errors import CasResultUnknown, MetadataUnavailable

ENV_VAR = "BKAIO_FAILPOINTS"
CAS_BEFORE = "metadata.cas_before"  # before a ledger create / CAS is sent
CAS_AFTER = "metadata.cas_after"  # after it was applied, before the caller learns it
NAMES = frozenset({CAS_BEFORE, CAS_AFTER})

_active: dict[str, str] = {}
_hits: dict[str, int] = {}


def configure(spec: str | None) -> None:
    """Replace the active metadata failpoints (other names in ``spec`` are ignored)."""
    _active.clear()
    _hits.clear()
    for raw in (spec or "").split(","):
        name, sep, action = raw.strip().partition("=")
        if sep and name.strip() in NAMES and action.strip():
            _active[name.strip()] = action.strip()


def hit(name: str, key: str) -> None:
    """Pass failpoint ``name`` while writing ``key``."""
    if not _active:
        return
    action = _active.get(name)
    if action is None:
        return
    _hits[name] = _hits.get(name, 0) + 1
    _fire(action, _hits[name], name, key)


def _fire(action: str, count: int, name: str, key: str) -> None:
    kind, _, arg = action.partition(":")
    if kind == "count":
        wanted, _, inner = arg.partition(":")
        if count == int(wanted):
            _fire(inner, 1, name, key)
    elif kind == "kill":
        os._exit(137)
    elif kind == "sleep":
        time.sleep(float(arg or "1000") / 1000.0)
    elif kind == "unavailable":
        raise MetadataUnavailable(f"failpoint {name}: injected unavailability writing {key!r}")
    elif kind == "unknown":
        raise CasResultUnknown(key, f"failpoint {name}: injected lost answer")
    else:
        raise ValueError(f"unknown metadata failpoint action {action!r}")


configure(os.environ.get(ENV_VAR))
