"""Real ``bookie`` processes for integration tests: start on port 0, kill -9, pause, restart.

    proc = BookieProcess(tmp_path / "b1", bookie_id="b1")
    host, port = proc.start()          # waits for the READY line
    proc.kill()                        # SIGKILL, like a power cut for the process
    proc.restart()                     # same data dir, same port
    proc.pause(); proc.resume()        # SIGSTOP / SIGCONT
    proc.stop()                        # SIGTERM, waits for a clean exit, returns the exit code
    proc.admin_address()               # with extra_args ["--admin-port", "0"]: the ADMIN line

``wrapper`` prefixes the command (e.g. ``["ip", "netns", "exec", NS]``: bookkeeper_aio/cli/netns.py; it
must exec the bookie, so signals reach it). ``extra_args`` are passed to ``bookie`` (e.g.
``["--frame-read-timeout-s", "1"]``), ``env`` is added to the environment (e.g.
``{"BKAIO_FAILPOINTS": "journal.after_fdatasync=count:20:kill"}``). The process's stderr (its
structlog lines) is kept in ``<data_dir>.log`` for post-mortems. Use as a context manager, or call
``cleanup()``, so no process outlives its test.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

READY_TIMEOUT_S = 20.0


class BookieStartError(RuntimeError):
    """The bookie exited or stayed silent instead of printing READY."""

    def __init__(self, message: str, returncode: int | None, log_tail: str) -> None:
        super().__init__(f"{message}\n--- bookie log tail ---\n{log_tail}")
        self.returncode = returncode
        self.log_tail = log_tail


class BookieProcess:
    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        bookie_id: str = "bookie-test",
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        wrapper: list[str] | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.wrapper = list(wrapper or [])
        self.bookie_id = bookie_id
        self.host = host
        self.port = port
        self.extra_args = list(extra_args or [])
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir.with_name(self.data_dir.name + ".log")
        self._stdout_rest = b""
        self._admin: tuple[str, int] | None = None

    # ------------------------------------------------------------------ lifecycle
    def command(self) -> list[str]:
        return [
            *self.wrapper,
            sys.executable, "-m", "bookie",
            "--data-dir", str(self.data_dir),
            "--bookie-id", self.bookie_id,
            "--host", self.host,
            "--port", str(self.port),
            *self.extra_args,
        ]  # fmt: skip

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> tuple[str, int]:
        """Start and wait for ``READY host:port``; raises :class:`BookieStartError`.

        A restart on the port of its previous run is tried once more when that port was taken
        meanwhile: the admin endpoint (``--admin-port 0``) binds before the bookie's own port, and
        the kernel may hand it exactly the port the killed bookie just freed."""
        try:
            return self._start(timeout_s)
        except BookieStartError as exc:
            if self.port == 0 or exc.returncode != 3 or "cannot listen" not in self.log_tail(5):
                raise
            return self._start(timeout_s)

    def _start(self, timeout_s: float) -> tuple[str, int]:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("bookie already running")
        env = {**os.environ, **self.env}
        env.setdefault("BKAIO_LOG_FORMAT", "json")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, env=env
            )
        line = self._read_ready(timeout_s)
        host, _, port = line.removeprefix("READY ").rpartition(":")
        self.host, self.port = host, int(port)
        return self.host, self.port

    def _read_ready(self, timeout_s: float) -> str:
        assert self.proc is not None
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        buffered = b""
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if selector.select(timeout=max(0.0, deadline - time.monotonic())):
                    chunk = os.read(self.proc.stdout.fileno(), 4096)
                    if not chunk:
                        break
                    buffered += chunk
                    if b"\n" in buffered:
                        line = buffered.split(b"\n", 1)[0].decode()
                        if line.startswith("READY "):
                            self._stdout_rest = buffered.split(b"\n", 1)[1]
                            self._admin = None
                            return line
                        break
        if self.proc.poll() is None:
            self.proc.kill()
        self.wait()
        raise BookieStartError(
            f"bookie did not become ready (exit code {self.proc.returncode})",
            self.proc.returncode,
            self.log_tail(),
        )

    def admin_token(self) -> bytes:
        """The token admin state changes carry (the one the bookie made in its data dir)."""
        return (self.data_dir / "admin.token").read_bytes().strip()

    def admin_address(self, timeout_s: float = 5.0) -> tuple[str, int]:
        """``host, port`` from the ``ADMIN host:port`` line the bookie prints after READY when
        started with ``--admin-port``; raises ``TimeoutError`` if it does not come."""
        if self._admin is not None:
            return self._admin
        assert self.proc is not None
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self._stdout_rest:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not selector.select(timeout=remaining):
                    raise TimeoutError("bookie printed no ADMIN line")
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk:
                    raise TimeoutError("bookie closed stdout before an ADMIN line")
                self._stdout_rest += chunk
        line, self._stdout_rest = self._stdout_rest.split(b"\n", 1)
        text = line.decode()
        if not text.startswith("ADMIN "):
            raise RuntimeError(f"expected an ADMIN line, got {text!r}")
        host, _, port = text.removeprefix("ADMIN ").rpartition(":")
        self._admin = (host, int(port))
        return self._admin

    def start_expect_failure(self, timeout_s: float = READY_TIMEOUT_S) -> int:
        """Start a bookie that must refuse to start; returns its exit code."""
        try:
            self.start(timeout_s)
        except BookieStartError as exc:
            return -1 if exc.returncode is None else exc.returncode
        raise AssertionError("bookie started but was expected to refuse")

    def restart(self, timeout_s: float = READY_TIMEOUT_S) -> tuple[str, int]:
        """Start again on the same data dir and (if it was bound before) the same port."""
        if self.running:
            self.kill()
        return self.start(timeout_s)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def kill(self) -> None:
        """SIGKILL (kill -9) and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.wait()

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM and wait for a clean exit; returns the exit code (None if it was not running)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
        return self.wait(timeout_s)

    def wait(self, timeout_s: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        code = self.proc.wait(timeout_s)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return code

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()

    def __enter__(self) -> BookieProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
