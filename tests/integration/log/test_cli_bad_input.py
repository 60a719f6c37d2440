"""Bad input through `bkaio log ...` (issue 14, acceptance 5, at the command line): an unknown log,
a position beyond the end, a corrupt log key in etcd -> exit status 1 and one clear message naming
the log on stderr, never a traceback. Real bookies and etcd (``--metadata`` names the test's cluster
root); tests/integration/cli/test_first_hour.py has the sandbox's cases (an unknown log for
``show``, a truncated ``--from``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bookkeeper_aio import BookKeeper, describe_log, open_log_writer
from metadata.keys import ClusterKeys
from tests.harness.sandbox import bkaio
from tests.integration.log.conftest import Cluster

pytestmark = [pytest.mark.etcd, pytest.mark.slow]  # one CLI process per case


async def _run(home: Path, *args: str) -> tuple[int, str, str]:
    result = await asyncio.to_thread(bkaio, home, *args, check=False, timeout=60)
    return result.returncode, result.stdout, result.stderr


async def test_bad_input_at_the_command_line(cluster: Cluster, bk: BookKeeper, tmp_path: Path) -> None:
    await cluster.start(3)
    writer = await open_log_writer(bk, "good", password=b"pw")
    positions = [await writer.append(f"{i}".encode()) for i in range(3)]
    await writer.close()
    last = positions[-1]
    assert last is not None
    await cluster.meta.store.put(ClusterKeys(cluster.root).log("broken"), b"\x00garbage")
    meta = ["--metadata", cluster.url]
    cases = {
        "unknown: show": (["log", "show", "nope"], "'nope'"),
        "unknown: tail": (["log", "tail", "nope", "--password", "pw"], "'nope'"),
        "unknown: tail -f": (["log", "tail", "nope", "-f", "--password", "pw"], "'nope'"),
        "unknown: truncate": (["log", "truncate", "nope", "--before", "1:0"], "'nope'"),
        # "log cursors nope": exits 0 with "(none)" (read_cursors does not check the log exists;
        # test_bad_input.py::test_cursors_of_an_unknown_log_name_the_log, xfail)
        "beyond: a later ledger": (
            ["log", "tail", "good", "--from", f"{last.ledger_id + 1000}:0", "--password", "pw"],
            "'good'",
        ),
        "beyond: past the last entry": (
            ["log", "tail", "good", "--from", f"{last.ledger_id}:{last.entry_id + 5}", "--password", "pw"],
            "'good'",
        ),
        "not in the log: truncate": (
            ["log", "truncate", "good", "--before", f"{last.ledger_id + 1000}", "--password", "pw"],
            "--force",
        ),
        "not in the log: cursor": (
            ["log", "cursors", "good", "--set", f"c={last.ledger_id + 1000}:0"],
            "'good'",
        ),
        "beyond: a cursor past a closed ledger's end": (
            ["log", "cursors", "good", "--set", f"c={last.ledger_id}:{last.entry_id + 5}"],
            "'good'",
        ),
        "corrupt: show": (["log", "show", "broken"], "'broken'"),
        "corrupt: tail": (["log", "tail", "broken", "--password", "pw"], "'broken'"),
        "corrupt: truncate": (["log", "truncate", "broken", "--before", "1:0"], "'broken'"),
    }
    failures = []
    for what, (args, names) in cases.items():
        code, out, err = await _run(tmp_path, *args, *meta)
        if code != 1 or names not in err or "Traceback" in err:
            failures.append(
                f"{what}: exit {code}, stderr {err.strip()[-300:]!r}, stdout {out.strip()[-200:]!r}"
            )
    assert not failures, "\n".join(failures)
    info = await describe_log(bk, "good")
    assert ([e.ledger_id for e in info.ledgers], info.cursors) == ([last.ledger_id], {})  # nothing changed
    forced = ["log", "truncate", "good", "--before", f"{last.ledger_id + 1000}", "--force", "--json"]
    code, out, err = await _run(tmp_path, *forced, "--password", "pw", *meta)
    assert (code, json.loads(out)["dropped_ledgers"]) == (0, []), err  # the last ledger stays
    # a listing with a corrupt log among good ones: the good one is listed, the broken one named
    code, out, err = await _run(tmp_path, "log", "list", "--json", *meta)
    assert "Traceback" not in err
    assert "'broken'" in err or "broken" in out, (code, out, err)
    if code == 0:
        assert "good" in json.dumps(json.loads(out))
