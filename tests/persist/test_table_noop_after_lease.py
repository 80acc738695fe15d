"""A change that changes nothing writes nothing, also after the table's writer lease
ran out: the table opens a new writer for the call, and the lapsed one is left to
lease expiry (GC), not expired by a state version of the call's own.  An empty append,
an upsert of the rows as they are, or the retry of an app transaction that landed,
called after the lease ran out, used to write a state version (the old writer's
expiry): not the rows, but a new seqno for a call documented to write nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from persist import AppTransaction, MemoryBlob, PersistClient, Table
from stash import Stash
from tests.support.clock import Clock

SCHEMA = pa.schema([pa.field("k", pa.int64(), False), ("v", pa.string())])
ROW = pa.table({"k": [1], "v": ["x"]}, schema=SCHEMA)
APP = AppTransaction("job", 1)

NOOPS: dict[str, Callable[[Table], Any]] = {
    "empty append": lambda t: t.append(SCHEMA.empty_table()),
    "upsert same": lambda t: t.upsert(ROW),
    "delete none": lambda t: t.delete(pc.field("k") == 9),
    "app retry": lambda t: t.append(ROW, app_transaction=APP),
}


@pytest.mark.parametrize("op", list(NOOPS))
def test_a_noop_after_the_lease_ran_out_writes_nothing(op: str) -> None:
    clock = Clock()
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off", clock=clock, writer_lease_seconds=60)
    t = c.create_table("t", SCHEMA, key=["k"])
    assert t.append(ROW, app_transaction=APP) == 0
    clock.advance(3600)  # the table's writer lease ran out
    before = c.inspect("t")
    NOOPS[op](t)
    after = c.inspect("t")
    assert (after.seqno, after.upper) == (before.seqno, before.upper)
    assert t.to_arrow().num_rows == 1
    t.append(pa.table({"k": [2], "v": ["y"]}, schema=SCHEMA))  # and it still writes
    assert t.to_arrow().num_rows == 2
    c.close()
    s.close()
