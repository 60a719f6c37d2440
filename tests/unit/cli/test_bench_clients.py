"""The parent side of a load run reads each client process's lines: creation progress before
``ready``, and a clear failure when a process says something else or exits."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bookkeeper_aio.cli.bench.clients import _Client, _wait_ready
from bookkeeper_aio.cli.bench.errors import BenchFailed


def _client(lines: list[str]) -> _Client:
    stdout = asyncio.StreamReader()
    for line in lines:
        stdout.feed_data(f"{line}\n".encode())
    stdout.feed_eof()
    proc: Any = SimpleNamespace(stdout=stdout)
    return _Client(0, proc, Path("client-0.log"))


async def test_creation_progress_is_shown_until_ready() -> None:
    client = _client(["some log line", "BENCH created 64", "BENCH created 128", "BENCH ready "])
    shown: list[int] = []
    await _wait_ready(client, lambda: shown.append(client.created))
    assert shown == [64, 128]
    assert client.created == 128


@pytest.mark.parametrize("lines", [["BENCH created 64"], ["BENCH error OSError: no etcd"]])
async def test_a_process_that_is_not_ready_fails_with_its_log(lines: list[str]) -> None:
    client = _client(lines)
    with pytest.raises(BenchFailed, match=r"client-0\.log"):
        await _wait_ready(client, lambda: None)
