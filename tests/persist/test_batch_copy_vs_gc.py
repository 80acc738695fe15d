"""A copy of an appended batch racing a GC never commits pointing at deleted parts.

The copy's parts were retired by a compaction; a GC (run here right after the append's
existence check, as a concurrent GC process would) deletes and forgets them, a new
version the append's compare-and-set retries on.  The append decides on that version:
its parts are listed again once the retired collection moved, and it is refused
(``PartsMissing``) instead of committing a state every later snapshot fails on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist import FileBlob, InvalidUsage, PersistClient, PersistError, fsck
from persist.gc import collect_garbage
from persist.txn import RAW_TIME
from stash import Antichain, Stash

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string())])


def test_copy_append_racing_gc_never_commits_deleted_parts(tmp_path: Path) -> None:
    s = Stash.open(f"sqlite:///{tmp_path / 's.db'}", fenced=False)
    c = PersistClient(s, FileBlob(tmp_path / "blob"), compaction="off", inline_max_bytes=0)
    try:
        w = c.open_writer("x", KS, VS)
        data = w.batch([(((1,), ("a",)), 0, 1)], 0, 1).into_transmittable()
        w.compare_and_append_batch([w.batch_from_transmittable(data)], 0, 1)
        for t in range(1, 8):
            w.compare_and_append([(((2,), ("b",)), t, 1)], t, t + 1)
        copy = w.batch_from_transmittable(data)
        (key,) = copy.blob_keys()
        c.compactor.compact_once("x")
        assert key not in c.inspect("x").referenced_blob_keys()  # retired
        copy.rewrite_ts(Antichain.from_elem(8), Antichain.from_elem(9))

        check = w._check_appendable

        def racing(*a: Any, **k: Any) -> Any:
            out = check(*a, **k)
            collect_garbage(c, "x", grace_seconds=0)  # a concurrent GC process
            return out

        w._check_appendable = racing  # type: ignore[method-assign]
        try:
            w.compare_and_append_batch([copy], 8, 9)
        except (InvalidUsage, PersistError):
            pass  # refused (BatchAppended or PartsMissing): fine
        assert fsck(c, "x").ok  # never a state referencing a deleted part
    finally:
        c.close()
        s.close()


def test_txn_copy_after_gc_deleted_its_parts_commits_nothing(tmp_path: Path) -> None:
    s = Stash.open(f"sqlite:///{tmp_path / 's.db'}", fenced=False)
    c = PersistClient(s, FileBlob(tmp_path / "blob"), compaction="off", inline_max_bytes=0)
    try:
        w, r = c.open("x", KS, VS)
        raw = w.batch(
            pa.table({"k": [1], "v": ["a"], "_time": [RAW_TIME], "_diff": [1]}),
            RAW_TIME,
            RAW_TIME + 1,
        )
        data = raw.into_transmittable()
        t = c.begin()
        t.write_batches("x", [w.batch_from_transmittable(data)])
        ts = t.commit()
        for u in range(ts + 1, ts + 8):
            w.compare_and_append([(((2,), ("b",)), u, 1)], u, u + 1)
        c.compactor.compact_once("x")
        collect_garbage(c, "x", grace_seconds=0)  # deletes and forgets the retired part
        copy = w.batch_from_transmittable(data)
        (key,) = copy.blob_keys()
        assert key not in c.inspect("x").referenced_blob_keys()
        t2 = c.begin()
        t2.write_batches("x", [copy])
        with pytest.raises((InvalidUsage, PersistError)):  # PartsMissing
            t2.commit()
        assert fsck(c, "x").ok
        up = c.inspect("x").upper.as_option()
        assert up is not None
        assert sum(r.snapshot(up - 1).column("_diff").to_pylist()) == 8
    finally:
        c.close()
        s.close()
