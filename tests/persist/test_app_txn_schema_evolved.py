"""An app transaction's retry after the table's schema evolved (another process added a
nullable column, widened a type) between the attempt that landed and the retry: the
retry passes the same rows in the table's newest columns, and the append is the one
recorded, so it returns the time recorded and writes nothing.  It used to be refused
as "committed with other rows" (the record's fingerprint is of the rows as conformed
to the schema of the attempt, the retry's of the newest schema), so a job retrying a
batch whose acknowledgement was lost could neither retry nor tell that it had landed.
Rows that differ in a column added since, or a write whose columns were dropped since,
are still refused (nothing can tell them the same)."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pytest

from persist import AppTransaction, InvalidUsage, MemoryBlob, PersistClient
from stash import Stash

KEY = pa.schema([("k", pa.int64())])
V0 = pa.schema([("a", pa.int32()), ("b", pa.string())])
SCHEMA = pa.schema([*KEY, *V0])
ROWS = pa.table({"k": [2, 1], "a": [20, 10], "b": ["y", "x"]}, schema=SCHEMA)
APP = AppTransaction("job", 5)


@pytest.fixture
def client() -> Iterator[PersistClient]:
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off")
    yield c
    c.close()
    s.close()


def _landed_then_evolved(client: PersistClient, new: pa.Schema, drop: list[str]) -> int:
    t = client.create_table("t", SCHEMA, key=["k"])
    at = t.append(ROWS, app_transaction=APP)
    client.open("t", KEY, new, drop=drop)  # another writer evolves the schema
    return at


@pytest.mark.parametrize(
    ("new", "retry"),
    [
        (
            pa.schema([*V0, ("c", pa.float64())]),
            ROWS.append_column("c", pa.array([None, None], pa.float64())),
        ),
        (
            pa.schema([("a", pa.int64()), ("b", pa.string())]),
            pa.table({"k": [1, 2], "a": [10, 20], "b": ["x", "y"]}),
        ),
        (
            pa.schema([("a", pa.int64()), ("b", pa.large_string()), ("c", pa.bool_())]),
            pa.table({"k": [1, 2], "a": [10, 20], "b": ["x", "y"], "c": [None, None]}),
        ),
    ],
    ids=["column added", "int widened", "both"],
)
def test_a_retry_after_the_schema_evolved_finds_the_write(
    client: PersistClient, new: pa.Schema, retry: pa.Table
) -> None:
    at = _landed_then_evolved(client, new, [])
    t = client.table("t")
    seqno = client.inspect("t").seqno
    assert t.append(retry, app_transaction=APP) == at
    assert client.inspect("t").seqno == seqno  # nothing written again
    assert t.to_arrow().num_rows == 2
    assert t.transaction_version("job") == 5


def test_a_retry_with_values_in_a_column_added_since_is_other_rows(
    client: PersistClient,
) -> None:
    _landed_then_evolved(client, pa.schema([*V0, ("c", pa.int64())]), [])
    t = client.table("t")
    seqno = client.inspect("t").seqno
    with pytest.raises(InvalidUsage, match="other rows"):
        t.append(ROWS.append_column("c", pa.array([None, 7])), app_transaction=APP)
    assert client.inspect("t").seqno == seqno


def test_a_retry_of_a_write_whose_column_was_dropped_is_refused(
    client: PersistClient,
) -> None:
    _landed_then_evolved(client, pa.schema([V0.field("a")]), ["b"])
    t = client.table("t")
    seqno = client.inspect("t").seqno
    with pytest.raises(InvalidUsage, match="other rows"):
        t.append(ROWS.drop_columns(["b"]), app_transaction=APP)
    assert client.inspect("t").seqno == seqno


@pytest.mark.parametrize("app_id", [None, 5, b"job", "", "\x00", "x" * 256, "a\nb"])
def test_transaction_version_refuses_what_is_no_app_id(
    client: PersistClient, app_id: object
) -> None:
    """``transaction_version`` takes an app id by the rule of ``AppTransaction``: a bad
    one is the caller's error (InvalidUsage naming the rule), not a failure of the stash
    (a ConsensusError, as it was for a non-str or a NUL) nor ``None`` (as for "" or
    300 characters: an id no write can have)."""
    t = client.create_table("t", SCHEMA, key=["k"])
    t.append(ROWS, app_transaction=APP)
    with pytest.raises(InvalidUsage, match="app_id must be a printable str of 1 to 255"):
        t.transaction_version(app_id)  # type: ignore[arg-type]
