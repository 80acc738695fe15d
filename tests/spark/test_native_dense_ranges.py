"""Protects: Spark's Parquet reader reads persist's blob parts exactly whatever encoding
plan they were written with: integer-like columns of a dense range (more than a handful
of values) delta-encoded, at the ends of their types' ranges (deltas that wrap around),
beside a handful of values kept in a dictionary, over several parts of one run encoded
with one plan (:func:`persist.encoding.encoding_plan`), each described in the shared pool;
and narrow decimals (``decimal32``/``decimal64``, pyarrow >= 18) as values and as keys.
The native read equals ``ReadHandle.snapshot``."""

from __future__ import annotations

import datetime as dt
import decimal
from typing import Any

import pyarrow as pa
import pytest

from persist import PersistClient
from stash import Stash
from tests.spark.test_persist_table import collected, snapshot
from tests.support.arrow_types import NARROW_DECIMALS

pytestmark = pytest.mark.spark

KS = pa.schema([("k", pa.int64())])
VS = pa.schema(
    [
        ("i8", pa.int8()),
        ("i16", pa.int16()),
        ("top", pa.int64()),
        ("bottom", pa.int64()),
        ("wide", pa.int64()),
        ("money", pa.decimal128(18, 3)),
        ("day", pa.date32()),
        ("flag", pa.int32()),
        # Narrow decimals (pyarrow >= 18): no min_max kernel for their range.
        *[(d, getattr(pa, d)(9, 2)) for d in NARROW_DECIMALS],
    ]
)


def _updates(n: int) -> pa.Table:
    big = decimal.Decimal(10**15 - 1)
    cols: dict[str, Any] = {
        "k": pa.array(range(n), pa.int64()),
        "i8": pa.array([(i % 256) - 128 for i in range(n)], pa.int8()),
        "i16": pa.array([32767 - (i * 7919) % 40 for i in range(n)], pa.int16()),
        "top": pa.array([2**63 - 1 - (i * 7919) % 60 for i in range(n)], pa.int64()),
        "bottom": pa.array([-(2**63) + (i * 7919) % 60 for i in range(n)], pa.int64()),
        # The two ends of int64 in one column: every delta wraps around.
        "wide": pa.array([2**63 - 1 if i % 2 else -(2**63) for i in range(n)], pa.int64()),
        "money": pa.array(
            [-(big - (i * 7919) % 50) / 1000 for i in range(n)],
            pa.decimal128(18, 3),
        ),
        "day": pa.array(
            [dt.date(9999, 12, 31) - dt.timedelta(days=(i * 7919) % 45) for i in range(n)],
            pa.date32(),
        ),
        "flag": pa.array([i % 3 for i in range(n)], pa.int32()),
    }
    for f in VS:
        if f.name.startswith("decimal"):
            cols[f.name] = pa.array(
                [decimal.Decimal((i * 7919) % 300 - 150) / 4 for i in range(n)], f.type
            )
    cols["_time"] = pa.array([0] * n, pa.int64())
    cols["_diff"] = pa.array([1] * n, pa.int64())
    return pa.table(cols)


def test_dense_ranges_at_the_ends_of_their_types_read_natively(
    spark: Any, spark_store: Any
) -> None:
    from persist import encoding
    from spark import PersistTable
    from spark.native_plan import plan_snapshot

    n = 3_000
    t = _updates(n)
    plan = encoding.encoding_plan(t)
    delta = {"i8", "i16", "top", "bottom", "money", "day"}
    assert delta <= set(plan.encoding) and "flag" in plan.dictionary, plan
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        c = PersistClient(
            s,
            spark_store.blob_uri,
            inline_max_bytes=0,
            target_part_bytes=12_000,  # several parts (about 16 KB encoded in all)
            compaction="off",
        )
        try:
            w = c.open_writer("dense", KS, VS)
            w.compare_and_append(t, 0, 1)
            st = c.inspect("dense")
            nparts = sum(len(b.parts) for b in st.batches())
            p = plan_snapshot(c, "dense", st.key_schema, st.value_schema, None)
        finally:
            c.close()
    assert nparts >= 2 and len(p.direct) == p.parts == nparts, p.summary()
    table = PersistTable.for_name(
        spark, "dense", stash=spark_store.stash_url, blob=spark_store.blob_uri
    )
    want = snapshot(spark_store, 0, shard="dense")
    assert sum(want.values()) == n
    assert collected(table.to_df(path="native")) == want


@pytest.mark.parametrize("name", NARROW_DECIMALS)
def test_a_key_of_a_narrow_decimal_reads_natively(spark: Any, spark_store: Any, name: str) -> None:
    """A shard keyed by one ``decimal32``/``decimal64`` column (pyarrow >= 18), written in
    runs that overlap: the native plan ranks their keys (it failed with
    ``ArrowNotImplementedError``: Arrow has no sort kernel for these types) and the
    native read equals the snapshot."""
    from spark import PersistTable
    from spark.native_plan import plan_snapshot

    t = getattr(pa, name)(7, 2)
    ks, vs = pa.schema([("k", t)]), pa.schema([("v", pa.int64())])
    shard = f"narrow_{name}"
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        c = PersistClient(s, spark_store.blob_uri, inline_max_bytes=0, compaction="off")
        try:
            w = c.open_writer(shard, ks, vs)
            for i in range(3):
                n = 200
                keys = [decimal.Decimal(j - 100 + 7 * i) / 4 for j in range(n)]
                w.compare_and_append(
                    pa.table(
                        {
                            "k": pa.array(keys, t),
                            "v": pa.array([i] * n, pa.int64()),
                            "_time": pa.array([i] * n, pa.int64()),
                            "_diff": pa.array([1] * n, pa.int64()),
                        }
                    ),
                    i,
                    i + 1,
                )
            st = c.inspect(shard)
            p = plan_snapshot(c, shard, st.key_schema, st.value_schema, None)
        finally:
            c.close()
    assert p.parts == 3, p.summary()
    table = PersistTable.for_name(
        spark, shard, stash=spark_store.stash_url, blob=spark_store.blob_uri
    )
    want = snapshot(spark_store, 2, shard=shard)
    assert sum(want.values()) == 600
    assert collected(table.to_df(path="native")) == want
