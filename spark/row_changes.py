"""Row-level changes on a persist shard from Spark: upsert, delete and update, with the
retractions computed in the executors.

Usage (``table`` is a :class:`spark.table.PersistTable`, or anything with the attributes
of :class:`ShardTable`)::

    from spark.row_changes import delete, update, upsert

    upsert(table, updates_df)                       # key and value columns
    delete(table, "id < 100")                       # SQL string or Column
    update(table, F.col("id") == 7, {"v": "v + 1"}) # set: SQL strings or Columns

The semantics are those of :class:`persist.WriteHandle`'s ``upsert`` / ``delete`` /
``update`` (:mod:`persist.rows`): a shard's key columns identify a row; a change
retracts live rows and inserts new ones at ONE new time ``t``, the shard's upper,
planned on the live rows as of ``t - 1``, and commits only if the upper is still ``t``.
So the changes of one shard are serializable: a lost race re-reads and re-plans (with
bounded, jittered retries through tenacity), then raises
:class:`persist.rows.ChangeContended` naming the shard.

How a change runs, per attempt:

1. the driver reads the shard's upper ``t`` from a freshly fetched state;
2. Spark reads the live rows as of ``t - 1`` through ``format("persist")`` (its
   consolidated read, with ``pushdown``: an upsert passes the key range of the incoming
   rows, a delete or update its condition, so only the parts whose statistics can hold
   matching rows are read) and joins them with the incoming rows (upsert: a left-semi
   join on the key columns, nulls equal) or filters them (delete, update);
3. the executors write the retractions and insertions as batches (their parts go to
   the blob store from there) and hand the driver only the batches' bytes;
4. the driver commits them in ONE transaction at exactly ``t``
   (:meth:`persist.Txn.commit_at`: one stash append; a lost race commits nothing, and
   the attempt's parts are deleted).

A change that changes nothing writes nothing and returns ``RowChanges(t - 1, 0, 0)``. The changes are netted as :func:`persist.rows.net_changes` nets
them (summed per row, Spark's grouping making ``-0.0`` equal ``0.0`` and NaN equal NaN
as consolidation does; zero sums dropped): a row an upsert or update leaves equal is
neither written nor counted, and ``inserted``/``retracted`` are the sums of the positive
and negative net diffs, as ``WriteHandle`` counts them. Column names reach Spark quoted
(:func:`spark.names.col`).

A shard with a column Spark reads as other values (nanosecond timestamps, times and
durations: :func:`spark.row_changes_driver.converts_values`) never has a retraction
built from Spark's values: :mod:`spark.row_changes_driver` plans its changes on the rows
persist read, Spark only choosing the rows by a row identity.  Sources of the idea: Delta Lake on Spark's ``MERGE`` /
``DELETE`` / ``UPDATE`` (``DeltaTable.merge``, ``.delete(condition)``,
``.update(condition, set)``: the shapes of ``condition`` and ``set``), and Materialize's
persist-client ``compare_and_append`` contract (``src/persist-client/src/write.rs``)
for the read-plan-commit loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import pyarrow as pa

from persist.errors import InvalidUsage
from persist.rows import CHANGE_ATTEMPTS, ChangeContended, RowChanges
from spark import row_changes_driver
from spark.names import col, quote
from spark.persist_common import DIFF, ShardTarget, registered_schemas


class ShardTable(Protocol):
    """What a change needs of a table: the SparkSession and where the shard lives
    (:class:`spark.table.PersistTable` has these)."""

    spark: Any
    shard: str
    stash_url: str
    blob_uri: str


class _Race(Exception):
    """An attempt lost the race for the upper (nothing committed)."""

    def __init__(self, last: Any) -> None:
        super().__init__(str(last))
        self.last = last


def _target(table: ShardTable) -> ShardTarget:
    return ShardTarget(table.stash_url, table.blob_uri, table.shard)


def _schemas(table: ShardTable) -> tuple[pa.Schema, pa.Schema]:
    schemas = registered_schemas(_target(table))
    if schemas is None:
        raise InvalidUsage(f"shard {table.shard!r} does not exist: create it first")
    return schemas


def _column(spark: Any, expr: Any, what: str) -> Any:
    """A SQL string or Column as a Column.

    Raises:
        InvalidUsage: neither (naming ``what``)."""
    from pyspark.sql import Column
    from pyspark.sql import functions as F

    if isinstance(expr, str):
        return F.expr(expr)
    if isinstance(expr, Column):
        return expr
    raise InvalidUsage(f"{what} must be a SQL expression string or a Column, not {type(expr)}")


@contextlib.contextmanager
def _client(table: ShardTable) -> Iterator[Any]:
    from spark.persist_common import persist_client

    with persist_client(_target(table)) as client:
        yield client


def _live(table: ShardTable, as_of: int) -> Any:
    """The live rows (key, value columns and ``_diff``) of the shard as of ``as_of``."""
    return (
        table.spark.read.format("persist")
        .option("stash", table.stash_url)
        .option("blob", table.blob_uri)
        .option("as_of", str(as_of))
        .option("pushdown", "true")
        .load(table.shard)
    )


def _commit(
    table: ShardTable,
    upper: int,
    changes: Any,
    names: Sequence[str],
    counts: tuple[int, int],
) -> RowChanges:
    """Write ``changes`` (``names`` columns and ``_diff``) from the executors and commit
    them at exactly ``upper`` (nothing when there are none).

    Raises:
        _Race: the upper moved (nothing committed, the parts deleted).
    """
    from persist import UpperMismatch
    from spark.persist_txn import PersistTxn

    inserted, retracted = counts
    if inserted == 0 and retracted == 0:
        # A change that changes nothing writes nothing (as persist.rows.apply_change):
        # the shard held its result as of upper - 1 already.
        return RowChanges(upper - 1, 0, 0)
    txn = PersistTxn(table.spark, table.stash_url, table.blob_uri)
    try:
        txn.write(changes.select(*[col(n) for n in names], DIFF), table.shard, diff_column=DIFF)
        try:
            txn.commit_at(upper)
        except UpperMismatch as e:
            txn.abort()  # nothing committed: delete the parts
            raise _Race(e) from None
    finally:
        txn.close()  # aborts (deletes the parts) unless committed
    return RowChanges(upper, inserted, retracted)


ROLE = "__persist_retract"
"""The column a plan marks its retractions with (true) and its insertions (false), so
the counts go by role (:func:`_counts`), whatever the sign of a live row's count."""


