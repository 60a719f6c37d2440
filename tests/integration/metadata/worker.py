"""Subprocess worker for the multi-process metadata tests.

    python -m tests.integration.metadata.worker increment URL LEDGER_ID TASKS PER_TASK
    python -m tests.integration.metadata.worker ids URL COUNT OUT_FILE
    python -m tests.integration.metadata.worker register URL BOOKIE_ID TTL_S

Reports on stdout, one line per fact ("ready", "progress N", "registered N", "done N").
"""

from __future__ import annotations

import asyncio
import sys

from metadata.bookies import BookieInfo, BookieRegistration
from metadata.cluster import connect
from metadata.errors import MetadataUnavailable
from metadata.idgen import IdGenerator
from metadata.ledger_manager import LedgerManager
from metadata.ledger_metadata import LedgerMetadata


def say(line: str) -> None:
    print(line, flush=True)


def increment(current: LedgerMetadata) -> LedgerMetadata:
    value = int(current.custom_metadata.get("count", b"0"))
    return current.with_custom_metadata({"count": str(value + 1).encode()})


async def run_increment(url: str, ledger_id: int, tasks: int, per_task: int) -> None:
    async with connect(url) as conn:
        manager = LedgerManager(conn.store, conn.root)

        async def worker() -> None:
            for _ in range(per_task):
                await manager.update(ledger_id, increment, attempts_max=10_000)

        say("ready")
        async with asyncio.TaskGroup() as group:
            for _ in range(tasks):
                group.create_task(worker())
        say(f"done {tasks * per_task}")


async def run_ids(url: str, count: int, out_file: str) -> None:
    async with connect(url) as conn:
        generator = IdGenerator(conn.store, conn.keys.idgen, block_size=10)
        ids: list[int] = []
        unavailable = 0
        say("ready")
        while len(ids) < count:
            try:
                ids.append(await generator.next_id())
            except MetadataUnavailable:
                unavailable += 1
                await asyncio.sleep(0.05)  # etcd is restarting: keep asking
                continue
            if len(ids) % 250 == 0:
                say(f"progress {len(ids)}")
            await asyncio.sleep(0.0005)
        with open(out_file, "w") as out:  # noqa: ASYNC230 -- a test worker, once at the end
            out.write("\n".join(map(str, ids)))
        say(f"done {len(ids)} unavailable {unavailable}")


async def run_register(url: str, bookie_id: str, ttl_s: int) -> None:
    async with connect(url) as conn:
        host, _, port = bookie_id.rpartition(":")
        registration = BookieRegistration(
            conn.store, conn.root, BookieInfo(bookie_id, host, int(port)), ttl_s=ttl_s
        )
        await registration.start()
        reported = 0
        while True:
            if registration.registrations != reported:
                reported = registration.registrations
                say(f"registered {reported}")
            await asyncio.sleep(0.05)


def main(argv: list[str]) -> None:
    command, url, *rest = argv
    if command == "increment":
        asyncio.run(run_increment(url, int(rest[0]), int(rest[1]), int(rest[2])))
    elif command == "ids":
        asyncio.run(run_ids(url, int(rest[0]), rest[1]))
    elif command == "register":
        asyncio.run(run_register(url, rest[0], int(rest[1])))
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
