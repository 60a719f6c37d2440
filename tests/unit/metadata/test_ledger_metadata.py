"""LedgerMetadata: validation, the state machine, ensemble changes and the serde (pure, no I/O)."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import pathlib

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from metadata import ledger_metadata as serde
from metadata.errors import InvalidMetadata, MetadataFormatError
from metadata.ledger_metadata import LedgerMetadata, LedgerState

BOOKIES = ("b1:3181", "b2:3181", "b3:3181")


def make(**overrides: object) -> LedgerMetadata:
    md = LedgerMetadata.new(7, BOOKIES, write_quorum=2, ack_quorum=2, password_hash=b"h" * 32, ctime_ms=5)
    return md if not overrides else LedgerMetadata(**{**_fields(md), **overrides})  # type: ignore[arg-type]


def _fields(md: LedgerMetadata) -> dict[str, object]:
    return {name: getattr(md, name) for name in LedgerMetadata.__dataclass_fields__}


@pytest.mark.parametrize(
    ("e", "qw", "qa"),
    [(3, 4, 2), (3, 2, 3), (3, 3, 0), (0, 0, 0), (65, 3, 2)],
)
def test_quorum_rule_e_ge_qw_ge_qa_ge_1(e: int, qw: int, qa: int) -> None:
    bookies = tuple(f"b{i}" for i in range(e))
    with pytest.raises(InvalidMetadata, match="E >= Qw >= Qa >= 1"):
        LedgerMetadata.new(1, bookies, write_quorum=qw, ack_quorum=qa)


def test_valid_quorums_accepted() -> None:
    md = LedgerMetadata.new(1, BOOKIES, write_quorum=3, ack_quorum=1)
    assert (md.ensemble_size, md.state, md.last_entry_id) == (3, LedgerState.OPEN, None)


def test_duplicate_bookie_in_ensemble_rejected() -> None:
    with pytest.raises(InvalidMetadata, match="repeats a bookie"):
        LedgerMetadata.new(1, ("a", "b", "a"), write_quorum=2, ack_quorum=2)


def test_ensembles_must_increase_and_start_at_zero() -> None:
    with pytest.raises(InvalidMetadata, match="start at entry 0"):
        make(ensembles=((1, BOOKIES),))
    with pytest.raises(InvalidMetadata, match="increasing"):
        make(ensembles=((0, BOOKIES), (5, BOOKIES), (5, BOOKIES)))


def test_last_entry_only_when_closed() -> None:
    with pytest.raises(InvalidMetadata, match="only when CLOSED"):
        make(last_entry_id=3)
    with pytest.raises(InvalidMetadata, match="needs last_entry_id"):
        make(state=LedgerState.CLOSED)


def test_close_empty_ledger_with_minus_one() -> None:
    closed = make().closed(-1, 0)
    assert (closed.state, closed.last_entry_id, closed.length) == (LedgerState.CLOSED, -1, 0)


def test_transition_table_is_enforced() -> None:
    md = make()
    recovering = md.in_recovery()
    closed = recovering.closed(10, 1000)
    assert closed.is_closed
    with pytest.raises(InvalidMetadata, match="illegal transition CLOSED -> IN_RECOVERY"):
        closed.in_recovery()
    with pytest.raises(InvalidMetadata, match="illegal transition IN_RECOVERY -> IN_RECOVERY"):
        recovering.in_recovery()
    with pytest.raises(InvalidMetadata, match="illegal transition CLOSED -> CLOSED"):
        closed.closed(10, 1000)


def test_ensemble_change_adds_or_replaces_the_last_fragment() -> None:
    md = make().with_ensemble_change(12, ("b4:3181", "b2:3181", "b3:3181"))
    assert md.ensembles == ((0, BOOKIES), (12, ("b4:3181", "b2:3181", "b3:3181")))
    again = md.with_ensemble_change(12, ("b5:3181", "b2:3181", "b3:3181"))
    assert again.ensembles[-1] == (12, ("b5:3181", "b2:3181", "b3:3181"))
    assert len(again.ensembles) == 2
    assert again.ensemble_for(11) == BOOKIES
    assert again.ensemble_for(12)[0] == "b5:3181"
    with pytest.raises(InvalidMetadata, match="precedes"):
        md.with_ensemble_change(3, BOOKIES)
    with pytest.raises(InvalidMetadata, match="closed ledger"):
        md.closed(20, 5).with_ensemble_change(21, BOOKIES)


def test_metadata_is_immutable() -> None:
    md = make(custom_metadata={"k": b"v"})
    with pytest.raises(AttributeError):
        md.state = LedgerState.CLOSED  # type: ignore[misc]
    with pytest.raises(TypeError):
        md.custom_metadata["k"] = b"w"  # type: ignore[index]


def test_roundtrip_keeps_every_field() -> None:
    md = make(custom_metadata={"app": b"\x00\xff"}).with_ensemble_change(4, ("x", "y", "z")).closed(9, 99)
    back = serde.decode(serde.encode(md), key="/r/ledgers/7", ledger_id=7)
    assert back == md


def test_fields_a_newer_version_added_survive_a_change_made_by_this_one() -> None:
    """A newer writer adds optional fields (same format_version): this version's decode keeps them
    and its encode writes them back, so its CAS of a closed or re-ensembled ledger erases nothing."""
    newer = msgpack.unpackb(serde.encode(make()).removeprefix(serde.MAGIC))
    extra = {"tiering": {"tier": "cold", "since_ms": 12}, "checksums": [b"\x01", b"\x02"], "flag": None}
    stored = serde.MAGIC + msgpack.packb({**newer, **extra}, use_bin_type=True)
    md = serde.decode(stored, key="/r/ledgers/7", ledger_id=7)
    assert dict(md.unknown_fields) == extra
    changed = md.with_ensemble_change(4, ("x", "y", "z")).closed(9, 99)
    written = serde.encode(changed)
    assert msgpack.unpackb(written.removeprefix(serde.MAGIC)).items() >= extra.items()
    back = serde.decode(written, key="/r/ledgers/7", ledger_id=7)
    assert back == changed
    assert dict(back.unknown_fields) == extra
    assert (back.state, back.last_entry_id, back.ensembles[-1]) == (
        LedgerState.CLOSED,
        9,
        (4, ("x", "y", "z")),
    )
    assert serde.encode(make()) == serde.MAGIC + msgpack.packb(newer, use_bin_type=True)  # none: as before
    with pytest.raises(TypeError):
        md.unknown_fields["flag"] = 1  # type: ignore[index]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "bad magic"),
        (b"hello world", "bad magic"),
        (serde.MAGIC + b"\xc1", "corrupt msgpack"),
        (serde.MAGIC + msgpack.packb([1, 2]), "expected a map"),
        (serde.MAGIC + msgpack.packb({"format_version": 99}), "unsupported format_version 99"),
        (serde.MAGIC + msgpack.packb({"format_version": 1}), "field 'ledger_id' missing"),
    ],
)
def test_garbage_is_rejected_naming_key_and_ledger(data: bytes, message: str) -> None:
    with pytest.raises(MetadataFormatError, match=message) as info:
        serde.decode(data, key="/r/ledgers/0000000000000000042", ledger_id=42)
    assert "ledger 42" in str(info.value)
    assert "/r/ledgers/0000000000000000042" in str(info.value)


def test_value_naming_another_ledger_is_rejected() -> None:
    with pytest.raises(MetadataFormatError, match="names ledger 7"):
        serde.decode(serde.encode(make()), key="k", ledger_id=8)


def test_a_value_decoded_again_is_the_same_metadata_and_still_checked_against_the_ledger_id() -> None:
    data = serde.encode(make(ctime_ms=123_456))
    first = serde.decode(data, key="k", ledger_id=7)
    assert serde.decode(bytes(bytearray(data)), key="k", ledger_id=7) is first  # by value, not identity
    assert serde.decode(data, key="k") is first
    with pytest.raises(MetadataFormatError, match="names ledger 7"):
        serde.decode(data, key="k", ledger_id=8)


def test_a_value_with_unknown_fields_is_decoded_anew_each_time() -> None:
    body = msgpack.unpackb(serde.encode(make(ctime_ms=654_321))[4:])
    body["future_field"] = [1, 2]  # mutable: not shared between two readers
    data = serde.MAGIC + msgpack.packb(body)
    first = serde.decode(data, key="k", ledger_id=7)
    second = serde.decode(data, key="k", ledger_id=7)
    assert first == second
    assert first is not second
    assert first.unknown_fields["future_field"] is not second.unknown_fields["future_field"]


def test_the_decoded_values_kept_are_bounded() -> None:
    for ctime_ms in range(serde.DECODED_MAX + 10):
        serde.decode(serde.encode(make(ctime_ms=ctime_ms)), key="k", ledger_id=7)
    assert len(serde._decoded) == serde.DECODED_MAX


def _round_trip_cases() -> list[LedgerMetadata]:
    md = make(ctime_ms=777_001, custom_metadata={"app": b"x"})
    changed = md.with_ensemble_change(3, ("b0", "b1", "b9")).with_replaced_bookies(
        [serde.ReplacedBookie(3, "b2", "b9", 1_000)]
    )
    return [
        md,
        md.in_recovery(),
        changed,
        changed.closed(9, 1_234),
        md.closed(-1, 0),
        make(ctime_ms=777_002, key_salt=b"s" * 16, key_iterations=3),
        make(ctime_ms=777_003, key_salt=b"s" * 16, key_iterations=3, key_ledger_salt=b"l" * 16, key_format=4),
        make(ctime_ms=777_004, digest_type="hmac-sha256", last_entry_id=None),
    ]


@pytest.mark.parametrize("md", _round_trip_cases(), ids=lambda md: f"{md.state.name}-{md.ctime_ms}")
def test_an_encoded_value_decodes_to_the_metadata_it_was_encoded_from(md: LedgerMetadata) -> None:
    data = serde.encode(md)
    assert serde.decode(data, key="k", ledger_id=7) is md  # kept by encode: no decoding
    serde._decoded.pop(data)
    fresh = serde.decode(data, key="k", ledger_id=7)  # what decode makes of the bytes themselves
    assert fresh == md
    assert fresh is not md
    assert {name: type(getattr(fresh, name)) for name in serde._FIELD_NAMES} == {
        name: type(getattr(md, name)) for name in serde._FIELD_NAMES
    }


def test_an_encoded_value_that_would_not_decode_is_not_kept() -> None:
    for md in (make(ctime_ms=777_101.0), make(ctime_ms=777_102, format_version=serde.FORMAT_VERSION + 1)):
        data = serde.encode(md)  # validation bounds values, not types: encode takes these
        assert data not in serde._decoded
        with pytest.raises(MetadataFormatError):
            serde.decode(data, key="k", ledger_id=7)
    with_unknown = make(ctime_ms=777_103, unknown_fields={"future_field": [1, 2]})
    assert serde.encode(with_unknown) not in serde._decoded  # decoded anew each time (mutable)


def test_invariant_violation_in_stored_value_is_a_format_error() -> None:
    body = msgpack.unpackb(serde.encode(make())[4:])
    body["write_quorum"] = 9
    with pytest.raises(MetadataFormatError, match="E >= Qw"):
        serde.decode(serde.MAGIC + msgpack.packb(body), key="k", ledger_id=7)


@pytest.mark.parametrize("field", sorted(set(serde._FIELD_TYPES) - {"format_version"}))
def test_a_missing_required_field_is_a_format_error_naming_it(field: str) -> None:
    # last_entry_id may be nil (an open ledger) but must be there: a missing one is no KeyError
    body = msgpack.unpackb(serde.encode(make())[4:])
    del body[field]
    with pytest.raises(MetadataFormatError, match=f"field '{field}' missing"):
        serde.decode(serde.MAGIC + msgpack.packb(body), key="k", ledger_id=7)


@given(st.binary(max_size=300))
def test_decoding_random_bytes_raises_only_format_errors(data: bytes) -> None:
    for candidate in (data, serde.MAGIC + data):
        with contextlib.suppress(MetadataFormatError):
            serde.decode(candidate, key="k", ledger_id=1)


@given(
    ensemble_size=st.integers(1, 8),
    data=st.data(),
    custom=st.dictionaries(st.text(max_size=10), st.binary(max_size=20), max_size=4),
)
def test_roundtrip_property(ensemble_size: int, data: st.DataObject, custom: dict[str, bytes]) -> None:
    qw = data.draw(st.integers(1, ensemble_size))
    qa = data.draw(st.integers(1, qw))
    bookies = tuple(f"10.0.0.{i}:3181" for i in range(ensemble_size))
    md = LedgerMetadata.new(data.draw(st.integers(0, 2**63 - 1)), bookies, write_quorum=qw, ack_quorum=qa)
    md = md.with_custom_metadata(custom)
    assert serde.decode(serde.encode(md), key="k", ledger_id=md.ledger_id) == md


def test_model_and_serde_import_no_io_modules() -> None:
    source = pathlib.Path(serde.__file__).read_text()
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
    }
    assert not imported & {"asyncio", "socket", "aetcd", "grpc", "bookkeeper_aio", "bookie"}


def test_may_record_replaced_leaves_out_no_ledger_that_records_the_bookie_replaced() -> None:
    plain = LedgerMetadata.new(7, ["b-1", "b-2"], write_quorum=2, ack_quorum=2)
    assert not serde.may_record_replaced(serde.encode(plain), "b-1")  # no history at all
    changed = plain.with_ensemble_change(5, ["b-3", "b-2"])
    for name in ("b-1", "bøokie-ü"):  # any UTF-8 id
        md = changed.with_replaced_bookies([serde.ReplacedBookie(5, name, "b-3", 1)])
        data = serde.encode(md)
        assert serde.may_record_replaced(data, name)
        assert any(record.bookie == name for record in serde.decode(data, key="k").replaced_bookies)
        assert not serde.may_record_replaced(data, "b-9")  # named nowhere


def test_may_not_hold_leaves_out_only_ledgers_that_list_the_bookie() -> None:
    """The filter of a bookie's scan for copies it may not need (bookie GC): True for every ledger
    that lists the bookie in no ensemble or records it replaced; False only for one that names it
    and has no history (so it lists it)."""
    for name in ("b-1", "bøokie-ü", "x" * 40):  # fixstr and str8 headers, any UTF-8 id
        held = LedgerMetadata.new(7, [name, "b-2"], write_quorum=2, ack_quorum=2)
        assert not serde.may_not_hold(serde.encode(held), name)
        elsewhere = LedgerMetadata.new(8, [f"{name}0", "b-2"], write_quorum=2, ack_quorum=2)
        assert serde.may_not_hold(serde.encode(elsewhere), name)  # its id inside another's
        moved = held.with_ensemble_change(0, ["b-3", "b-2"]).with_replaced_bookies(
            [serde.ReplacedBookie(0, name, "b-3", 1)]
        )
        assert serde.may_not_hold(serde.encode(moved), name)  # a history: decoded to judge


def test_the_with_helpers_build_what_dataclasses_replace_builds() -> None:
    md = make(custom_metadata={"a": b"1"})
    record = serde.ReplacedBookie(0, "b1:3181", "b4:3181", 9)
    changed = md.with_ensemble_change(5, ["b1:3181", "b4:3181", "b3:3181"])  # a list: normalized
    assert changed == dataclasses.replace(
        md, ensembles=(*md.ensembles, (5, ("b1:3181", "b4:3181", "b3:3181")))
    )
    assert changed.ensembles[-1][1] == ("b1:3181", "b4:3181", "b3:3181")
    assert md.closed(4, 40) == dataclasses.replace(md, state=LedgerState.CLOSED, last_entry_id=4, length=40)
    assert md.with_replaced_bookies([record]).replaced_bookies == (record,)
    merged = md.with_custom_metadata({"b": b"2"})
    assert dict(merged.custom_metadata) == {"a": b"1", "b": b"2"}
    assert dict(md.custom_metadata) == {"a": b"1"}  # the original is untouched
    with pytest.raises(InvalidMetadata, match="repeats a bookie"):
        md.with_ensemble_change(5, ["b1:3181", "b1:3181", "b3:3181"])  # validated whole
