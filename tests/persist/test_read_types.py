"""Reads give back every column type and every filter exactly.

Regressions: ``timestamp[s]`` (and ``date64``, ``time32[s]``) columns in blob parts,
whole-number float keys beyond the float's exact integer range read by a fresh client
(key samples from the stash), ``-0.0``/``0.0`` and NaN rows under a filter that tells them
apart, ``isin`` of values of another type than the column's (pruning by statistics must
agree with evaluating the filter, and must not crash).
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from arrow_strategies import COLUMN_TYPES, arrow_array, canonical_rows, column_values
from hypothesis import given, settings
from hypothesis import strategies as st

from persist import PersistClient
from persist.decoding import INLINE_CACHE, decode_part
from persist.encoding import encode_inline_part, encode_part, make_part_ref
from persist.merge import decode_keys, encode_keys
from persist.updates import updates_schema
from stash import Stash
from stash.codec import canonical_json


@pytest.fixture
def where(tmp_path: Path) -> Iterator[tuple[str, str]]:
    url = f"sqlite:///{tmp_path / 'stash.db'}"
    Stash.open(url).close()
    yield url, f"file://{tmp_path / 'blob'}"


def _client(where: tuple[str, str], inline: bool = False) -> PersistClient:
    return PersistClient(
        Stash.open(where[0]),
        where[1],
        compaction="off",
        inline_max_bytes=1 << 20 if inline else 0,
        gc_interval_seconds=None,
    )


def _close(c: PersistClient) -> None:
    s = c.stash
    c.close()
    s.close()


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
    name = "s" + uuid.uuid4().hex
    c = _client(where, inline)
    try:
        w = c.open_writer(name, ks, vs)
        for i, rows in enumerate(appends):
            w.compare_and_append(_updates(ks, vs, rows, i), i, i + 1)
    finally:
        _close(c)
    return name


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
    c = _client(where)
    try:
        r = c.open_reader(name, ks, vs)
        snap = r.snapshot(1)
        assert snap.schema.field("v").type == t
        assert canonical_rows(snap, ["k", "v"]) == [(1, 18_000 * day), (2, -day), (3, 0)]
        assert r.snapshot(1, filter=pc.field("k") >= 2, columns=["v"]).num_rows == 2
        assert sum(b.num_rows for b in r.snapshot_stream(1)) == 3
    finally:
        _close(c)


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
    c = _client(where)
    try:
        r = c.open_reader(name, ks, vs)
        want = canonical_rows(r.snapshot(1))
        assert len(want) == len(keys)
        got = [row for b in r.snapshot_stream(1) for row in canonical_rows(b)]
        assert got == want
    finally:
        _close(c)


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
        c = _client(where, inline)
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
            _close(c)
