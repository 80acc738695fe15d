"""A filtered read raises where the unfiltered snapshot's filter raises, even when
statistics would skip the part holding the row it fails on.

The defect: ``ReadHandle.snapshot(as_of, filter=f)`` promises to be exactly
``snapshot(as_of).filter(f)``, or to raise ``InvalidUsage`` where that raises.  A filter
that fails on some row (a checked cast overflowing) raised on the snapshot, but
statistics pruned the part holding that row (``i < 10`` excludes it), so the filtered
read returned rows instead of raising.  Filters calling only functions that cannot fail
still prune."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from persist import FileBlob, InvalidUsage, PersistClient
from persist.exprs import prunable
from stash import Stash

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("i", pa.int32())])


def test_filter_that_raises_on_the_snapshot_raises_on_the_filtered_read(tmp_path: Path) -> None:
    s = Stash.open(f"sqlite:///{tmp_path / 's.db'}", fenced=False)
    c = PersistClient(s, FileBlob(tmp_path / "blob"), compaction="off", inline_max_bytes=0)
    try:
        w, r = c.open("a", KS, VS)
        for t, (k, i) in enumerate([(1, 2**31 - 1), (2, 5)]):
            w.compare_and_append(
                pa.table({"k": [k], "i": pa.array([i], pa.int32()), "_time": [t], "_diff": [1]}),
                t,
                t + 1,
            )
        f = (pc.field("i") < 10) & (pc.field("i").cast(pa.int8()) == 5)
        with pytest.raises(pa.ArrowInvalid):
            r.snapshot(1).filter(f)
        with pytest.raises(InvalidUsage):
            r.snapshot(1, filter=f)
        # Arithmetic that overflows on the pruned row, likewise.
        g = (pc.field("i") < 10) & (pc.multiply_checked(pc.field("i"), 2) > 0)
        with pytest.raises(pa.ArrowInvalid):
            r.snapshot(1).filter(g)
        with pytest.raises(InvalidUsage):
            r.snapshot(1, filter=g)
        # A filter of total calls reads the same rows (and prunes: see below).
        h = (pc.field("i") < 10) & ~pc.field("k").is_null()
        assert r.snapshot(1, filter=h).column("k").to_pylist() == [2]
    finally:
        c.close()
        s.close()


def test_only_filters_of_calls_that_cannot_fail_prune() -> None:
    schema = pa.schema([("k", pa.int64()), ("i", pa.int32()), ("f", pa.float64())])
    i, k, f = pc.field("i"), pc.field("k"), pc.field("f")
    for ok in [
        i < 10,
        (i >= 1) & (k != 2) | i.is_null(),
        pc.and_kleene(k.isin([1, 2]), ~i.is_valid()),
        pc.is_nan(f) | (f == 0.0),
        pc.or_(i > 1, k <= 3),
    ]:
        assert prunable(ok, schema), ok
    for failing in [
        (i < 10) & (i.cast(pa.int8()) == 5),
        pc.add_checked(k, 1) > 3,
        pc.divide(k, i) > 0,
        ~(pc.utf8_length(k.cast(pa.string())) > 1),
    ]:
        assert not prunable(failing, schema), failing
