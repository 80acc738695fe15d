"""The native read of a persist shard: a snapshot as a DataFrame whose bulk Spark's own
Parquet reader scans, with no Python worker in the way.

:func:`spark.native_plan.plan_snapshot` splits the snapshot into direct parts (rows of the
snapshot as stored, no two holding one (key, value)) and a small tail that persist reads
and consolidates on the driver. This module turns that plan into one DataFrame:

* each schema version's direct parts are read by ``spark.read.schema(...).parquet(paths)``
  (each holds one time, not after ``as_of``, as planning proved from its ``_time``
  statistics: no row is filtered by time), conformed to the read view in Spark
  expressions when the version differs (a column it lacks is a typed null, a widened one
  is cast), so Spark's column pruning and filter pushdown reach the Parquet reader;
* the tail becomes a local relation (``createDataFrame`` of its Arrow table);
* rows of direct parts whose key intervals hold no tail key are snapshot rows as they
  are. The touched parts' rows of tail keys are merged with the tail on the driver
  (:func:`spark.native_plan.merge_on_driver`) and the direct parts are read through a
  broadcast left-anti join on the tail's keys (null-safe when a tail key has a null),
  plus the merged rows; keys and merged rows are two small local relations: one scan, no
  shuffle. Beyond
  :data:`spark.native_plan.DRIVER_MERGE_MAX_BYTES` of touched parts, Spark merges them
  instead: their rows of tail keys (a broadcast left-semi join) are unioned with the
  tail and summed per (key, value) (rows whose diffs cancel dropped), their other rows
  pass the anti-join. Either way only the tail's keys are aggregated.

The DataFrame's columns are the shard's key and value columns (newest schema, in Spark's
read types, :mod:`spark.arrow_spark`) and ``_diff``, each distinct (key, value) once
(but for one that several runs of inserts only each insert: once per run, ``_diff`` 1,
:mod:`spark.native_plan`): ``ReadHandle.snapshot(as_of)`` without its ``_time`` column.

Which blob stores: ``file://`` (and plain local paths) read as ``file://`` paths; an
``s3://bucket/prefix`` store as ``s3a://`` paths when the session's Hadoop configuration
sets some ``fs.s3a.`` option (endpoint, credentials provider...). Any other store, or a
column type Spark's Parquet reader does not read as persist does
(:func:`spark.native_plan.native_type`), makes :func:`native_reason` say why the Python
path (``format("persist")``) is taken instead.
"""

from __future__ import annotations

import logging
from typing import Any

import pyarrow as pa

from spark.names import col, literal_path, quote
from spark.native_plan import DIFF, TIME, NativePlan, native_type

log = logging.getLogger(__name__)


def blob_paths_root(spark: Any, blob_uri: str) -> tuple[str | None, str]:
    """``(prefix, why)``: the Hadoop path prefix under which blob key ``k`` is the file
    ``prefix + "/" + k`` (``None`` when Spark cannot read the store; ``why`` says
    why)."""
    from persist.blob import open_blob
    from persist.blob.arrowfs import ArrowFsBlob
    from persist.blob.file import FileBlob

    try:
        blob = open_blob(blob_uri)
    except Exception as e:  # noqa: BLE001 - the reason is reported, the Python path decides
        return None, f"the blob store cannot be opened here ({type(e).__name__})"
    try:
        if isinstance(blob, FileBlob):
            return "file://" + str(blob.root), ""
        if isinstance(blob, ArrowFsBlob) and blob.fs.type_name == "s3":
            why = _s3a_unreadable(spark)
            if why is not None:
                return None, why
            return "s3a://" + blob.root.rstrip("/"), ""
        scheme = blob_uri.split("://", 1)[0] if "://" in blob_uri else "?"
        return None, f"Spark's Hadoop layer does not read {scheme}:// blob stores here"
    finally:
        blob.close()


