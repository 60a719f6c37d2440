"""Client configuration: one frozen dataclass, every timeout a budget with its unit in the name.

Defaults are chosen for a LAN cluster. Each bound says why it exists; ``validate()`` runs at
construction so a bad value fails where it is written, not deep inside the write path.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bookkeeper_aio.errors import BKInterfaceError
from bookkeeper_aio.protocol.codes import FRAME_BYTES_MAX


@dataclass(frozen=True, slots=True)
class ClientConfig:
    # ---- connections
    connect_timeout_s: float = 5.0
    """Budget for one TCP connect + hello to a bookie; past it the bookie counts as failed."""
    reconnect_backoff_initial_s: float = 0.05
    reconnect_backoff_max_s: float = 2.0
    """After a failed connect, requests to that bookie fail fast until the backoff expires (so a dead
    bookie triggers an ensemble change at once instead of a connect timeout per request)."""
    connection_pending_max: int = 100_000
    """Requests waiting for an answer on one connection. Beyond it a request fails with
    TooManyRequests: the per-ledger window normally keeps us far below."""
    frame_bytes_max: int = FRAME_BYTES_MAX
    write_eager_bytes: int = 256 * 1024
    """Frames for one bookie are written once per event-loop tick, or as soon as this many bytes
    are queued: the bookie starts on the first part of a burst while the client still builds the
    rest (a burst of 1,000 adds written at the end of the tick kept client and bookies taking
    turns instead of working at once)."""
    write_eager_frames: int = 256
    """... or as soon as this many frames are queued, whichever comes first (small entries: 256
    KiB of 100-byte adds is more than a window holds, so they would never be written early)."""

    # ---- security (docs/security.md)
    tls_enabled: bool = False
    """Connect to bookies over TLS: their certificate is verified against ``tls_ca_file`` (else the
    system's trust store) and, with ``tls_check_hostname``, must name the address connected to."""
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    """A client certificate (with ``tls_key_file``) for bookies that require mutual TLS."""
    tls_key_file: str = ""
    tls_check_hostname: bool = True
    auth_provider: str = ""
    """Authenticate to bookies (AUTH handshake) with ``token`` or a ``package.module:factory``
    provider; empty: no authentication."""
    auth_token: str = dataclasses.field(default="", repr=False)
    """The ``token`` provider's token (prefer ``auth_token_file``: a file is not in ``ps`` output)."""
    auth_token_file: str = ""

    # ---- adds
    add_timeout_s: float = 5.0
    """A bookie that has not acknowledged an add within this budget is replaced (ensemble change)."""
    add_window_max: int = 10_000
    """Adds in flight per ledger handle. ``append`` waits for a slot (backpressure) when full."""
    adds_in_flight_max: int = 5_000
    """Adds in flight across every ledger handle of the client. Beyond it ``append`` waits in the
    client for a permit (backpressure, oldest first; the wait is not part of the add timeout), so
    a backlog of many ledgers does not wait in the bookies' queues where its timeouts run. 5,000
    (Apache BookKeeper's historical ``throttle``): the bookies must only do 1,000 adds/s for all of
    them to answer within the default ``add_timeout_s``."""
    entry_bytes_max: int = FRAME_BYTES_MAX - 1024
    """Largest payload accepted by ``append``: must fit a frame with its header and digest."""
    explicit_lac_interval_ms: int = 100
    """After this long without a new add carrying it, the LAC is sent with WRITE_LAC so readers see
    the last entry without waiting for a next write (while the writer's next add waits for a permit
    of ``adds_in_flight_max``, that add carries it once sent). 0 disables explicit LAC."""
    explicit_lac_interval_max_ms: int = 800
    """A writer whose next add follows a WRITE_LAC within four intervals is slow, not idle: its
    interval doubles, up to this, so a steady stream slower than the interval does not pay a
    WRITE_LAC to every bookie per add. A longer pause brings it back to ``explicit_lac_interval_ms``.
    Equal to it (or lower): no adaptation."""
    ensemble_change_attempts_max: int = 16
    """Metadata CAS conflicts an ensemble change or close tolerates before failing the handle."""

    # ---- reads
    read_timeout_s: float = 5.0
    """Budget for one read request to one bookie; then the next replica is tried."""
    speculative_read_delay_ms: int = 50
    """A read with no answer after this long is also sent to the next replica; the first valid
    answer wins. 0 disables speculative reads."""
    read_window_max: int = 2048
    """Entry reads in flight for one range iteration (bounds memory of read-ahead). Batch reads
    split it over 4 batches (stripes: 4 per stripe), so it sets their size too: 512 entries per
    batch for Qw == E, ~100 per stripe at E5; the bytes in flight are bounded apart
    (``batch_read_bytes_max``)."""
    batch_read_count_max: int = 1_000
    """Entries asked for in one BATCH_READ (used when every bookie holds every entry, Qw == E)."""
    batch_read_bytes_max: int = 4 * 1024 * 1024

    # ---- metadata
    metadata_timeout_s: float = 10.0
    """Budget for one metadata operation (read, CAS) issued by the client."""

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def load(
        cls, path: str | None = None, env: Mapping[str, str] | None = None, **overrides: Any
    ) -> ClientConfig:
        """Defaults <- TOML file (keys at top level or under ``[client]``) <- environment
        (``BKAIO_CLIENT_<KEY>``) <- ``overrides``. Unknown keys and bad values raise
        BKInterfaceError naming the key and where it came from."""
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        if path is not None:
            try:
                with open(path, "rb") as handle:
                    table = tomllib.load(handle)
            except (OSError, tomllib.TOMLDecodeError) as error:
                raise BKInterfaceError(f"client config file {path}: {error}") from error
            table = table.get("client", table)
            values.update({k: _coerce(k, v, f"config file {path}") for k, v in table.items()})
            sources.update(dict.fromkeys(table, f"config file {path}"))
        for key, value in (os.environ if env is None else env).items():
            if key.startswith(ENV_PREFIX) and key != CONFIG_FILE_ENV:
                name = key[len(ENV_PREFIX) :].lower()
                values[name] = _coerce(name, value, f"environment {key}")
                sources[name] = f"environment {key}"
        values.update({k: _coerce(k, v, "argument") for k, v in overrides.items()})
        sources.update(dict.fromkeys(overrides, "argument"))
        try:
            return cls(**values)
        except BKInterfaceError as error:
            # a range error starts with the key it is about: name where that key's value came from
            key = str(error).split(" ", 1)[0].removeprefix("ClientConfig.")
            if key in sources:
                raise BKInterfaceError(f"{sources[key]}: {error}") from None
            raise

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int | float) and value < 0:
                raise BKInterfaceError(f"ClientConfig.{f.name} must be >= 0, got {value}")
        positive = (
            "connect_timeout_s",
            "add_timeout_s",
            "read_timeout_s",
            "metadata_timeout_s",
            "add_window_max",
            "adds_in_flight_max",
            "read_window_max",
            "connection_pending_max",
            "write_eager_bytes",
            "write_eager_frames",
            "batch_read_count_max",
            "batch_read_bytes_max",
            "ensemble_change_attempts_max",
            "entry_bytes_max",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise BKInterfaceError(f"ClientConfig.{name} must be > 0")
        if self.entry_bytes_max > self.frame_bytes_max:
            raise BKInterfaceError("entry_bytes_max must not exceed frame_bytes_max")
        if (self.tls_ca_file or self.tls_cert_file or self.tls_key_file) and not self.tls_enabled:
            raise BKInterfaceError("tls_ca_file/tls_cert_file/tls_key_file are set but tls_enabled is false")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise BKInterfaceError("a client certificate needs both tls_cert_file and tls_key_file")
        if self.auth_provider == "token" and not (self.auth_token or self.auth_token_file):
            raise BKInterfaceError("auth_provider token needs auth_token or auth_token_file")
        if (self.auth_token or self.auth_token_file) and not self.auth_provider:
            raise BKInterfaceError(
                "auth_token/auth_token_file are set but auth_provider is empty (use token)"
            )
        if self.reconnect_backoff_initial_s > self.reconnect_backoff_max_s:
            raise BKInterfaceError("reconnect_backoff_initial_s must be <= reconnect_backoff_max_s")


ENV_PREFIX = "BKAIO_CLIENT_"
CONFIG_FILE_ENV = "BKAIO_CLIENT_CONFIG"
"""Names the TOML file a client given no config reads (not a setting: skipped by ``load``)."""
_BOOL_WORDS = {
    "true": True,
    "1": True,
    "yes": True,
    "on": True,
    "false": False,
    "0": False,
    "no": False,
    "off": False,
}
_FIELD_TYPES: dict[str, type] = {f.name: type(f.default) for f in dataclasses.fields(ClientConfig)}


def _coerce(name: str, value: Any, source: str) -> Any:
    kind = _FIELD_TYPES.get(name)
    if kind is None:
        raise BKInterfaceError(f"{source}: unknown client setting {name!r} (see docs/configuration.md)")
    try:
        if kind is bool and isinstance(value, str):
            value = _BOOL_WORDS.get(value.strip().lower(), value)  # an unknown word fails below
        elif isinstance(value, str) and kind is not str:
            value = kind(value)
        elif kind is float and type(value) is int:
            value = float(value)
    except ValueError:
        raise BKInterfaceError(f"{source}: {name} must be {kind.__name__}, got {value!r}") from None
    if type(value) is not kind:
        raise BKInterfaceError(f"{source}: {name} must be {kind.__name__}, got {value!r}")
    return value
