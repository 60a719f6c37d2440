"""docs/operations.md, followed as written: its three hosts are network namespaces with the guide's
own addresses (10.0.0.11-13 on a bridge), and every code block runs where its first line says
(``# on h1``, ``# on every host``), in the guide's order. Unit files are started as their
``ExecStart`` lines with their ``Environment=`` (``systemctl enable --now``, ``restart`` and
``disable --now`` act on those processes), TOML files are written where the guide puts them.

What differs from a real host, and why: the paths the guide uses (``/etc/bookkeeper-aio``,
``/var/lib/bookkeeper-aio``, ``/var/backups``, ``$HOME``) live under a directory per host; the
install block's venv, ``pip install`` and ``useradd`` are skipped (the project's venv is used,
and ``/opt/bkaio/bin`` means its ``bin``) and processes run as the test's user (``User=`` and the
``-o/-g`` owners are dropped); ``/usr/bin/etcd`` is the etcd the other tests use. Per-host values
the guide gives in prose (the etcd member's ``NAME``/``IP``, each bookie's ``bookie_id`` and
``advertised_address``) are set per host as it says."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bookkeeper_aio.cli.netns import NetnsHosts, NetnsUnavailable, unavailable_reason
from tests.harness.etcd import find_etcd_binary

DOC = Path(__file__).resolve().parents[3] / "docs" / "operations.md"
HOSTS = ("h1", "h2", "h3")
VENV_BIN = Path(sys.executable).parent
SKIPPED_LINES = ("python3 -m venv ", "/opt/bkaio/bin/pip ", "useradd ")

REASON = unavailable_reason() or (None if shutil.which("curl") else "no curl (the guide's probes use it)")
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"cannot follow the guide here: {REASON}")


@dataclass
class Block:
    lang: str
    lines: list[str]

    @property
    def head(self) -> str:
        return self.lines[0] if self.lines else ""


def blocks(text: str) -> list[Block]:
    found, current = [], None
    for line in text.splitlines():
        if current is None and line.startswith("```") and len(line) > 3:
            current = Block(line[3:].strip(), [])
        elif current is not None and line.startswith("```"):
            found.append(current)
            current = None
        elif current is not None:
            current.lines.append(line)
    return found


@dataclass
class Unit:
    env: dict[str, str]
    exec_start: str


@dataclass
class Guide:
    """The three hosts and what the guide started on them."""

    hosts: NetnsHosts
    base: Path
    etcd: str
    units: dict[str, Unit] = field(default_factory=dict)
    running: dict[tuple[str, str], subprocess.Popen[bytes]] = field(default_factory=dict)
    outputs: list[tuple[str, str]] = field(default_factory=list)

    def root(self, host: str) -> Path:
        return self.base / host

    def localize(self, host: str, text: str) -> str:
        root = self.root(host)
        for path in ("/etc/bookkeeper-aio", "/var/lib/bookkeeper-aio", "/var/backups"):
            text = text.replace(path, f"{root}{path}")
        text = text.replace("/opt/bkaio/bin/", f"{VENV_BIN}/").replace("/usr/bin/etcd ", f"{self.etcd} ")
        return text.replace(" -o bkaio -g bkaio", "")

    def env(self, host: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        home = self.root(host) / "home"
        home.mkdir(parents=True, exist_ok=True)
        path = f"{self.base / 'bin'}:{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        hosts = ",".join(f"{self.hosts.address(i)}={self.root(h)}" for i, h in enumerate(HOSTS))
        return {
            "PATH": path,
            "HOME": str(home),
            "LANG": "C.UTF-8",
            "BKAIO_LOG_FORMAT": "json",
            "GUIDE_HOSTS": hosts,  # for the scp shim
            **(extra or {}),
        }

    def ns(self, host: str) -> list[str]:
        return self.hosts.prefix(HOSTS.index(host))

    def run_shell(self, host: str, lines: list[str]) -> None:
        script = "\n".join(["set -e", "[ -f ~/.profile ] && . ~/.profile", *lines])
        with subprocess.Popen(
            [*self.ns(host), "bash", "-c", self.localize(host, script)],
            env=self.env(host),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as shell:
            deadline = time.monotonic() + 180
            while True:
                try:
                    stdout, stderr = shell.communicate(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:  # polled: a unit may die meanwhile
                    died = [f"{u} on {h}" for (h, u), p in self.running.items() if p.poll() is not None]
                    if died or time.monotonic() > deadline:
                        shell.kill()
                        logs = "".join(
                            self._log_tail(h, u) for (h, u) in self.running if f"{u} on {h}" in died
                        )
                        raise AssertionError(
                            f"on {host}, waiting for:\n{script}\n{died or 'timeout'}\n{logs}"
                        ) from None
        self.outputs.append((host, stdout))
        output = f"--- stdout\n{stdout}\n--- stderr\n{stderr}"
        assert shell.returncode == 0, f"on {host}:\n{script}\n{output}"

    def _log_tail(self, host: str, name: str) -> str:
        lines = (self.root(host) / f"{name}.log").read_text(errors="replace").splitlines()
        return f"--- {name} on {host}:\n" + "\n".join(lines[-10:]) + "\n"

    def start(self, host: str, name: str) -> None:
        unit = self.units[name]
        env = {key: self.localize(host, value) for key, value in unit.env.items()}
        if "NAME" in env:  # the etcd unit: "only its Environment= line differs" per host
            env.update(NAME=f"e{HOSTS.index(host) + 1}", IP=self.hosts.address(HOSTS.index(host)))
        command = re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], self.localize(host, unit.exec_start))
        with (self.root(host) / f"{name}.log").open("ab") as log:
            self.running[(host, name)] = subprocess.Popen(
                [*self.ns(host), *shlex.split(command)], env=self.env(host, env), stdout=log, stderr=log
            )

    def stop(self, host: str, name: str) -> None:
        proc = self.running.pop((host, name))
        proc.send_signal(signal.SIGTERM)  # KillSignal=SIGTERM, TimeoutStopSec=60
        assert proc.wait(60) == 0, f"{name} on {host} exited with {proc.returncode}"

    def systemctl(self, host: str, line: str) -> None:
        if m := re.fullmatch(r"systemctl daemon-reload && systemctl enable --now (\S+)", line):
            self.start(host, m.group(1))
        elif m := re.fullmatch(r"systemctl restart (\S+)", line):
            self.stop(host, m.group(1))
            self.start(host, m.group(1))
        elif m := re.fullmatch(r"systemctl disable --now (\S+)", line):
            self.stop(host, m.group(1))
        else:
            raise AssertionError(f"the guide uses a systemctl form this test does not know: {line!r}")

    def run_block(self, host: str, lines: list[str]) -> None:
        pending: list[str] = []
        for raw in lines:
            line = raw.split("  #", 1)[0].strip() if raw.strip().startswith("systemctl") else raw
            if line.startswith(SKIPPED_LINES):
                continue
            if line.startswith("systemctl"):
                if pending:
                    self.run_shell(host, pending)
                    pending = []
                self.systemctl(host, line)
            else:
                pending.append(line)
        if any(p.strip() and not p.strip().startswith("#") for p in pending):
            self.run_shell(host, pending)

    def write_file(self, host: str, block: Block) -> None:
        target = Path(self.localize(host, block.head.lstrip("# ").split()[0]))
        target.parent.mkdir(parents=True, exist_ok=True)
        number = HOSTS.index(host) + 1
        text = "\n".join(block.lines[1:]) + "\n"
        text = text.replace('bookie_id = "bookie-1"', f'bookie_id = "bookie-{number}"')
        text = text.replace('advertised_address = "10.0.0.11"', f'advertised_address = "10.0.0.1{number}"')
        target.write_text(self.localize(host, text))

    def close(self) -> None:
        for proc in self.running.values():
            proc.send_signal(signal.SIGTERM)
        for proc in self.running.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.hosts.close()


SCP = f"""#!{sys.executable}
# scp between the guide's hosts: HOST:PATH is PATH under that host's directory ($GUIDE_HOSTS)
import os, shutil, sys
roots = dict(pair.split("=", 1) for pair in os.environ["GUIDE_HOSTS"].split(","))
*sources, target = [arg for arg in sys.argv[1:] if not arg.startswith("-")]
address, _, path = target.partition(":")
for root in roots.values():  # the sender's copy of the guide's paths -> the receiver's
    if path.startswith(root + "/"):
        path = roots[address] + path[len(root):]
