"""The driver's read of direct parts' rows of tail keys (:mod:`spark.native_merge`): it
gives exactly the rows a whole-part read filtered by key gives, decodes only the row
groups that can hold a tail key, and its cache of decoded row groups answers later reads
with the same rows, whatever keys they ask for. No Spark session is needed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist import MemoryBlob, PersistClient
from persist.errors import CorruptPart
from persist.parts import read_parts
from spark.native_merge import RowGroupCache, touched_rows
from stash import Stash

KEY = pa.schema([pa.field("a", pa.int64()), pa.field("b", pa.string())])
VAL = pa.schema([pa.field("v", pa.float64()), pa.field("s", pa.string())])
N = 120_000  # several Parquet row groups in one part (at least 16,384 rows each)


def _rows() -> pa.Table:
    a = np.arange(N, dtype=np.int64) // 2  # two rows per a: b tells them apart
    b = [None if i % 1000 == 7 else f"b{i % 2}" for i in range(N)]  # some null keys
    return pa.table(
        {
            "a": pa.array(a),
            "b": pa.array(b, pa.string()),
            "v": pa.array(np.arange(N, dtype=np.float64) / 3),
            "s": pa.array([f"s{i % 97}" for i in range(N)], pa.string()),
        }
    )


class CountingBlob(MemoryBlob):
    """A memory blob store counting ``get`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.gets = 0

    def get(self, key: str) -> bytes | None:
        self.gets += 1
        return super().get(key)


@pytest.fixture(scope="module")
def part() -> Iterator[tuple[Any, Any, Any, pa.Table]]:
    """``(blob, ref, history, rows)``: one sorted, consolidated part of ``N`` rows."""
    s = Stash.open("memory://", fenced=False)
    blob = CountingBlob()
    c = PersistClient(s, blob, compaction="off", inline_max_bytes=0)
    try:
        w, r = c.open("t", KEY, VAL)
        rows = _rows()
        zeros, ones = np.zeros(N, np.int64), np.ones(N, np.int64)
        w.append(
            rows.append_column("_time", pa.array(zeros)).append_column("_diff", pa.array(ones)),
            0,
            1,
        )
        (batch,) = [b for b in c.inspect("t").batches() if b.parts]
        (ref,) = batch.parts
        history = r.read_schemas()
        whole = read_parts(blob, [ref], schema=history[0].updates_schema(history[1]))
        yield blob, ref, history, whole
    finally:
        c.close()
        s.close()


def _want(whole: pa.Table, keys: list[tuple[Any, Any]]) -> list[dict[str, Any]]:
    wanted = set(keys)
    return sorted(
        (r for r in whole.to_pylist() if (r["a"], r["b"]) in wanted),
        key=lambda r: (r["a"], r["b"] is None, r["b"] or ""),
    )


def _got(table: pa.Table) -> list[dict[str, Any]]:
    return sorted(table.to_pylist(), key=lambda r: (r["a"], r["b"] is None, r["b"] or ""))


def _keys(keys: list[tuple[Any, Any]]) -> pa.Table:
    return pa.table(
        {"a": pa.array([k[0] for k in keys], pa.int64()), "b": pa.array([k[1] for k in keys])}
    )


def test_clustered_keys_decode_only_their_row_groups(part: Any) -> None:
    blob, ref, history, whole = part
    keys = [(a, f"b{i}") for a in range(30_000, 30_050) for i in (0, 1)]
    cache = RowGroupCache(1 << 30)
    got = touched_rows(blob, "mem", [ref], history, KEY, _keys(keys), cache=cache)
    assert _got(got) == _want(whole, keys)
    assert len(got) == 99  # one of those rows has a null b
    groups = cache.layout(("mem", ref.key, ref.checksum))
    assert groups is not None and len(groups) >= 4
    decoded = sum(1 for g in range(len(groups)) if cache.get(("mem", ref.key, ref.checksum, g)))
    # The keys lie in one row group; the samples bound each group more loosely (they are
    # not taken at group boundaries), so its neighbours may be decoded too, no others.
    assert 1 <= decoded <= 3 < len(groups)


def test_cached_row_groups_answer_later_reads_without_fetching(part: Any) -> None:
    blob, ref, history, whole = part
    cache = RowGroupCache(1 << 30)
    first = [(10, "b0"), (59_000, "b1")]
    touched_rows(blob, "mem", [ref], history, KEY, _keys(first), cache=cache)
    before = blob.gets
    got = touched_rows(blob, "mem", [ref], history, KEY, _keys(first[:1]), cache=cache)
    assert blob.gets == before  # one of the cached groups answers
    assert _got(got) == _want(whole, first[:1])
    other = [(45_000, "b0")]  # a row group not decoded yet: fetched
    got = touched_rows(blob, "mem", [ref], history, KEY, _keys(other), cache=cache)
    assert blob.gets == before + 1
    assert _got(got) == _want(whole, other)


def test_a_bound_of_zero_bytes_keeps_nothing(part: Any) -> None:
    blob, ref, history, whole = part
    cache = RowGroupCache(0)
    keys = [(5, "b1")]
    for _ in range(2):
        got = touched_rows(blob, "mem", [ref], history, KEY, _keys(keys), cache=cache)
        assert _got(got) == _want(whole, keys)
    assert cache.nbytes == 0 and cache.hits == 0


def test_the_cache_evicts_the_least_recently_used_within_its_bound() -> None:
    cache = RowGroupCache(3 * 800)
    tables = [pa.table({"x": pa.array(np.arange(100, dtype=np.int64) + i)}) for i in range(4)]
    for i, t in enumerate(tables):
        cache.put(("k", i), t)
        assert cache.nbytes <= cache.max_bytes
    assert cache.get(("k", 0)) is None
    assert cache.get(("k", 3)) is not None


def test_a_corrupt_part_is_reported_not_read(part: Any) -> None:
    blob, ref, history, _whole = part
    bad = MemoryBlob()
    data = blob.get(ref.key)
    bad.set(ref.key, data[:-10] + b"0123456789")
    with pytest.raises(CorruptPart, match=ref.key):
        touched_rows(bad, "bad", [ref], history, KEY, _keys([(1, "b0")]), cache=RowGroupCache(0))


SHARED = RowGroupCache(1 << 30)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.lists(
        st.tuples(
            st.integers(min_value=-5, max_value=N // 2 + 5),
            st.sampled_from(["b0", "b1", None, "zz"]),
        ),
        max_size=60,
    )
)
def test_equals_a_whole_part_read_filtered_by_key(part: Any, keys: list[Any]) -> None:
    """Any key set (absent keys, null key columns, repeats), with one cache shared by
    every example: exactly the rows of those keys."""
    blob, ref, history, whole = part
    got = touched_rows(blob, "mem", [ref], history, KEY, _keys(keys), cache=SHARED)
    assert _got(got) == _want(whole, keys)


def test_keys_at_the_sample_positions_and_the_ends_are_found(part: Any) -> None:
    """The bounds' own keys (every sampled row, the first and the last row) each alone:
    a group whose bound ends exactly at the key must be read."""
    from persist.merge import sample_positions

    blob, ref, history, whole = part
    rows = whole.select(["a", "b"]).to_pylist()
    for pos in [*sample_positions(ref.rows).tolist(), 1, N - 2]:
        keys = [(rows[pos]["a"], rows[pos]["b"])]
        cache = RowGroupCache(1 << 30)
        got = touched_rows(blob, "mem", [ref], history, KEY, _keys(keys), cache=cache)
        assert _got(got) == _want(whole, keys), pos