def _net(changes: Any, names: Sequence[str]) -> Any:
    """``changes`` summed per row (key and value columns; Spark's grouping normalizes
    ``-0.0`` and NaN as consolidation compares them, and groups nulls), zero sums
    dropped: :func:`persist.rows.net_changes` in Spark."""
    from pyspark.sql import functions as F

    summed = changes.groupBy(*[col(n) for n in names]).agg(F.sum(DIFF).alias(DIFF))
    return summed.where(F.col(DIFF) != 0)


def _counts(changes: Any, netted: Any) -> tuple[int, int]:
    """(inserted, retracted) by role, as :func:`persist.rows.net_changes` counts them
    with ``retracting``: the retractions' (``changes`` rows with :data:`ROLE` true) and
    the insertions' absolute diffs, each less what cancelled in ``netted`` (the same
    changes summed per row)."""
    from pyspark.sql import functions as F

    d = F.abs(F.col(DIFF))
    row = changes.agg(
        F.coalesce(F.sum(F.when(F.col(ROLE), d)), F.lit(0)).alias("ret"),
        F.coalesce(F.sum(F.when(~F.col(ROLE), d)), F.lit(0)).alias("ins"),
    ).first()
    net = netted.agg(F.coalesce(F.sum(d), F.lit(0)).alias("n")).first()["n"]
    ins, ret = int(row["ins"]), int(row["ret"])
    cancelled = (ins + ret - int(net)) // 2
    return ins - cancelled, ret - cancelled


