from __future__ import annotations

from bookkeeper_aio import errors
from bookkeeper_aio.protocol.codes import StatusCode


def test_every_error_status_maps_to_one_class() -> None:
    seen = set()
    for status in StatusCode:
        if status is StatusCode.EOK:
            continue
        exc = errors.error_for_status(status)
        assert isinstance(exc, errors.BKError)
        assert exc.code == status
        seen.add(type(exc))
    assert len(seen) == len(StatusCode) - 1


def test_unknown_status_is_bad_request_not_crash() -> None:
    assert isinstance(errors.error_for_status(999, "x"), errors.BadRequest)


def test_fenced_is_not_retriable_and_io_is() -> None:
    assert not errors.LedgerFenced.retriable
    assert errors.BookieIOError.retriable


def test_outcome_unknown_defaults_false_and_copies_keep_class_message_and_fields() -> None:
    from metadata.errors import CasResultUnknown

    assert errors.LedgerClosed("x").outcome_unknown is False
    original = CasResultUnknown("/k", "lost")  # its own __init__ signature
    original.__cause__ = OSError("cause")
    sent = errors.with_outcome_unknown(original, True)
    assert type(sent) is CasResultUnknown
    assert (str(sent), sent.key, sent.outcome_unknown) == (str(original), "/k", True)
    assert sent.__cause__ is original.__cause__
    assert original.outcome_unknown is False  # the original is left alone
    assert errors.with_outcome_unknown(sent, False).outcome_unknown is False
