"""A client program for the multi-host sandbox tests, run inside a host's network namespace.

python -m tests.integration.cli.netns_client write URL HISTORY STOP
    creates an E3/Qw2/Qa2 ledger, prints {"ledger", "ensemble"} as one JSON line, appends
    "value-N" entries (about 500/s) writing "N ENTRY_ID" to HISTORY once each is acked, until
    the file STOP exists; then closes the ledger and prints {"last_entry"}. Exits 1 on any
    failed append (the writer must ride out a lost bookie by an ensemble change).
python -m tests.integration.cli.netns_client read URL LEDGER
    prints the ledger's payloads as one JSON list.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from bookkeeper_aio import BookKeeper, ClientConfig

PASSWORD = b"sandbox-demo"  # the sandbox's autorecovery daemon is given this one
CONFIG = ClientConfig(add_timeout_s=2.0, read_timeout_s=5.0)


async def write(url: str, history: Path, stop: Path) -> int:
    async with BookKeeper.connect(url, config=CONFIG) as bk:
        handle = await bk.create_ledger(3, 2, 2, password=PASSWORD)
        print(
            json.dumps({"ledger": handle.id, "ensemble": list(handle.metadata.ensembles[0][1])}), flush=True
        )
        with history.open("a") as out:
            n = 0
            while not os.path.exists(stop):  # noqa: ASYNC240 (a stat per append: not worth a thread)
                entry_id = await handle.append(f"value-{n}".encode())
                out.write(f"{n} {entry_id}\n")
                if n % 20 == 0:
                    out.flush()
                n += 1
                await asyncio.sleep(0.002)
        await handle.close()
        print(json.dumps({"last_entry": handle.metadata.last_entry_id}), flush=True)
    return 0


async def read(url: str, ledger_id: int) -> int:
    async with BookKeeper.connect(url, config=CONFIG) as bk:
        reader = await bk.open_ledger(ledger_id, password=PASSWORD)
        print(json.dumps([entry.payload.decode() async for entry in reader.read()]), flush=True)
        await reader.close()
    return 0


def main() -> int:
    command, url, *rest = sys.argv[1:]
    if command == "write":
        return asyncio.run(write(url, Path(rest[0]), Path(rest[1])))
    return asyncio.run(read(url, int(rest[0])))


if __name__ == "__main__":
    sys.exit(main())
