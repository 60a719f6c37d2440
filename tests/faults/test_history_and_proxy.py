"""The fault suite's own tools: each check of the history checker fires on a history that breaks
it, and each proxy mode does to the bytes what it says."""

from __future__ import annotations

import asyncio

import pytest

from bookkeeper_aio.errors import LedgerClosed, LogFenced, with_outcome_unknown
from tests.faults.history import History, LogHistory, Outcome
from tests.faults.proxy import FaultProxy, Mode


def _history(
    values: list[bytes], *, read: list[bytes] | None = None, recovered: int | None = None
) -> History:
    history = History()
    for entry_id, value in enumerate(values):
        history.ok(history.invoke("w", 1, value), entry_id)
    read = values if read is None else read
    history.read_back(1, list(enumerate(read)))
    history.recovered_at(1, len(read) - 1 if recovered is None else recovered)
    return history


def test_the_history_keeps_each_ledgers_highest_ack() -> None:
    history = History()
    history.ok(history.invoke("w", 1, b"a"), 0)
    late = history.invoke("w", 1, b"b")
    history.ok(history.invoke("w", 1, b"c"), 2)
    history.ok(late, 1)  # acked after a later entry: the highest stays
    history.failed(history.invoke("w", 1, b"d"), LedgerClosed("x"))
    history.ok(history.invoke("v", 7, b"e"), 0)
    history.invoke("v", 8, b"f")  # never answered: no ack
    assert history.acked_max == {1: 2, 7: 0}


def test_a_consistent_history_passes() -> None:
    history = _history([b"a", b"b"])
    history.failed(history.invoke("w", 1, b"c"), LedgerClosed("x"))  # nothing sent: fail
    history.failed(history.invoke("w", 1, b"d"), with_outcome_unknown(LedgerClosed("y"), True))  # info
    history.invoke("w", 1, b"e")  # never answered: info
    assert history.check() == []
    assert history.counts() == {"ok": 2, "fail": 1, "info": 2}


@pytest.mark.parametrize(
    ("history", "complaint"),
    [
        (_history([b"a", b"b"], read=[b"a"]), "LOST"),
        (_history([b"a"], read=[b"a", b"zz"], recovered=1), "phantom"),
        (_history([b"a", b"b"], recovered=0), "acked above the final last entry"),
        (_history([b"a", b"b"], read=[b"a", b"a"]), "read twice"),
    ],
)
def test_each_violation_is_reported(history: History, complaint: str) -> None:
    assert any(complaint in problem for problem in history.check()), history.check()


def test_an_untyped_failure_is_reported() -> None:
    history = _history([b"a"])
    history.failed(history.invoke("w", 1, b"b"), RuntimeError("not a BKError"))
    assert any("not a BKError" in problem for problem in history.check()), history.check()


def test_figures_count_violations_by_kind() -> None:
    clean = _history([b"a", b"b"])
    assert clean.figures() == {
        "ok": 2, "fail": 0, "info": 0, "acked": 2, "lost": 0, "duplicated": 0, "inconsistent": 0,
        "violations": 0,
    }  # fmt: skip
    lost = _history([b"a", b"b"], read=[b"a"]).figures()  # entry 1 lost, and acked above the end
    assert (lost["lost"], lost["duplicated"], lost["inconsistent"], lost["violations"]) == (1, 0, 1, 2)
    twice = _history([b"a", b"b"], read=[b"a", b"a"]).figures()  # b lost, a read twice
    assert (twice["lost"], twice["duplicated"], twice["inconsistent"], twice["violations"]) == (1, 1, 0, 2)


def test_disagreeing_readers_recoverers_and_lacs_are_reported() -> None:
    history = _history([b"a", b"b"])
    history.read_back(1, [(0, b"a")])
    history.recovered_at(1, 0)
    history.lac_seen(1, 1)
    history.lac_seen(1, 0)
    problems = "\n".join(history.check())
    assert "reader 2 disagrees" in problems
    assert "recoverers disagree" in problems
    assert "LACs went back" in problems


def test_a_failed_add_that_was_read_and_out_of_order_acks_are_reported() -> None:
    history = History()
    late = history.invoke("w", 1, b"first")
    early = history.invoke("w", 1, b"second")
    history.ok(early, 0)
    history.ok(late, 1)
    dropped = history.invoke("w", 1, b"third")
    dropped.outcome = Outcome.FAIL
    history.read_back(1, [(0, b"second"), (1, b"first"), (2, b"third")])
    history.recovered_at(1, 2)
    problems = "\n".join(history.check())
    assert "not in invoke order" in problems
    assert "failed (nothing sent) yet was read" in problems


async def _echo_server() -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


async def test_proxy_modes_do_what_they_say() -> None:
    server = await _echo_server()
    async with server, FaultProxy(server.sockets[0].getsockname()[:2]) as proxy:
        reader, writer = await asyncio.open_connection(*proxy.address)
        writer.write(b"ping")
        assert await asyncio.wait_for(reader.readexactly(4), 2) == b"ping"
        proxy.set(Mode.BLACKHOLE_DOWN)  # the request arrives, the answer does not
        writer.write(b"lost")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.readexactly(4), 0.3)
        assert proxy.bytes_up == 8
        proxy.set(Mode.DELAY, delay_s=0.2)
        writer.write(b"slow")
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await asyncio.wait_for(reader.readexactly(4), 2) == b"slow"
        assert loop.time() - started >= 0.2
        proxy.set(Mode.RESET)
        assert await asyncio.wait_for(reader.read(), 2) == b""  # closed
        writer.close()
        proxy.set(Mode.CUT_AFTER, cut_after_bytes=3)
        sent_before = proxy.bytes_up
        reader, writer = await asyncio.open_connection(*proxy.address)
        writer.write(b"abcdef")
        assert await asyncio.wait_for(reader.read(), 2) == b""  # torn after 3 bytes, then closed
        assert proxy.bytes_up - sent_before == 3
        writer.close()


