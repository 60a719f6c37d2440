"""The key layout under a cluster root (documented in docs/metadata.md). Pure.

Ledger ids are zero-padded to 19 digits so that key order is numeric order (paged listing).
"""

from __future__ import annotations

from dataclasses import dataclass

from metadata.errors import InvalidMetadata

LEDGER_ID_DIGITS = 19  # len(str(2**63 - 1))
NAME_CHARS_MAX = 256


def validate_root(root: str) -> str:
    """A root is an absolute path without a trailing slash, e.g. ``/bookkeeper/default``."""
    if not root.startswith("/") or root.endswith("/") or "//" in root or len(root) > NAME_CHARS_MAX:
        raise InvalidMetadata(f"cluster root must look like /bookkeeper/<cluster>, got {root!r}")
    return root


def validate_name(name: str, what: str) -> str:
    """A path component: non-empty, no '/', bounded."""
    if not name or "/" in name or len(name) > NAME_CHARS_MAX or name in {".", ".."}:
        raise InvalidMetadata(f"bad {what} {name!r}: must be 1..{NAME_CHARS_MAX} chars without '/'")
    return name


@dataclass(frozen=True, slots=True)
class ClusterKeys:
    """Every key of one cluster, derived from its root."""

    root: str

    def __post_init__(self) -> None:
        validate_root(self.root)

    @property
    def cluster(self) -> str:
        return f"{self.root}/cluster"

    @property
    def idgen(self) -> str:
        return f"{self.root}/idgen"

    @property
    def auditor(self) -> str:
        return f"{self.root}/auditor"

    @property
    def ledgers_prefix(self) -> str:
        return f"{self.root}/ledgers/"

    def ledger(self, ledger_id: int) -> str:
        if ledger_id < 0:
            raise InvalidMetadata(f"ledger id must be >= 0, got {ledger_id}")
        return f"{self.ledgers_prefix}{ledger_id:0{LEDGER_ID_DIGITS}d}"

    def ledger_id_of(self, key: str) -> int:
        """The ledger id in a ledger key; raises `InvalidMetadata` for a foreign key."""
        tail = key.removeprefix(self.ledgers_prefix)
        if tail == key or len(tail) != LEDGER_ID_DIGITS or not tail.isdigit():
            raise InvalidMetadata(f"not a ledger key: {key!r}")
        return int(tail)

    @property
    def bookies_prefix(self) -> str:
        return f"{self.root}/bookies/"

    def bookies_state_prefix(self, state: str) -> str:
        return f"{self.bookies_prefix}{validate_name(state, 'bookie state')}/"

    def bookie(self, state: str, bookie_id: str) -> str:
        return f"{self.bookies_state_prefix(state)}{validate_name(bookie_id, 'bookie id')}"

    def cookie(self, bookie_id: str) -> str:
        return f"{self.root}/cookies/{validate_name(bookie_id, 'bookie id')}"

    @property
    def logs_prefix(self) -> str:
        return f"{self.root}/logs/"

    def log(self, name: str) -> str:
        return f"{self.logs_prefix}{validate_name(name, 'log name')}"

    def log_name_of(self, key: str) -> str:
        """The log name in a log key; raises `InvalidMetadata` for a foreign key."""
        tail = key.removeprefix(self.logs_prefix)
        if tail == key:
            raise InvalidMetadata(f"not a log key: {key!r}")
        return validate_name(tail, "log name")

    def log_cursors_prefix(self, name: str) -> str:
        """A log's named cursors live beside it, not in its key: committing one never races the
        writer's CAS of the ledger list."""
        return f"{self.root}/logcursors/{validate_name(name, 'log name')}/"

    def log_cursor(self, name: str, cursor: str) -> str:
        return f"{self.log_cursors_prefix(name)}{validate_name(cursor, 'cursor name')}"

    # ---- autorecovery (metadata/underreplication.py) ----------------------------------------------

    @property
    def underreplicated_prefix(self) -> str:
        return f"{self.root}/underreplicated/"

    def underreplicated(self, ledger_id: int) -> str:
        if ledger_id < 0:
            raise InvalidMetadata(f"ledger id must be >= 0, got {ledger_id}")
        return f"{self.underreplicated_prefix}{ledger_id:0{LEDGER_ID_DIGITS}d}"

    def underreplicated_id_of(self, key: str) -> int:
        """The ledger id in an under-replication mark's key; `InvalidMetadata` for a foreign key."""
        tail = key.removeprefix(self.underreplicated_prefix)
        if tail == key or len(tail) != LEDGER_ID_DIGITS or not tail.isdigit():
            raise InvalidMetadata(f"not an under-replication key: {key!r}")
        return int(tail)

    @property
    def replication_locks_prefix(self) -> str:
        return f"{self.root}/replication/locks/"

    def replication_lock(self, ledger_id: int) -> str:
        if ledger_id < 0:
            raise InvalidMetadata(f"ledger id must be >= 0, got {ledger_id}")
        return f"{self.replication_locks_prefix}{ledger_id:0{LEDGER_ID_DIGITS}d}"

    @property
    def replication_disabled(self) -> str:
        return f"{self.root}/replication/disabled"

    @property
    def replication_daemons_prefix(self) -> str:
        return f"{self.root}/replication/daemons/"

    def replication_daemon(self, daemon_id: str) -> str:
        return f"{self.replication_daemons_prefix}{validate_name(daemon_id, 'daemon id')}"

    @property
    def replication_instances_prefix(self) -> str:
        return f"{self.root}/replication/instances/"

    def replication_instance(self, bookie_id: str) -> str:
        return f"{self.replication_instances_prefix}{validate_name(bookie_id, 'bookie id')}"

    @property
    def decommissioning_prefix(self) -> str:
        return f"{self.root}/replication/decommissioning/"

    def decommissioning(self, bookie_id: str) -> str:
        return f"{self.decommissioning_prefix}{validate_name(bookie_id, 'bookie id')}"
