"""``snapshot_many`` with no explicit time reads a closed shard (upper ``{}``: every
time definite) at a time that holds every one of its rows.

The defect: the default time was ``min(upper) - 1`` with a closed shard counted as
``I64_MAX``, so a closed shard was read at ``I64_MAX - 1``, missing an update at
``I64_MAX`` that ``ReadHandle.snapshot(I64_MAX)`` returns."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from persist import FileBlob, PersistClient
from stash import Antichain, Stash

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.int64())])


def test_snapshot_many_default_reads_every_row_of_a_closed_shard(tmp_path: Path) -> None:
    s = Stash.open(f"sqlite:///{tmp_path / 's.db'}", fenced=False)
    c = PersistClient(s, FileBlob(tmp_path / "blob"), compaction="off")
    try:
        w, r = c.open("x", KS, VS)
        w.compare_and_append([(((1,), (1,)), 0, 1), (((2,), (2,)), 2**63 - 1, 1)], 0, Antichain())
        assert sorted(r.snapshot(2**63 - 1).column("k").to_pylist()) == [1, 2]
        assert sorted(c.snapshot_many(["x"])["x"].column("k").to_pylist()) == [1, 2]
        # With an open shard listed too, both are read at its latest definite time.
        w2, _ = c.open("y", KS, VS)
        w2.compare_and_append([(((3,), (3,)), 4, 1)], 0, 6)
        both = c.snapshot_many(["x", "y"])
        assert sorted(both["x"].column("k").to_pylist()) == [1]
        assert both["y"].column("k").to_pylist() == [3]
        assert set(both["x"].column("_time").to_pylist()) == {5}
    finally:
        c.close()
        s.close()