# ---------------------------------------------------------------------------------- logs
def _log_history(
    acks: list[tuple[str, bytes, tuple[int, int]]],
    *,
    versions: list[list[tuple[int, bool, int | None]]] | None = None,
    read: list[tuple[tuple[int, int], bytes]] | None = None,
) -> LogHistory:
    """Writers' acks; the list's versions (default: ledger 1 of writer a, CLOSED at the last ack
    on it); one read (default: the acks in position order)."""
    history = LogHistory()
    for writer, value, position in acks:
        history.ok(history.invoke(writer, value), position)
    history.leader("a", 1)
    last_on_1 = max((entry_id for _, _, (ledger_id, entry_id) in acks if ledger_id == 1), default=-1)
    for view in versions or [[(1, True, None)], [(1, False, last_on_1)]]:
        history.list_seen(len(history.versions) + 1, view)
    for ledger_id, _, last in history.versions[-1][1]:
        history.ledger_end(ledger_id, last)
    history.read_back(sorted((p, v) for _, v, p in acks) if read is None else read)
    history.writable_after_heal = True
    return history


def test_a_consistent_log_history_passes() -> None:
    history = _log_history([("a", b"a0", (1, 0)), ("a", b"a1", (1, 1))])
    history.failed(history.invoke("a", b"a2"), LogFenced("l", "x", outcome_unknown=True))  # info
    history.tailed([((1, 0), b"a0")])
    assert history.check() == []
    figures = history.figures()
    assert (figures["ok"], figures["info"], figures["violations"], figures["takeovers"]) == (2, 1, 0, 1)


def test_a_roll_may_list_two_open_ledgers_of_one_writer() -> None:
    acks = [("a", b"a0", (1, 0)), ("a", b"a1", (2, 0))]
    versions = [[(1, True, None)], [(1, True, None), (2, True, None)], [(1, False, 0), (2, False, 0)]]
    history = _log_history(acks, versions=versions)
    history.owned("a", 2)
    assert history.check() == []
    assert history.figures()["two_open"] == 1


@pytest.mark.parametrize(
    ("acks", "versions", "read", "complaint"),
    [
        # a takeover by b that left a's ledger OPEN: two leaders' ledgers open at once
        (
            [("a", b"a0", (1, 0)), ("b", b"b0", (2, 0))],
            [[(1, True, None)], [(1, True, None), (2, True, None)], [(1, False, 0), (2, False, 0)]],
            None,
            "2 OPEN ledgers",
        ),
        # an ack on a ledger the list never held
        ([("a", b"a0", (1, 0)), ("a", b"a1", (7, 0))], None, [((1, 0), b"a0")], "outside the list"),
        # an ack above the end the list marks
        (
            [("a", b"a0", (1, 0)), ("a", b"a1", (1, 1))],
            [[(1, False, 0)]],
            [((1, 0), b"a0")],
            "above the ledger",
        ),
        # an acked append the reader does not find
        ([("a", b"a0", (1, 0)), ("a", b"a1", (1, 1))], None, [((1, 0), b"a0"), ((1, 1), b"zz")], "LOST"),
        # a phantom read, and a value read twice
        ([("a", b"a0", (1, 0))], [[(1, False, 1)]], [((1, 0), b"a0"), ((1, 1), b"a0")], "read twice"),
        ([("a", b"a0", (1, 0))], [[(1, False, 1)]], [((1, 0), b"a0"), ((1, 1), b"x")], "phantom"),
        # a gap in a ledger the list marks CLOSED at 1
        ([("a", b"a0", (1, 0))], [[(1, False, 1)]], [((1, 0), b"a0")], "read as entries"),
        # one writer's acks out of invoke order
        ([("a", b"a0", (1, 1)), ("a", b"a1", (1, 0))], None, None, "not in invoke order"),
    ],
)
def test_each_log_violation_is_reported(
    acks: list[tuple[str, bytes, tuple[int, int]]],
    versions: list[list[tuple[int, bool, int | None]]] | None,
    read: list[tuple[tuple[int, int], bytes]] | None,
    complaint: str,
) -> None:
    history = _log_history(acks, versions=versions, read=read)
    history.owned("b", 2)
    problems = history.check()
    assert any(complaint in problem for problem in problems), problems
    assert history.figures()["violations"] == len(problems)


def test_log_readers_tails_marks_and_liveness_are_checked() -> None:
    history = _log_history([("a", b"a0", (1, 0)), ("a", b"a1", (1, 1))])
    history.read_back([((1, 0), b"a0")])  # a second reader that disagrees
    history.tailed([((1, 1), b"a1"), ((1, 0), b"a0")])  # went back
    history.tailed([((1, 0), b"nope")])  # not what the final read has
    history.ledger_end(1, 5)  # the ledger's own metadata says otherwise than the list's mark
    history.list_seen(9, [(1, False, 1), (2, True, None)])  # and one is still OPEN at the end
    history.writable_after_heal = False
    problems = "\n".join(history.check())
    for complaint in (
        "reader 2 disagrees",
        "went back",
        "the final read has",
        "its metadata at 5",
        "still OPEN at the end",
        "not writable again",
    ):
        assert complaint in problems, problems
