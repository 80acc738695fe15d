"""A ``DiffOverflow`` names the shard it was met in, from every read and write path.

The defects: ``snapshot_stream``'s ``DiffOverflow`` named no shard (``shard`` was
``None``, where ``snapshot``'s names it), so a job streaming many shards could not tell
which one overflowed; ``Txn.write``'s named no shard either, and showed the row at
``_time = -9223372036854775808``, the placeholder its untimed updates hold until the
commit (not a time the caller wrote)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from persist import DiffOverflow, FileBlob, PersistClient
from stash import Stash

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.int64())])


def test_stream_diff_overflow_names_the_shard(tmp_path: Path) -> None:
    s = Stash.open(f"sqlite:///{tmp_path / 's.db'}", fenced=False)
    c = PersistClient(s, FileBlob(tmp_path / "blob"), compaction="off", inline_max_bytes=0)
    try:
        w, r = c.open("overflowing", KS, VS)
        w.compare_and_append([(((1,), (1,)), 0, 2**62)], 0, 1)
        w.compare_and_append([(((1,), (1,)), 1, 2**62)], 1, 2)
        with pytest.raises(DiffOverflow) as e:
            list(r.snapshot_stream(1))
        assert e.value.shard is not None and "overflowing" in str(e.value)
    finally:
        c.close()
        s.close()


def test_txn_write_diff_overflow_names_the_shard_not_a_placeholder_time(tmp_path: Path) -> None:
    s = Stash.open(f"sqlite:///{tmp_path / 's.db'}", fenced=False)
    c = PersistClient(s, FileBlob(tmp_path / "blob"), compaction="off")
    try:
        c.open("txn_overflowing", KS, VS)
        updates = pa.table({"k": [1, 1], "v": [7, 7], "_diff": [2**62, 2**62]})
        txn = c.begin()
        with pytest.raises(DiffOverflow) as e:
            txn.write("txn_overflowing", updates)
        assert e.value.shard is not None and "txn_overflowing" in str(e.value)
        assert e.value.row == {"k": 1, "v": 7}
        assert "-9223372036854775808" not in str(e.value)
        # With its own times, the row's time is the caller's.
        timed = updates.append_column("t", pa.array([3, 3], pa.int64()))
        with pytest.raises(DiffOverflow) as e:
            txn.write("txn_overflowing", timed, time_column="t")
        txn.abort()
        assert e.value.row == {"k": 1, "v": 7, "_time": 3}
        assert "txn_overflowing" in str(e.value)
    finally:
        c.close()
        s.close()
