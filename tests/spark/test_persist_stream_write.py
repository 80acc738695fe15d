"""Exactly-once streaming writes to a persist shard (``df.writeStream.format("persist")``).

Streams from a directory of JSON files (one file per micro-batch), run with
``trigger(availableNow=True)``; replays are provoked by deleting the newest entries of
Spark's commit log (``checkpointLocation/commits/``) and by a SIGKILL of a driver process
after the persist commit and before Spark's.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.spark

SCHEMA = "id long, v string"


def _opts(store: Any) -> dict[str, str]:
    return {"stash": store.stash_url, "blob": store.blob_uri}


def _files(src: Path, batches: list[list[tuple[int, str]]], start: int = 0) -> None:
    """One JSON file per micro-batch (``maxFilesPerTrigger`` 1), names sorting in order."""
    src.mkdir(exist_ok=True)
    for i, rows in enumerate(batches, start):
        body = "".join(json.dumps({"id": k, "v": v}) + "\n" for k, v in rows)
        (src / f"part-{i:04d}.json").write_text(body)


def _stream(spark: Any, src: Path, store: Any, shard: str, ckpt: Path, **options: Any) -> None:
    """Run the stream from ``src`` into ``shard`` until it has no more input."""
    w = (
        spark.readStream.schema(SCHEMA)
        .option("maxFilesPerTrigger", 1)
        .json(str(src))
        .writeStream.format("persist")
        .options(**_opts(store))
        .option("key_columns", "id")
        .option("checkpointLocation", str(ckpt))
    )
    for k, v in options.items():
        w = w.option(k, v)
    q = w.trigger(availableNow=True).start(shard)
    q.awaitTermination()
    if q.exception() is not None:
        raise AssertionError(f"stream failed: {q.exception()}")


def _rows(spark: Any, store: Any, shard: str) -> Counter[tuple[Any, ...]]:
    """The shard's consolidated rows with their diffs."""
    df = spark.read.format("persist").options(**_opts(store)).load(shard)
    return Counter(tuple(r) for r in df.collect())


def _newest_commits(ckpt: Path, n: int = 1) -> list[Path]:
    entries = sorted(
        (p for p in (ckpt / "commits").iterdir() if p.name.isdigit()), key=lambda p: int(p.name)
    )
    return entries[-n:]


BATCHES = [[(1, "a"), (2, "b")], [(3, "c")], [(4, "d"), (5, "e")]]


def _expected(batches: list[list[tuple[int, str]]]) -> Counter[tuple[Any, ...]]:
    return Counter((k, v, 1) for rows in batches for k, v in rows)


def test_replayed_micro_batch_adds_nothing(spark: Any, spark_store: Any) -> None:
    src, ckpt = spark_store.root / "src", spark_store.root / "ckpt"
    _files(src, BATCHES)
    _stream(spark, src, spark_store, "events", ckpt)
    assert _rows(spark, spark_store, "events") == _expected(BATCHES)
    # Spark's commit log loses the newest entry: the last micro-batch runs again.
    for p in _newest_commits(ckpt):
        p.unlink()
        (p.parent / f".{p.name}.crc").unlink(missing_ok=True)
    _stream(spark, src, spark_store, "events", ckpt)
    assert _rows(spark, spark_store, "events") == _expected(BATCHES)
    # New input after the replay is written once.
    more = [[(6, "f")]]
    _files(src, more, start=len(BATCHES))
    _stream(spark, src, spark_store, "events", ckpt)
    assert _rows(spark, spark_store, "events") == _expected(BATCHES + more)
