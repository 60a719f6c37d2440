"""Bookie configuration: defaults <- TOML file <- environment <- command-line flags.

Every key is a field of :class:`BookieConfig` (units in the names). The TOML file holds the keys at
top level (``port = 3181``); the environment uses ``BKAIO_BOOKIE_<KEY>`` (``BKAIO_BOOKIE_PORT=3181``);
flags use dashes (``--port 3181``). Values are type-checked and range-checked with a message that
names the key and its source; unknown keys are errors (a typo must not silently fall back).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
import ssl
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from bookie import journal_format as fmt
from bookie.auth import BookieAuthProvider, load_providers
from bookie.gc import GcConfig
from bookie.journal import JournalConfig
from bookie.mode import DiskThresholds
from bookie.storage import StorageConfig
from bookkeeper_aio.common.logging_setup import LEVEL_ENV
from bookkeeper_aio.common.tls import server_context
from bookkeeper_aio.protocol.codes import FRAME_BYTES_MAX
from metadata.cluster import parse_url
from metadata.errors import InvalidUrl

ENV_PREFIX = "BKAIO_BOOKIE_"
_RECORD_OVERHEAD_BYTES = fmt.ENTRY_RECORD_OVERHEAD_BYTES_MAX  # compaction copies format-2 records too


class ConfigError(ValueError):
    """A configuration value that is missing, unknown, of the wrong type or out of range."""


def _key(default: Any, help_text: str) -> Any:
    """A config key: its default and its one description (``bookie --help`` and the reference table
    in docs/configuration.md both come from it; a test keeps the doc equal to :func:`reference_table`)."""
    return dataclasses.field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class BookieConfig:
    data_dir: str = _key("", "Directory for the journal, index checkpoints and the COOKIE (required).")
    bookie_id: str = _key(
        "",
        "The bookie's identity, written into the cookie; defaults to `<host>:<port>`, required when "
        "`port` is 0.",
    )
    host: str = _key(
        "127.0.0.1", "Listen address for the bookie protocol (`0.0.0.0` or `::`: every interface)."
    )
    port: int = _key(3181, "Listen port; 0 = ephemeral (printed in the `READY host:port` line).")
    advertised_address: str = _key(
        "",
        "`HOST[:PORT]` clients and other hosts reach this bookie at, published in its registration "
        "(port defaults to the listening one); empty = the listening `host:port`. Required when "
        "`host` is a wildcard; a loopback address is refused when the metadata endpoints are not "
        "loopback (no other host could reach it).",
    )
    journal_segment_bytes: int = _key(
        256 * 1024 * 1024,
        "Size of a preallocated journal segment (must hold two maximum-size records).",
    )
    journal_group_wait_ms: float = _key(
        0.0, "0 = adaptive group commit (recommended); > 0 = timed groups with this maximum wait."
    )
    journal_group_bytes: int = _key(
        512 * 1024, "Timed policy only: a group goes out once this many bytes gathered."
    )
    journal_queue_bytes_max: int = _key(
        64 * 1024 * 1024,
        "Bytes appended but not yet synced before sockets stop being read (backpressure).",
    )
    checkpoint_interval_s: float = _key(
        30.0, "How often the index is checkpointed (replay after a crash starts there)."
    )
    checkpoint_journal_bytes: int = _key(
        256 * 1024 * 1024,
        "A checkpoint is also written once the journal grew by this much since the last one: "
        "bounds what a restart replays whatever the write rate.",
    )
    checkpoint_journal_records: int = _key(
        500_000, "The same bound in journal records (small entries replay slower per byte)."
    )
    frame_bytes_max: int = _key(
        FRAME_BYTES_MAX,
        "Largest request frame accepted; a larger length prefix closes the connection before "
        "anything is buffered.",
    )
    in_flight_per_connection_max: int = _key(
        4096,
        "Unanswered requests per connection before it stops being read: a client pipelining 1,000 "
        "adds (the benchmark) never waits, a flood is held at ~4k requests (~4 MiB of 1 KiB adds).",
    )
    in_flight_total_max: int = _key(
        65536,
        "Unanswered requests across all connections before every socket stops being read: bounds "
        "memory whatever the number of connections (~64 MiB of 1 KiB adds); checked once per socket "
        "read, so it may overshoot by one read's worth.",
    )
    connections_max: int = _key(
        1024, "Client connections; beyond it new connections are closed at once (bounds memory + fds)."
    )
    frame_read_timeout_s: float = _key(
        30.0, "A started frame must complete this soon after the previous one (slow-loris guard)."
    )
    answer_bytes_buffered_max: int = _key(
        8 * 1024 * 1024,
        "Answer bytes queued for a client that is not reading them before its connection stops "
        "being read and its reads wait (a client cannot make the bookie buffer unbounded answers).",
    )
    answer_bytes_total_max: int = _key(
        256 * 1024 * 1024,
        "Answer bytes queued for clients not reading them, all connections together (with the "
        "entries their reads hold): above it, every connection holding more than 1 MiB of unread "
        "answers stops being read and its reads wait until it has read them (clients that read "
        "their answers go on); bounds the bookie's memory whatever the number of connections.",
    )
    reads_in_flight_per_connection_max: int = _key(
        16,
        "Reads of one connection holding an entry in memory at once (the others wait their turn): "
        "with answer_bytes_buffered_max, what one connection's unread answers can cost.",
    )
    idle_timeout_s: float = _key(
        300.0,
        "A connection with nothing in flight and nothing buffered this long is closed (clients "
        "reconnect on their next request); 0 = never.",
    )
    connections_per_address_max: int = _key(
        64,
        "Client connections from one peer address (an IPv6 peer: its /64); beyond it new ones are "
        "held unread and reset. A small share of connections_max: when every slot is taken, an idle "
        "or unauthenticated connection of the address holding the most is closed for a newcomer "
        "from another.",
    )
    bad_requests_per_address_per_s: float = _key(
        100.0,
        "EUA, EBADREQ and ETOOMANYREQUESTS answers one peer address may earn per second (10 s worth "
        "at once); beyond, each of its connections that earns another stops being read until the "
        "rate is back under (a client that floods wrong keys or bad requests gets no more of the "
        "bookie's time); 0 = no limit.",
    )
    tls_cert_file: str = _key(
        "",
        "PEM certificate (chain) the bookie port presents; with `tls_key_file` it turns TLS on for "
        "every client connection (docs/security.md). Empty: plaintext.",
    )
    tls_key_file: str = _key("", "PEM private key of `tls_cert_file` (keep it readable by the bookie only).")
    tls_ca_file: str = _key(
        "", "PEM CA certificates that sign client certificates (needed by `tls_client_auth`)."
    )
    tls_client_auth: str = _key(
        "none",
        "Mutual TLS: `none`, `optional` (a client certificate, when offered, must verify) or "
        "`required` (clients without a certificate signed by `tls_ca_file` are refused).",
    )
    auth_providers: str = _key(
        "",
        "Comma-separated auth providers clients must authenticate with (AUTH handshake) before "
        "any request: `token` (built in) or `package.module:factory`. Empty: no authentication.",
    )
    auth_token_file: str = _key(
        "", "The `token` provider's tokens: one per line (`principal:token` names its holder in logs)."
    )
    auth_timeout_s: float = _key(
        10.0, "With auth providers: a connection not authenticated this soon after connecting is closed."
    )
    log_level: str = _key("info", "debug, info, warning or error.")
    metadata: str = _key(
        "",
        "Metadata URL (`etcd://HOST:PORT[,HOST:PORT]/ROOT`): once listening, the bookie checks its "
        "cookie there and registers itself so clients find it. Empty: a standalone bookie that "
        "clients address directly.",
    )
    registration_ttl_s: int = _key(
        10,
        "Lease of the registration (2..3600): a bookie that stops refreshing it vanishes from the "
        "writable set after this long (clients then stop choosing it for new ensembles).",
    )
    admin_host: str = _key(
        "127.0.0.1",
        "Listen address of the admin HTTP endpoint (`/health`, `/ready`, `/metrics`, `/state`).",
    )
    admin_port: int = _key(
        -1, "Admin HTTP port: -1 = disabled, 0 = ephemeral (the bookie prints `ADMIN host:port`)."
    )
    admin_token_file: str = _key(
        "",
        "File holding the token (its first line) that admin state changes (`POST /readonly`, "
        "`POST /gc`) must carry as `Authorization: Bearer TOKEN`. Empty: the bookie writes a random "
        "one to `<data_dir>/admin.token` (mode 0600) at start.",
    )
    disk_free_bytes_min: int = _key(
        512 * 1024 * 1024,
        "Read-only mode below this much free space on the data dir: normal adds get EREADONLY and "
        "the registration moves to `bookies/readonly/` (docs/bookie.md, *Read-only mode*).",
    )
    disk_free_bytes_writable: int = _key(
        768 * 1024 * 1024,
        "Back to writable once free space is at least this (hysteresis; >= `disk_free_bytes_min`).",
    )
    disk_reserve_bytes: int = _key(
        128 * 1024 * 1024,
        "While read-only, recovery adds are still accepted as long as free space is above this "
        "(<= `disk_free_bytes_min`).",
    )
    disk_check_interval_s: float = _key(
        1.0, "How often the data dir's free space is checked (one statvfs, in a worker thread)."
    )

    gc_interval_s: float = _key(
        900.0,
        "Seconds between garbage-collection passes (forget ledgers deleted from metadata, compact "
        "journal segments, delete dead ones); 0 = only on demand (admin `/gc`, `bkaio bookie gc`).",
    )
    limbo_after_cut: int = _key(
        1,
        "1: a journal tail cut at startup puts the ledgers it may have touched in limbo (reads of "
        "what the bookie lacks answer EUNKNOWNLEDGERSTATE until metadata settles them): the cut "
        "group may have been synced and acknowledged, then rotted. 0 turns it off: only where the "
        "filesystem checksums data (ZFS, btrfs: rot reads as EIO, so a damaged final group is a "
        "torn, unsynced write).",
    )
    limbo_check_interval_s: float = _key(
        30.0,
        "Seconds between passes that settle ledgers in limbo (after a journal cut) against metadata "
        "(docs/bookie.md, *Limbo ledgers*).",
    )
    gc_deleted_ledger_grace_s: float = _key(
        60.0,
        "A ledger is collected only after it was missing from metadata in two listings this far apart.",
    )
    gc_future_ledger_grace_s: float = _key(
        3600.0,
        "The same for a ledger id at or above the id counter: no client was handed it, so its "
        "record came from a fence or an add of an id nobody allocated.",
    )
    gc_over_replicated_interval_s: float = _key(
        86400.0,
        "Seconds between checks for over-replicated ledgers: closed ledgers this bookie holds that "
        "metadata places only on other bookies (re-replicated while it was away, or an orphan copy "
        "of a heal whose metadata update failed); each is collected once two checks found it so, "
        "under its replication lock. 0 = never.",
    )
    gc_over_replicated_scan_ledgers_per_s: float = _key(
        5000.0,
        "Pace of the over-replication check's scan of the ledgers' metadata (whole values, read a "
        "page of 1,000 at a time), so the bookies' daily scans leave etcd to the clients; 0 = "
        "unpaced.",
    )
    compaction_threshold: float = _key(
        0.5,
        "Journal segments whose live bytes fall below this fraction of their size are compacted "
        "(live entries copied, index switched, segment deleted); 0 = never compact, 1 = always.",
    )
    compaction_rate_bytes_per_s: int = _key(
        32 * 1024 * 1024,
        "Throttle of compaction's copies, so foreground adds keep their latency.",
    )
    compaction_roll_dead_bytes: int = _key(
        16 * 1024 * 1024,
        "The journal's current segment is rolled (ended early, into the segment created ahead of "
        "time) when at least this many of its bytes are dead and its live fraction is under "
        "`compaction_threshold`, so compaction can reclaim it; 0 = never roll.",
    )

    def validate(self) -> BookieConfig:
        """Return a config with derived defaults filled in; raise :class:`ConfigError`."""
        if not self.data_dir:
            raise ConfigError("data_dir is required (--data-dir DIR)")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port {self.port} is out of range 0..65535")
        if not -1 <= self.admin_port <= 65535:
            raise ConfigError(f"admin_port {self.admin_port} is out of range -1..65535 (-1 = disabled)")
        config = self
        advertised_host, advertised_port = config.advertised()
        _check_reachable(config, advertised_host)
        if not config.bookie_id:
            if advertised_port == 0:
                raise ConfigError("bookie_id is required when port is 0 (--bookie-id ID)")
            # ``host:port`` as before there was an advertised address (an IPv6 host unbracketed):
            # a bookie's id is in its cookie and every ledger's metadata and must not change
            config = dataclasses.replace(config, bookie_id=f"{advertised_host}:{advertised_port}")
        _positive(config, "in_flight_per_connection_max", "connections_max", "journal_group_bytes")
        _positive(config, "in_flight_total_max")
        _positive(config, "answer_bytes_buffered_max", "reads_in_flight_per_connection_max")
        _positive(config, "answer_bytes_total_max")
        _positive(config, "connections_per_address_max")
        if config.idle_timeout_s < 0:
            raise ConfigError("idle_timeout_s must be >= 0")
        if config.bad_requests_per_address_per_s < 0:
            raise ConfigError("bad_requests_per_address_per_s must be >= 0")
        if not 2 <= config.registration_ttl_s <= 3600:
            raise ConfigError(f"registration_ttl_s {config.registration_ttl_s} is out of range 2..3600")
        _positive(config, "journal_queue_bytes_max", "checkpoint_interval_s", "frame_read_timeout_s")
        _positive(config, "checkpoint_journal_bytes", "checkpoint_journal_records")
        if not 1024 <= config.frame_bytes_max <= fmt.RECORD_BODY_BYTES_MAX - _RECORD_OVERHEAD_BYTES:
            raise ConfigError(f"frame_bytes_max {config.frame_bytes_max} is out of range")
        if config.journal_group_wait_ms < 0:
            raise ConfigError("journal_group_wait_ms must be >= 0")
        _positive(config, "disk_check_interval_s", "compaction_rate_bytes_per_s", "limbo_check_interval_s")
        for name in (
            "gc_interval_s",
            "gc_deleted_ledger_grace_s",
            "gc_future_ledger_grace_s",
            "gc_over_replicated_interval_s",
            "gc_over_replicated_scan_ledgers_per_s",
            "compaction_roll_dead_bytes",
        ):
            if getattr(config, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(config, name)}")
        if config.limbo_after_cut not in (0, 1):
            raise ConfigError(f"limbo_after_cut must be 0 or 1, got {config.limbo_after_cut}")
        if not 0.0 <= config.compaction_threshold <= 1.0:
            raise ConfigError(f"compaction_threshold {config.compaction_threshold} is out of range 0..1")
        try:
            config.disk_thresholds().validate()
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if config.tls_client_auth not in ("none", "optional", "required"):
            raise ConfigError(f"tls_client_auth {config.tls_client_auth!r}: use none, optional or required")
        if bool(config.tls_cert_file) != bool(config.tls_key_file):
            raise ConfigError("TLS needs both tls_cert_file and tls_key_file (or neither: plaintext)")
        if config.tls_client_auth != "none" and not (config.tls_cert_file and config.tls_ca_file):
            raise ConfigError(
                f"tls_client_auth {config.tls_client_auth} needs TLS on (tls_cert_file, tls_key_file) "
                "and tls_ca_file (the CA of the client certificates)"
            )
        if "token" in (p.strip() for p in config.auth_providers.split(",")) and not config.auth_token_file:
            raise ConfigError("auth_providers has token: set auth_token_file (one token per line)")
        _positive(config, "auth_timeout_s")
        if config.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level {config.log_level!r}: use debug, info, warning or error")
        try:
            config.journal_config().validate()
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        return config

    def advertised(self, bound_port: int | None = None) -> tuple[str, int]:
        """The (host, port) this bookie publishes; ``bound_port`` is the port it listens on once
        bound (an ephemeral ``port`` 0 is known only then). Raises :class:`ConfigError`."""
        port = self.port if bound_port is None else bound_port
        text = self.advertised_address.strip()
        if not text:
            if _is_wildcard(self.host):
                raise ConfigError(
                    f"host {self.host!r} listens on every interface: set advertised_address "
                    "(--advertised-address HOST[:PORT]) to the address other hosts reach this bookie at"
                )
            return self.host, port
        host, port_text = _split_host_port(text)
        if port_text:
            try:
                port = int(port_text)
            except ValueError:
                raise ConfigError(
                    f"advertised_address {text!r}: port {port_text!r} is not a number"
                ) from None
            if not 1 <= port <= 65535:
                raise ConfigError(f"advertised_address {text!r}: port {port} is out of range 1..65535")
        if not host or _is_wildcard(host):
            raise ConfigError(
                f"advertised_address {text!r}: give the host other machines reach this bookie at "
                "(a name or an IP address, not a wildcard)"
            )
        return host, port

    def published_address(self, bound_port: int) -> str:
        """``host:port`` for the registration, once listening on ``bound_port``."""
        return _join(*self.advertised(bound_port))

    def tls_context(self) -> ssl.SSLContext | None:
        """The bookie port's TLS context, None for plaintext; raises ``TlsConfigError``."""
        if not self.tls_cert_file:
            return None
        return server_context(self.tls_cert_file, self.tls_key_file, self.tls_ca_file, self.tls_client_auth)

    def auth_providers_loaded(self) -> dict[str, BookieAuthProvider]:
        """The auth providers by the name clients send ({} = none); raises ``AuthConfigError``."""
        return load_providers(self)

    def journal_config(self) -> JournalConfig:
        return JournalConfig(
            segment_bytes=self.journal_segment_bytes,
            group_wait_ms=self.journal_group_wait_ms,
            group_bytes=self.journal_group_bytes,
            queue_bytes_max=self.journal_queue_bytes_max,
            record_bytes_max=self.frame_bytes_max + _RECORD_OVERHEAD_BYTES,
        )

    def disk_thresholds(self) -> DiskThresholds:
        return DiskThresholds(
            free_bytes_min=self.disk_free_bytes_min,
            free_bytes_writable=self.disk_free_bytes_writable,
            reserve_bytes=self.disk_reserve_bytes,
        )

    def gc_config(self) -> GcConfig:
        return GcConfig(
            interval_s=self.gc_interval_s,
            deleted_ledger_grace_s=self.gc_deleted_ledger_grace_s,
            future_ledger_grace_s=self.gc_future_ledger_grace_s,
            over_replicated_interval_s=self.gc_over_replicated_interval_s,
            compaction_threshold=self.compaction_threshold,
            compaction_rate_bytes_per_s=self.compaction_rate_bytes_per_s,
            compaction_roll_dead_bytes=self.compaction_roll_dead_bytes,
        )

    def storage_config(self) -> StorageConfig:
        return StorageConfig(
            data_dir=self.data_dir,
            bookie_id=self.bookie_id,
            journal=self.journal_config(),
            checkpoint_interval_s=self.checkpoint_interval_s,
            checkpoint_journal_bytes=self.checkpoint_journal_bytes,
            checkpoint_journal_records=self.checkpoint_journal_records,
            limbo_after_cut=bool(self.limbo_after_cut),
        )


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None  # a host name
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _is_wildcard(host: str) -> bool:
    address = _ip(host)
    return not host or (address is not None and address.is_unspecified)


