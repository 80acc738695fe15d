"""Differential property: every path of a row-level change (:data:`tests.persist.
row_paths.PATHS`: the write handle, a transaction; other layers append theirs) gives the
same shard and the same counts, over every key type of :mod:`tests.persist.
arrow_strategies` (nanosecond timestamps, times and durations, floats with ``-0.0`` and
NaN, decimals, binaries, nulls).

Each example draws a shard's schemas (one or two key columns of any type, an int64 and
maybe a float64 value column), a pool of keys (with twins: ``-0.0`` for ``0.0``), raw
initial updates (duplicates and counts above 1 included) and a few upserts, deletes and
updates (filters on a key column's pool values or on ``v``; ``set`` of an expression,
a scalar, a key from the pool or NaN).  Each path gets a fresh shard with the same
initial updates and applies the changes in order; per change the outcome (its counts,
or the error type refusing it) and at the end the live rows (canonical: temporal values
as stored integers, ``-0.0`` as ``0.0``, one NaN) must agree across paths; after each
upsert, each of its keys has exactly its row, once.

Examples are few for ``make test``; ``STASH_RELIABILITY=long`` runs many more.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from persist import MemoryBlob, PersistClient, PersistError
from persist.write import WriteHandle
from stash import Stash
from tests.persist.arrow_strategies import (
    KEY_TYPES,
    arrow_array,
    canonical_rows,
    column_values,
    literal,
)
from tests.persist.row_paths import PATHS, Op
from tests.reliability.campaign import runs

NAN = float("nan")


@pytest.fixture(scope="module")
def client() -> Iterator[PersistClient]:
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="inline", inline_max_bytes=0)
    try:
        yield c
    finally:
        c.close()
        s.close()


def _twin(v: Any) -> Any:
    """The other zero of a float zero (one key to a shard), else ``v``."""
    return -v if isinstance(v, float) and v == 0.0 else v


@st.composite
def _examples(draw: st.DrawFn) -> tuple[pa.Schema, pa.Schema, pa.Table, list[Op]]:
    nk = draw(st.integers(1, 2))
    keys = [
        pa.field(f"k{i}", draw(st.sampled_from(KEY_TYPES)), draw(st.booleans())) for i in range(nk)
    ]
    with_f = draw(st.booleans())
    vals = [pa.field("v", pa.int64())] + ([pa.field("f", pa.float64())] if with_f else [])
    ks, vs = pa.schema(keys), pa.schema(vals)
    pool = draw(
        st.lists(
            st.tuples(*[column_values(f.type, f.nullable) for f in keys]), min_size=1, max_size=4
        )
    )
    pool += [tuple(_twin(v) for v in k) for k in pool if any(_twin(v) is not v for v in k)]
    small = st.one_of(st.none(), st.integers(-3, 3))
    floats = st.sampled_from([None, 0.0, -0.0, NAN, 1.5])

    def row(key: tuple[Any, ...]) -> list[Any]:
        return [*key, draw(small)] + ([draw(floats)] if with_f else [])

    def table(rs: list[list[Any]]) -> pa.Table:
        fields = [*keys, *vals]
        return pa.table(
            {f.name: arrow_array([r[i] for r in rs], f.type) for i, f in enumerate(fields)},
            schema=pa.schema(fields),
        )

    initial = [row(draw(st.sampled_from(pool))) for _ in range(draw(st.integers(0, 5)))]
    init = table(initial).append_column(
        "_diff", pa.array([draw(st.sampled_from([1, 1, 2])) for _ in initial], pa.int64())
    )

    def key_filter() -> pc.Expression:
        i = draw(st.integers(0, nk - 1))
        chosen = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3))
        f = keys[i]
        return pc.field(f.name).isin(arrow_array([k[i] for k in chosen], f.type))

    def a_filter() -> pc.Expression:
        if draw(st.booleans()):
            return key_filter()
        return pc.field("v") >= draw(st.integers(-3, 3))

    ops: list[Op] = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["upsert", "upsert", "delete", "update", "update"]))
        if kind == "upsert":
            chosen = draw(st.lists(st.sampled_from(pool), max_size=4))
            ops.append(("upsert", table([row(k) for k in chosen])))
        elif kind == "delete":
            ops.append(("delete", a_filter()))
        else:
            how = draw(st.sampled_from(["expr", "scalar", "key", "nan"]))
            if how == "expr":
                change: dict[str, Any] = {"v": pc.field("v") + 1}
            elif how == "scalar":
                change = {"v": draw(small)}
            elif how == "nan" and with_f:
                change = {"f": NAN}
            else:
                i = draw(st.integers(0, nk - 1))
                change = {keys[i].name: literal(draw(st.sampled_from(pool))[i], keys[i].type)}
            ops.append(("update", a_filter(), change))
    return ks, vs, init, ops


def _live(w: WriteHandle) -> Counter[tuple[Any, ...]]:
    t = w.read_live(w.change_state(), None)
    names = [*w.key_schema.names, *w.value_schema.names]
    diffs = t.column("_diff").to_pylist()
    return Counter(dict(zip(canonical_rows(t, names), diffs, strict=True)))


def _check_upserted(w: WriteHandle, rows: pa.Table) -> None:
    """After an upsert, each of its keys has exactly one live row, its row, with
    ``_diff`` 1 (keys and rows compared canonically)."""
    keys, names = w.key_schema.names, [*w.key_schema.names, *w.value_schema.names]
    by_key: dict[tuple[Any, ...], list[tuple[tuple[Any, ...], int]]] = {}
    t = w.read_live(w.change_state(), None)
    diffs = t.column("_diff").to_pylist()
    for k, row, d in zip(canonical_rows(t, keys), canonical_rows(t, names), diffs, strict=True):
        by_key.setdefault(k, []).append((row, d))
    for k, row in zip(canonical_rows(rows, keys), canonical_rows(rows, names), strict=True):
        assert by_key.get(k) == [(row, 1)], f"key {k}: {by_key.get(k)} after upserting {row}"


def _run(
    client: PersistClient, path: Any, ks: pa.Schema, vs: pa.Schema, init: pa.Table, ops: list[Op]
) -> tuple[list[Any], Counter[tuple[Any, ...]]]:
    w, r = client.open(f"d-{uuid.uuid4().hex}", ks, vs)
    r.expire()
    if init.num_rows:
        t = init.append_column("_time", pa.repeat(pa.scalar(0, pa.int64()), init.num_rows))
        w.compare_and_append(t.select([*ks.names, *vs.names, "_time", "_diff"]), 0, 1)
    outcomes: list[Any] = []
    for op in ops:
        try:
            ch = path(client, w, op)
        except PersistError as e:
            outcomes.append(type(e).__name__)
        else:
            outcomes.append((ch.inserted, ch.retracted))
            if op[0] == "upsert":
                _check_upserted(w, op[1])
    live = _live(w)
    w.expire()
    return outcomes, live


@pytest.mark.sized
@settings(
    max_examples=runs(25, 400),
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
@given(example=_examples())
def test_every_path_gives_the_same_shard_and_counts(
    client: PersistClient, example: tuple[pa.Schema, pa.Schema, pa.Table, list[Op]]
) -> None:
    ks, vs, init, ops = example
    results = {name: _run(client, path, ks, vs, init, ops) for name, path in PATHS}
    (first, want), *others = results.items()
    for name, got in others:
        assert got[0] == want[0], f"outcomes of {name} differ from {first}'s"
        assert got[1] == want[1], f"live rows of {name} differ from {first}'s"
    assert all(n > 0 for n in want[1].values())
    for o in want[0]:
        event("refused" if isinstance(o, str) else "no change" if o == (0, 0) else "changed")
