"""Protects: :func:`persist.fetch._advance_and_filter` gives the same table (values,
types, chunks) for a few rows, which it advances in Python (a merge of one-row parts),
as its vectorised path does: every time advanced to its part's floor, then only
``lower <= t < upper`` kept. A differential hypothesis test over random parts, floors
and bounds."""

from __future__ import annotations

import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist import fetch

times = st.integers(-5, 20)


@st.composite
def cases(draw: st.DrawFn) -> tuple[pa.Table, list[int], list[int], int | None, int | None]:
    parts = draw(st.lists(st.lists(times, min_size=0, max_size=5), min_size=1, max_size=8))
    floors = [draw(times) for _ in parts]
    rows = [len(p) for p in parts]
    if draw(st.booleans()):  # a part claiming other rows than it has: no advancing
        rows[0] += 1
    chunks = [
        pa.table(
            {"k": pa.array([f"r{i}" for i in range(len(p))]), "_time": pa.array(p, pa.int64())}
        )
        for p in parts
        if p
    ]
    if not chunks:
        chunks = [pa.table({"k": pa.array([], pa.string()), "_time": pa.array([], pa.int64())})]
    table = pa.concat_tables(chunks)
    lower = draw(st.one_of(st.none(), times))
    upper = draw(st.one_of(st.none(), times))
    return table, floors, rows, lower, upper


@settings(
    max_examples=400, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(cases())
def test_few_rows_match_the_vectorised_path(
    case: tuple[pa.Table, list[int], list[int], int | None, int | None],
) -> None:
    table, floors, rows, lower, upper = case
    few = fetch._advance_and_filter(table, floors, rows, lower, upper)
    saved = fetch._FEW_ROWS
    fetch._FEW_ROWS = -1
    try:
        vec = fetch._advance_and_filter(table, floors, rows, lower, upper)
    finally:
        fetch._FEW_ROWS = saved
    assert few.schema.equals(vec.schema, check_metadata=True)
    assert few.equals(vec)
    assert [c.num_chunks for c in few.columns] == [c.num_chunks for c in vec.columns]
    assert [len(c) for c in few.column("_time").chunks] == [
        len(c) for c in vec.column("_time").chunks
    ]
