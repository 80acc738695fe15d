"""Spark row changes retract the stored rows exactly, count as ``WriteHandle`` counts and
compare zone-less timestamp keys without the session time zone.

Each test runs one change through :mod:`spark.row_changes` on one shard and through
``WriteHandle`` on a twin shard of the same contents, and compares the shards and the
``RowChanges``."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

pytestmark = pytest.mark.spark


@dataclass
class Table:
    spark: Any
    shard: str
    stash_url: str
    blob_uri: str


class Twins:
    """Shards ``spark`` and ``model`` of equal contents (``rows``: updates tables)."""

    def __init__(self, store: Any, ks: pa.Schema, vs: pa.Schema, updates: list[pa.Table]):
        from persist import PersistClient
        from stash import Stash

        self.ks, self.vs = ks, vs
        self.stash = Stash.open(store.stash_url, fenced=False)
        self.client = PersistClient(self.stash, store.blob_uri, compaction="off")
        self.model = self.client.open_writer("model", ks, vs)
        spark_w = self.client.open_writer("spark", ks, vs)
        for t, u in enumerate(updates):
            u = u.append_column("_time", pa.array([t] * u.num_rows, pa.int64()))
            for w in (self.model, spark_w):
                w.compare_and_append(u, t, t + 1)
        spark_w.expire()

    def rows(self, shard: str) -> list[tuple[Any, ...]]:
        read = self.client.open_reader(shard, self.ks, self.vs)
        try:
            upper = read.fetch_recent_upper().as_option()
            t = read.snapshot(upper - 1).drop(["_time"])
        finally:
            read.expire()
        return sorted((tuple(r.values()) for r in t.to_pylist()), key=repr)

    def close(self) -> None:
        self.model.expire()
        self.client.close()
        self.stash.close()


@pytest.fixture
def twins(spark_store: Any) -> Iterator[Any]:
    made: list[Twins] = []

    def make(ks: pa.Schema, vs: pa.Schema, updates: list[pa.Table]) -> Twins:
        made.append(Twins(spark_store, ks, vs, updates))
        return made[-1]

    yield make
    for t in made:
        t.close()


def _same(got: Any, want: Any, tw: Twins) -> None:
    assert (got.inserted, got.retracted) == (want.inserted, want.retracted)
    assert tw.rows("spark") == tw.rows("model")


NS = pa.timestamp("ns")


def test_nanosecond_values_are_retracted_exactly(spark: Any, spark_store: Any, twins: Any) -> None:
    """A ``timestamp[ns]`` value column with sub-microsecond parts: delete, update and
    upsert retract the stored rows, and an update keeps the columns it does not set as
    stored. Before the fix the retractions were built from Spark's microsecond values:
    the row stayed live next to a phantom row with ``_diff -1``."""
    from spark import row_changes as rc

    ks = pa.schema([("id", pa.int64())])
    vs = pa.schema([("ts", NS), ("n", pa.int64())])
    base = 1_700_000_000_000_000_000
    tw = twins(
        ks,
        vs,
        [
            pa.table(
                {
                    "id": pa.array([1, 2, 3, 4], pa.int64()),
                    "ts": pa.array([base + 1, base + 2_501, base + 999, None], NS),
                    "n": pa.array([10, 20, 30, 40], pa.int64()),
                    "_diff": pa.array([1, 1, 2, 1], pa.int64()),
                }
            )
        ],
    )
    t = Table(spark, "spark", spark_store.stash_url, spark_store.blob_uri)
    _same(rc.delete(t, "id = 1"), tw.model.delete(pc.field("id") == 1), tw)
    _same(
        rc.update(t, "id >= 2", {"n": "n + 1"}),
        tw.model.update(pc.field("id") >= 2, {"n": pc.field("n") + 1}),
        tw,
    )
    rows = spark.createDataFrame(
        [(2, dt.datetime(2024, 1, 1, 0, 0, 0, 7), 5)], "id long, ts timestamp_ntz, n long"
    )
    incoming = pa.table(
        {
            "id": pa.array([2], pa.int64()),
            "ts": pa.array([dt.datetime(2024, 1, 1, 0, 0, 0, 7)], NS),
            "n": pa.array([5], pa.int64()),
        }
    )
    _same(rc.upsert(t, rows), tw.model.upsert(incoming), tw)
    assert all(r[-1] > 0 for r in tw.rows("spark"))  # no phantom retraction


def test_nanosecond_keys_keep_apart(spark: Any, spark_store: Any, twins: Any) -> None:
    """Keys 500 ns and 700 ns past one microsecond are two keys: a delete chosen by the
    value column retracts exactly the one row (Spark reads both keys as one)."""
    from spark import row_changes as rc

    ks = pa.schema([("k", NS)])
    vs = pa.schema([("v", pa.string())])
    tw = twins(
        ks,
        vs,
        [
            pa.table(
                {
                    "k": pa.array([1_000_500, 1_000_700], NS),
                    "v": ["a", "b"],
                    "_diff": pa.array([1, 1], pa.int64()),
                }
            )
        ],
    )
    t = Table(spark, "spark", spark_store.stash_url, spark_store.blob_uri)
    _same(rc.delete(t, "v = 'a'"), tw.model.delete(pc.field("v") == "a"), tw)
    _same(
        rc.update(t, "v = 'b'", {"v": "'c'"}), tw.model.update(pc.field("v") == "b", {"v": "c"}), tw
    )


def test_counts_are_write_handles(spark: Any, spark_store: Any, twins: Any) -> None:
    """Spark's ``RowChanges`` are ``WriteHandle``'s (:func:`persist.rows.net_changes`):
    a live row of count -1 (a raw append of a retraction) deleted, a row of count 3
    updated, an upsert and an update that leave rows as they are (nothing written,
    nothing counted: before the fix Spark counted each row it rewrote, and wrote it)."""
    from spark import row_changes as rc

    ks = pa.schema([("id", pa.int64())])
    vs = pa.schema([("v", pa.string())])
    tw = twins(
        ks,
        vs,
        [
            pa.table(
                {
                    "id": pa.array([1, 2, 3], pa.int64()),
                    "v": ["a", "b", "c"],
                    "_diff": [-1, 3, 1],
                }
            )
        ],
    )
    t = Table(spark, "spark", spark_store.stash_url, spark_store.blob_uri)
    deleted = rc.delete(t, "id = 1")
    _same(deleted, tw.model.delete(pc.field("id") == 1), tw)
    assert (deleted.inserted, deleted.retracted) == (0, 1)  # by role, not by the diff's sign
    _same(
        rc.update(t, "id = 2", {"v": "'d'"}), tw.model.update(pc.field("id") == 2, {"v": "d"}), tw
    )
    same = spark.createDataFrame([(3, "c")], "id long, v string")
    got = rc.upsert(t, same)
    _same(got, tw.model.upsert(pa.table({"id": pa.array([3], pa.int64()), "v": ["c"]})), tw)
    assert (got.inserted, got.retracted) == (0, 0)
    _same(rc.update(t, "id = 3", {"v": "v"}), tw.model.update(pc.field("id") == 3, {"v": "c"}), tw)


def test_zoneless_timestamp_key_range_ignores_the_session_time_zone(
    spark: Any, spark_store: Any, twins: Any
) -> None:
    """A ``timestamp[us]`` (zone-less) key upserted with the session time zone far from
    the driver's: the old row is replaced. Before the fix the key range's bounds went
    through a Python ``datetime`` read in the driver's zone and compared in the
    session's, so the read missed the old row and the key had two live rows."""
    from spark import row_changes as rc

    ks = pa.schema([("k", pa.timestamp("us"))])
    vs = pa.schema([("v", pa.string())])
    when = dt.datetime(2024, 3, 10, 2, 30)
    tw = twins(
        ks,
        vs,
        [pa.table({"k": pa.array([when], ks.field("k").type), "v": ["old"], "_diff": [1]})],
    )
    t = Table(spark, "spark", spark_store.stash_url, spark_store.blob_uri)
    before = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", "Pacific/Kiritimati")  # UTC+14
    try:
        rows = spark.createDataFrame([(when, "new")], "k timestamp_ntz, v string")
        got = rc.upsert(t, rows)
    finally:
        spark.conf.set("spark.sql.session.timeZone", before)
    want = tw.model.upsert(pa.table({"k": pa.array([when], ks.field("k").type), "v": ["new"]}))
    _same(got, want, tw)
    assert tw.rows("spark") == [(when, "new", 1)]