def _run(table: ShardTable, plan: Any) -> RowChanges:
    """The read-plan-commit loop: ``plan(upper)`` returns the changes DataFrame (or
    ``None`` for no read: an empty shard) planned on the live rows as of ``upper -
    1``; retried on a lost race with jittered back-off, :data:`CHANGE_ATTEMPTS` times.

    Raises:
        ChangeContended: every attempt lost the race (naming the shard).
    """
    from tenacity import (
        RetryError,
        Retrying,
        retry_if_exception_type,
        stop_after_attempt,
        wait_random_exponential,
    )

    ks, vs = _schemas(table)
    names = [*ks.names, *vs.names]
    try:
        for attempt in Retrying(
            stop=stop_after_attempt(CHANGE_ATTEMPTS),
            wait=wait_random_exponential(multiplier=0.005, max=0.5),
            retry=retry_if_exception_type(_Race),
        ):
            with attempt:
                with _client(table) as client:
                    state = client.inspect(table.shard)
                upper = state.upper.as_option()
                if upper is None:
                    raise InvalidUsage(f"shard {table.shard!r} is finalized: its upper is empty")
                since = state.since.as_option()
                if upper and since is not None and since > upper - 1:
                    raise InvalidUsage(
                        f"shard {table.shard!r}: its since {{{since}}} is beyond upper - 1 "
                        f"({upper - 1}), so the live rows cannot be read through Spark at a "
                        "time before the upper; use persist's WriteHandle for this change"
                    )
                changes = plan(upper)
                if changes is None:
                    return _commit(table, upper, None, names, (0, 0))
                changes = changes.persist()
                netted = _net(changes, names).persist()
                try:
                    counts = _counts(changes, netted)
                    return _commit(table, upper, netted, names, counts)
                finally:
                    netted.unpersist()
                    changes.unpersist()
    except RetryError as e:
        last = e.last_attempt.exception()
        assert isinstance(last, _Race)
        raise ChangeContended(repr(table.shard), CHANGE_ATTEMPTS, last.last) from None
    raise AssertionError("unreachable")  # pragma: no cover


def _conform(df: Any, ks: pa.Schema, vs: pa.Schema, shard: str) -> Any:
    """``df``'s key and value columns in the shard's order and Spark types.

    Raises:
        InvalidUsage: ``df`` lacks one or has another column (``_time``/``_diff``
            included)."""

    from spark.persist_common import arrow_to_spark

    spark_schema = arrow_to_spark(pa.schema([*ks, *vs]), shard)
    names = spark_schema.fieldNames()
    extra = [c for c in df.columns if c not in names]
    missing = [c for c in names if c not in df.columns]
    if extra or missing:
        raise InvalidUsage(
            f"upsert into shard {shard!r}: rows must have exactly the key and value columns "
            f"{names}{f'; unknown {extra}' if extra else ''}"
            f"{f'; missing {missing}' if missing else ''}"
        )
    have = {f.name: f.dataType for f in df.schema.fields}
    # Cast only what differs: Spark 4 evaluates no expression of a TIME column, a cast
    # to its own type included (UNSUPPORTED_TIME_TYPE).
    return df.select(
        *[
            col(f.name)
            if have[f.name] == f.dataType
            else col(f.name).cast(f.dataType).alias(f.name)
            for f in spark_schema
        ]
    )


