"""The batch reader of the ``persist`` Spark source: fetch, consolidate and convert parts.

Invariants kept here: a task yields Arrow record batches in the DataFrame's schema (the
shard's newest value schema when the read was planned; each part is conformed from the
schema version it was written with, before consolidation); with
``consolidate=full`` the rows equal ``ReadHandle.snapshot(as_of)``: each task of a read cut
by key range (:class:`~spark.persist_planning.KeyRangePartition`) streams the snapshot's
rows of its range (:func:`persist.fetch.stream_snapshot`: a k-way merge of its parts' sorted
runs holding about one part per run in memory), and the ranges partition the key space, so
each distinct row comes from exactly one task, with no shuffle; times are advanced to the
read time and updates beyond it dropped before consolidation; the filters the reader accepted in
:meth:`PersistPushdownReader.pushFilters` (Spark no longer applies them) are applied
exactly to every row it yields, and the parts planning skipped hold no row that passes
them; it accepts none on a PySpark that would reuse the plan they made for another
query (:func:`spark_reuses_pushed_plans`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (
    DataSourceReader,
    InputPartition,
)
from pyspark.sql.types import StructType

from spark.arrow_spark import to_spark_column
from spark.persist_common import (
    DIFF,
    TIME,
    PersistSourceError,
    ReadSettings,
    open_read,
    persist_client,
)
from spark.persist_planning import (
    KeyRangePartition,
    PartsPartition,
    PushedFilter,
    filter_expression,
    plan_key_ranges,
    plan_parts,
    prune_for_filters,
    pushed_filter,
    resolve_as_of,
)

log = logging.getLogger(__name__)


def read_snapshot(
    blob: Any,
    batches: Sequence[Any],
    schema: pa.Schema,
    key_names: Sequence[str],
    value_names: Sequence[str],
    as_of: int,
    schemas: Any = None,
    filter: Any = None,
) -> pa.Table:
    """The updates of ``batches`` at ``as_of``: times ``> as_of`` dropped, the rest
    advanced to ``as_of``, consolidated (persist's ``snapshot_table``, as
    ``ReadHandle.snapshot`` does for a whole shard); with ``filter`` (an Arrow
    expression over key and value columns) only the rows it keeps.

    Raises:
        persist.errors.CorruptPart: a part is missing (compacted and garbage-collected
            during the read: retry it) or corrupt.
    """
    from persist.fetch import snapshot_table

    return snapshot_table(
        blob,
        list(batches),
        schema,
        key_names,
        value_names,
        as_of,
        schemas=schemas,
        filter=filter,
    )


def read_updates(
    blob: Any,
    batches: Sequence[Any],
    schema: pa.Schema,
    as_of: int,
    schemas: Any = None,
    filter: Any = None,
) -> pa.Table:
    """The raw updates of ``batches`` up to ``as_of``: times ``> as_of`` dropped, the rest
    kept as stored (only advanced to their batch's lower and since, as
    :func:`persist.fetch.read_batches` does), not consolidated; with ``filter`` only the
    rows it keeps.

    Raises:
        persist.errors.CorruptPart: a part is missing or corrupt.
    """
    from persist.fetch import read_batches

    return read_batches(
        blob, list(batches), schema, upper=as_of + 1, schemas=schemas, filter=filter
    )


# ---------------------------------------------------------- arrow helpers


def expand_table(table: pa.Table, shard: str) -> pa.Table:
    """Repeat each row by its ``_diff`` and drop the column.

    Raises:
        PersistSourceError: a row has a negative multiplicity.
    """
    diffs = table.column(DIFF)
    if table.num_rows and pc.min(diffs).as_py() < 0:
        raise PersistSourceError(
            f"shard {shard} has a row with negative multiplicity at this as_of; "
            "read it without expand=true to see diffs"
        )
    import numpy as np

    idx = np.repeat(np.arange(table.num_rows), diffs.to_numpy(zero_copy_only=False))
    return table.drop_columns([DIFF]).take(pa.array(idx, pa.int64()))


def _to_output(
    table: pa.Table,
    schema: StructType,
    time_column: str | None,
    diff_column: str | None,
    shard: str = "?",
) -> pa.Table:
    """Rename ``_time``/``_diff`` and convert to the exact Arrow schema Spark expects
    (:func:`spark.arrow_spark.to_spark_column`: sub-microsecond parts are floored).

    Raises:
        PersistSourceError: a value does not fit the Spark type of its column (a
            duration in seconds or milliseconds beyond Spark's microsecond range), naming
            the column and ``shard``.
    """
    from pyspark.sql.pandas.types import to_arrow_schema

    target = to_arrow_schema(schema, timezone="UTC")
    cols = []
    for f in target:
        if f.name == time_column:
            src = table.column(TIME)
        elif f.name == diff_column:
            src = table.column(DIFF)
        else:
            src = table.column(f.name)
        try:
            cols.append(to_spark_column(src, f.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise PersistSourceError(
                f"column {f.name!r} of shard {shard}: a {src.type} value does not fit "
                f"Spark's {f.type}: {e}"
            ) from None
    return pa.Table.from_arrays(cols, schema=target)


def key_range_partitions(
    batches: Sequence[Any], s: ReadSettings, as_of: int, schemas: Any = None
) -> list[InputPartition] | None:
    """The input partitions of a consolidated read cut by key range
    (:func:`~spark.persist_planning.plan_key_ranges`): ``s.partitions`` ranges, by default
    as many as a raw read has partitions (:func:`~spark.persist_planning.plan_parts`);
    ``None`` when some part has no key samples (then one partition reads everything)."""
    wanted = s.partitions
    if wanted is None:
        wanted = max(1, len(plan_parts(batches, s.partition_bytes, False)))
    history = None if schemas is None else schemas[0]  # reads schema-less inline parts
    planned = plan_key_ranges(batches, s.key_schema, wanted, history)
    if planned is None:
        log.info("shard %s has parts without key samples: one partition", s.target.shard)
        return None
    return [KeyRangePartition(group, as_of, lo, hi) for group, lo, hi in planned]


def read_key_range(
    partition: KeyRangePartition,
    s: ReadSettings,
    schema: StructType,
    filter: pc.Expression | None = None,
) -> Iterator[pa.RecordBatch]:
    """The snapshot's rows in one key range as Arrow batches of the DataFrame's schema,
    streamed range piece by range piece (:func:`persist.fetch.stream_snapshot`); with
    ``filter`` (pushed filters over key and value columns), only the rows it keeps.

    Raises:
        PersistSourceError: with ``expand=true``, a row has a negative multiplicity.
        persist.errors.CorruptPart: a part is missing or corrupt.
    """
    from persist.blob import RetryingBlob, open_blob
    from persist.fetch import stream_snapshot
    from persist.merge import decode_keys
    from persist.parts import updates_schema

    updates = updates_schema(s.key_schema, s.value_schema)
    lower = None if partition.lower is None else decode_keys([partition.lower], s.key_schema)
    upper = None if partition.upper is None else decode_keys([partition.upper], s.key_schema)
    blob = RetryingBlob(open_blob(s.target.blob_uri))
    try:
        for table in stream_snapshot(
            blob,
            partition.parts,
            updates,
            s.key_schema.names,
            s.value_schema.names,
            partition.as_of,
            key_schema=s.key_schema,
            lower=lower,
            upper=upper,
            schemas=getattr(partition, "schemas", None),
        ):
            if filter is not None:
                table = table.filter(filter)
            if s.expand:
                table = expand_table(table, s.target.shard)
            out = _to_output(table, schema, s.time_column, s.diff_column, s.target.shard)
            yield from out.to_batches(max_chunksize=64 * 1024)
    finally:
        blob.close()


class PersistBatchReader(DataSourceReader):
    """Plans one partition per part (group) at ``as_of``; reads Arrow end to end.

    Takes no filters (:class:`PersistPushdownReader` does, with ``pushdown=true``).
    Spark's Python data sources get no column pruning (PySpark 4.3 passes the full
    schema to ``DataSource.reader``), so every column is read.
    """

    def __init__(self, settings: ReadSettings, schema: StructType) -> None:
        self.settings = settings
        self.schema = schema
        self.pushed: list[PushedFilter] = []  # only PersistPushdownReader fills it

    def _columns(self) -> pa.Schema:
        s = self.settings
        return pa.schema(list(s.key_schema) + list(s.value_schema))

    def partitions(self) -> Sequence[InputPartition]:
        s = self.settings
        with (
            persist_client(s.target, readonly=s.readonly) as client,
            open_read(client, s.target.shard, s.key_schema, s.value_schema) as read,
        ):
            # since, upper and parts from one state version read after the reader's
            # since hold was taken (so the since cannot pass the time decided on).
            state = client.inspect(s.target.shard)
            as_of = resolve_as_of(state, s.as_of, s.target.shard, client.blob)
            if as_of is None:
                return []
            batches = read.snapshot_batches(as_of)
            # (schema history, this read's schema id): tasks conform each part from the
            # schema version it was written with to this read's.
            schemas = read.read_schemas()
            read.detach()  # executors read these parts later: GC keeps them meanwhile
        batches = prune_for_filters(
            batches, read.schema, self._columns(), as_of, self.pushed, schemas
        )
        if s.full:
            ranged = key_range_partitions(batches, s, as_of, schemas)
            if ranged is not None:
                for r in ranged:
                    r.schemas = schemas  # type: ignore[attr-defined]
                return ranged
        out = []
        for group in plan_parts(batches, s.partition_bytes, s.full):
            p = PartsPartition(group, as_of)
            p.schemas = schemas  # type: ignore[attr-defined]
            out.append(p)
        return out

    def read(self, partition: InputPartition | None) -> Iterator[pa.RecordBatch]:
        """The rows of one input partition as Arrow batches. When planning gave no
        partition (a shard with no complete time or no parts) PySpark still calls this
        once, with ``None`` or ``InputPartition(None)``: that is an empty read."""
        if partition is None or getattr(partition, "value", partition) is None:
            return
        if isinstance(partition, KeyRangePartition):
            filt = filter_expression(self.pushed, self._columns())
            yield from read_key_range(partition, self.settings, self.schema, filt)
            return
        if not isinstance(partition, PartsPartition):
            raise PersistSourceError(f"unexpected input partition {partition!r}")
        s = self.settings
        from persist.blob import RetryingBlob, open_blob
        from persist.parts import updates_schema

        schema = updates_schema(s.key_schema, s.value_schema)
        schemas = getattr(partition, "schemas", None)
        filt = filter_expression(self.pushed, self._columns())
        blob = RetryingBlob(open_blob(s.target.blob_uri))
        try:
            if s.consolidate == "none":
                table = read_updates(blob, partition.parts, schema, partition.as_of, schemas, filt)
            else:
                table = read_snapshot(
                    blob,
                    partition.parts,
                    schema,
                    s.key_schema.names,
                    s.value_schema.names,
                    partition.as_of,
                    schemas,
                    filt,
                )
        finally:
            blob.close()
        if s.expand:
            table = expand_table(table, s.target.shard)
        out = _to_output(table, self.schema, s.time_column, s.diff_column, s.target.shard)
        yield from out.to_batches(max_chunksize=64 * 1024)


def spark_reuses_pushed_plans() -> bool:
    """Whether the running PySpark may reuse the read plan of a query that pushed
    filters for a later query of the same DataFrame that pushes none.

    PySpark 4 does: ``PythonScanBuilder.pushFilters`` stores the plan its pushdown
    worker returns (the reader, pushed filters included, and its partitions) on the
    relation's ``PythonDataSourceV2`` (``setReadInfo``), and a scan with no filter to push
    takes its plan from there (``getOrCreateReadInfo``): ``df.filter("v = 1").count()``
    then ``df.count()`` counts only the rows with ``v = 1``.  Upstream Spark's 5.0 line
    carries a pushed plan on its scan instead (the rework that came with limit pushdown,
    SPARK-58551).  Judged by ``pyspark.__version__``, which Spark's planning worker shares
    with the driver; an unreadable version counts as reusing."""
    import re

    import pyspark

    m = re.match(r"(\d+)\.", getattr(pyspark, "__version__", ""))
    return m is None or int(m.group(1)) < 5


_REUSE_WARNED = False


class PersistPushdownReader(PersistBatchReader):
    """:class:`PersistBatchReader` that takes Spark's pushed filters (read option
    ``pushdown=true``; needs ``spark.sql.python.filterPushdown.enabled``, which
    :func:`spark.register` turns on).

    Filters on key and value columns that the source applies exactly
    (:func:`spark.persist_planning.pushed_filter`) are kept: planning skips the parts
    whose statistics show no row passes them, and each task applies them exactly; the
    others go back to Spark.

    On a PySpark that reuses a pushed plan for later queries of the same DataFrame
    (:func:`spark_reuses_pushed_plans`: every PySpark 4), a plan made with pushed
    filters would answer a later unfiltered query with the filtered rows, and nothing
    the source sees tells the two queries apart.  There the reader takes no filter: each
    goes back to Spark, which filters the rows itself (correct for every query, without
    the pruning), and a warning says so once per process.
    """

    def pushFilters(self, filters: list[Any]) -> list[Any]:
        """Keep the filters the source applies exactly; return the others to Spark
        (all of them where :func:`spark_reuses_pushed_plans`)."""
        if spark_reuses_pushed_plans():
            global _REUSE_WARNED
            if not _REUSE_WARNED and filters:
                _REUSE_WARNED = True
                import pyspark

                log.warning(
                    "persist source: pushdown=true takes no filters on PySpark %s, which "
                    "would reuse a filtered query's plan for later queries of the same "
                    "DataFrame; Spark filters the rows itself",
                    getattr(pyspark, "__version__", "?"),
                )
            return list(filters)
        columns = self._columns()
        rest = []
        for f in filters:
            p = pushed_filter(f, columns)
            if p is None:
                rest.append(f)
            else:
                self.pushed.append(p)
        return rest


# ------------------------------------------------------------- streaming
