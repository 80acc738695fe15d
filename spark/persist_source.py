"""The ``persist`` Spark data source: read, write and stream persist shards.

Batch read::

    spark.read.format("persist").option("stash", STASH_URL).option("blob", BLOB_URI)
         .option("as_of", 42).load("flights")

gives the shard's contents at ``as_of`` (default: the latest complete time, ``upper - 1``;
for a closed shard, upper ``{}``, the latest time any update has:
:func:`spark.persist_planning.resolve_as_of`). Each column reads in the Spark type that
holds its values (:mod:`spark.arrow_spark`: unsigned integers widen, sub-microsecond
times are floored).
What the rows are depends on ``consolidate``:

* ``full`` (the default): the snapshot, equal to ``ReadHandle.snapshot(as_of)``: each
  distinct (key, value) row once, its multiplicity in the diff column (``_diff``, renamed
  with ``diff_column``), rows whose updates cancel absent. The read is cut by key range
  with no shuffle: planning cuts the key space into ``partitions`` ranges (default: as
  many as a raw read has partitions) from the parts' key samples, each input partition
  holds every part overlapping its range, and its task streams the k-way merge of those
  parts' sorted runs restricted to its range, so all updates of a key meet in one task
  and each distinct row appears once in the DataFrame. A shard holding parts written
  before key samples were recorded is read by one task (one input partition);
* ``partition``: updates consolidated within each input partition only (one per part, or
  per group of small parts up to ``partition_bytes``, default 128 MiB of Parquet); a row
  may appear in several partitions with partial diffs: summing the diff per distinct row
  (:func:`consolidated`) gives the snapshot;
* ``none``: the raw updates with times ``<= as_of``, as stored (times only advanced to
  their batch's since), one partition per part (group); ``time_column`` shows their
  times.

``pushdown=true`` pushes Spark's simple filters on key and value columns to the source:
planning skips parts whose statistics exclude them and tasks apply them exactly
(:class:`spark.persist_reader.PersistPushdownReader`), on a PySpark that plans each
query's pushed filters afresh; PySpark 4 reuses a filtered query's plan for later
queries of the same DataFrame, so there the reader takes no filter and Spark filters
(:func:`spark.persist_reader.spark_reuses_pushed_plans`). ``expand=true`` (only with ``full``) drops
the diff column and repeats each row by its multiplicity (a negative multiplicity raises).
``time_column`` adds the read time (``as_of``, or the update's time with ``consolidate=none``). Each
task fetches its parts from the blob store, advances times, drops later updates, consolidates and
yields Arrow ``RecordBatch``es (no row-at-a-time conversion on either side). Planning keeps each
sliced batch's runs, so a task never takes parts of several runs for one consolidated run.
A shard with no complete time yet (created by an empty write) reads as an empty
DataFrame with its schema. Timestamps with a time zone read as Spark ``timestamp``
(same instant), those without as ``timestamp_ntz`` (same wall-clock value), whatever
the session time zone.

Batch write::

    df.write.format("persist").option("stash", ...).option("blob", ...)
      .option("key_columns", "id").option("time_column", "day").mode("append").save("flights")

Each task builds one batch with the shard's batch builder (parts go to the blob store from
the executor) and returns it as a transmittable batch in its commit message; the driver
commits all of them with one ``compare_and_append_batch``. On an upper race only that
metadata step is retried (no part is uploaded twice): the batches' timestamps are
rewritten in metadata (``Batch.rewrite_ts``) when the write's times allow it. If any task
fails, or the commit fails for good, ``abort`` deletes the uploaded batches that the shard
does not reference; parts of tasks that died without reporting are left for persist's GC.

Only ``mode("append")`` works (see :data:`SAVE_MODES`). Columns are matched to an
existing shard's by name, in any order, and cast to the shard's types when that is a
safe widening; a ``_diff`` column is the diff column unless ``diff_column`` says
otherwise, so a DataFrame read from the source writes back without options. Every
option name is checked (:data:`READ_OPTIONS`, :data:`WRITE_OPTIONS`): an unknown one or
a malformed boolean raises, suggesting the closest valid name. A write ignores the
read-shaping options (:data:`~spark.persist_common.READ_SHAPE_OPTIONS`, which ``INSERT
INTO`` a SQL view made with them passes on) and refuses ``as_of``: a time-travel view is
read-only. ``key_columns`` identify and
order rows but are not unique: a shard may hold several rows with one key;
``unique_keys=true`` refuses a write that inserts a key more than once (the positive
diffs of its updates sum to more than 1), checked over the whole write before it
commits, not against the rows already in the shard. ``mergeSchema=true`` evolves an
existing shard's schema to take the DataFrame (Delta Lake's option; persist's compatible
schema evolution): extra columns become nullable value columns, wider types
widen the shard's; without it, extra columns raise naming them. A read returns the
shard's newest schema, older parts conformed to it.

Times: ``time_column`` (an integer column), or ``time`` (one fixed time for every row), or
neither: "at the shard's upper", i.e. the whole write lands at one new time equal to the
upper at commit (a racing writer pushes it one later). ``diff_column`` gives diffs (else 1).
``upper`` sets the shard's new upper (default: the largest time written + 1).
``compaction`` (``off`` by default, ``inline``, ``background``) is the committing client's
compaction mode: with ``off`` merge requests wait for ``persist compact`` or
:mod:`spark.jobs.compact`. Another Python thread than the one that built the session must
call :func:`spark.activate` first (Spark resolves Python sources per thread). The shard is
created on the first write: keys are ``key_columns`` (default: every column that is not a
value, time or diff column), values ``value_columns`` (default: none; or every remaining
column when only ``key_columns`` is given).

Streaming read (``spark.readStream.format("persist")``): the first micro-batch is the
snapshot at ``as_of`` (default: the latest complete time when the query starts), later ones
hold the updates committed after it, read through ``ReadHandle.listen``, with their diffs
in ``_diff`` and, with ``time_column``, their real times. Offsets are ``{"as_of": t}``:
everything at times ``<= t`` has been delivered; the reader's lease holds the shard's
since at the last committed offset so that compaction never advances times a later
micro-batch still has to tell apart.

The source is split by concept: :mod:`spark.persist_common` (options, settings, schema
conversions), :mod:`spark.persist_planning` (which parts each input partition reads),
:mod:`spark.persist_reader` (the batch reader), :mod:`spark.persist_stream` (the stream
reader), :mod:`spark.persist_writer` (the writer) and :mod:`spark.persist_stream_writer`
(exactly-once streaming writes: ``df.writeStream.format("persist")``); this module holds the
:class:`PersistDataSource` that ties them together.

Invariants: commit messages and partitions carry only picklable metadata and transmittable
batch bytes, never data; a committed write is exactly the union of its tasks' batches; a
write that raised committed nothing (an indeterminate stash outcome is reported as such and
its batches are not deleted while the shard may reference them). Spark's Python workers
are other processes: the stash must be a database URL (``sqlite:////abs/path.db``,
``postgresql+psycopg://...``) and the blob a URI every worker can reach.
"""