os.makedirs(path if path.endswith("/") else os.path.dirname(path), exist_ok=True)
for source in sources:
    shutil.copy2(source, path)
"""


def _scp_shim(directory: Path) -> None:
    directory.mkdir()
    shim = directory / "scp"
    shim.write_text(SCP)
    shim.chmod(0o755)


def parse_unit(lines: list[str]) -> Unit:
    joined = "\n".join(lines).replace("\\\n", " ")
    env: dict[str, str] = {}
    exec_start = ""
    for line in joined.splitlines():
        key, _, value = line.partition("=")
        if key == "Environment":
            env.update(pair.split("=", 1) for pair in shlex.split(value))  # type: ignore[misc]
        elif key == "ExecStart":
            exec_start = value
    assert exec_start, "a unit file without ExecStart"
    return Unit(env, exec_start)


def test_the_operations_guide_builds_a_working_three_host_cluster(tmp_path: Path) -> None:
    etcd = find_etcd_binary()
    if etcd is None:
        pytest.skip("no etcd binary")
    try:
        hosts = NetnsHosts.create(len(HOSTS), network="10.0.0", first_host=11)
    except NetnsUnavailable as exc:
        pytest.skip(f"the guide's addresses cannot be set up here: {exc}")
    guide = Guide(hosts, tmp_path, etcd)
    _scp_shim(tmp_path / "bin")
    ran = 0
    try:
        for block in blocks(DOC.read_text()):
            head = block.head
            if block.lang == "ini" and head.startswith("# /etc/systemd/system/"):
                name = head.split("/")[-1].split()[0].removesuffix(".service")
                guide.units[name] = parse_unit(block.lines[1:])
            elif block.lang == "toml" and head.startswith("# /etc/"):
                for host in HOSTS:
                    guide.write_file(host, block)
            elif block.lang == "sh" and head.startswith("# on "):
                where = head.removeprefix("# on ").strip()
                targets = HOSTS if where == "every host" else (where,)
                with ThreadPoolExecutor(len(targets)) as pool:  # one operator terminal per host
                    for done in [pool.submit(guide.run_block, host, block.lines[1:]) for host in targets]:
                        done.result()
                ran += 1
        assert ran >= 12, f"only {ran} blocks of the guide ran: did its markup change?"
        text = "\n".join(out for _, out in guide.outputs)
        for number in (1, 2, 3):  # `bkaio bookies`: each at its own host's address
            assert re.search(rf"bookie-{number}\s+writable\s+10\.0\.0\.1{number}:3181", text), text
        assert re.search(r"^ok\s+True$", text, re.MULTILINE), text  # simpletest, over TLS with the token
        assert "refused without the CA and the token" in text, text
        assert re.search(r"^auditor\s+\S+", text, re.MULTILINE), text  # autorecovery status
        assert re.search(r"^left\s+\[\]$", text, re.MULTILINE), text  # decommission of bookie-3
        assert ("h3", "bookie") not in guide.running  # and it was stopped
        final = [out for host, out in guide.outputs if "BOOKIE_ID" in out][-1]  # the last `bkaio bookies`
        assert re.search(r"bookie-1\s+writable", final), final
        assert re.search(r"bookie-2\s+writable", final), final
        assert "bookie-3" not in final, final
        assert list((tmp_path / "h1" / "var" / "backups").glob("bkaio-*.db"))  # the snapshot
    finally:
        guide.close()