def _split_host_port(text: str) -> tuple[str, str]:
    """``host:port``, ``[v6]:port``, ``[v6]``, or a host alone (a name, IPv4 or bare IPv6 — an IPv6
    address with a port needs the brackets): (host, port text). Raises :class:`ConfigError`."""
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ConfigError(
                f"advertised_address {text!r}: write an IPv6 address as [ADDRESS] or [ADDRESS]:PORT"
            )
        return host, rest.removeprefix(":")
    if text.count(":") == 1:
        host, _, port = text.partition(":")
        return host, port
    if ":" in text and _ip(text) is None:
        raise ConfigError(f"advertised_address {text!r}: write an IPv6 address with a port as [ADDRESS]:PORT")
    return text, ""


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address or a name) can only be reached from this machine."""
    if host.lower() in ("localhost", "localhost.localdomain") or host.lower().endswith(".localhost"):
        return True
    address = _ip(host.strip("[]"))
    return address is not None and address.is_loopback  # a host name: whatever it resolves to elsewhere


def _check_reachable(config: BookieConfig, advertised_host: str) -> None:
    """Refuse to publish a loopback address into a cluster whose metadata other hosts use."""
    if not config.metadata or not is_loopback(advertised_host):
        return
    try:
        url = parse_url(config.metadata)
    except InvalidUrl as exc:
        raise ConfigError(f"metadata: {exc}") from exc
    remote = [f"{host}:{port}" for host, port in url.endpoints if not is_loopback(host)]
    if url.scheme == "etcd" and remote:
        raise ConfigError(
            f"this bookie would advertise the loopback address {advertised_host} to a cluster whose "
            f"metadata is at {', '.join(remote)}: no other host could reach it. Set "
            "--advertised-address HOST[:PORT] (or --host) to an address of this machine the clients reach"
        )


def _positive(config: BookieConfig, *names: str) -> None:
    for name in names:
        if getattr(config, name) <= 0:
            raise ConfigError(f"{name} must be > 0, got {getattr(config, name)}")


_FIELDS = {f.name: f for f in fields(BookieConfig)}


def _coerce(name: str, value: Any, source: str) -> Any:
    field = _FIELDS.get(name)
    if field is None:
        raise ConfigError(f"{source}: unknown key {name!r} (known: {', '.join(sorted(_FIELDS))})")
    kind = {"str": str, "int": int, "float": float}[str(field.type)]
    if isinstance(value, str) and kind is not str:
        try:
            value = kind(value)
        except ValueError:
            raise ConfigError(f"{source}: {name} must be {kind.__name__}, got {value!r}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not kind:
        raise ConfigError(f"{source}: {name} must be {kind.__name__}, got {value!r}")
    return value


def load(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> tuple[BookieConfig, argparse.Namespace]:
    """Parse flags, read ``--config`` TOML and the environment; returns the validated config (and
    the parsed flags, whose ``sources`` maps each key set explicitly to where it came from)."""
    args = build_parser().parse_args(argv)
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if args.config:
        try:
            with open(args.config, "rb") as handle:
                table = tomllib.load(handle)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config file {args.config}: {exc}") from exc
        for key, value in table.items():
            values[key] = _coerce(key, value, f"config file {args.config}")
            sources[key] = f"config file {args.config}"
    # every process's $BKAIO_LOG_LEVEL (docs/configuration.md), as environment; the bookie's own wins
    if env.get(LEVEL_ENV) and f"{ENV_PREFIX}LOG_LEVEL" not in env:
        values["log_level"] = env[LEVEL_ENV].lower()
        sources["log_level"] = f"environment {LEVEL_ENV}"
    for key, value in env.items():
        if key.startswith(ENV_PREFIX):
            name = key[len(ENV_PREFIX) :].lower()
            values[name] = _coerce(name, value, f"environment {key}")
            sources[name] = f"environment {key}"
    for name in _FIELDS:
        flag_value = getattr(args, name, None)
        if flag_value is not None:
            values[name] = _coerce(name, flag_value, f"flag --{name.replace('_', '-')}")
            sources[name] = f"flag --{name.replace('_', '-')}"
    args.sources = sources
    try:
        return BookieConfig(**values).validate(), args
    except ConfigError as exc:
        # a message starts with the key it is about: name where that key's value came from
        key = str(exc).split(" ", 1)[0].rstrip(":")
        if key in sources:
            raise ConfigError(f"{sources[key]}: {exc}") from None
        raise


def effective_toml(config: BookieConfig, sources: Mapping[str, str]) -> str:
    """``config`` as a TOML file ``--config`` accepts, each key commented with where its value came
    from (``bookie --print-config``); derived values (``bookie_id``) say so."""
    lines = ["# bookie: effective configuration (defaults <- file <- environment <- flags)"]
    for name in _FIELDS:
        value = getattr(config, name)
        if name in sources:
            origin = sources[name]
        elif value != _FIELDS[name].default:
            origin = "derived"
        else:
            origin = "default"
        literal = json.dumps(value, ensure_ascii=False) if isinstance(value, str) else repr(value)
        lines.append(f"{name} = {literal}  # {origin}")
    return "\n".join(lines) + "\n"


def help_text(name: str) -> str:
    """The description of config key ``name`` (markdown: the reference table in the docs)."""
    return str(_FIELDS[name].metadata.get("help", ""))


def format_default(name: str) -> str:
    """A key's default as the docs and ``--help`` show it (byte sizes in KiB / MiB)."""
    value = _FIELDS[name].default
    if "bytes" in name and isinstance(value, int) and value >= 1024:
        for unit, size in (("MiB", 1024 * 1024), ("KiB", 1024)):
            if value % size == 0:
                return f"{value // size} {unit}"
    return repr(value)


