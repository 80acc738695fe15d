"""Protects: consolidate_order refuses a table by its schema the same way whether the
verdict on that schema is remembered or judged afresh.

consolidate_order keeps its verdicts on the last schemas it saw (a writer consolidates
one schema over and over); the verdict found again must be the one judged anew: the
first missing column, then ``_time``/``_diff`` not non-null int64, then the first
column of an unsupported type, with the same messages."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import persist.consolidation as consolidation
from persist.consolidation import consolidate_order
from persist.errors import InvalidUsage

TYPES = [pa.int64(), pa.string(), pa.float64(), pa.list_(pa.int64()), pa.int32()]


def _outcome(table: pa.Table, keys: list[str], vals: list[str]) -> str:
    try:
        consolidate_order(table, keys, vals)
    except InvalidUsage as e:
        return str(e)
    return "ok"


@st.composite
def _tables(draw: st.DrawFn) -> tuple[pa.Table, list[str], list[str]]:
    names = draw(st.lists(st.sampled_from(["k", "v", "w", "_time", "_diff"]), unique=True))
    fields = [pa.field(n, draw(st.sampled_from(TYPES))) for n in names]
    rows = draw(st.integers(0, 2))
    cols = []
    for f in fields:
        if pa.types.is_list(f.type):
            cols.append(pa.array([[1]] * rows, f.type))
        elif pa.types.is_string(f.type):
            cols.append(pa.array(["a"] * rows, f.type))
        else:
            cols.append(pa.array([draw(st.sampled_from([None, 1]))] * rows, f.type))
    table = pa.Table.from_arrays(cols, schema=pa.schema(fields))
    keys = draw(st.lists(st.sampled_from(["k", "w"]), unique=True, max_size=2))
    vals = draw(st.lists(st.sampled_from(["v"]), max_size=1))
    return table, keys, vals


@settings(max_examples=80, deadline=None)
@given(_tables())
def test_a_remembered_verdict_is_the_fresh_one(
    drawn: tuple[pa.Table, list[str], list[str]],
) -> None:
    table, keys, vals = drawn
    consolidation._PROBLEMS = []
    fresh = _outcome(table, keys, vals)
    assert consolidation._PROBLEMS  # remembered
    assert _outcome(table, keys, vals) == fresh
    # The same schema in another object (a table read anew) finds the verdict too.
    again = pa.Table.from_arrays(table.columns, schema=pa.schema(list(table.schema)))
    assert _outcome(again, keys, vals) == fresh


def test_verdicts_tell_schemas_apart() -> None:
    """A remembered verdict on one schema never answers for another."""
    good = pa.table({"k": [1], "_time": [0], "_diff": [1]})
    bad = pa.table({"k": [[1]], "_time": [0], "_diff": [1]})
    assert consolidate_order(good, ["k"], [])[0].num_rows == 1
    with pytest.raises(InvalidUsage, match="column 'k' has unsupported type"):
        consolidate_order(bad, ["k"], [])
    assert consolidate_order(good, ["k"], [])[0].num_rows == 1
    with pytest.raises(InvalidUsage, match="has no column 'v'"):
        consolidate_order(good, ["k"], ["v"])
