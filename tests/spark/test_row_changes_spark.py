"""Spark row-level changes (:mod:`spark.row_changes`) against persist's own
``WriteHandle.upsert`` / ``delete`` / ``update`` on the same shard contents."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

pytestmark = pytest.mark.spark

KS = pa.schema([("id", pa.int64())])
VS = pa.schema([("v", pa.string()), ("n", pa.int64())])


@dataclass
class Table:
    spark: Any
    shard: str
    stash_url: str
    blob_uri: str


# Rows over two appends (retractions across runs, a count of 2, a key with two values).
HISTORY = [
    ([(1, "a", 10, 1), (2, "b", 20, 1), (3, "c", 30, 2), (4, "d", 40, 1)], 0),
    ([(2, "b", 20, -1), (2, "bb", 21, 1), (5, "e", 50, 1), (6, "f", 60, 1), (4, "d2", 41, 1)], 1),
]


class Stores:
    """A persist client on the test's stores with two shards of equal contents."""

    def __init__(self, store: Any) -> None:
        from persist import PersistClient
        from stash import Stash

        self.stash = Stash.open(store.stash_url, fenced=False)
        self.client = PersistClient(self.stash, store.blob_uri, compaction="off")
        self.writers = {s: self.client.open_writer(s, KS, VS) for s in ("spark", "model")}
        for rows, t in HISTORY:
            for w in self.writers.values():
                w.compare_and_append(_table(rows, t), t, t + 1)

    def rows(self, shard: str) -> list[tuple[Any, ...]]:
        read = self.client.open_reader(shard, KS, VS)
        try:
            upper = read.fetch_recent_upper().as_option()
            t = read.snapshot(upper - 1).drop(["_time"])
        finally:
            read.expire()
        return sorted(tuple(r.values()) for r in t.to_pylist())

    def close(self) -> None:
        for w in self.writers.values():
            w.expire()
        self.client.close()
        self.stash.close()


def _table(rows: list[tuple[int, str, int, int]], t: int) -> pa.Table:
    return pa.table(
        {
            "id": pa.array([r[0] for r in rows], pa.int64()),
            "v": [r[1] for r in rows],
            "n": pa.array([r[2] for r in rows], pa.int64()),
            "_time": pa.array([t] * len(rows), pa.int64()),
            "_diff": pa.array([r[3] for r in rows], pa.int64()),
        }
    )


@pytest.fixture
def stores(spark_store: Any) -> Any:
    s = Stores(spark_store)
    yield s
    s.close()


def test_changes_match_write_handle(spark: Any, spark_store: Any, stores: Stores) -> None:
    from pyspark.sql import functions as F

    from persist import InvalidUsage
    from spark import row_changes as rc

    t = Table(spark, "spark", spark_store.stash_url, spark_store.blob_uri)
    model = stores.writers["model"]
    steps: list[tuple[Any, Any]] = [
        (
            lambda: rc.upsert(
                t, spark.createDataFrame([(4, "x", 1), (7, "y", 2)], "id long, v string, n long")
            ),
            lambda: model.upsert(
                pa.table({"id": [4, 7], "v": ["x", "y"], "n": [1, 2]}).cast(pa.schema([*KS, *VS]))
            ),
        ),
        (
            lambda: rc.delete(t, "id < 2 or v = 'bb'"),
            lambda: model.delete((pc.field("id") < 2) | (pc.field("v") == "bb")),
        ),
        (
            lambda: rc.update(t, F.col("id") == 3, {"n": "n + 1", "v": F.lit("c!")}),
            lambda: model.update(pc.field("id") == 3, {"n": pc.field("n") + 1, "v": "c!"}),
        ),
        (
            lambda: rc.update(t, "id = 6", {"id": "id + 100"}),
            lambda: model.update(pc.field("id") == 6, {"id": pc.field("id") + 100}),
        ),
        (lambda: rc.delete(t, "id > 1000"), lambda: model.delete(pc.field("id") > 1000)),
    ]
    for ours, theirs in steps:
        got, want = ours(), theirs()
        assert (got.inserted, got.retracted) == (want.inserted, want.retracted)
        assert got.time == want.time or not (want.inserted or want.retracted)  # no-op: upper - 1
        assert stores.rows("spark") == stores.rows("model")
    before = stores.rows("spark")
    upper = stores.client.inspect("spark").upper
    dupes = spark.createDataFrame([(9, "p", 1), (9, "q", 2)], "id long, v string, n long")
    with pytest.raises(InvalidUsage, match="two rows have one key"):
        rc.upsert(t, dupes)
    with pytest.raises(InvalidUsage, match="of a live row it does not change"):
        rc.update(t, "id = 5", {"id": "7"})
    with pytest.raises(InvalidUsage, match="exactly the key and value columns"):
        rc.upsert(t, spark.createDataFrame([(9, "p")], "id long, v string"))
    assert stores.client.inspect("spark").upper == upper
    assert stores.rows("spark") == before


def test_lost_race_replans(spark: Any, spark_store: Any, stores: Stores, monkeypatch: Any) -> None:
    """A write landing between the read and the commit makes the change re-read and
    re-plan: the row it added under the upserted key is retracted too."""
    from spark import row_changes as rc

    t = Table(spark, "spark", spark_store.stash_url, spark_store.blob_uri)
    real = rc._counts
    raced: list[int] = []

    def racing(*changes: Any) -> Any:
        if not raced:
            w = stores.writers["spark"]
            upper = stores.client.inspect("spark").upper.as_option()
            w.compare_and_append(_table([(8, "late", 0, 1)], upper), upper, upper + 1)
            raced.append(upper)
        return real(*changes)

    monkeypatch.setattr(rc, "_counts", racing)
    out = rc.upsert(t, spark.createDataFrame([(8, "new", 1)], "id long, v string, n long"))
    assert out.time == raced[0] + 1
    assert (out.inserted, out.retracted) == (1, 1)
    assert [r for r in stores.rows("spark") if r[0] == 8] == [(8, "new", 1, 1)]


@pytest.mark.slow  # several Spark jobs per change, from threads
def test_concurrent_updates_lose_nothing(spark: Any, spark_store: Any, stores: Stores) -> None:
    """Threads sharing the SparkSession each run ``update(id == 1, n = n + 1)``: every
    acknowledged update is in the final value (serializable per shard)."""
    import threading

    from spark import row_changes as rc

    t = Table(spark, "spark", spark_store.stash_url, spark_store.blob_uri)
    errors: list[BaseException] = []
    done: list[int] = []

    def run() -> None:
        try:
            for _ in range(2):
                rc.update(t, "id = 1", {"n": "n + 1"})
                done.append(1)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert [r for r in stores.rows("spark") if r[0] == 1] == [(1, "a", 10 + len(done), 1)]
    assert len(done) == 6
