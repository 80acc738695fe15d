"""persist/key_identity.py against a model of consolidation's equality, on every column
type a shard takes: two keys are one exactly when their canonical values
(:func:`tests.persist.arrow_strategies.canonical_rows`: temporal values as stored
integers, ``-0.0`` as ``0.0``, one NaN, null equal to null) are equal; so are the
duplicate check, the semi-join, and the pruning filter (which keeps at least every
matching row); the bounds exist for every type but floats."""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist import key_identity as ki
from tests.persist.arrow_strategies import KEY_TYPES, arrow_array, canonical_rows, column_values
from tests.reliability.campaign import runs


@st.composite
def _tables(draw: st.DrawFn) -> tuple[pa.Table, pa.Table, list[str]]:
    types = draw(st.lists(st.sampled_from(KEY_TYPES), min_size=1, max_size=2))
    names = [f"k{i}" for i in range(len(types))]
    pools = [draw(st.lists(column_values(t), min_size=1, max_size=3)) for t in types]
    pools = [p + [-v for v in p if isinstance(v, float) and v == 0.0] for p in pools]

    def table(n: int) -> pa.Table:
        rows = [[draw(st.sampled_from(p)) for p in pools] for _ in range(n)]
        return pa.table(
            {
                k: arrow_array([r[i] for r in rows], t)
                for i, (k, t) in enumerate(zip(names, types, strict=True))
            }
        )

    return table(draw(st.integers(0, 6))), table(draw(st.integers(0, 4))), names


@pytest.mark.sized
@settings(max_examples=runs(120, 2000), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(example=_tables())
def test_identity_is_consolidation_equality(example: tuple[pa.Table, pa.Table, list[str]]) -> None:
    left, right, names = example
    model_l, model_r = canonical_rows(left, names), canonical_rows(right, names)
    # identity columns: plain equality is the model's
    ident = ki.identity_columns(left, names)
    assert ident.num_rows == left.num_rows
    assert all(c.null_count == 0 and not pa.types.is_floating(c.type) for c in ident.columns)
    rows = list(zip(*[c.to_pylist() for c in ident.columns], strict=True))
    for i in range(left.num_rows):
        for j in range(left.num_rows):
            assert (rows[i] == rows[j]) == (model_l[i] == model_l[j])
    # duplicates
    at = ki.duplicate_key(left, names)
    if len(set(model_l)) == len(model_l):
        assert at is None
    else:
        assert at is not None and model_l.count(model_l[at]) > 1
    # the semi-join
    want = [m in set(model_r) for m in model_l]
    assert ki.isin(left, right, names).to_pylist() == want
    # the pruning filter keeps at least the matching rows, on every type
    f = ki.key_filter(right, names)
    if f is None:
        assert right.num_rows == 0
    else:
        kept = ds.dataset(left).to_table(filter=f)
        assert Counter(canonical_rows(kept, names)) >= Counter(
            [m for m, w in zip(model_l, want, strict=True) if w]
        )
    for k in names:
        col = left.column(k)
        bounds = ki.key_bounds(col)
        if pa.types.is_floating(col.type) or col.null_count == len(col):
            assert bounds is None
        else:
            assert bounds is not None
            lo, hi = bounds
            assert (
                pc.all(pc.and_(pc.greater_equal(col, lo), pc.less_equal(col, hi))).as_py()
                is not False
            )