def upsert(table: ShardTable, df: Any) -> RowChanges:
    """Replace, for each row of ``df``, every live row with its key by it, at one new
    time (as :meth:`persist.WriteHandle.upsert`).

    Args:
        table: the shard (see :class:`ShardTable`).
        df: a DataFrame of exactly the shard's key and value columns (matched by name,
            cast to the shard's types), each key at most once.

    Returns: :class:`persist.RowChanges` (``inserted``: rows of ``df``; ``retracted``:
        live rows replaced, with their counts).

    Raises:
        InvalidUsage: bad columns, or two rows of ``df`` with one key (naming the key
            columns and the key); nothing committed.
        ChangeContended: every attempt lost the race for the upper.
    """
    from pyspark.sql import functions as F

    ks, vs = _schemas(table)
    keys = list(ks.names)
    rows = _conform(df, ks, vs, table.shard)
    if row_changes_driver.converts_values(pa.schema([*ks, *vs])):
        return row_changes_driver.upsert(table, rows, ks, vs)
    rows = rows.persist()
    try:
        dupes = (
            rows.groupBy(*[col(k) for k in keys])
            .count()
            .where(F.col("count") > 1)
            .limit(1)
            .collect()
        )
        if dupes:
            key = [dupes[0][k] for k in keys]
            raise InvalidUsage(
                f"upsert into shard {table.shard!r}: two rows have one key {keys} = {key}; "
                "each key may appear once; nothing was committed"
            )
        bounds, n = _key_bounds(rows, keys)

        def plan(upper: int) -> Any:
            inserts = rows.withColumn(DIFF, F.lit(1).cast("long")).withColumn(ROLE, F.lit(False))
            if upper == 0 or n == 0:
                return inserts if n else None
            live = _live(table, upper - 1)
            rng = None
            for k, (lo, hi) in zip(keys, bounds, strict=True):  # statistics pruning
                if lo is None:
                    continue
                e = col(k).between(lo, hi) | col(k).isNull()
                rng = e if rng is None else rng & e
            if rng is not None:
                live = live.where(rng)
            old = live.alias("l").join(rows.alias("r"), _on(keys), "left_semi")
            retract = old.withColumn(DIFF, -F.col(DIFF)).withColumn(ROLE, F.lit(True))
            return retract.unionByName(inserts)

        return _run(table, plan)
    finally:
        rows.unpersist()


