"""Protects: the persist Spark source returns exactly the updates a model holds.

The persist source's reader, driven in-process (planning and every partition's read,
each pickled as Spark ships them), against a Counter model of the updates: every
consolidate mode, several key ranges, pushed filters on key and value columns, as_of at
and between times, retractions in other runs/appends/parts, diffs summing to 0 and 2,
with and without inline compaction."""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark.sql.datasource import EqualTo, GreaterThan, IsNotNull, IsNull, LessThan

from tests.reliability.campaign import runs
from tests.support.source_harness import build, model, norm, read_source

pytestmark = pytest.mark.adversarial

KEYS = pa.schema([("k", pa.string())])
VALUES = pa.schema([("v", pa.int64())])

UPD = st.tuples(
    st.tuples(st.sampled_from([None, "", "a", "b", "é", "zz"])),
    st.tuples(st.sampled_from([None, 0, 1, 2])),
    st.integers(0, 2),
    st.sampled_from([-2, -1, 1, 1, 2]),
)
SPEC = st.fixed_dictionaries(
    {
        "appends": st.lists(
            st.lists(st.lists(UPD, min_size=1, max_size=10), min_size=1, max_size=3),
            min_size=1,
            max_size=3,
        ),
        "compact_after": st.integers(0, 3),
        "as_of_frac": st.floats(0, 1),
    }
)

FILTERS: list[tuple[Any, Any]] = [
    (None, lambda k, v: True),
    ([GreaterThan(("v",), 0)], lambda k, v: v is not None and v > 0),
    ([EqualTo(("k",), "b")], lambda k, v: k == "b"),
    ([IsNull(("v",))], lambda k, v: v is None),
    (
        [IsNotNull(("k",)), LessThan(("v",), 2)],
        lambda k, v: k is not None and v is not None and v < 2,
    ),
]


@pytest.mark.sized
@settings(max_examples=runs(15, 80), deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=SPEC)
def test_source_reads_equal_the_model(tmp_path_factory: Any, spec: dict[str, Any]) -> None:
    root = Path(tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp()))
    (root / "blob").mkdir()
    su, bu = f"sqlite:///{root / 's.db'}", (root / "blob").as_uri()
    upper = build(su, bu, "t", KEYS, VALUES, spec["appends"], compact_after=spec["compact_after"])
    as_of = int(spec["as_of_frac"] * (upper - 1))
    exp = model(spec["appends"], as_of)
    base = {"stash": su, "blob": bu, "shard": "t", "as_of": str(as_of)}
    for mode, parts in (("full", None), ("full", "3"), ("partition", None), ("none", None)):
        for filt, keep in FILTERS:
            opts = dict(base, consolidate=mode)
            if parts:
                opts["partitions"] = parts
            if filt:
                opts["pushdown"] = "true"
            rows = read_source(opts, filt)
            got: Counter = Counter()
            for k, v, d in rows:
                got[norm((k, v))] += d
            got = Counter({r: d for r, d in got.items() if d})
            want = Counter({r: d for r, d in exp.items() if keep(*r)})
            assert got == want, (mode, parts, filt)
            if mode == "full":
                assert len(rows) == len(got), (mode, parts, filt)  # each row once, no 0
