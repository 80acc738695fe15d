"""The batch reader of the ``persist`` Spark source: fetch, consolidate and convert parts.

Invariants kept here: a task yields Arrow record batches in the DataFrame's schema; with
``consolidate=full`` the rows equal ``ReadHandle.snapshot(as_of)``; times are advanced to
the read time and updates beyond it dropped before consolidation.
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
from spark.persist_planning import PartsPartition, plan_parts, resolve_as_of

log = logging.getLogger(__name__)


def read_snapshot(
    blob: Any,
    batches: Sequence[Any],
    schema: pa.Schema,
    key_names: Sequence[str],
    value_names: Sequence[str],
    as_of: int,
) -> pa.Table:
    """The updates of ``batches`` at ``as_of``: times ``> as_of`` dropped, the rest
    advanced to ``as_of``, consolidated (persist's ``snapshot_table``, as
    ``ReadHandle.snapshot`` does for a whole shard).

    Raises:
        persist.errors.CorruptPart: a part is missing (compacted and garbage-collected
            during the read: retry it) or corrupt.
    """
    from persist.read import snapshot_table

    return snapshot_table(blob, list(batches), schema, key_names, value_names, as_of)


def read_updates(blob: Any, batches: Sequence[Any], schema: pa.Schema, as_of: int) -> pa.Table:
    """The raw updates of ``batches`` up to ``as_of``: times ``> as_of`` dropped, the rest
    kept as stored (only advanced to their batch's lower and since, as
    :func:`persist.read.read_batches` does), not consolidated.

    Raises:
        persist.errors.CorruptPart: a part is missing or corrupt.
    """
    from persist.read import read_batches

    return read_batches(blob, list(batches), schema, upper=as_of + 1)


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
    """Plans one partition per part (group) at ``as_of``; reads Arrow end to end."""

    def __init__(self, settings: ReadSettings, schema: StructType) -> None:
        self.settings = settings
        self.schema = schema

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
        blob = RetryingBlob(open_blob(s.target.blob_uri))
        try:
            if s.consolidate == "none":
                table = read_updates(blob, partition.parts, schema, partition.as_of)
            else:
                table = read_snapshot(
                    blob,
                    partition.parts,
                    schema,
                    s.key_schema.names,
                    s.value_schema.names,
                    partition.as_of,
                )
        finally:
            blob.close()
        if s.expand:
            table = expand_table(table, s.target.shard)
        out = _to_output(table, self.schema, s.time_column, s.diff_column)
        yield from out.to_batches(max_chunksize=64 * 1024)


# ------------------------------------------------------------- streaming
