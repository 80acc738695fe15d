"""The Spark compaction job answers merge requests without changing any readable as_of."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist import PersistClient
from spark.jobs.compact import compact_shard
from stash import Stash

pytestmark = pytest.mark.spark

KEYS = pa.schema([("k", pa.int64())])
VALUES = pa.schema([("v", pa.string()), ("x", pa.float64())])


def _snapshots(store: Any, times: list[int]) -> dict[int, list[dict[str, Any]]]:
    with Stash.open(store.stash_url, fenced=False) as s:
        client = PersistClient(s, store.blob_uri, compaction="off")
        try:
            with client.open_reader("c", KEYS, VALUES) as read:
                return {t: read.snapshot(t).to_pylist() for t in times}
        finally:
            client.close()


def test_spark_merges_keep_every_readable_time(spark: Any, spark_store: Any) -> None:
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        client = PersistClient(s, spark_store.blob_uri, compaction="off", inline_max_bytes=0)
        try:
            write, read = client.open("c", KEYS, VALUES)
            for t in range(12):
                rows = [
                    (((k,), (f"v{k}", None if k % 3 else k / 2)), t, 1)
                    for k in range(t * 50, t * 50 + 200)
                ]
                # Retract what the previous append added for keys that are now re-added.
                if t:
                    rows += [
                        (((k,), (f"v{k}", None if k % 3 else k / 2)), t, -1)
                        for k in range(t * 50, t * 50 + 150)
                    ]
                write.compare_and_append(rows, t, t + 1)
            read.downgrade_since(6)
            write.expire()
            read.expire()
            before = client.inspect("c")
        finally:
            client.close()
    reqs = before.trace.all_fueled_merge_reqs()
    assert reqs, "the appends should have left merge requests for the job"
    times = [6, 9, 11]
    want = _snapshots(spark_store, times)

    report = compact_shard(
        spark,
        spark_store.stash_url,
        spark_store.blob_uri,
        "c",
        min_spark_bytes=0,  # every merge through Spark
        bytes_per_task=4096,  # several output runs per merge
        gc=True,
        gc_grace_seconds=0,
    )
    assert report.failed == 0, report.errors
    assert report.spark_merges == len(reqs) and report.applied >= 1
    assert report.rows_out <= report.rows_in
    assert _snapshots(spark_store, times) == want

    with Stash.open(spark_store.stash_url, fenced=False) as s:
        client = PersistClient(s, spark_store.blob_uri, compaction="off")
        try:
            after = client.inspect("c")
        finally:
            client.close()
    assert len(list(after.batches())) < len(list(before.batches()))
    root = Path(spark_store.blob_uri[len("file://") :])
    on_disk = {str(p.relative_to(root)) for p in root.rglob("*.parquet")}
    assert on_disk == after.referenced_blob_keys()
