"""A ``Table`` outlives its writer's lease: after an idle spell longer than the lease
(``writer_lease_seconds``; a service idle overnight, a laptop asleep) its next write
opens a new writer and commits, whether or not another client dropped the expired
writer from the state meanwhile.  Every write through the table used to raise
``LeaseExpired`` for ever, since the table reused the writer whose lease had run out.
A writer expired while its lease still ran (another process's expiry) fails that one
write, committing nothing, and the next write of the table works."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from persist import LeaseExpired, MemoryBlob, PersistClient, Table
from stash import Stash
from tests.support.clock import Clock

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.string())])

WRITES: dict[str, Callable[[Table], Any]] = {
    "append": lambda t: t.append(pa.table({"k": [2], "v": ["b"]})),
    "upsert": lambda t: t.upsert(pa.table({"k": [1], "v": ["c"]})),
    "update": lambda t: t.update(pc.field("k") == 1, {"v": "d"}),
    "delete": lambda t: t.delete(pc.field("k") == 1),
    "merge": lambda t: (
        t.merge(pa.table({"k": [1], "v": ["e"]})).when_matched_update_all().execute()
    ),
}


def _world() -> tuple[Clock, PersistClient, PersistClient, Table]:
    clock = Clock()
    s, blob = Stash.open("memory://", fenced=False), MemoryBlob()
    kw: dict[str, Any] = {"clock": clock, "writer_lease_seconds": 60, "compaction": "off"}
    c = PersistClient(s, blob, **kw)
    other = PersistClient(s, blob, **kw)
    t = c.create_table("t", SCHEMA, key=["k"])
    t.append(pa.table({"k": [1], "v": ["a"]}))
    return clock, c, other, t


@pytest.mark.parametrize("dropped", [False, True], ids=["stale", "dropped"])
@pytest.mark.parametrize("op", list(WRITES))
def test_a_write_after_the_lease_ran_out_commits(op: str, dropped: bool) -> None:
    clock, c, other, t = _world()
    clock.advance(3600)
    if dropped:  # another client's transition drops the expired writer from the state
        other.table("t").append(pa.table({"k": [9], "v": ["z"]}))
    before = t.details()["upper"]
    WRITES[op](t)
    assert t.details()["upper"] == before + 1
    WRITES["append"](t)  # and the next one too
    c.close()
    other.close()


def test_a_writer_expired_within_its_lease_fails_one_write_only() -> None:
    _clock, c, other, t = _world()
    w = t._write_handle()
    w.expire()  # as another process's GC would
    w._expired = False  # ... which this process does not see
    before = t.details()["upper"]
    with pytest.raises(LeaseExpired):
        WRITES["append"](t)
    assert t.details()["upper"] == before
    WRITES["append"](t)
    assert t.details()["upper"] == before + 1
    c.close()
    other.close()