def reference_table() -> str:
    """The markdown table of every key, as docs/configuration.md (*Reference*) holds it.

    ``python -m bookie.config`` prints it (paste it into the doc after changing a key).
    """
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, field in _FIELDS.items():
        rows.append(f"| `{name}` | {field.type} | `{format_default(name)}` | {help_text(name)} |")
    return "\n".join(rows) + "\n"


def _metavar(name: str, kind: str) -> str:
    if name.endswith("_ms"):
        return "MS"
    if name.endswith("_s"):
        return "SECONDS"
    if "bytes" in name:
        return "BYTES"
    return {"int": "N", "float": "X"}.get(kind, name.upper())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bookie",
        description="Run a bookkeeper-aio bookie (storage node).",
        epilog=f"Every option can also be set in the --config TOML file (key with underscores) or "
        f"the environment ({ENV_PREFIX}<KEY>); flags win over the environment, which wins over the "
        "file. Reference: docs/configuration.md.",
    )
    parser.add_argument("--config", metavar="FILE", help="TOML file with bookie settings (keys at top level)")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective configuration (as a TOML file, each key with its source) and exit",
    )
    for name, field in _FIELDS.items():
        described = help_text(name).replace("`", "").replace("*", "")
        default = repr(field.default)
        if format_default(name) != default:
            default = f"{default} = {format_default(name)}"
        help_line = f"{described} (default: {default}; env {ENV_PREFIX}{name.upper()})"
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=None,
            metavar=_metavar(name, str(field.type)),
            help=help_line.replace("%", "%%"),
        )
    return parser


if __name__ == "__main__":
    print(reference_table(), end="")
