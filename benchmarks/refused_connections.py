"""The bookie's CPU per connection of a TLS-handshake flood (issue 20, item 6): the real
BookieServer in this process, on a real TLS port allowing ``--per-address`` connections per peer
address, and the attacker of the attack tests (``tests/harness/attacker.py tls-stall``) in a
process of its own, from another address: ``--connections`` TCP connections that never start
their handshake, each opened again when the bookie closes it. Those over the per-address limit are
closed at accept; the others at the handshake timeout (``--handshake-timeout-s``).

Measured: the event loop thread's CPU time (``time.thread_time`` sampled on the loop) and the
whole process's (``time.process_time``) over the attack, per connection the attacker tried. The
attacker's CPU is not counted (another process); the kernel's work for the TCP handshakes that
runs in softirq context may land on either side. Steady enough on a loaded machine for an A/B of
the accept path (medians of ``--reps``).

    python -m benchmarks.refused_connections --seconds 5 --reps 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trustme
import uvloop

from bookie.config import BookieConfig
from bookie.server import BookieServer
from tests.harness.tls import issue


async def one_run(args: argparse.Namespace) -> dict[str, Any]:
    data_dir = tempfile.mkdtemp(prefix="bench-refused-", dir=args.dir)
    files = issue(trustme.CA(), Path(data_dir) / "certs", "bookie", "127.0.0.1", "localhost")
    config = BookieConfig(
        data_dir=str(Path(data_dir) / "data"),
        bookie_id="bench",
        port=0,
        tls_cert_file=files.cert,
        tls_key_file=files.key,
        connections_per_address_max=args.per_address,
        frame_read_timeout_s=args.handshake_timeout_s,
    )
    server = BookieServer(config)
    await server.start()
    try:
        host, port = server.address
        attacker = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.harness.attacker", "tls-stall",
            "--target", f"{host}:{port}", "--connections", str(args.connections),
            "--seconds", str(args.seconds), "--source-host", "127.0.0.2",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        await asyncio.sleep(0.5)  # the attacker's interpreter starts: not measured
        loop0, process0, wall0 = time.thread_time(), time.process_time(), time.perf_counter()
        out, _ = await attacker.communicate()
        loop_s, process_s = time.thread_time() - loop0, time.process_time() - process0
        wall_s = time.perf_counter() - wall0
    finally:
        await server.close()
        shutil.rmtree(data_dir, ignore_errors=True)
    summary = json.loads(out.decode().strip().splitlines()[-1])
    connections = max(1, int(summary["attempts"]))  # opened or refused: each one the bookie accepted
    return {
        "connections": connections,
        "refused": int(summary["refused"]),
        "connections_per_s": round(connections / wall_s),
        "loop_us_per_connection": round(loop_s / connections * 1e6, 1),
        "process_us_per_connection": round(process_s / connections * 1e6, 1),
        "loop_cpu_share": round(loop_s / wall_s, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="length of one attack")
    ap.add_argument("--connections", type=int, default=96, help="attacker's connections at once")
    ap.add_argument("--per-address", type=int, default=32, help="connections_per_address_max")
    ap.add_argument("--handshake-timeout-s", type=float, default=1.0, help="frame_read_timeout_s")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="parent of the temporary data dirs")
    args = ap.parse_args()
    runs = []
    for _ in range(args.reps):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            result = runner.run(one_run(args))
        print(json.dumps(result), flush=True)
        runs.append(result)
    median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    print(json.dumps({"median": median, "config": vars(args)}))


if __name__ == "__main__":
    main()
