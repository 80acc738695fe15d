"""Reads give back every column type and every filter exactly.

Regressions: ``timestamp[s]`` (and ``date64``, ``time32[s]``) columns in blob parts,
whole-number float keys beyond the float's exact integer range read by a fresh client
(key samples from the stash), ``-0.0``/``0.0`` and NaN rows under a filter that tells them
apart, ``isin`` of values of another type than the column's (pruning by statistics must
agree with evaluating the filter, and must not crash).
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persist.decoding import INLINE_CACHE, decode_part
from persist.encoding import encode_inline_part, encode_part, make_part_ref
from persist.errors import InvalidUsage
from persist.merge import decode_keys, encode_keys
from persist.stats import prune_mask, table_stats
from persist.updates import updates_schema
from stash import Antichain, Stash
from stash.codec import canonical_json
from tests.persist.arrow_strategies import (
    COLUMN_TYPES,
    arrow_array,
    canonical_rows,
    close_client,
    column_values,
    fresh_client,
    write_shard,
)


@pytest.fixture
def where(tmp_path: Path) -> Iterator[tuple[str, str]]:
    url = f"sqlite:///{tmp_path / 'stash.db'}"
    Stash.open(url).close()
    yield url, f"file://{tmp_path / 'blob'}"


def _updates(ks: pa.Schema, vs: pa.Schema, rows: list[tuple[Any, ...]], time: int) -> pa.Table:
    """An updates table from ``(key..., value..., diff)`` tuples at ``time``."""
    fields = [*ks, *vs]
    cols = {f.name: arrow_array([r[i] for r in rows], f.type) for i, f in enumerate(fields)}
    cols["_time"] = pa.array([time] * len(rows), pa.int64())
    cols["_diff"] = pa.array([r[-1] for r in rows], pa.int64())
    return pa.table(cols)


def _shard(
    where: tuple[str, str],
    ks: pa.Schema,
    vs: pa.Schema,
    appends: list[list[tuple[Any, ...]]],
    inline: bool = False,
) -> str:
    """A new shard holding one append per entry of ``appends`` (the i-th at time i)."""
    tables = [_updates(ks, vs, rows, i) for i, rows in enumerate(appends)]
    return write_shard(*where, inline, ks, vs, tables)


# ------------------------------------------------------------ types round-trip


@settings(max_examples=60, deadline=None)
@given(t=st.sampled_from(COLUMN_TYPES), data=st.data())
def test_every_type_round_trips_through_blob_and_inline_parts(t: pa.DataType, data: Any) -> None:
    """Every column type a shard accepts decodes to the very type and values it was
    encoded with, from a Parquet (blob) part and from an inline part."""
    values = data.draw(st.lists(column_values(t), min_size=1, max_size=6))
    table = pa.table({"k": arrow_array(values, t)})
    updates_schema(table.schema, pa.schema([]))  # a type a shard accepts
    for inline, encoded in ((False, encode_part(table)), (True, encode_inline_part(table))):
        ref = make_part_ref(None if inline else "p", encoded, table.num_rows, inline=inline)
        INLINE_CACHE.clear()
        got = decode_part(encoded, ref)
        assert got.schema == table.schema, (inline, got.schema)
        assert canonical_rows(got) == canonical_rows(table)


@pytest.mark.parametrize(
    "t",
    [pa.timestamp("s"), pa.timestamp("s", "UTC"), pa.timestamp("s", "+05:30"), pa.date64()],
)
def test_second_timestamps_read_back_from_blob_parts(
    where: tuple[str, str], t: pa.DataType
) -> None:
    """A ``timestamp[s]`` column (Parquet stores it in milliseconds) read by a fresh
    client from blob parts: snapshot, filtered snapshot and stream all work."""
    ks = pa.schema([("k", pa.int64())])
    vs = pa.schema([("v", t)])
    day = 86_400 if pa.types.is_timestamp(t) else 86_400_000
    name = _shard(where, ks, vs, [[(1, 18_000 * day, 1), (2, -day, 1)], [(3, 0, 1)]])
    c = fresh_client(*where, False)
    try:
        r = c.open_reader(name, ks, vs)
        snap = r.snapshot(1)
        assert snap.schema.field("v").type == t
        assert canonical_rows(snap, ["k", "v"]) == [(1, 18_000 * day), (2, -day), (3, 0)]
        assert r.snapshot(1, filter=pc.field("k") >= 2, columns=["v"]).num_rows == 2
        assert sum(b.num_rows for b in r.snapshot_stream(1)) == 3
    finally:
        close_client(c)


@pytest.mark.parametrize("inline", [False, True])
@pytest.mark.parametrize("ms", [1, -1, 86_400_000 + 3_600_000])
def test_date64_that_is_not_a_whole_day_is_refused_and_nothing_is_written(
    where: tuple[str, str], inline: bool, ms: int
) -> None:
    """A ``date64`` value that is not a whole day is refused on write, naming the column
    and the value, for every path a write takes (rows, tables, blob and inline parts):
    Parquet stores dates as days, so a blob part would read it back as another value
    than an inline part keeps.  Nothing is committed."""
    ks = pa.schema([("k", pa.int64())])
    vs = pa.schema([("d", pa.date64())])
    c = fresh_client(*where, inline)
    try:
        w = c.open_writer("d64", ks, vs)
        with pytest.raises(InvalidUsage, match=r"'d' \(date64\) holds .* not a whole day"):
            w.compare_and_append([(((1,), (ms,)), 0, 1)], 0, 1)
        with pytest.raises(InvalidUsage, match="not a whole day"):
            w.compare_and_append(_updates(ks, vs, [(1, 86_400_000, 1), (2, ms, 1)], 0), 0, 1)
        assert w.upper == Antichain.from_elem(0)
        w.compare_and_append([(((1,), (86_400_000,)), 0, 1)], 0, 1)
        assert canonical_rows(c.open_reader("d64", ks, vs).snapshot(0), ["k", "d"]) == [
            (1, 86_400_000)
        ]
    finally:
        close_client(c)


# ------------------------------------------------------------ float key samples


@pytest.mark.parametrize(
    ("t", "big"),
    [
        (pa.float64(), 1e16),
        (pa.float64(), -(2.0**60)),
        (pa.float32(), 2.0**30),
        (pa.float64(), 1e300),
    ],
)
def test_whole_float_keys_beyond_exact_ints_stream_for_a_fresh_client(
    where: tuple[str, str], t: pa.DataType, big: float
) -> None:
    """Key samples of whole floats beyond 2**53 (float64) / 2**24 (float32), read from
    the stash by a new client, decode to the float keys they sampled."""
    ks = pa.schema([("k", t)])
    vs = pa.schema([("v", pa.int64())])
    keys = [big, 2.0, -0.0, 0.5, math.inf]
    name = _shard(where, ks, vs, [[(k, 1, 1) for k in keys], [(big, 1, 1)]])
    c = fresh_client(*where, False)
    try:
        r = c.open_reader(name, ks, vs)
        want = canonical_rows(r.snapshot(1))
        assert len(want) == len(keys)
        got = [row for b in r.snapshot_stream(1) for row in canonical_rows(b)]
        assert got == want
    finally:
        close_client(c)


@settings(max_examples=60, deadline=None)
@given(t=st.sampled_from([pa.float32(), pa.float64()]), data=st.data())
def test_float_key_samples_round_trip_through_canonical_json(t: pa.DataType, data: Any) -> None:
    """Encoded key samples, written as the stash's canonical JSON writes them (whole
    floats as integers) and parsed back, decode to the exact float (sign of zero and
    NaN included)."""
    values = data.draw(st.lists(column_values(t), min_size=1, max_size=6))
    keys = pa.table({"k": arrow_array(values, t)})
    stored = json.loads(canonical_json([list(s) for s in encode_keys(keys)]))
    got = decode_keys(stored, keys.schema)
    for a, b in zip(got.column("k").to_pylist(), keys.column("k").to_pylist(), strict=True):
        assert (a is None and b is None) or (
            a is not None
            and b is not None
            and (
                math.isnan(a)
                and math.isnan(b)
                or (a == b and math.copysign(1, a) == math.copysign(1, b))
            )
        ), (a, b)


# ------------------------------------------------------------ filters and consolidation


def test_a_filter_telling_zeros_apart_gives_no_phantom_row(where: tuple[str, str]) -> None:
    """A row inserted with ``0.0`` and retracted with ``-0.0`` (equal to consolidation)
    is absent from a read filtered by ``isin([0.0])`` (which ``is_in`` tells apart)."""
    ks = pa.schema([("k", pa.int64())])
    vs = pa.schema([("x", pa.float64())])
    for inline in (False, True):
        name = _shard(
            where,
            ks,
            vs,
            [[(1, 0.0, 1), (2, math.nan, 1)], [(1, -0.0, -1), (2, -math.nan, -1)]],
            inline,
        )
        c = fresh_client(*where, inline)
        try:
            r = c.open_reader(name, ks, vs)
            assert r.snapshot(1).num_rows == 0
            for f in (
                pc.field("x").isin([0.0]),
                pc.field("x").isin([-0.0]),
                pc.field("x") == 0.0,
                pc.is_nan(pc.field("x")),
            ):
                assert r.snapshot(1, filter=f).num_rows == 0, (inline, f)
                assert r.snapshot(1, filter=f, columns=["k"]).num_rows == 0, (inline, f)
        finally:
            close_client(c)


_ISIN_CASES: list[tuple[pa.DataType, Any, pc.Expression]] = [
    (pa.date32(), 18_262, pc.field("c").isin([dt.datetime(2020, 1, 1, 5)])),
    (pa.date32(), 18_262, pc.field("c").isin([dt.datetime(2020, 1, 1)])),
    (pa.date64(), 18_262 * 86_400_000, pc.field("c").isin([dt.datetime(2020, 1, 1, 23)])),
    (pa.int64(), 5, pc.field("c").isin(["5"])),
    (pa.int32(), 5, pc.field("c").isin([5.0])),
    (pa.bool_(), True, pc.field("c").isin([1])),
    (pa.string(), "5", pc.field("c").isin([5])),
    (
        pa.timestamp("us", "UTC"),
        1_577_836_800_000_000,
        pc.field("c").isin(pa.array([1_577_840_400_000], pa.timestamp("ms", "+01:00"))),
    ),
    (
        pa.timestamp("us", "UTC"),
        1_577_836_800_000_000,
        pc.field("c").isin(pa.array([1_577_836_800], pa.timestamp("s", "America/New_York"))),
    ),
    (pa.decimal128(5, 2), decimal.Decimal("1.50"), pc.field("c").isin([1.5])),
]


@pytest.mark.parametrize(("t", "value", "filt"), _ISIN_CASES)
def test_isin_of_another_type_reads_what_the_snapshot_filter_keeps(
    where: tuple[str, str], t: pa.DataType, value: Any, filt: pc.Expression
) -> None:
    """``snapshot(filter=isin(values of another type))`` equals
    ``snapshot().filter(...)``, or raises ``InvalidUsage`` where that raises: pruning
    by statistics never skips a part holding a row the filter keeps, and never
    crashes."""
    from persist import InvalidUsage

    ks = pa.schema([("k", pa.int64())])
    vs = pa.schema([("c", t)])
    name = _shard(where, ks, vs, [[(1, value, 1), (2, None, 1)]])
    c = fresh_client(*where, False)
    try:
        r = c.open_reader(name, ks, vs)
        snap = r.snapshot(0)
        try:
            want = snap.filter(filt)
        except pa.ArrowException:
            with pytest.raises(InvalidUsage, match="filter"):
                r.snapshot(0, filter=filt)
            return
        got = r.snapshot(0, filter=filt)
        assert canonical_rows(got) == canonical_rows(want)
    finally:
        close_client(c)


def test_prune_mask_keeps_parts_whose_rows_isin_of_another_type_keeps() -> None:
    """``prune_mask`` never drops a part holding a row the filter keeps as Arrow
    evaluates it, nor raises, for ``isin`` of values of another type."""
    for t, value, filt in _ISIN_CASES:
        table = pa.table({"c": arrow_array([value], t)})
        try:
            kept = table.filter(filt).num_rows
        except pa.ArrowException:
            continue
        mask = prune_mask([(table_stats(table), 1)], table.schema, filt)
        assert mask == [True] or kept == 0, (t, filt)


@pytest.mark.parametrize(
    "filt",
    [
        # Arrow casts the value set only once it sees rows: 1.50 is no int64.
        pc.field("c").isin(pa.array([decimal.Decimal("1.50")], pa.decimal128(5, 2))),
        # pc.and_ on expressions names a function Arrow does not have.
        pc.and_(pc.field("c") > 1, pc.field("k") > 1),
    ],
)
def test_a_filter_arrow_cannot_evaluate_raises_invalid_usage(
    where: tuple[str, str], filt: pc.Expression
) -> None:
    """Where ``snapshot().filter(f)`` raises, ``snapshot(filter=f)`` raises
    ``InvalidUsage`` naming the filter (not a raw Arrow error); nothing else changes."""
    from persist import InvalidUsage

    ks = pa.schema([("k", pa.int64())])
    vs = pa.schema([("c", pa.int64())])
    for inline in (False, True):
        name = _shard(where, ks, vs, [[(1, 1, 1), (2, 2, 1)], [(3, 3, 1)]], inline)
        c = fresh_client(*where, inline)
        try:
            r = c.open_reader(name, ks, vs)
            with pytest.raises(pa.ArrowException):
                r.snapshot(1).filter(filt)
            with pytest.raises(InvalidUsage, match="filter"):
                r.snapshot(1, filter=filt)
            with pytest.raises(InvalidUsage, match="filter"):
                r.snapshot(1, filter=filt, columns=["k"])
            assert r.snapshot(1).num_rows == 3
        finally:
            close_client(c)


def _calls(node: Any, name: str) -> int:
    from persist.exprs import Call

    if not isinstance(node, Call):
        return 0
    return (node.name == name) + sum(_calls(a, name) for a in node.args)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_expression_tree_reads_every_filter_shape(data: Any) -> None:
    """Every filter shape a read accepts parses into its tree (a parse failure would
    only turn pruning off, silently: this keeps it on)."""
    from persist.exprs import expression_tree
    from tests.persist.arrow_strategies import filters, shard_schemas

    ks, vs = data.draw(shard_schemas())
    schema = updates_schema(ks, vs)
    filt = data.draw(filters(schema))
    tree = expression_tree(filt)
    assert _calls(tree, "is_in") == str(filt).count("is_in(")


def test_isin_of_the_columns_kind_still_prunes() -> None:
    """An ``isin`` of Python ints on an int32 column, or of strs on a large_string one,
    prunes as before; one of datetimes on a date column prunes nothing."""
    table = pa.table(
        {
            "w": pa.array([5, 6], pa.int32()),
            "s": pa.array(["a", "b"], pa.large_string()),
            "d": pa.array([dt.date(2020, 1, 1)] * 2, pa.date32()),
        }
    )
    parts = [(table_stats(table), 2)]
    assert prune_mask(parts, table.schema, pc.field("w").isin([1, 2])) == [False]
    assert prune_mask(parts, table.schema, pc.field("s").isin(["x"])) == [False]
    assert prune_mask(parts, table.schema, pc.field("w").isin([1, 2**40])) == [True]
    assert prune_mask(parts, table.schema, pc.field("d").isin([dt.date(2021, 1, 1)])) == [False]
    late = pc.field("d").isin([dt.datetime(2020, 1, 1, 5)])
    assert prune_mask(parts, table.schema, late) == [True]
