"""The dataclasses Spark jobs carry print no ledger password: Spark logs and tracebacks show their
repr (a task's arguments, a failed job's plan)."""

from __future__ import annotations

import pickle

from bookkeeper_aio.spark.options import Source, parse_source
from bookkeeper_aio.spark.reader import ReadSpec
from bookkeeper_aio.spark.writer import WriteSpec

PASSWORD = b"S3CRET-ledger-password"


def test_source_read_and_write_specs_keep_the_password_out_of_their_repr() -> None:
    specs = [
        Source("etcd://127.0.0.1:2379/bk", "events", None, PASSWORD),
        ReadSpec("etcd://127.0.0.1:2379/bk", "events", PASSWORD),
        WriteSpec("etcd://127.0.0.1:2379/bk", "events", PASSWORD, "value", 3, 2, 2, "job-1"),
    ]
    for spec in specs:
        shown = repr(spec) + str(spec)
        assert "password" not in shown, shown
        assert PASSWORD.decode() not in shown
        assert "events" in shown  # the rest is still shown
        copy = pickle.loads(pickle.dumps(spec))  # what goes to the executors keeps it
        assert copy == spec
        assert copy.password == PASSWORD


def test_a_parsed_source_too() -> None:
    source = parse_source(
        {"metadata": "etcd://h:1/r", "path": "l", "password": PASSWORD.decode()}, allow_ledgers=True
    )
    assert source.password == PASSWORD
    assert PASSWORD.decode() not in repr(source)