from __future__ import annotations

import logging
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
)
from pyspark.sql.types import LongType, StructField, StructType

from spark.options import check_names
from spark.persist_common import (
    CONSOLIDATE_MODES,
    DEFAULT_PARTITION_BYTES,
    DIFF,
    READ_OPTIONS,
    PersistSourceError,
    ReadSettings,
    ShardTarget,
    _opt,
    _opt_int,
    _truthy,
    arrow_to_spark,
    check_write_options,
    registered_schemas,
)
from spark.persist_reader import PersistBatchReader, PersistPushdownReader
from spark.persist_stream import PersistStreamReader
from spark.persist_writer import SAVE_MODES, PersistWriter, WriteSettings

log = logging.getLogger(__name__)


#: Table properties Spark's session catalog adds to the options of a table made by
#: ``CREATE TABLE ... USING persist OPTIONS (...)`` (besides the options themselves).
CATALOG_PROPERTIES = frozenset({"owner", "provider", "comment", "location", "external"})


def catalog_options(options: Any) -> Any:
    """The options of a ``CREATE TABLE ... USING persist`` table as the source takes them.

    Spark's session catalog hands a Python data source the table's options prefixed
    ``option.`` along with table properties (``owner``, ``provider``); this strips the
    prefix and drops those properties, so that a catalog table reads and writes as
    ``format("persist").options(...)`` does. Options without any ``option.`` key are
    returned unchanged.

    Raises:
        PersistSourceError: an option is given both with and without the prefix, with
            different values.
    """
    prefixed = [k for k in options if k.lower().startswith("option.")]
    if not prefixed:
        return options
    for k in prefixed:
        name, value = k[len("option.") :], options[k]
        if name in options and options[name] != value:
            from stash import redact

            raise PersistSourceError(
                f"option {name!r} is given twice, as {redact(str(options[name]))!r} and "
                f"{redact(str(value))!r}"
            )
        del options[k]
        options[name] = value
    for k in [k for k in options if k.lower() in CATALOG_PROPERTIES]:
        del options[k]
    return options


def _target(options: Any) -> ShardTarget:
    """:meth:`ShardTarget.from_options`, explaining the SQL case where Spark drops the
    options: a table made by ``CREATE TABLE ... USING persist OPTIONS (...)`` is read and
    written with none of its options (PySpark 4.3 passes a Python data source only the
    ``WITH (...)`` options of the query).

    Raises:
        PersistSourceError: an option is missing.
    """
    if not any(_opt(options, n) for n in ("stash", "blob", "shard", "path")):
        raise PersistSourceError(
            "the persist source needs options stash, blob and shard, and got none of them. "
            "In SQL, Spark hands a Python data source no options of a table made by "
            "CREATE TABLE ... USING persist OPTIONS (...); use CREATE TEMPORARY VIEW name "
            "USING persist OPTIONS (stash '...', blob '...', shard '...') instead"
        )
    return ShardTarget.from_options(options)