def _s3a_unreadable(spark: Any) -> str | None:
    """Why the session cannot read ``s3a://`` paths, or ``None`` when it can: Hadoop's
    S3A filesystem (hadoop-aws) must be on the JVM's class path and some ``fs.s3a.``
    option set by the user, not only by Hadoop's ``core-default.xml`` (which defines
    dozens of them in every session)."""
    jvm = spark.sparkContext._jvm
    try:
        loader = jvm.java.lang.Thread.currentThread().getContextClassLoader()
        jvm.java.lang.Class.forName("org.apache.hadoop.fs.s3a.S3AFileSystem", False, loader)
    except Exception:  # noqa: BLE001 - py4j raises Py4JJavaError for ClassNotFoundException
        return (
            "the blob store is on S3 and Hadoop's S3A filesystem (hadoop-aws, "
            "org.apache.hadoop.fs.s3a.S3AFileSystem) is not on the session's class path "
            "(add it, e.g. spark.jars.packages, and set the fs.s3a options)"
        )
    if any(k.startswith("spark.hadoop.fs.s3a.") for k, _v in spark.sparkContext.getConf().getAll()):
        return None
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    it = conf.iterator()
    while it.hasNext():
        key = str(it.next().getKey())
        if key.startswith("fs.s3a."):
            sources = conf.getPropertySources(key) or []
            if any(str(src) != "core-default.xml" for src in sources):
                return None
    return "the blob store is on S3 and the session sets no fs.s3a option (endpoint, credentials)"


def type_reason(key_schema: pa.Schema, history: Any) -> str | None:
    """Why a column of some schema version keeps the read off the native path, or
    ``None``."""
    hist, _dst = history
    for version in [key_schema, *hist.versions]:
        for f in version:
            if not native_type(f.type):
                return (
                    f"column {f.name!r} is {f.type}, which Spark's Parquet reader reads differently"
                )
    return None


def name_reason(spark: Any, key_schema: pa.Schema, history: Any) -> str | None:
    """Why column names keep the read off the native path, or ``None``: two names that
    differ only in case, when the session resolves names case-insensitively (Spark's
    Parquet reader then refuses the schema). Any other name is read quoted
    (:func:`spark.names.col`)."""
    from spark.names import case_clash

    if str(spark.conf.get("spark.sql.caseSensitive", "false")).lower() == "true":
        return None
    hist, _dst = history
    for version in hist.versions:
        clash = case_clash([*key_schema.names, *version.names])
        if clash is not None:
            return (
                f"columns {clash[0]!r} and {clash[1]!r} differ only in case, one name to "
                "Spark's Parquet reader (spark.sql.caseSensitive is false)"
            )
    return None


def _spark_schema(schema: pa.Schema) -> Any:
    from spark.persist_common import arrow_to_spark

    return arrow_to_spark(schema)


def _read_group(
    spark: Any,
    paths: list[str],
    source: pa.Schema,
    target: pa.Schema,
    plan_sources: Any,
    as_of: int,
) -> Any:
    """The rows of one schema version's parts at ``paths`` as the view's key, value and
    ``_diff`` columns. Every direct part holds one time, not after ``as_of`` (planning
    proved it from the parts' ``_time`` statistics), so no row is filtered by time and
    ``_time`` is not read. A part written under the view's own columns is read with the
    view's schema as is (no projection: a plain Parquet scan); others are conformed in
    Spark expressions (a column the version lacks is a typed null, a widened one cast)."""
    from pyspark.sql import functions as F

    st = _spark_schema(source)
    tt = _spark_schema(target)
    out = [(f, src) for f, src in zip(tt.fields, plan_sources, strict=True) if f.name != TIME]
    if all(src == f.name and st[src].dataType == f.dataType for f, src in out):
        from pyspark.sql.types import StructType

        return spark.read.schema(StructType([f for f, _s in out])).parquet(*paths)
    df = spark.read.schema(st).parquet(*paths)
    cols = []
    for f, src in out:
        if src is None:
            cols.append(F.lit(None).cast(f.dataType).alias(f.name))
        elif st[src].dataType == f.dataType:
            cols.append(col(src).alias(f.name))
        else:
            cols.append(col(src).cast(f.dataType).alias(f.name))
    return df.select(*cols)


def _direct_df(spark: Any, plan: NativePlan, prefix: str, parts: list[Any]) -> Any:
    """The rows of direct ``parts`` (at least one) as the view's columns and ``_diff``."""
    hist, dst = plan.history
    target = hist.view_schema(dst)
    out: Any = None
    for sid in sorted({p.schema_id for p in parts}):
        paths = [literal_path(f"{prefix}/{p.key}") for p in parts if p.schema_id == sid]
        cp = hist.plan(sid, dst)
        assert plan.as_of is not None
        df = _read_group(spark, paths, hist.updates_schema(sid), target, cp.sources, plan.as_of)
        out = df if out is None else out.unionByName(df)
    return out


def _local_df(spark: Any, rows: pa.Table, schema: Any) -> Any:
    """``rows`` (an updates table of the read view) as a local DataFrame of ``schema``."""
    from spark.persist_reader import _to_output

    return spark.createDataFrame(_to_output(rows, schema, None, DIFF), schema=schema)


