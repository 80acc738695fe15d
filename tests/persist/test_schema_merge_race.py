"""Two ``mergeSchema`` Spark writes planned against one version ``(id | a)``: the
first adds ``c1`` and commits a value in it; the second (adding ``c2``) is refused when
its writer opens the shard (its merged schema lacks ``c1``, which it never saw), instead
of registering ``(a, c2)`` and dropping ``c1`` and its value.  The planning runs on the
driver without a SparkSession (``WriteSettings`` and ``PersistWriter`` are plain
Python), on one SQLite stash file."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from pyspark.sql.types import LongType, StructField, StructType

from persist import PersistClient, SchemaMismatch
from spark.persist_writer import PersistWriter, WriteSettings
from stash import Stash

KS = pa.schema([pa.field("id", pa.int64(), nullable=False)])
VA = pa.schema([pa.field("a", pa.int64())])


def _df_schema(*cols: str) -> StructType:
    return StructType([StructField(c, LongType(), c != "id") for c in ("id", "a", *cols)])


def test_concurrent_merge_schema_writes_do_not_drop_each_others_column(tmp_path: Path) -> None:
    url, blob = f"sqlite:///{tmp_path}/stash.db", f"file://{tmp_path}/blob"
    s = Stash.open(url, fenced=False)
    c = PersistClient(s, blob, compaction="off")
    try:
        c.open("s", KS, VA)
        opts = {"stash": url, "blob": blob, "path": "s", "mergeSchema": "true"}
        registered = (KS, VA)
        plan1 = WriteSettings.from_options(opts, _df_schema("c1"), registered)
        plan2 = WriteSettings.from_options(opts, _df_schema("c2"), registered)
        assert plan2.value_schema.names == ["a", "c2"]
        PersistWriter(plan1)  # registers (a, c1)
        w, _ = c.open("s", KS, plan1.value_schema)
        w.compare_and_append([(((1,), (10, 11)), 0, 1)], 0, 1)  # job 1's commit
        with pytest.raises(SchemaMismatch, match=r"'c1'"):
            PersistWriter(plan2)
        st = c.inspect("s")
        assert [v.names for v in st.schema_history] == [["a"], ["a", "c1"]]
        _, r = c.open("s", KS, st.value_schema)
        assert r.snapshot(0).column("c1").to_pylist() == [11]
    finally:
        c.close()
        s.close()
