"""Child processes running `worker` for the multi-process tests, read line by line."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import signal
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]


class Worker:
    """One ``python -m tests.integration.metadata.worker ...`` child."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[str] = []

    @classmethod
    async def spawn(cls, *args: str) -> Worker:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.integration.metadata.worker",
            *args,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        return cls(process)

    async def expect(self, prefix: str, timeout_s: float = 30.0) -> str:
        """The next stdout line starting with ``prefix`` (earlier lines are kept in ``lines``)."""
        assert self.process.stdout is not None
        async with asyncio.timeout(timeout_s):
            while True:
                raw = await self.process.stdout.readline()
                if not raw:
                    raise AssertionError(f"worker exited ({await self.process.wait()}) before {prefix!r}")
                line = raw.decode().strip()
                self.lines.append(line)
                if line.startswith(prefix):
                    return line

    def signal(self, sig: signal.Signals) -> None:
        self.process.send_signal(sig)

    async def reap(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        await self.process.wait()
