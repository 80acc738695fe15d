"""A change that changes nothing writes nothing: a ``Table.append`` of no rows (and an
``upsert``, ``delete``, ``update``, ``merge`` or ``restore`` that changes no row)
commits no version, so the table's seqno, upper and history stay as they were, and it
returns ``upper - 1`` (a read as of it shows the table as the call left it), as
:class:`persist.RowChanges` does.  An empty append used to commit a version (a new
seqno, the upper moved by one, an ``append`` history entry)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from persist import MemoryBlob, PersistClient, RowChanges, Table
from stash import Stash

SCHEMA = pa.schema([pa.field("k", pa.int64(), False), ("v", pa.string())])

NOOPS: dict[str, Callable[[Table], Any]] = {
    "append arrow": lambda t: t.append(SCHEMA.empty_table()),
    "append pandas": lambda t: t.append(
        pd.DataFrame({"k": pd.Series([], dtype="int64"), "v": pd.Series([], dtype=object)})
    ),
    "append batches": lambda t: t.append(pa.RecordBatchReader.from_batches(SCHEMA, [])),
    "upsert empty": lambda t: t.upsert(SCHEMA.empty_table()),
    "upsert same": lambda t: t.upsert(pa.table({"k": [1], "v": ["a"]}, schema=SCHEMA)),
    "delete none": lambda t: t.delete(pc.field("k") == 9),
    "update none": lambda t: t.update(pc.field("k") == 9, {"v": "z"}),
    "update same": lambda t: t.update(pc.field("k") == 1, {"v": "a"}),
    "merge none": lambda t: (
        t.merge(pa.table({"k": [9], "v": ["z"]}, schema=SCHEMA)).when_matched_delete().execute()
    ),
    "restore now": lambda t: t.restore(t.details()["upper"] - 1),
}


@pytest.fixture
def table() -> Iterator[tuple[PersistClient, Table]]:
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off")
    t = c.create_table("t", SCHEMA, key=["k"])
    t.append(pa.table({"k": [1, 2], "v": ["a", "b"]}, schema=SCHEMA))
    yield c, t
    c.close()
    s.close()


@pytest.mark.parametrize("op", list(NOOPS))
def test_a_change_that_changes_nothing_writes_nothing(
    op: str, table: tuple[PersistClient, Table]
) -> None:
    c, t = table
    before = c.inspect("t")
    history = t.history().num_rows
    out = NOOPS[op](t)
    after = c.inspect("t")
    assert (after.seqno, after.upper) == (before.seqno, before.upper)
    assert t.history().num_rows == history
    if isinstance(out, int | RowChanges):  # a merge returns its metrics
        time = out.time if isinstance(out, RowChanges) else out
        assert time == before.upper.as_option() - 1
    assert t.to_arrow(as_of=before.upper.as_option() - 1).num_rows == 2


def test_an_empty_append_to_a_new_table_writes_nothing(
    table: tuple[PersistClient, Table],
) -> None:
    c, _t = table
    u = c.create_table("u", SCHEMA, key=["k"])
    seqno = c.inspect("u").seqno
    assert u.append(SCHEMA.empty_table()) == -1  # upper 0: nothing is readable yet
    assert c.inspect("u").seqno == seqno and u.to_arrow().num_rows == 0
