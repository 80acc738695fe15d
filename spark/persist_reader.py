"""The batch reader of the ``persist`` Spark source: fetch, consolidate and convert parts.

Invariants kept here: a task yields Arrow record batches in the DataFrame's schema; with
``consolidate=full`` the rows equal ``ReadHandle.snapshot(as_of)``; times are advanced to
the read time and updates beyond it dropped before consolidation; the filters the reader
accepted in :meth:`PersistPushdownReader.pushFilters` (Spark no longer applies them) are
applied exactly to every row it yields, and the parts planning skipped hold no row that
passes them.
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

from spark.persist_common import DIFF, TIME, PersistSourceError, ReadSettings, persist_client
from spark.persist_planning import (
    PartsPartition,
    PushedFilter,
    filter_expression,
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
    from persist.read import snapshot_table

    return snapshot_table(blob, list(batches), schema, key_names, value_names, as_of, filter=filter)


def read_updates(
    blob: Any, batches: Sequence[Any], schema: pa.Schema, as_of: int, filter: Any = None
) -> pa.Table:
    """The raw updates of ``batches`` up to ``as_of``: times ``> as_of`` dropped, the rest
    kept as stored (only advanced to their batch's lower and since, as
    :func:`persist.read.read_batches` does), not consolidated; with ``filter`` only the
    rows it keeps.

    Raises:
        persist.errors.CorruptPart: a part is missing or corrupt.
    """
    from persist.read import read_batches

    return read_batches(blob, list(batches), schema, upper=as_of + 1, filter=filter)


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
    table: pa.Table, schema: StructType, time_column: str | None, diff_column: str | None
) -> pa.Table:
    """Rename ``_time``/``_diff`` and cast to the exact Arrow schema Spark expects."""
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
        cols.append(src.cast(f.type))
    return pa.Table.from_arrays(cols, schema=target)


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
            persist_client(s.target) as client,
            client.open_reader(s.target.shard, s.key_schema, s.value_schema) as read,
        ):
            as_of = resolve_as_of(read, s.as_of, s.target.shard)
            if as_of is None:
                return []
            batches = read.snapshot_batches(as_of)
            read.detach()  # executors read these parts later: GC keeps them meanwhile
        batches = prune_for_filters(batches, read.schema, self._columns(), as_of, self.pushed)
        return [
            PartsPartition(group, as_of) for group in plan_parts(batches, s.partition_bytes, s.full)
        ]

    def read(self, partition: InputPartition | None) -> Iterator[pa.RecordBatch]:
        """The rows of one input partition as Arrow batches. When planning gave no
        partition (a shard with no complete time or no parts) PySpark still calls this
        once, with ``None`` or ``InputPartition(None)``: that is an empty read."""
        if partition is None or getattr(partition, "value", partition) is None:
            return
        if not isinstance(partition, PartsPartition):
            raise PersistSourceError(f"unexpected input partition {partition!r}")
        s = self.settings
        from persist.blob import open_blob
        from persist.client import RetryingBlob
        from persist.parts import updates_schema

        schema = updates_schema(s.key_schema, s.value_schema)
        filt = filter_expression(self.pushed, self._columns())
        blob = RetryingBlob(open_blob(s.target.blob_uri))
        try:
            if s.consolidate == "none":
                table = read_updates(blob, partition.parts, schema, partition.as_of, filt)
            else:
                table = read_snapshot(
                    blob,
                    partition.parts,
                    schema,
                    s.key_schema.names,
                    s.value_schema.names,
                    partition.as_of,
                    filt,
                )
        finally:
            blob.close()
        if s.expand:
            table = expand_table(table, s.target.shard)
        out = _to_output(table, self.schema, s.time_column, s.diff_column)
        yield from out.to_batches(max_chunksize=64 * 1024)


class PersistPushdownReader(PersistBatchReader):
    """:class:`PersistBatchReader` that takes Spark's pushed filters (read option
    ``pushdown=true``; needs ``spark.sql.python.filterPushdown.enabled``, which
    :func:`spark.register` turns on).

    Filters on key and value columns that the source applies exactly
    (:func:`spark.persist_planning.pushed_filter`) are kept: planning skips the parts
    whose statistics show no row passes them, and each task applies them exactly; the
    others go back to Spark.

    Not the default because of PySpark 4.3's planning cache: Spark keeps the reader a
    filtered query planned on the DataFrame (or temporary view) and reuses it, pushed
    filters included, for a later query of the same DataFrame that has no filter to
    push, which then sees only the earlier query's rows. With ``pushdown=true``, load a
    fresh DataFrame for each query.
    """

    def pushFilters(self, filters: list[Any]) -> list[Any]:
        """Keep the filters the source applies exactly; return the others to Spark."""
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
