"""The read of row-level changes (:mod:`persist.rows_read`: row groups pruned by their
Parquet statistics) and the vectorised key matching of :mod:`persist.rows`: each gives
exactly what the plain path gives."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persist import InvalidUsage, MemoryBlob, PersistClient
from persist import rows as rows_mod
from persist.rows_read import _pruned_part, read_live_rows, row_groups_prunable
from stash import Stash

KEY = pa.schema([pa.field("a", pa.int64(), False), pa.field("b", pa.int32(), False)])
VAL = pa.schema(
    [pa.field("s", pa.string()), pa.field("d", pa.date32()), pa.field("f", pa.float64())]
)
N = 120_000  # several Parquet row groups in one part (at least 16,384 rows each)


def rows(lo: int, hi: int, tag: str = "x") -> pa.Table:
    n = hi - lo
    return pa.table(
        {
            "a": pa.array(range(lo, hi), pa.int64()),
            "b": pa.array([i % 7 for i in range(lo, hi)], pa.int32()),
            "s": pa.array([f"{tag}{i % 100}" for i in range(lo, hi)], pa.string()),
            "d": pa.array([dt.date(2020, 1, 1 + i % 28) for i in range(lo, hi)], pa.date32()),
            "f": pa.array([float(i % 5) for i in range(n)], pa.float64()),
        }
    )


@pytest.fixture(scope="module")
def shard() -> Iterator[tuple[Any, Any]]:
    """A shard of ``N`` rows in one multi-row-group part, then changes in other
    batches (an upsert over a key range, a delete, a raw append of a duplicate)."""
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off")
    w, r = c.open("s", KEY, VAL)
    w.upsert(rows(0, N))
    w.upsert(rows(50_000, 50_100, "y"))
    w.delete((pc.field("a") >= 70_000) & (pc.field("a") < 70_010))
    dup = rows(90_000, 90_001, "z")
    u = w.fetch_recent_upper().as_option()
    w.compare_and_append(
        dup.append_column("_time", pa.array([u], pa.int64())).append_column(
            "_diff", pa.array([2], pa.int64())
        ),
        u,
        u + 1,
    )
    try:
        yield w, r
    finally:
        c.close()
        s.close()


FILTERS = [
    pc.field("a") == 50_050,
    (pc.field("a") == 1_234) & (pc.field("b") == 1_234 % 7),
    (pc.field("a") >= 69_990) & (pc.field("a") < 70_020),
    pc.field("a") == 90_000,
    pc.field("a") > 10**9,  # no row
    pc.field("s") == "y3",  # a value column: every row group may hold it
    pc.field("d") == dt.date(2020, 1, 3),
    (pc.field("a") < 100) & (pc.field("f") == 1.0),  # a float column: not pruned
    pc.field("_diff") == 2,  # not a row filter: not pruned
]


@pytest.mark.parametrize("i", range(len(FILTERS)))
def test_read_live_rows_equals_the_filtered_snapshot(shard: tuple[Any, Any], i: int) -> None:
    w, r = shard
    filt = FILTERS[i]
    state = w.change_state()
    upper = state.upper.as_option()
    got = w.read_live(state, filt)
    want = r.snapshot(upper - 1, filter=filt)
    assert got.sort_by([("a", "ascending"), ("b", "ascending"), ("s", "ascending")]).equals(
        want.sort_by([("a", "ascending"), ("b", "ascending"), ("s", "ascending")])
    )


def test_only_the_row_groups_that_can_match_are_decoded(shard: tuple[Any, Any]) -> None:
    w, _ = shard
    state = w.change_state()
    big = [p for b in state.batches() for p in b.parts if p.rows == N]
    assert len(big) == 1, "the first batch is one part"
    filt = pc.field("a") == 1_234
    assert row_groups_prunable(filt, w.schema, KEY.names, VAL.names)
    part = _pruned_part(w._ctx.blob, big[0], w.schema, KEY, filt)
    assert 0 < part.num_rows < N // 2
    assert 1_234 in part.column("a").to_pylist()
    rng = (pc.field("a") >= 69_990) & (pc.field("a") < 70_020)
    part = _pruned_part(w._ctx.blob, big[0], w.schema, KEY, rng)
    assert 0 < part.num_rows < N // 2
    assert {*range(69_990, 70_020)} <= {*part.column("a").to_pylist()}
    # a filter on a float column is not pruned by statistics
    assert not row_groups_prunable(pc.field("f") == 1.0, w.schema, KEY.names, VAL.names)


def test_read_live_rows_rejects_a_bad_filter(shard: tuple[Any, Any]) -> None:
    w, _ = shard
    state = w.change_state()
    with pytest.raises(InvalidUsage, match="nope"):
        read_live_rows(
            w._ctx.blob,
            list(state.batches()),
            w.schema,
            KEY.names,
            VAL.names,
            0,
            schemas=(state.schemas(), w.schema_id),
            filter=pc.field("nope") == 1,
        )


def test_changes_on_the_multi_row_group_shard_match_the_model(shard: tuple[Any, Any]) -> None:
    w, r = shard
    w.update(pc.field("a") == 1_234, {"s": "u"})
    w.delete((pc.field("a") >= 30_000) & (pc.field("a") < 30_005))
    w.upsert(rows(90_000, 90_002, "w"))  # replaces the raw duplicate (count 2)
    upper = w.fetch_recent_upper().as_option()
    t = r.snapshot(upper - 1, filter=(pc.field("a") >= 1_234) & (pc.field("a") <= 1_234))
    assert t.column("s").to_pylist() == ["u"] and t.column("_diff").to_pylist() == [1]
    t = r.snapshot(upper - 1, filter=(pc.field("a") >= 29_999) & (pc.field("a") <= 30_005))
    assert t.column("a").to_pylist() == [29_999, 30_005]
    t = r.snapshot(upper - 1, filter=pc.field("a").isin([90_000, 90_001]))
    assert t.column("s").to_pylist() == ["w0", "w1"] and t.column("_diff").to_pylist() == [1, 1]


# ------------------------------------------------- vectorised key matching
key_values = st.one_of(st.none(), st.integers(-3, 3))
float_values = st.one_of(st.none(), st.sampled_from([0.0, -0.0, 1.5, float("nan")]))


@settings(max_examples=60, deadline=None)
@given(
    live=st.lists(st.tuples(st.integers(-3, 3), key_values, float_values), max_size=20),
    incoming=st.lists(st.tuples(st.integers(-3, 3), key_values, float_values), max_size=8),
    with_float=st.booleans(),
    nullable=st.booleans(),
)
def test_key_matching_is_the_tuple_matching(
    live: list[tuple[int, int | None, float | None]],
    incoming: list[tuple[int, int | None, float | None]],
    with_float: bool,
    nullable: bool,
) -> None:
    """:func:`rows.with_keys_of` and :func:`rows.check_distinct_keys` agree with a
    model of key identity: Python tuples with ``-0.0`` made ``0.0`` and every NaN one
    token (null equal to null)."""
    keys = ["k", "j", "x"] if with_float else ["k", "j"]

    def tab(rs: list[tuple[int, int | None, float | None]]) -> pa.Table:
        j = [r[1] if nullable else (r[1] or 0) for r in rs]
        return pa.table(
            {
                "k": pa.array([r[0] for r in rs], pa.int64()),
                "j": pa.array(j, pa.int64()),
                "x": pa.array([r[2] for r in rs], pa.float64()),
                "_diff": pa.array([1] * len(rs), pa.int64()),
            }
        )

    def model(t: pa.Table) -> list[tuple[Any, ...]]:
        def one(v: Any) -> Any:
            if isinstance(v, float):
                return "nan" if math.isnan(v) else v + 0.0
            return v

        cols = [t.column(k).to_pylist() for k in keys]
        return [tuple(one(v) for v in r) for r in zip(*cols, strict=True)]

    lt, it = tab(live), tab(incoming).drop_columns(["_diff"])
    want_keys = set(model(it))
    got = rows_mod.with_keys_of(lt, it, keys)
    want = [k for k in model(lt) if k in want_keys]
    assert sorted(model(got), key=repr) == sorted(want, key=repr)
    assert got.column_names == lt.column_names
    distinct = len(want_keys) == it.num_rows
    if distinct:
        rows_mod.check_distinct_keys(it, keys)
    else:
        with pytest.raises(InvalidUsage, match="two rows have one key"):
            rows_mod.check_distinct_keys(it, keys)
