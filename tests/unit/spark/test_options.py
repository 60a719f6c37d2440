"""The data source's options: every bad value is a SparkOptionError naming the option."""

from __future__ import annotations

import pytest

from bookkeeper_aio import BKInterfaceError, LogPosition
from bookkeeper_aio.spark import options as opt
from bookkeeper_aio.spark.options import SparkOptionError
from bookkeeper_aio.spark.reader import check_listed

URL = "etcd://127.0.0.1:2379/bookkeeper/x"


def _source(allow_ledgers: bool = True, **options: str) -> opt.Source:
    return opt.parse_source({k.lower(): v for k, v in options.items()}, allow_ledgers=allow_ledgers)


def test_a_log_or_ledgers() -> None:
    source = _source(metadata=URL, path="orders", password="pw")
    assert (source.log, source.ledgers, source.password) == ("orders", None, b"pw")
    source = _source(metadata=URL, ledgers=" 13, 12")
    assert (source.log, source.ledgers, source.password) == (None, (12, 13), b"")


@pytest.mark.parametrize(
    ("options", "option", "match"),
    [
        ({"path": "orders"}, "metadata", "required"),
        ({"metadata": "http://x", "path": "orders"}, "metadata", "etcd://"),
        ({"metadata": URL}, "path", "no log named"),
        ({"metadata": URL, "path": "orders", "ledgers": "12"}, "ledgers", "not both"),
        ({"metadata": URL, "ledgers": "12,x"}, "ledgers", "comma-separated"),
        ({"metadata": URL, "ledgers": "12,-1"}, "ledgers", "comma-separated"),
        ({"metadata": URL, "ledgers": "\u00b2"}, "ledgers", "comma-separated"),  # isdigit(), not int()
        ({"metadata": URL, "ledgers": "\u0663"}, "ledgers", "comma-separated"),  # an Arabic-Indic 3
        ({"metadata": URL, "ledgers": str(2**63)}, "ledgers", "comma-separated"),
        ({"metadata": URL, "ledgers": "12,12"}, "ledgers", "repeat"),
        ({"metadata": URL, "ledgers": ""}, "ledgers", "comma-separated"),
    ],
)
def test_bad_sources_name_the_option(options: dict[str, str], option: str, match: str) -> None:
    with pytest.raises(SparkOptionError, match=match) as caught:
        opt.parse_source(options, allow_ledgers=True)
    assert caught.value.option == option
    assert str(caught.value).startswith(f"option {option!r}")
    assert isinstance(caught.value, BKInterfaceError)


def test_ledgers_only_for_batch_reads() -> None:
    with pytest.raises(SparkOptionError, match="only a batch read") as caught:
        _source(allow_ledgers=False, metadata=URL, ledgers="12")
    assert caught.value.option == "ledgers"


def test_unknown_and_unused_options_are_refused() -> None:
    opt.check_known({"metadata": URL, "maxentriesperpartition": "5"}, opt.READ_OPTIONS, "batch read")
    with pytest.raises(SparkOptionError, match="unknown option") as caught:
        opt.check_known({"maxentriesperpartiton": "5"}, opt.READ_OPTIONS, "batch read")
    assert caught.value.option == "maxentriesperpartiton"
    with pytest.raises(SparkOptionError, match="not used by a batch read") as caught:
        opt.check_known({"payloadcolumn": "value"}, opt.READ_OPTIONS, "batch read")
    assert caught.value.option == "payloadColumn"


def test_positions() -> None:
    parse = opt.parse_position
    assert parse({}, "startingPosition", "earliest", ("earliest",)) == "earliest"
    both = ("earliest", "latest")
    assert parse({"startingposition": " LATEST "}, "startingPosition", "earliest", both) == "latest"
    text = '{"ledger_id": 12, "entry_id": 3}'
    assert parse({"startingposition": text}, "startingPosition", "earliest", ()) == LogPosition(12, 3)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("latest", "'latest' is not accepted here"),
        ("12:3", "expected"),
        ('{"ledger_id": 12}', "expected"),
        ('{"ledger_id": 12, "entry_id": 3, "x": 1}', "expected"),
        ('{"ledger_id": -1, "entry_id": 3}', "ledger_id must be an integer >= 0"),
        ('{"ledger_id": 1, "entry_id": 2.5}', "entry_id must be an integer >= 0"),
        ('{"ledger_id": true, "entry_id": 2}', "ledger_id must be an integer >= 0"),
        ("[12, 3]", "expected"),
    ],
)
def test_bad_positions_name_the_option(text: str, match: str) -> None:
    with pytest.raises(SparkOptionError, match=match) as caught:
        opt.parse_position({"startingposition": text}, "startingPosition", "earliest", ("earliest",))
    assert caught.value.option == "startingPosition"


@pytest.mark.parametrize("text", ["0", "-3", "x", "1.5", ""])
def test_bad_counts_name_the_option(text: str) -> None:
    with pytest.raises(SparkOptionError, match="an integer >= 1") as caught:
        opt.parse_positive_int({"maxentriesperpartition": text}, "maxEntriesPerPartition", 10)
    assert caught.value.option == "maxEntriesPerPartition"


def test_counts() -> None:
    assert opt.parse_positive_int({}, "maxEntriesPerPartition", 10) == 10
    assert opt.parse_positive_int({"maxentriesperpartition": " 7"}, "maxEntriesPerPartition", 10) == 7


def test_a_position_outside_what_is_read_names_its_option() -> None:
    check_listed(opt.STARTING_POSITION, LogPosition(7, 3), "l", [5, 7], 5)  # listed: no error
    cases = [
        (None, 0, "option 'endingPosition': ledger 9 is not among the ledgers read ([5, 7])"),
        ("l", 5, "option 'endingPosition': ledger 9 is not in log 'l' (its ledgers: [5, 7])"),
        ("l", 10, "option 'endingPosition': ledger 9 of log 'l' was truncated (the log starts at ledger 10)"),
    ]
    for log, truncated_before, message in cases:
        with pytest.raises(opt.SparkOptionError) as raised:
            check_listed(opt.ENDING_POSITION, LogPosition(9, 0), log, [5, 7], truncated_before)
        assert str(raised.value).startswith(message)
        assert raised.value.option == opt.ENDING_POSITION
