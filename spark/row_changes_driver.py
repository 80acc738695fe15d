"""Row-level changes from Spark on shards whose values Spark converts: planned on the
driver on the rows persist read, Spark only choosing the rows and computing new values.

Spark holds timestamps, times and durations in microseconds
(:mod:`spark.arrow_spark`): a ``timestamp[ns]``, ``time64[ns]`` or ``duration[ns]``
column reads truncated; other types read as other Spark types (unsigned integers,
fixed-size binaries). A retraction built from such a value would not cancel the stored
row (the row stays live and a phantom row with ``_diff -1`` appears), and two keys that
differ below the microsecond would read as one. So on a shard with such a column
(:func:`converts_values`) a change never rebuilds a stored value from what Spark
returned:

* **delete / update**: the driver reads the live rows through persist
  (:meth:`persist.WriteHandle.read_live`), numbers them (a row identity, ``__row``) and
  hands Spark a copy (``createDataFrame``); Spark evaluates the condition and the ``set``
  expressions on it and returns only the numbers of the matching rows and the new
  values of the ``set`` columns. The retractions are the stored rows with those numbers,
  as persist read them; an updated row keeps every column ``set`` does not name exactly
  as stored;
* **upsert**: the incoming DataFrame's rows are collected as Arrow
  (``DataFrame.toArrow``), cast exactly to the shard's types, and upserted by
  :meth:`persist.WriteHandle.upsert` itself.

The planning is persist's own (:func:`persist.rows.plan_delete`, :func:`plan_update`,
:func:`apply_change`): key identity, counts and the read-plan-commit loop are those of
``WriteHandle``, so both give the same shard and the same ``RowChanges``. The rows pass
through the driver: this path is for shards of such types, where exactness rules;
others take :mod:`spark.row_changes`, whose retractions the executors compute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from persist.errors import InvalidUsage
from persist.rows import Planned, RowChanges

__all__ = ["converts_values", "delete", "update", "upsert"]

ROW = "__row"
"""The row identity column Spark sees: the row's position in the live rows read."""


def converts_values(schema: pa.Schema) -> bool:
    """Whether Spark holds some column of ``schema`` as other values or in a type it
    does not compare as persist does: any column but those Spark's Parquet reader reads
    as stored (:func:`spark.native_plan.native_type`: signed integers, floats, booleans,
    strings, binaries, ``date32``, timestamps of second to microsecond units, decimals up
    to 38 digits). Nanosecond timestamps, times and durations read truncated; unsigned
    integers, fixed-size binaries, times and durations read in other types."""
    from spark.native_plan import native_type

    return not all(native_type(f.type) for f in schema)


@contextlib.contextmanager
def _writer(table: Any, ks: pa.Schema, vs: pa.Schema) -> Iterator[Any]:
    from spark.persist_common import ShardTarget, persist_client

    target = ShardTarget(table.stash_url, table.blob_uri, table.shard)
    with persist_client(target) as client, client.open_writer(table.shard, ks, vs) as w:
        yield w


def _exact(arrow: pa.Table, schema: pa.Schema, what: str) -> pa.Table:
    """``arrow``'s ``schema`` columns cast exactly (pyarrow's safe cast) to their types.

    Raises:
        InvalidUsage: a value that does not convert exactly (naming the column)."""
    cols = []
    for f in schema:
        try:
            cols.append(arrow.column(f.name).cast(f.type, safe=True))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise InvalidUsage(
                f"{what}: column {f.name!r} ({arrow.column(f.name).type}) does not convert "
                f"exactly to {f.type}: {e}; nothing was committed"
            ) from None
    return pa.Table.from_arrays(cols, schema=schema)


def upsert(table: Any, rows: Any, ks: pa.Schema, vs: pa.Schema) -> RowChanges:
    """Upsert ``rows`` (a DataFrame of the key and value columns, conformed to the
    shard's Spark types) through :meth:`persist.WriteHandle.upsert`."""
    arrow = rows.toArrow()
    exact = _exact(arrow, pa.schema([*ks, *vs]), f"upsert into shard {table.shard!r}")
    with _writer(table, ks, vs) as w:
        result: RowChanges = w.upsert(exact)
    return result


def _chosen(
    table: Any, live: pa.Table, ks: pa.Schema, vs: pa.Schema, pick: Callable[[Any], Any]
) -> pa.Table:
    """``pick`` (a DataFrame of the live rows as Spark reads them, with ``__row``, to a
    DataFrame of ``__row`` and other columns) collected as Arrow."""
    from pyspark.sql.types import LongType, StructField, StructType

    from spark.persist_common import arrow_to_spark
    from spark.persist_reader import _to_output

    fields = arrow_to_spark(pa.schema([*ks, *vs]), table.shard).fields
    schema = StructType([*fields, StructField("_diff", LongType()), StructField(ROW, LongType())])
    numbered = live.append_column(ROW, pa.array(range(live.num_rows), pa.int64()))
    df = table.spark.createDataFrame(_to_output(numbered, schema, None, "_diff"), schema=schema)
    out: pa.Table = pick(df).toArrow()
    return out


def delete(table: Any, cond: Any, ks: pa.Schema, vs: pa.Schema) -> RowChanges:
    """Retract the live rows ``cond`` (a Column) holds for, chosen by Spark on a copy of
    the live rows read by persist (see the module docstring)."""
    from pyspark.sql import functions as F

    from persist import rows as rows_mod

    keys, values = ks.names, vs.names
    with _writer(table, ks, vs) as w:

        def plan(read: Callable[[pc.Expression | None], pa.Table], upper: int) -> Planned:
            live = read(None)
            got = _chosen(table, live, ks, vs, lambda df: df.where(cond).select(F.col(ROW)))
            return rows_mod.plan_delete(live.take(got.column(ROW)), keys, values)

        result: RowChanges = rows_mod.apply_change(w, plan)
    return result


def update(
    table: Any, cond: Any, exprs: Mapping[str, Any], ks: pa.Schema, vs: pa.Schema
) -> RowChanges:
    """Set the ``exprs`` columns (Columns, cast to the shard's Spark types) of the live
    rows ``cond`` holds for: Spark chooses the rows and computes the new values on a
    copy of the live rows read by persist; :func:`persist.rows.plan_update` retracts the
    stored rows and inserts them with those values (see the module docstring)."""
    from pyspark.sql import functions as F

    from persist import rows as rows_mod

    keys, values = ks.names, vs.names
    schema = pa.schema([*ks, *vs])
    sets = {c: f"__set{i}" for i, c in enumerate(exprs)}
    with _writer(table, ks, vs) as w:

        def pick(df: Any) -> Any:
            cols = [exprs[c].alias(sets[c]) for c in exprs]
            return df.where(cond).select(F.col(ROW), *cols)

        def plan(read: Callable[[pc.Expression | None], pa.Table], upper: int) -> Planned:
            live = read(None)
            got = _chosen(table, live, ks, vs, pick)
            old = live.take(got.column(ROW))
            for c, name in sets.items():
                col = got.column(name)
                try:
                    old = old.append_column(name, col.cast(schema.field(c).type, safe=True))
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                    raise InvalidUsage(
                        f"update of shard {table.shard!r}: the new values of column {c!r} "
                        f"({col.type}) do not convert exactly to {schema.field(c).type}: "
                        f"{e}; nothing was committed"
                    ) from None
            changes = {c: pc.field(name) for c, name in sets.items()}
            return rows_mod.plan_update(old, changes, keys, values, live)

        result: RowChanges = rows_mod.apply_change(w, plan)
    return result
