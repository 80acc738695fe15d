"""Protects: names and paths are data on ``PersistTable.to_df``'s native path.

Column names Spark would parse (``a.b``, a widened ``x.y``, a backtick) are read quoted on
every step (direct parts, conform, anti-join with the tail, Spark's merge of touched
parts, ``columns``); two names that differ only in case make ``auto`` take the Python
path; glob characters in a ``file://`` blob path are escaped for Hadoop's globbing. Each
read is compared with ``ReadHandle.snapshot``."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist import PersistClient
from stash import Stash
from tests.spark.test_persist_table import collected, snapshot

pytestmark = pytest.mark.spark


def _updates(schema: pa.Schema, rows: list[tuple[Any, ...]], time: int, diff: int) -> pa.Table:
    cols = {f.name: pa.array([r[i] for r in rows], f.type) for i, f in enumerate(schema)}
    cols["_time"] = pa.array([time] * len(rows), pa.int64())
    cols["_diff"] = pa.array([diff] * len(rows), pa.int64())
    return pa.table(cols)


def _build(store: Any, blob_uri: str, keys: pa.Schema, versions: list[pa.Schema]) -> int:
    """A bulk run of blob parts at time 0 (keys 0..199, some null), then a tail at times
    1..3 under the last schema version: retractions of bulk rows (null keys among
    them), re-insertions with other values and new keys. Every value column is an
    integer (the row's key, or 0 for a null key) or a string of it. Returns the upper."""
    first, last = versions[0], versions[-1]

    def row(k: int | None, schema: pa.Schema, bump: int = 0) -> tuple[Any, ...]:
        n = 0 if k is None else k
        vals = [str(n + bump) if pa.types.is_string(f.type) else n + bump for f in schema]
        return (k, *vals)

    ks = [None if i % 9 == 0 else i for i in range(200)]
    with Stash.open(store.stash_url, fenced=False) as s:
        c = PersistClient(s, blob_uri, compaction="off", inline_max_bytes=0, target_part_bytes=600)
        try:
            w = c.open_writer("n", keys, first)
            bulk = sorted({row(k, first) for k in ks}, key=lambda r: (r[0] is not None, r[0]))
            w.append(_updates(pa.schema([*keys, *first]), bulk, 0, 1), 0, 1)
            w.expire()
            w = c.open_writer("n", keys, last)
            both = pa.schema([*keys, *last])
            gone = [row(k, last) for k in (None, 5, 150)]
            w.append(_updates(both, gone, 1, -1), 1, 2)
            back = [row(k, last, bump=1000) for k in (None, 5, 250)]
            w.append(_updates(both, back, 2, 1), 2, 3)
            w.append(_updates(both, [row(7, last)], 3, -1), 3, 4)
            w.expire()
            return int(c.inspect("n").upper.as_option())
        finally:
            c.close()


def _table(spark: Any, store: Any, blob_uri: str) -> Any:
    from spark import PersistTable

    return PersistTable.for_name(spark, "n", stash=store.stash_url, blob=blob_uri)


def _both_merges(table: Any, want: Counter, as_of: int) -> None:
    """The native read equals ``want``, with the touched parts merged on the driver and
    by Spark."""
    import spark.native_plan as native_plan

    assert collected(table.to_df(as_of=as_of, path="native")) == want
    limit = native_plan.DRIVER_MERGE_MAX_BYTES
    native_plan.DRIVER_MERGE_MAX_BYTES = 0
    try:
        table.close()  # no reuse of the plan merged on the driver
        assert collected(table.to_df(as_of=as_of, path="native")) == want
    finally:
        native_plan.DRIVER_MERGE_MAX_BYTES = limit
        table.close()


def test_names_spark_would_parse_are_read_quoted(spark: Any, spark_store: Any) -> None:
    """A key ``a.b`` with null keys in the tail, a value ``x.y`` widened from int32 to
    int64 by a later schema version, a value with a backtick: before the fix the
    anti-join read ``a.b`` as a nested field and the conform step did the same for
    ``x.y``."""
    keys = pa.schema([("a.b", pa.int64())])
    v0 = pa.schema([("x.y", pa.int32()), ("c`d", pa.string())])
    v1 = pa.schema([("x.y", pa.int64()), ("c`d", pa.string())])
    upper = _build(spark_store, spark_store.blob_uri, keys, [v0, v1])
    table = _table(spark, spark_store, spark_store.blob_uri)
    for as_of in (0, upper - 1):
        _both_merges(table, snapshot(spark_store, as_of, shard="n"), as_of)
    cols = table.to_df(columns=["x.y", "c`d"], path="native")
    assert cols.columns == ["x.y", "c`d", "_diff"]
    assert cols.count() == sum(snapshot(spark_store, upper - 1, shard="n").values())


def test_names_equal_but_for_case_take_the_python_path(spark: Any, spark_store: Any) -> None:
    """Value columns ``v`` and ``V``: Spark's Parquet reader (case-insensitive) refuses
    them, so ``auto`` reads through the persist data source and ``native`` says why."""
    from spark.persist_common import PersistSourceError

    keys = pa.schema([("k", pa.int64())])
    values = pa.schema([("v", pa.int64()), ("V", pa.string())])
    upper = _build(spark_store, spark_store.blob_uri, keys, [values])
    table = _table(spark, spark_store, spark_store.blob_uri)
    assert collected(table.to_df()) == snapshot(spark_store, upper - 1, shard="n")
    with pytest.raises(PersistSourceError, match="differ only in case"):
        table.to_df(path="native")


def test_glob_characters_in_the_blob_path_are_literal(spark: Any, spark_store: Any) -> None:
    """A ``file://`` blob store under a directory named ``b[1]{x}``: Spark's Parquet
    reader globbed the part paths and found nothing (``PATH_NOT_FOUND``) before the
    fix."""
    root = Path(spark_store.root) / "b[1]{x}"
    root.mkdir()
    blob_uri = root.as_uri()
    keys = pa.schema([("k", pa.int64())])
    values = pa.schema([("v", pa.string())])
    upper = _build(spark_store, blob_uri, keys, [values])
    table = _table(spark, spark_store, blob_uri)
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        c = PersistClient(s, blob_uri, compaction="off")
        try:
            r = c.open_reader("n", keys, values)
            want = Counter(
                {(row["k"], row["v"]): row["_diff"] for row in r.snapshot(upper - 1).to_pylist()}
            )
            r.expire()
        finally:
            c.close()
    assert collected(table.to_df(path="native")) == want
