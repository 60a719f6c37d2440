"""The pure decision rules, checked exhaustively against their definitions (docs/replication.md §1, §4).

For every E <= 5, Qw <= E, Qa <= Qw: every assignment of {positive, negative, unknown, no reply}
to the replicas of a write set, and every subset of answered bookies of an ensemble.
"""

from __future__ import annotations

import itertools

import pytest

from bookkeeper_aio import LedgerRecoveryError
from bookkeeper_aio.client.quorum import DistributionSchedule
from bookkeeper_aio.client.recovery import (
    Decision,
    Reply,
    classify_read,
    decide_entry,
    fence_reply_counts,
    last_entry_of,
    recovery_start,
)
from bookkeeper_aio.protocol.codes import StatusCode

CONFIGS = [(e, qw, qa) for e in range(1, 6) for qw in range(1, e + 1) for qa in range(1, qw + 1)]
NO_REPLY = None


def _could_have_been_acked(qa: int, replies: tuple[Reply | None, ...]) -> bool:
    """Definition: some Qa-subset of the write set holds no explicit negative (every member may
    have acked the entry, and a fenced "no" member never will)."""
    return any(
        all(replies[i] is not Reply.NEGATIVE for i in subset)
        for subset in itertools.combinations(range(len(replies)), qa)
    )


@pytest.mark.parametrize(("e", "qw", "qa"), CONFIGS)
def test_decide_entry__matches_definitions_for_every_reply_assignment(e: int, qw: int, qa: int) -> None:
    for replies in itertools.product([Reply.POSITIVE, Reply.NEGATIVE, Reply.UNKNOWN, NO_REPLY], repeat=qw):
        pos = replies.count(Reply.POSITIVE)
        neg = replies.count(Reply.NEGATIVE)
        unk = replies.count(Reply.UNKNOWN)
        decision = decide_entry(qw, qa, pos, neg, unk)
        acked_possible = _could_have_been_acked(qa, replies)
        if pos:
            assert decision is Decision.EXISTS
        elif not acked_possible:
            # Safety: ABSENT exactly when no ack quorum can be free of a negative.
            assert decision is Decision.ABSENT, (qw, qa, replies)
        elif NO_REPLY in replies:
            assert decision is Decision.PENDING, (qw, qa, replies)
        else:
            assert decision is Decision.UNDECIDED, (qw, qa, replies)
        # The safety property stated the other way round: never ABSENT while an ack quorum could
        # consist of bookies that did not say no.
        if decision is Decision.ABSENT:
            assert not acked_possible
        # Quorum coverage of the negatives is the same test as the schedule's.
        schedule = DistributionSchedule(e, qw, qa)
        negatives_at = [schedule.write_set(0)[i] for i, r in enumerate(replies) if r is Reply.NEGATIVE]
        assert schedule.covers_write_set(0, negatives_at) == (not acked_possible)


@pytest.mark.parametrize(("e", "qw", "qa"), CONFIGS)
def test_quorum_coverage__every_entry_and_subset_matches_definition(e: int, qw: int, qa: int) -> None:
    schedule = DistributionSchedule(e, qw, qa)
    for entry_id in range(e):
        members = schedule.write_set(entry_id)
        for size in range(e + 1):
            for answered in itertools.combinations(range(e), size):
                got = set(answered)
                no_unanswered_ack_quorum = all(
                    any(p in got for p in subset) for subset in itertools.combinations(members, qa)
                )
                assert schedule.covers_write_set(entry_id, answered) == no_unanswered_ack_quorum


@pytest.mark.parametrize(("e", "qw", "qa"), CONFIGS)
def test_ensemble_coverage__fenced_subset_leaves_no_unfenced_ack_quorum(e: int, qw: int, qa: int) -> None:
    """Fencing is done exactly when no write set keeps Qa unfenced bookies (docs/replication.md §4),
    and then ``covers_ensemble`` needs at least E - Qa + 1 answers when Qw == E (ensemble coverage,
    docs/replication.md §1)."""
    schedule = DistributionSchedule(e, qw, qa)
    for size in range(e + 1):
        for fenced in itertools.combinations(range(e), size):
            writer_can_still_ack = any(
                sum(1 for p in ws if p not in fenced) >= qa for ws in schedule.write_sets()
            )
            assert schedule.covers_ensemble(fenced) == (not writer_can_still_ack)
            if qw == e and schedule.covers_ensemble(fenced):
                assert len(fenced) >= e - qa + 1


def test_fence_replies__only_proofs_of_the_fence_count() -> None:
    counting = {StatusCode.EOK, StatusCode.ENOENTRY, StatusCode.ENOLEDGER}
    for status in StatusCode:
        assert fence_reply_counts(status) == (status in counting), status


def test_classify_read__only_explicit_no_is_negative_and_corrupt_is_unknown() -> None:
    assert classify_read(StatusCode.EOK, body_valid=True) is Reply.POSITIVE
    assert classify_read(StatusCode.EOK, body_valid=False) is Reply.UNKNOWN  # corrupt / no body
    assert classify_read(StatusCode.ENOENTRY, body_valid=False) is Reply.NEGATIVE
    assert classify_read(StatusCode.ENOLEDGER, body_valid=False) is Reply.NEGATIVE
    for status in (
        StatusCode.EIO,
        StatusCode.EUNKNOWNLEDGERSTATE,
        StatusCode.EUA,
        StatusCode.ETOOMANYREQUESTS,
        StatusCode.EBADREQ,
        StatusCode.EFENCED,
        StatusCode.EREADONLY,
    ):
        assert classify_read(status, body_valid=False) is Reply.UNKNOWN, status


def test_recovery_start__never_before_the_last_fragment() -> None:
    assert recovery_start(-1, 0) == -1  # single fragment, nothing acked
    assert recovery_start(-1, 2000) == 1999  # BOOKKEEPER-2615: current fragment says -1
    assert recovery_start(2500, 2000) == 2500
    assert recovery_start(1500, 2000) == 1999  # a stale LAC from an earlier fragment


def test_last_entry_of__first_absent_ends_and_undecided_before_it_aborts() -> None:
    ex, ab, un, pe = Decision.EXISTS, Decision.ABSENT, Decision.UNDECIDED, Decision.PENDING
    assert last_entry_of([ab], 4) == 4
    assert last_entry_of([ex, ex, ab, ex], 4) == 6  # a gap: entries after it never count
    assert last_entry_of([ex, ab, un], 4) == 5  # undecided after the end does not matter
    assert last_entry_of([ex, pe, ab], 4) is None
    assert last_entry_of([ex, ex], 4) is None
    with pytest.raises(LedgerRecoveryError):
        last_entry_of([ex, un, ab], 4)