def _key_bounds(rows: Any, keys: Sequence[str]) -> tuple[list[tuple[Any, Any]], int]:
    """Each key column's least and greatest value in ``rows`` as literal Columns of its
    own type (``(None, None)``: all null), and the row count.

    A timestamp is carried as an exact number or string, never as a Python
    ``datetime``: PySpark turns a naive ``datetime`` into a zoned ``timestamp`` in the
    driver's time zone, which Spark then compares with a zone-less ``timestamp_ntz``
    column in the session's time zone, shifting the bound when the two zones differ.
    Zoned timestamps travel as microseconds since the epoch (``unix_micros``), zone-less
    ones as their text (a wall-clock value, no zone)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import TimestampNTZType, TimestampType

    types = {f.name: f.dataType for f in rows.schema.fields}
    aggs = [F.count(F.lit(1)).alias("n")]
    for i, k in enumerate(keys):
        for j, agg in enumerate((F.min, F.max)):
            c = agg(col(k))
            if isinstance(types[k], TimestampType):
                c = F.unix_micros(c)
            elif isinstance(types[k], TimestampNTZType):
                c = c.cast("string")
            aggs.append(c.alias(f"b{i}_{j}"))
    row = rows.agg(*aggs).first()
    out: list[tuple[Any, Any]] = []
    for i, k in enumerate(keys):
        ends = []
        for j in (0, 1):
            v = row[f"b{i}_{j}"]
            if v is None:
                ends.append(None)
            elif isinstance(types[k], TimestampType):
                ends.append(F.timestamp_micros(F.lit(v)))
            elif isinstance(types[k], TimestampNTZType):
                ends.append(F.lit(v).cast(TimestampNTZType()))
            else:
                ends.append(F.lit(v))
        out.append((ends[0], ends[1]))
    return out, int(row["n"])


def _on(keys: Sequence[str]) -> Any:
    """Null-safe equality of the aliases ``l`` and ``r`` on every key column (persist's
    keys compare nulls equal)."""
    from pyspark.sql import functions as F

    cond = None
    for k in keys:
        c = F.col(f"l.{quote(k)}").eqNullSafe(F.col(f"r.{quote(k)}"))
        cond = c if cond is None else cond & c
    return cond


def delete(table: ShardTable, condition: Any) -> RowChanges:
    """Retract every live row ``condition`` (a SQL string or ``Column`` over the key and
    value columns; rows where it is null are kept) holds for, at one new time (as
    :meth:`persist.WriteHandle.delete`).

    Raises:
        InvalidUsage: ``condition`` is neither a string nor a Column.
        pyspark.errors.AnalysisException: it does not apply to the shard's columns.
        ChangeContended: every attempt lost the race for the upper.
    """
    from pyspark.sql import functions as F

    cond = _column(table.spark, condition, "delete: condition")
    ks, vs = _schemas(table)
    if row_changes_driver.converts_values(pa.schema([*ks, *vs])):
        return row_changes_driver.delete(table, cond, ks, vs)

    def plan(upper: int) -> Any:
        if upper == 0:
            return None
        live = _live(table, upper - 1).where(cond)
        return live.withColumn(DIFF, -F.col(DIFF)).withColumn(ROLE, F.lit(True))

    return _run(table, plan)


def update(table: ShardTable, condition: Any, set: Mapping[str, Any]) -> RowChanges:
    """Retract every live row ``condition`` holds for and insert it again with ``set``
    (``{column: SQL expression string | Column}``, evaluated on the old row, as
    ``DeltaTable.update`` takes it), keeping its count, at one new time (as
    :meth:`persist.WriteHandle.update`).  Key columns may change, unless two live rows
    would then get one key they did not share before: two updated rows mapped to one
    key, or an updated row mapped onto the key of a live row the update does not
    change.

    Raises:
        InvalidUsage: ``set`` empty or naming a column that is not a key or value
            column; a key collision as above (naming the key); nothing committed.
        pyspark.errors.AnalysisException: an expression does not apply to the columns.
        ChangeContended: every attempt lost the race for the upper.
    """
    from pyspark.sql import functions as F

    ks, vs = _schemas(table)
    keys, names = list(ks.names), [*ks.names, *vs.names]
    if not isinstance(set, Mapping) or not set:
        raise InvalidUsage("update: set must be a non-empty {column: SQL string | Column}")
    bad = [c for c in set if c not in names]
    if bad:
        raise InvalidUsage(f"update: set names {bad}, which are not key or value columns {names}")
    cond = F.coalesce(_column(table.spark, condition, "update: condition"), F.lit(False))
    exprs = {c: _column(table.spark, v, f"update: set[{c!r}]") for c, v in set.items()}
    from spark.persist_common import arrow_to_spark

    types = {f.name: f.dataType for f in arrow_to_spark(pa.schema([*ks, *vs]), table.shard)}
    if row_changes_driver.converts_values(pa.schema([*ks, *vs])):
        cast = {c: e.cast(types[c]) for c, e in exprs.items()}
        return row_changes_driver.update(table, cond, cast, ks, vs)
    key_change = any(k in set for k in keys)

    def plan(upper: int) -> Any:
        if upper == 0:
            return None
        live = _live(table, upper - 1)
        old = live.where(cond)
        new = old.select(
            *[(exprs[c].cast(types[c]) if c in exprs else col(c)).alias(c) for c in names],
            F.col(DIFF),
            *[col(k).alias(f"_old_{i}") for i, k in enumerate(keys)],
        )
        if key_change:
            _check_keys(new, live.where(~cond), keys)
        retract = old.withColumn(DIFF, -F.col(DIFF)).withColumn(ROLE, F.lit(True))
        inserts = new.select(*[col(n) for n in names], DIFF).withColumn(ROLE, F.lit(False))
        return retract.unionByName(inserts)

    return _run(table, plan)


def _check_keys(new: Any, kept: Any, keys: Sequence[str]) -> None:
    """Refuse an update that gives two live rows one key they did not share before.

    Raises:
        InvalidUsage: naming the key columns and the key.
    """
    from pyspark.sql import functions as F

    old_key = F.struct(*[F.col(f"_old_{i}") for i in range(len(keys))])
    merged = (
        new.groupBy(*[col(k) for k in keys])
        .agg(F.countDistinct(old_key).alias("n"))
        .where(F.col("n") > 1)
        .limit(1)
        .collect()
    )
    if merged:
        raise InvalidUsage(
            f"update: two updated rows would get one key {list(keys)} = "
            f"{[merged[0][k] for k in keys]}; nothing was committed"
        )
    hit = (
        new.select(*[col(k) for k in keys])
        .distinct()
        .alias("l")
        .join(kept.select(*[col(k) for k in keys]).alias("r"), _on(keys), "left_semi")
        .limit(1)
        .collect()
    )
    if hit:
        raise InvalidUsage(
            f"update: an updated row would get the key {list(keys)} = "
            f"{[hit[0][k] for k in keys]} of a live row it does not change; nothing was "
            "committed"
        )
