"""The bookie's mode: WRITABLE or READONLY, with explicit transitions (disk full: docs/bookie.md).

:class:`ModeMachine` is pure state (no I/O, no clock): the server feeds it observations and it
decides. Reasons for READONLY, any of which holds it there:

- **disk low**: free space on the data dir fell below ``free_bytes_min``; it clears only once free
  space is back at ``free_bytes_writable`` or more (hysteresis: a bookie hovering around one
  threshold must not flap between the registration sets every second);
- **disk unusable**: statvfs failed, or the filesystem is mounted read-only / the directory is not
  writable; clears on the next good observation;
- **journal failed**: the journal hit an I/O error (permanent until a restart);
- **foreign cluster**: the metadata root no longer holds the cluster the data dir belongs to
  (found by GC: :class:`bookie.gc.ForeignCluster`; permanent until a restart);
- **operator**: set through the admin endpoint; sticks until the operator clears it, whatever the
  disk does.

While READONLY (:meth:`ModeMachine.check_add`): a normal ADD_ENTRY is refused with
:class:`ReadOnly` (EREADONLY, its message says why); a RECOVERY_ADD is accepted while the last
observed free space is above ``reserve_bytes`` (recovery must be able to finish re-replicating a
ledger this bookie is in). Reads, fences and WRITE_LAC are not gated here: they are tiny records
that may use the reserve (a refused fence would stall recovery of a ledger this bookie holds).

Every transition calls ``on_change(old, new, reason)`` once and is logged as ``bookie.mode_changed``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from bookie.storage import StorageError

log = structlog.get_logger(__name__)


class Mode(enum.Enum):
    WRITABLE = "writable"
    READONLY = "readonly"


_READONLY = Mode.READONLY
"""As a module name: ``Mode.READONLY`` goes through ``EnumType.__getattr__``'s slow attribute
path on Python 3.11 (about 0.3 us), and :attr:`ModeMachine.read_only` is asked by adds
(:meth:`ModeMachine.check_add`) and at each mode update."""
_WRITABLE = Mode.WRITABLE  # likewise (each mode update, each start)


class ReadOnly(StorageError):
    """An add refused because the bookie is read-only (wire status EREADONLY)."""


@dataclass(frozen=True)
class DiskThresholds:
    free_bytes_min: int
    """Go read-only when the data dir's free space is below this."""
    free_bytes_writable: int
    """Come back to writable once free space is at least this (>= ``free_bytes_min``)."""
    reserve_bytes: int
    """Recovery adds are accepted while free space is above this (< ``free_bytes_min``)."""

    def validate(self) -> None:
        if self.reserve_bytes < 0:
            raise ValueError(f"disk_reserve_bytes must be >= 0, got {self.reserve_bytes}")
        if self.free_bytes_min < self.reserve_bytes:
            raise ValueError(
                f"disk_free_bytes_min ({self.free_bytes_min}) must be >= disk_reserve_bytes "
                f"({self.reserve_bytes}): recovery adds use the space between them"
            )
        if self.free_bytes_writable < self.free_bytes_min:
            raise ValueError(
                f"disk_free_bytes_writable ({self.free_bytes_writable}) must be >= disk_free_bytes_min "
                f"({self.free_bytes_min})"
            )


ModeListener = Callable[[Mode, Mode, str], None]


