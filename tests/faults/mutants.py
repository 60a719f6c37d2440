"""Safety mutants (`make mutants`): one-line breaking edits to safety-critical code the suite must kill.

    python -m tests.faults.mutants            # every mutant
    python -m tests.faults.mutants NAME ...   # some of them (``--list`` names them)

Each mutant is applied in a scratch copy of the work tree (the files git knows of, tracked or not
ignored; never the tree itself), then the tests that should kill it run there (``pytest`` with the
scratch copy first on the import path, bookie processes included). The mutant is *killed* when they
fail. A surviving mutant is a missing test: the run exits 1 and names it. A mutant whose line is
not found exactly once is an error (the code moved: update the list).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 900
TEST_TIMEOUT_S = 120
LOG_FIGHT = "tests/faults/test_nemesis.py::test_ledgers_and_logs_under_one_nemesis"
"""`make test`'s log writers fighting for one log (a node id: the module's other tests are not needed)."""


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    what: str


MUTANTS = (
    Mutant(
        "ack-before-fdatasync",
        "bookie/journal.py",
        "        self._inflight_callbacks = callbacks\n",
        "        self._inflight_callbacks, callbacks = callbacks, "
        "self._run_callbacks(callbacks, None) or []\n",
        ("tests/integration/bookie/test_durability.py", "tests/unit/bookie/test_journal.py"),
        "a group's acks run when it is handed to the writer, before its write and fdatasync",
    ),
    Mutant(
        "recovery-read-without-fence",
        "bookkeeper_aio/client/recovery.py",
        "RECOVERY_READ_FLAGS = int(ReadFlag.FENCE_LEDGER)\n",
        "RECOVERY_READ_FLAGS = 0\n",
        ("tests/unit/recovery",),
        "recovery reads do not carry FENCE_LEDGER (BOOKKEEPER-2614)",
    ),
    Mutant(
        "quorum-coverage-off-by-one",
        "bookkeeper_aio/client/quorum.py",
        "        return self.write_quorum - self.ack_quorum + 1\n",
        "        return self.write_quorum - self.ack_quorum\n",
        ("tests/unit/client/test_quorum_placement.py", "tests/unit/recovery"),
        "quorum coverage needs Qw - Qa answers instead of Qw - Qa + 1",
    ),
    Mutant(
        "no-write-back",
        "bookkeeper_aio/client/recovery.py",
        "            writer.add(head.entry_id, head.body)\n",
        "            pass\n",
        ("tests/unit/recovery",),
        "recovery closes the ledger without writing the entries it found back to their write sets",
    ),
    Mutant(
        "fence-not-journaled",
        "bookie/storage.py",
        "        self.journal.append((fmt.encode_fence(ledger_id),), durable)\n",
        "        self._loop.call_soon(durable, None)\n",
        ("tests/unit/bookie/test_storage.py", "tests/integration/bookie/test_durability.py"),
        "a fence is answered without its FENCE record in the journal (lost on restart)",
    ),
    Mutant(
        "add-completes-during-ensemble-change",
        "bookkeeper_aio/client/add_pipeline.py",
        "        if self._changing:\n            return\n        pending = self._pending\n",
        "        pending = self._pending\n",
        ("tests/unit/client/test_failures.py", "tests/unit/client/test_replaced_bookies.py"),
        "adds complete while an ensemble change is in flight",
    ),
    Mutant(
        "corrupt-record-as-no-entry",
        "bookie/storage.py",
        '        return EntryCorrupt(f"entry {ledger_id}:{entry_id}: journal record fails its checksum")\n',
        '        return NoEntry(f"entry {ledger_id}:{entry_id}: journal record fails its checksum")\n',
        ("tests/faults/test_disk_faults.py",),
        "a record failing its checksum is answered 'no such entry' instead of EIO",
    ),
    Mutant(
        "close-ignores-in-recovery",
        "bookkeeper_aio/client/ledger_close.py",
        "    if md.state is LedgerState.IN_RECOVERY:\n",
        "    if False:\n",
        ("tests/unit/client/test_close_and_create.py",),
        "a writer's close overwrites IN_RECOVERY metadata instead of failing with LedgerFenced",
    ),
    Mutant(
        "zombie-worker-unguarded",
        "bookkeeper_aio/autorecovery/worker.py",
        "        guards: Guards = () if lock is None else (self._urm.guard(lock),)\n",
        "        guards: Guards = ()\n",
        ("tests/integration/autorecovery/test_zombie_worker.py",),
        "a replication worker's CAS is not guarded by its lock: one paused past its lease commits "
        "a stale replacement after an ABA of the fragment",
    ),
    Mutant(
        "replaced-unsure-unmarked",
        "bookkeeper_aio/autorecovery/auditor.py",
        "            if then is None or any(then.existed(first) for first in holding):\n",
        "            if then is not None and any(then.existed(first) for first in holding):\n",
        ("tests/unit/autorecovery/test_auditor.py",),
        "the auditor leaves a ledger unmarked when it cannot tell whether a replaced bookie's old "
        "data dir held entries of it (its metadata's history compacted away)",
    ),
    Mutant(
        "replaced-recovery-unmarked",
        "bookkeeper_aio/autorecovery/auditor.py",
        "        return first in self.firsts or recovered\n",
        "        return first in self.firsts\n",
        ("tests/unit/autorecovery/test_auditor.py",),
        "the auditor leaves unmarked a ledger that was under recovery when a bookie's new data dir "
        "registered, whose close then listed the bookie in a new fragment: recovery's write-back "
        "may have written it to the old data dir before that CAS",
    ),
    Mutant(
        "log-open-leaves-old-ledgers-open",
        "bookkeeper_aio/log/writer.py",
        "        proposed = taken_over(current.metadata, recovered, manager.now_ms())\n",
        "        proposed = current.metadata\n",
        (LOG_FIGHT,),
        "a new log writer fences the last ledgers but lists its own without marking them CLOSED",
    ),
    Mutant(
        "log-open-fences-last-ledger-only",
        "bookkeeper_aio/log/writer.py",
        "    last_two = md.ledger_ids[-2:]\n",
        "    last_two = md.ledger_ids[-1:]\n",
        (LOG_FIGHT,),
        "a new log writer fences only the last ledger (a roll's previous one stays writable)",
    ),
    Mutant(
        "log-change-ignores-takeover",
        "bookkeeper_aio/log/writer.py",
        "            if last is None or last.ledger_id != leader_ledger:\n",
        "            if last is None:\n",
        # the fault run rarely hits its window (a roll's create and CAS both inside a takeover's):
        # the integration test of concurrent opens does
        (LOG_FIGHT, "tests/integration/log/test_logs.py::test_concurrent_opens_leave_one_consistent_list"),
        "a log writer's list change (a roll) applies after another writer took the log over",
    ),
    Mutant(
        "log-roll-switches-before-drain",
        "bookkeeper_aio/log/writer.py",
        "                    await old.wait_for_adds()\n",
        "                    pass\n",
        ("tests/unit/log/test_writer_roll_order.py",),
        "a roll sends appends to the new ledger while the old one's may still fail (a hole in the log)",
    ),
    Mutant(
        "bookie-adopts-closed-ledger",
        "bookie/ledger_keys.py",
        "        if not info.writable:\n",
        "        if False:\n",
        ("tests/unit/bookie/test_ledger_keys.py",),
        "a bookie without a record of a closed ledger makes one for a zombie writer's add",
    ),
    Mutant(
        "checkpoint-after-forget-unsynced",
        "bookie/storage.py",
        "            while self._forgotten:\n",
        "            while False:\n",
        ("tests/unit/bookie/test_storage.py",),
        "a checkpoint after GC forgot a ledger leaves its in-flight records past its position",
    ),
    Mutant(
        "limbo-answers-no-entry",
        "bookie/processor.py",
        "    Unknown: StatusCode.EUNKNOWNLEDGERSTATE,\n",
        "    Unknown: StatusCode.ENOENTRY,\n",
        ("tests/integration/bookie/test_limbo.py",),
        "a bookie in limbo after a journal cut answers ENOENTRY for entries it may have acknowledged",
    ),
    Mutant(
        "cut-without-limbo",
        "bookie/replay.py",
        "        if garbage_end > end and limbo_after_cut and not never_synced:\n",
        "        if False:\n",
        ("tests/unit/bookie/test_limbo.py",),
        "replay cuts a damaged final journal group with no limbo marker",
    ),
    Mutant(
        "replay-unsynced-left-unsynced",
        "bookie/replay.py",
        "                    fileio.pwrite(fd, fileio.pread(fd, end - start, start), start)\n",
        "                    pass\n",
        ("tests/simulation/test_replay_durability.py",),
        "a start replays whole groups a process crash left unsynced and lets a checkpoint point into "
        "them without writing them again: a page whose writeback failed is lost by a later power cut",
    ),
    Mutant(
        "replay-mark-left-behind",
        "bookie/journal.py",
        "        self._writer.mark_synced(start)\n",
        "        pass\n",
        ("tests/unit/bookie/test_limbo.py",),
        "a start leaves the synced mark before groups it replayed and serves: rot found there later is "
        "cut as a tear in flight, without limbo",
    ),
    Mutant(
        "synced-mark-any-boot",
        "bookie/replay.py",
        "    if mark is None or mark.boot != fmt.boot_digest(boot):\n",
        "    if mark is None:\n",
        ("tests/unit/bookie/test_limbo.py",),
        "replay trusts a synced mark written before a reboot (a power cut may have left it behind the "
        "synced end): a damaged synced group is cut without limbo",
    ),
    Mutant(
        "synced-mark-any-later-cut",
        "bookie/replay.py",
        "    return cut == synced or (\n",
        "    return cut >= synced or (\n",
        ("tests/unit/bookie/test_limbo.py",),
        "replay takes any cut after a stale synced mark for the tear of the group in flight: acknowledged "
        "bytes after the mark are cut without limbo",
    ),
    Mutant(
        "synced-mark-left-stale",
        "bookie/journal.py",
        "                self.fileio.remove(self._mark_path)\n",
        "                pass\n",
        ("tests/unit/bookie/test_limbo.py",),
        "a synced mark that could not be rewritten stays behind the synced end, passing synced bytes "
        "off as never synced",
    ),
    Mutant(
        "limbo-writer-add-unchecked",
        "bookie/storage.py",
        "                        and limbo.wants_write_check(lid)\n",
        "                        and False\n",
        ("tests/unit/bookie/test_limbo.py",),
        "a writer's add of a ledger in limbo is journaled without metadata showing the ledger OPEN",
    ),
    Mutant(
        "replay-empty-middle-segment-skipped",
        "bookie/replay.py",
        "            if empty is not None:\n",
        "            if False:\n",
        ("tests/unit/bookie/test_journal_segments.py",),
        "replay skips a journal segment that holds nothing (emptied or zeroed) before one that holds "
        "data: the entries it held answer ENOENTRY",
    ),
    Mutant(
        "replay-previous-end-unchecked",
        "bookie/replay.py",
        "    if previous_end and end is not None and end != previous_end:\n",
        "    if False:\n",
        ("tests/unit/bookie/test_journal_segments.py",),
        "replay takes zeros in place of the last groups of a segment before another for space never "
        "written: the entries they held answer ENOENTRY",
    ),
    Mutant(
        "segment-header-without-previous-end",
        "bookie/journal.py",
        "                run.parts.insert(0, fmt.encode_segment_header(run.segment_id, run.previous_end))\n",
        "                run.parts.insert(0, fmt.encode_segment_header(run.segment_id, 0))\n",
        ("tests/unit/bookie/test_journal_segments.py",),
        "the journal records no previous end in a new segment's header: replay cannot tell the "
        "segment before lost its last groups",
    ),
    Mutant(
        "wiped-data-dir-starts-empty",
        "bookie/cookie.py",
        "    if cookie.get(JOURNAL_CREATED) is True:\n",
        "    if False:\n",
        ("tests/unit/bookie/test_wiped_data_dir.py",),
        "a data dir whose journal and index were wiped under a kept COOKIE starts empty under its old "
        "identity: ENOLEDGER / ENOENTRY for what it acknowledged",
    ),
    Mutant(
        "request-values-uncounted",
        "bookkeeper_aio/protocol/messages.py",
        "    if len(body) <= UNCOUNTED_REQUEST_BYTES_MAX:\n",
        "    if len(body) <= PLAIN_REQUEST_BYTES_MAX:\n",
        ("tests/unit/protocol/test_decode_regressions.py",),
        "request frames up to 64 KiB are unpacked with no count of their arrays, maps and extension "
        "values: 54 KB of nested arrays hold the event loop ~8 ms each",
    ),
    Mutant(
        "journal-records-uncounted",
        "bookie/journal.py",
        "        self._appended(offset + size, 1)\n",
        "        self._appended(offset + size, 0 if callback is None else 1)\n",
        ("tests/unit/bookie/test_journal.py",),
        "records journaled without a completion (compaction's copies, keys) do not count towards the "
        "checkpoint's record bound: replay after a crash grows past it",
    ),
    Mutant(
        "add-key-check-reused-across-ledgers",
        "bookie/storage.py",
        "                    if lid == checked_lid and key == checked_key and checked_state is not None:\n",
        "                    if key == checked_key and checked_state is not None:\n",
        ("tests/unit/bookie/test_add_fast_path.py",),
        "an add carrying another ledger's key, after an add of that ledger in the same socket read, "
        "is journaled (on the other ledger's state) instead of refused EUA",
    ),
    Mutant(
        "add-key-check-skipped-after-a-good-key",
        "bookie/storage.py",
        "                    if lid == checked_lid and key == checked_key and checked_state is not None:\n",
        "                    if lid == checked_lid and checked_state is not None:\n",
        ("tests/unit/bookie/test_add_fast_path.py",),
        "an add with a wrong key, after an add of the same ledger with its key in the same socket read, "
        "is journaled instead of refused EUA",
    ),
)


def _scratch_copy(into: Path) -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def apply(mutant: Mutant, tree: Path) -> None:
    path = tree / mutant.path
    text = path.read_text()
    found = text.count(mutant.old)
    if found != 1:
        raise SystemExit(f"mutant {mutant.name}: its line is in {mutant.path} {found} times, not once")
    path.write_text(text.replace(mutant.old, mutant.new))


def run(mutant: Mutant) -> tuple[bool, float, str]:
    """(killed, seconds, the tests that failed: what killed it; else the tail of pytest's output)."""
    with tempfile.TemporaryDirectory(prefix=f"bkaio-mutant-{mutant.name}-") as scratch:
        tree = Path(scratch)
        _scratch_copy(tree)
        apply(mutant, tree)
        env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
        check = f"import bookie; assert bookie.__file__.startswith({str(tree)!r}), bookie.__file__"
        subprocess.run([sys.executable, "-c", check], cwd=tree, env=env, check=True)  # the copy is imported
        started = time.monotonic()
        command = [
            sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow",
            f"--timeout={TEST_TIMEOUT_S}", *mutant.tests,
        ]  # fmt: skip
        try:
            result = subprocess.run(
                command, cwd=tree, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            return True, time.monotonic() - started, f"the tests hung past {TIMEOUT_S} s"
        lines = (result.stdout + result.stderr).strip().splitlines()
        if result.returncode == 5:  # pytest ran nothing: the list names tests that are gone
            raise SystemExit(f"mutant {mutant.name}: {' '.join(mutant.tests)} selected no test")
        failed = [line.split(" - ")[0] for line in lines if line.startswith(("FAILED ", "ERROR "))]
        return result.returncode != 0, time.monotonic() - started, "; ".join(failed) or " | ".join(lines[-2:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.faults.mutants")
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="name the mutants and exit")
    args = parser.parse_args(argv)
    if args.list:
        for mutant in MUTANTS:
            print(f"{mutant.name:40} {mutant.path}: {mutant.what}")
        return
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        raise SystemExit(f"unknown mutants: {sorted(unknown)}")
    survivors = []
    for mutant in chosen:
        killed, seconds, tail = run(mutant)
        verdict = "killed" if killed else "SURVIVED"
        print(f"{verdict:8} {mutant.name:38} {seconds:6.1f} s  {tail}", flush=True)
        if not killed:
            survivors.append(mutant.name)
    if survivors:
        print(f"{len(survivors)} of {len(chosen)} mutants survived (missing tests): {', '.join(survivors)}")
        sys.exit(1)
    print(f"all {len(chosen)} mutants killed")


if __name__ == "__main__":
    main()