class PersistDataSource(DataSource):
    """``format("persist")``: batch read/write and streaming read of a persist shard.

    Also usable from SQL: ``CREATE TEMPORARY VIEW v USING persist OPTIONS (...)``, then
    ``SELECT`` and ``INSERT INTO v``. ``CREATE TABLE t USING persist OPTIONS (...)``
    succeeds (:func:`catalog_options`), but Spark then reads and writes ``t`` without
    its options, which :func:`_target` reports.
    """

    def __init__(self, options: Any) -> None:
        super().__init__(catalog_options(options))

    @classmethod
    def name(cls) -> str:
        return "persist"

    # ------------------------------------------------------------- reading
    def _read_settings(self, streaming: bool) -> ReadSettings:
        what = "a streaming read of the persist source" if streaming else "reading a persist shard"
        check_names(self.options, READ_OPTIONS, what, PersistSourceError)
        target = _target(self.options)
        expand = _truthy(self.options, "expand")
        if expand and streaming:
            raise PersistSourceError("expand=true is not available for streaming reads")
        consolidate = (_opt(self.options, "consolidate") or "full").lower()
        if consolidate not in CONSOLIDATE_MODES:
            raise PersistSourceError(
                f"option consolidate must be one of {', '.join(CONSOLIDATE_MODES)}, "
                f"got {consolidate!r}"
            )
        if expand and consolidate != "full":
            raise PersistSourceError(
                f"expand=true repeats each row of the consolidated snapshot; it cannot be "
                f"combined with consolidate={consolidate}"
            )
        partition_bytes = _opt_int(self.options, "partition_bytes")
        if partition_bytes is not None and partition_bytes <= 0:
            raise PersistSourceError(
                f"option partition_bytes must be a positive number of bytes, got {partition_bytes}"
            )
        partitions = _opt_int(self.options, "partitions")
        if partitions is not None and partitions <= 0:
            raise PersistSourceError(
                f"option partitions must be a positive number of key ranges, got {partitions}"
            )
        as_of = _opt_int(self.options, "as_of")
        schemas = registered_schemas(target)
        if schemas is None:
            from stash import redact

            raise PersistSourceError(
                f"persist shard {target.shard} does not exist in {redact(target.stash_url)}; "
                "write to it first"
            )
        time_column = _opt(self.options, "time_column")
        diff_column = None if expand else (_opt(self.options, "diff_column") or DIFF)
        names = {n.lower() for n in [*schemas[0].names, *schemas[1].names]}
        for extra in (time_column, diff_column):
            if extra is not None and extra.lower() in names:
                raise PersistSourceError(
                    f"column name {extra!r} for time/diff is already a key or value column "
                    "(column names are compared ignoring case, as Spark does)"
                )
        if (
            time_column is not None
            and diff_column is not None
            and (time_column.lower() == diff_column.lower())
        ):
            raise PersistSourceError(f"time_column and diff_column are both {time_column!r}")
        return ReadSettings(
            target=target,
            key_schema=schemas[0],
            value_schema=schemas[1],
            as_of=as_of,
            time_column=time_column,
            diff_column=diff_column,
            partition_bytes=partition_bytes or DEFAULT_PARTITION_BYTES,
            consolidate=consolidate,
            expand=expand,
            partitions=partitions,
            pushdown=_truthy(self.options, "pushdown"),
            readonly=_truthy(self.options, "readonly"),
        )

    @staticmethod
    def _output_schema(s: ReadSettings) -> StructType:
        columns = pa.schema(list(s.key_schema) + list(s.value_schema))
        fields = list(arrow_to_spark(columns, s.target.shard).fields)
        if s.time_column is not None:
            fields.append(StructField(s.time_column, LongType(), True))
        if s.diff_column is not None:
            fields.append(StructField(s.diff_column, LongType(), True))
        return StructType(fields)

    def schema(self) -> StructType:
        """Key columns, value columns, then the time column (if asked) and diff column."""
        return self._output_schema(self._read_settings(False))

    def reader(self, schema: StructType) -> DataSourceReader:
        s = self._read_settings(False)
        return (PersistPushdownReader if s.pushdown else PersistBatchReader)(s, schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return PersistStreamReader(self._read_settings(True), schema)

    # ------------------------------------------------------------- writing
    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        """Exactly-once streaming writes (:mod:`spark.persist_stream_writer`)."""
        from spark.persist_stream_writer import stream_writer

        return stream_writer(self.options, schema, overwrite)

    def writer(self, schema: StructType, overwrite: bool) -> PersistWriter:
        check_write_options(self.options)
        if overwrite:
            raise PersistSourceError(SAVE_MODES)
        target = _target(self.options)
        return PersistWriter(
            WriteSettings.from_options(self.options, schema, registered_schemas(target))
        )


# ------------------------------------------------------------------ helpers
def consolidated(df: Any, diff_column: str = DIFF, time_column: str | None = None) -> Any:
    """Globally consolidate a DataFrame read from the persist source: sum the diff per
    distinct row (all columns but the diff and time columns) and drop zero sums.

    Returns a DataFrame with the same columns (the time column, if any, is dropped).
    """
    from pyspark.sql import functions as F

    cols = [c for c in df.columns if c not in (diff_column, time_column)]
    return (
        df.groupBy(*cols).agg(F.sum(diff_column).alias(diff_column)).where(F.col(diff_column) != 0)
    )