def _on(df: Any, keys: Any, key_schema: pa.Schema) -> Any:
    """Null-safe equality of ``df``'s key columns and ``keys``' ``__k0, __k1, ...``."""
    on = None
    for i, k in enumerate(key_schema.names):
        c = df[quote(k)].eqNullSafe(keys[f"__k{i}"])
        on = c if on is None else on & c
    return on


def _without_keys(df: Any, keys: Any, key_schema: pa.Schema, nulls: bool) -> Any:
    """``df`` without the rows whose key is a row of ``keys`` (a DataFrame of the key
    columns): a broadcast left-anti join, on plain equality of the key columns, or
    null-safe equality when some key of ``keys`` has a null (Spark's ``<=>``: a null key
    matches a null key, as consolidation matches them)."""
    from pyspark.sql import functions as F

    names = key_schema.names
    keys = F.broadcast(keys.toDF(*[f"__k{i}" for i in range(len(names))]))
    if nulls:
        on = _on(df, keys, key_schema)
    else:
        on = None
        for i, k in enumerate(names):
            c = df[quote(k)] == keys[f"__k{i}"]
            on = c if on is None else on & c
    return df.join(keys, on, "left_anti")


def output_schema(key_schema: pa.Schema, history: Any) -> Any:
    """The Spark schema of a snapshot DataFrame: key and value columns of the read view
    and ``_diff`` (long)."""
    from pyspark.sql.types import LongType, StructField, StructType

    hist, dst = history
    st = _spark_schema(pa.schema(list(key_schema) + list(hist.versions[dst])))
    return StructType([*st.fields, StructField(DIFF, LongType(), True)])


def snapshot_df(spark: Any, plan: NativePlan, key_schema: pa.Schema, prefix: str) -> Any:
    """The snapshot of ``plan`` as a DataFrame (see the module docstring); ``prefix``
    from :func:`blob_paths_root`."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StructType

    from spark.persist_reader import _to_output

    schema = output_schema(key_schema, plan.history)
    names = schema.fieldNames()
    if plan.as_of is None or (not plan.direct and plan.tail is None):
        return spark.createDataFrame([], schema)
    untouched = [p for p in plan.direct if not p.touched]
    touched = [p for p in plan.direct if p.touched]
    pieces: list[Any] = []
    if plan.merged is not None:
        # Two small local relations, of one partition each (one task, not one per
        # core, to broadcast the keys and to scan the merged rows): the tail's keys (the
        # broadcast side of the anti-join) and the merged rows (a union). One relation
        # used on both sides costs more: Spark's analyzer copies and hashes its rows
        # for each use.
        assert plan.tail_keys is not None
        if plan.direct:
            every = _direct_df(spark, plan, prefix, plan.direct)
            key_fields = StructType([schema[k] for k in key_schema.names])
            keys = spark.createDataFrame(
                _to_output(plan.tail_keys, key_fields, None, None), schema=key_fields
            )
            nulls = any(c.null_count for c in plan.tail_keys.columns)
            pieces.append(_without_keys(every, keys.coalesce(1), key_schema, nulls))
        if plan.merged.num_rows:
            pieces.append(_local_df(spark, plan.merged, schema).coalesce(1))
        if not pieces:
            return spark.createDataFrame([], schema)
    elif plan.tail is None:
        pieces.append(_direct_df(spark, plan, prefix, plan.direct))
    else:
        if untouched:
            pieces.append(_direct_df(spark, plan, prefix, untouched))
        tail = _local_df(spark, plan.tail, schema)
        if touched:
            near = _direct_df(spark, plan, prefix, touched)
            keys = F.broadcast(
                tail.select(
                    *[col(k).alias(f"__k{i}") for i, k in enumerate(key_schema.names)]
                ).distinct()
            )
            on = _on(near, keys, key_schema)
            every = [col(n) for n in names]
            pieces.append(near.join(keys, on, "left_anti").select(*every))
            merged = near.join(keys, on, "left_semi").select(*every).unionByName(tail)
            value_cols = [col(n) for n in names if n != DIFF]
            summed = merged.groupBy(*value_cols).agg(F.sum(DIFF).alias(DIFF))
            pieces.append(summed.where(F.col(DIFF) != 0).select(*every))
        else:
            pieces.append(tail)
    out: Any = pieces[0]
    for p in pieces[1:]:
        out = out.unionByName(p)
    return out
