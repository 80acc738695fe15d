"""A closed ``Table`` refuses every call: after ``close()`` a write, a read, history or
maintenance raises ``InvalidUsage`` naming the table and that it is closed, and commits
nothing (no version, no writer registered).  A closed table used to open a new writer
and commit, so ``with client.table(name) as t: ...`` did not end its writes."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from persist import AppTransaction, InvalidUsage, MemoryBlob, PersistClient, Table
from stash import Stash

SCHEMA = pa.schema([pa.field("k", pa.int64(), False), ("v", pa.string())])
ROW = pa.table({"k": [7], "v": ["x"]}, schema=SCHEMA)

CALLS: dict[str, Callable[[Table], Any]] = {
    "append": lambda t: t.append(ROW),
    "append app": lambda t: t.append(ROW, app_transaction=AppTransaction("a", 1)),
    "append empty": lambda t: t.append(SCHEMA.empty_table()),
    "upsert": lambda t: t.upsert(ROW),
    "delete": lambda t: t.delete(pc.field("k") == 1),
    "update": lambda t: t.update(pc.field("k") == 1, {"v": "z"}),
    "merge": lambda t: t.merge(ROW).when_not_matched_insert_all().execute(),
    "restore": lambda t: t.restore(0),
    "optimize": lambda t: t.optimize(),
    "set_retention": lambda t: t.set_retention(dt.timedelta(days=1)),
    "vacuum": lambda t: t.vacuum(),
    "to_arrow": lambda t: t.to_arrow(),
    "to_pandas": lambda t: t.to_pandas(),
    "to_reader": lambda t: t.to_reader(),
    "to_duckdb": lambda t: t.to_duckdb(),
    "history": lambda t: t.history(),
    "details": lambda t: t.details(),
    "transaction_version": lambda t: t.transaction_version("a"),
}


@pytest.fixture
def client() -> Iterator[PersistClient]:
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off")
    t = c.create_table("t", SCHEMA, key=["k"])
    t.append(pa.table({"k": [1, 2], "v": ["a", "b"]}, schema=SCHEMA))
    t.close()
    yield c
    c.close()
    s.close()


@pytest.mark.parametrize("call", list(CALLS))
def test_a_closed_table_refuses_every_call(call: str, client: PersistClient) -> None:
    t = client.table("t")
    t.append(pa.table({"k": [3], "v": ["c"]}, schema=SCHEMA))
    t.close()
    t.close()  # idempotent
    before = client.inspect("t")
    with pytest.raises(InvalidUsage, match=r"table 't' is closed: .* refused"):
        CALLS[call](t)
    after = client.inspect("t")
    assert (after.seqno, after.upper) == (before.seqno, before.upper)
    assert after.writers == before.writers == {}
    assert t.name == "t" and t.key == ["k"]  # what it is stays readable
    assert client.table("t").to_arrow().num_rows == 3  # open it again


def test_a_merge_built_before_close_commits_nothing(client: PersistClient) -> None:
    t = client.table("t")
    builder = t.merge(ROW).when_not_matched_insert_all()
    t.close()
    seqno = client.inspect("t").seqno
    with pytest.raises(InvalidUsage, match="table 't' is closed: merge refused"):
        builder.execute()
    assert client.inspect("t").seqno == seqno


def test_with_block_closes(client: PersistClient) -> None:
    with client.table("t") as t:
        t.append(ROW)
    with pytest.raises(InvalidUsage, match="closed"):
        t.append(ROW)