class ModeMachine:
    """WRITABLE <-> READONLY from disk observations, journal failure and the operator's toggle."""

    def __init__(self, thresholds: DiskThresholds, on_change: ModeListener | None = None) -> None:
        thresholds.validate()
        self.thresholds = thresholds
        self.on_change = on_change
        self.mode = _WRITABLE
        self.free_bytes: int | None = None
        """Free bytes at the last disk observation (None before the first, or when it failed)."""
        self.total_bytes: int | None = None
        """The filesystem's size at the last disk observation (None as ``free_bytes``)."""
        self.disk_low = False
        self.disk_problem: str | None = None
        self.journal_failed: str | None = None
        self.foreign_cluster: str | None = None
        self.manual = False
        self.transitions = 0
        self._reason: str | None = None

    # ------------------------------------------------------------------ inputs
    def observe_disk(
        self, free_bytes: int | None, problem: str | None = None, total_bytes: int | None = None
    ) -> None:
        """One disk check: free bytes (None when unknown), a problem (unusable / read-only fs), and
        the filesystem's size."""
        self.free_bytes = free_bytes
        self.total_bytes = total_bytes if free_bytes is not None else None
        self.disk_problem = problem
        if free_bytes is not None:
            if not self.disk_low and free_bytes < self.thresholds.free_bytes_min:
                self.disk_low = True
            elif self.disk_low and free_bytes >= self.thresholds.free_bytes_writable:
                self.disk_low = False
        self._update()

    def observe_journal(self, failed: BaseException | None) -> None:
        """The journal's failure, if any (sticky: a failed journal never comes back)."""
        if failed is not None and self.journal_failed is None:
            self.journal_failed = repr(failed)
            self._update()

    def observe_foreign_cluster(self, problem: str) -> None:
        """The metadata root no longer holds this bookie's cluster (sticky, as a failed journal)."""
        if self.foreign_cluster is None:
            self.foreign_cluster = problem
            self._update()

    def set_manual(self, read_only: bool) -> None:
        """The operator's toggle: read-only until cleared, whatever the disk does."""
        if read_only != self.manual:
            self.manual = read_only
            log.info("bookie.mode_manual", read_only=read_only)
            self._update()

    # ------------------------------------------------------------------ queries
    @property
    def read_only(self) -> bool:
        return self.mode is _READONLY

    @property
    def reason(self) -> str | None:
        """Why the bookie is read-only (all reasons, '; '-joined), None while writable."""
        return self._reason

    def reasons(self) -> list[str]:
        out: list[str] = []
        if self.manual:
            out.append("set read-only by the operator (admin: POST /readonly?set=0 with the token clears it)")
        if self.journal_failed is not None:
            out.append(f"journal failed: {self.journal_failed}")
        if self.foreign_cluster is not None:
            out.append(self.foreign_cluster)
        if self.disk_problem is not None:
            out.append(self.disk_problem)
        if self.disk_low:
            t = self.thresholds
            if self.free_bytes is not None and self.free_bytes < t.free_bytes_min:
                out.append(f"disk free {self.free_bytes} bytes < disk_free_bytes_min {t.free_bytes_min}")
            else:
                out.append(
                    f"disk free {self.free_bytes} bytes, read-only until disk_free_bytes_writable "
                    f"{t.free_bytes_writable}"
                )
        return out

    def check_add(self, recovery: bool) -> None:
        """Raise :class:`ReadOnly` if this add must be refused (call only while read-only)."""
        if not self.read_only:
            return
        if not recovery:
            raise ReadOnly(f"bookie is read-only: {self._reason}")
        if self.journal_failed is not None:
            return  # the journal answers it (EIO): read-only says nothing more
        free, reserve = self.free_bytes, self.thresholds.reserve_bytes
        if free is None or free <= reserve:
            raise ReadOnly(
                f"bookie is read-only and its disk reserve is used up (free {free} bytes <= "
                f"disk_reserve_bytes {reserve}): recovery adds refused too"
            )

    # ------------------------------------------------------------------ transitions
    def _update(self) -> None:
        reasons = self.reasons()
        self._reason = "; ".join(reasons) if reasons else None
        new = _READONLY if reasons else _WRITABLE
        old = self.mode
        if new is old:
            return
        self.mode = new
        self.transitions += 1
        reason = self._reason or f"no reason left to be read-only (disk free {self.free_bytes} bytes)"
        emit = log.warning if new is _READONLY else log.info
        emit("bookie.mode_changed", old=old.value, new=new.value, reason=reason, free_bytes=self.free_bytes)
        if self.on_change is not None:
            self.on_change(old, new, reason)
