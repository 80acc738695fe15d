"""A MERGE built on a ``Table`` (``table.merge(...)``) and executed after an idle spell
longer than the writer's lease commits: the writer is the table's at ``execute()``, not
the one it had when the builder was made.  Before, ``execute()`` raised
``LeaseExpired`` (nothing committed) unless another client had meanwhile dropped the
expired writer; a one-shot source (a ``RecordBatchReader``) is read once either way."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

from persist import MemoryBlob, PersistClient
from stash import Stash
from tests.support.clock import Clock

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.string())])


@pytest.mark.parametrize("reader", [False, True], ids=["table", "reader"])
def test_a_merge_executed_after_the_lease_ran_out_commits(reader: bool) -> None:
    clock = Clock()
    s = Stash.open("memory://", fenced=False)
    kw: dict[str, Any] = {"clock": clock, "writer_lease_seconds": 60, "compaction": "off"}
    c = PersistClient(s, MemoryBlob(), **kw)
    t = c.create_table("t", SCHEMA, key=["k"])
    t.append(pa.table({"k": [1], "v": ["a"]}))
    rows = pa.table({"k": [1, 2], "v": ["z", "y"]})
    source: Any = (
        pa.RecordBatchReader.from_batches(rows.schema, rows.to_batches()) if reader else rows
    )
    builder = t.merge(source).when_matched_update_all().when_not_matched_insert_all()
    clock.advance(3600)
    r = builder.execute()
    assert (r.num_target_rows_updated, r.num_target_rows_inserted) == (1, 1)
    assert t.to_arrow().sort_by("k").to_pylist() == [{"k": 1, "v": "z"}, {"k": 2, "v": "y"}]
    c.close()
    s.close()
