"""Protects: ``PersistTable.to_df`` on an S3 blob store when the session cannot read
``s3a://`` (no hadoop-aws jar on the class path, no ``fs.s3a`` configuration, as in
this repository's PySpark): ``path="auto"`` takes the Python path, says why in exactly
one log line and gives ``ReadHandle.snapshot``; ``path="native"`` raises naming the
store and the reason; :func:`spark.native_read.blob_paths_root` maps an S3 blob to
``s3a://`` when the session can read it.

The S3 store is a moto server (``tests/support/s3_fixtures.py``); reading ``s3a://``
end to end needs hadoop-aws, which this machine cannot fetch, so that step is not here.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import pyarrow as pa
import pytest

from persist import PersistClient
from spark.persist_common import PersistSourceError
from stash import Stash

pytestmark = pytest.mark.spark

KEYS = pa.schema([("k", pa.int64())])
VALUES = pa.schema([("v", pa.string())])


def _build(stash_url: str, blob_uri: str) -> Counter:
    """A shard ``t`` with a blob part, an inline part and a retraction; returns its
    snapshot at the last time (``ReadHandle.snapshot``), without ``_time``."""
    with Stash.open(stash_url, fenced=False) as s:
        c = PersistClient(s, blob_uri, compaction="off", inline_max_bytes=0)
        small = PersistClient(s, blob_uri, compaction="off")
        try:
            w, r = c.open("t", KEYS, VALUES)
            w.append([(((k,), (f"v{k}",)), 0, 1) for k in range(20)], 0, 1)
            w2, r2 = small.open("t", KEYS, VALUES)
            w2.append([(((3,), ("v3",)), 1, -1), (((30,), ("x",)), 1, 1)], 1, 2)
            t = r.snapshot(1)
            for h in (w, r, w2, r2):
                h.expire()
        finally:
            small.close()
            c.close()
    return Counter(
        {(row["k"], row["v"]): row["_diff"] for row in t.to_pylist() if row["_diff"] != 0}
    )


def _store(table: Any) -> str:
    """``s3://bucket/prefix`` of the table's blob URI (its query holds the endpoint)."""
    return table.blob_uri.split("?", 1)[0]


@pytest.fixture
def s3_table(
    s3_server: Any, s3_blob_uri: str, spark: Any, spark_store: Any, monkeypatch: Any
) -> tuple[Any, Counter]:
    from spark import PersistTable

    # The session's JVM (and so its Python workers) may have started before the moto
    # fixture put its credentials in this process's environment: hand them to the
    # workers as SparkContext.environment, which each data source registration carries.
    env = spark.sparkContext.environment
    monkeypatch.setitem(env, "AWS_ACCESS_KEY_ID", s3_server.access_key_id)
    monkeypatch.setitem(env, "AWS_SECRET_ACCESS_KEY", s3_server.secret_access_key)
    monkeypatch.setitem(env, "AWS_DEFAULT_REGION", "us-east-1")
    want = _build(spark_store.stash_url, s3_blob_uri)
    t = PersistTable.for_name(spark, "t", stash=spark_store.stash_url, blob=s3_blob_uri)
    return t, want


def test_auto_takes_the_python_path_and_says_why_once(s3_table: Any, caplog: Any) -> None:
    table, want = s3_table
    with caplog.at_level(logging.DEBUG, logger="spark"):
        df = table.to_df(path="auto")
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("spark")]
    why = [m for m in lines if "reads through the persist data source" in m]
    assert len(why) == 1, lines
    assert "S3" in why[0] and "fs.s3a" in why[0], why[0]
    assert _store(table) in why[0] and "***" in why[0], why[0]  # named, endpoint redacted
    rows = df.collect()
    got = Counter({(r["k"], r["v"]): r["_diff"] for r in rows})
    assert len(rows) == len(got) and got == want


def test_native_raises_naming_the_store_and_the_reason(s3_table: Any) -> None:
    table, _ = s3_table
    with pytest.raises(PersistSourceError) as e:
        table.to_df(path="native")
    msg = str(e.value)
    assert "cannot be read natively" in msg and "fs.s3a" in msg and "S3" in msg, msg
    assert _store(table) in msg and "127.0.0.1" not in msg, msg  # named, endpoint redacted


def test_blob_paths_root_maps_s3_to_s3a_when_configured(
    spark: Any, s3_blob_uri: str, monkeypatch: Any
) -> None:
    import spark.native_read as native_read

    bucket_prefix = s3_blob_uri.split("://", 1)[1].split("?", 1)[0]
    monkeypatch.setattr(native_read, "_s3a_unreadable", lambda _spark: None)
    assert native_read.blob_paths_root(spark, s3_blob_uri) == (f"s3a://{bucket_prefix}", "")
    monkeypatch.setattr(native_read, "_s3a_unreadable", lambda _spark: "no S3A here")
    assert native_read.blob_paths_root(spark, s3_blob_uri) == (None, "no S3A here")
