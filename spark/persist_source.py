"""The ``persist`` Spark data source: read, write and stream persist shards.

Batch read::

    spark.read.format("persist").option("stash", STASH_URL).option("blob", BLOB_URI)
         .option("as_of", 42).load("flights")

gives the shard's contents at ``as_of`` (default: the latest complete time, ``upper - 1``).
What the rows are depends on ``consolidate``:

* ``full`` (the default): the snapshot, equal to ``ReadHandle.snapshot(as_of)``: each
  distinct (key, value) row once, its multiplicity in the diff column (``_diff``, renamed
  with ``diff_column``), rows whose updates cancel absent. Every part is read by one task
  (one input partition), so all updates that could cancel meet in the same
  consolidation; issue 16's key-range planning will split this read without a shuffle;
* ``partition``: updates consolidated within each input partition only (one per part, or
  per group of small parts up to ``partition_bytes``, default 128 MiB of Parquet); a row
  may appear in several partitions with partial diffs: summing the diff per distinct row
  (:func:`consolidated`) gives the snapshot;
* ``none``: the raw updates with times ``<= as_of``, as stored (times only advanced to
  their batch's since), one partition per part (group); ``time_column`` shows their
  times.

``expand=true`` (only with ``full``) drops the diff column and repeats each row by its
multiplicity (a negative multiplicity raises). ``time_column`` adds the read time
(``as_of``, or the update's time with ``consolidate=none``). Each task fetches its parts
from the blob store, advances times, drops later updates, consolidates and yields Arrow
``RecordBatch``es (no row-at-a-time conversion on either side). Planning keeps each
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
a malformed boolean raises, suggesting the closest valid name. ``key_columns`` identify and
order rows but are not unique: a shard may hold several rows with one key;
``unique_keys=true`` refuses a write that inserts a key more than once (the positive
diffs of its updates sum to more than 1), checked over the whole write before it
commits, not against the rows already in the shard.

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

Invariants: commit messages and partitions carry only picklable metadata and transmittable
batch bytes, never data; a committed write is exactly the union of its tasks' batches; a
write that raised committed nothing (an indeterminate stash outcome is reported as such and
its batches are not deleted while the shard may reference them). Spark's Python workers
are other processes: the stash must be a database URL (``sqlite:////abs/path.db``,
``postgresql+psycopg://...``) and the blob a URI every worker can reach.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.types import LongType, StructField, StructType

from spark.options import check_names, parse_bool

log = logging.getLogger(__name__)

TIME = "_time"
"""Name of the time column in persist parts and updates tables."""
DIFF = "_diff"
"""Name of the diff column in persist parts and updates tables."""

DEFAULT_PARTITION_BYTES = 128 * 1024 * 1024
"""Parts are grouped into one input partition up to this many Parquet bytes."""

HEARTBEAT_SECONDS = 10.0
"""How often a streaming read renews its lease while idle."""

COMMIT_ATTEMPTS = 50
"""How many times ``commit`` retries ``compare_and_append_batch`` after upper races."""


class PersistSourceError(ValueError):
    """The persist source was asked for something it cannot do (bad or missing option,
    unknown shard, a time before the shard's upper, a negative multiplicity to expand)."""


# ---------------------------------------------------------------- options
def _opt(options: Any, name: str) -> str | None:
    value = options.get(name)
    if value is None:
        return None
    value = str(value).strip()
    return value or None


def _opt_int(options: Any, name: str) -> int | None:
    raw = _opt(options, name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise PersistSourceError(f"option {name!r} must be an integer, got {raw!r}") from None


def _opt_list(options: Any, name: str) -> list[str] | None:
    raw = _opt(options, name)
    if raw is None:
        return None
    return [c.strip() for c in raw.split(",") if c.strip()]


def _truthy(options: Any, name: str) -> bool:
    return parse_bool(name, _opt(options, name), False, PersistSourceError)


READ_OPTIONS = (
    "stash",
    "blob",
    "path",
    "shard",
    "as_of",
    "time_column",
    "diff_column",
    "partition_bytes",
    "consolidate",
    "expand",
)
"""Every option a read (batch or streaming) of the persist source understands."""

WRITE_OPTIONS = (
    "stash",
    "blob",
    "path",
    "shard",
    "key_columns",
    "value_columns",
    "time_column",
    "time",
    "diff_column",
    "upper",
    "compaction",
    "unique_keys",
)
"""Every option a write to the persist source understands."""

CONSOLIDATE_MODES = ("full", "partition", "none")
"""Values of the read option ``consolidate`` (see the module docstring)."""


@dataclass(frozen=True)
class ShardTarget:
    """Where a shard lives: stash URL (consensus), blob URI (parts) and shard name."""

    stash_url: str
    blob_uri: str
    shard: str

    @classmethod
    def from_options(cls, options: Any) -> ShardTarget:
        """Read ``stash``, ``blob`` and ``path``/``shard`` from data source options.

        Raises:
            PersistSourceError: an option is missing.
        """
        stash_url = _opt(options, "stash")
        blob_uri = _opt(options, "blob")
        shard = _opt(options, "shard") or _opt(options, "path")
        missing = [
            n
            for n, v in (
                ("stash", stash_url),
                ("blob", blob_uri),
                ("shard (load/save path)", shard),
            )
            if v is None
        ]
        if missing:
            raise PersistSourceError(f"the persist source needs option(s): {', '.join(missing)}")
        assert stash_url is not None and blob_uri is not None and shard is not None
        return cls(stash_url, blob_uri, shard)


# ------------------------------------------------------------ persist glue
# Everything this module needs from persist beyond its documented handle API is here.


@contextlib.contextmanager
def persist_client(
    target: ShardTarget, *, readonly: bool = False, compaction: str = "off"
) -> Iterator[Any]:
    """A :class:`persist.PersistClient` on the target's stores, closed (with its stash)
    afterwards. ``compaction`` is the client's mode (``"off"``: merge requests stay in the
    trace for ``persist compact`` / :mod:`spark.jobs.compact`)."""
    from persist.client import PersistClient
    from stash import Stash

    stash = Stash.open(target.stash_url, mode="readonly" if readonly else "writable", fenced=False)
    try:
        client = PersistClient(stash, target.blob_uri, compaction=compaction)  # type: ignore[arg-type]
        try:
            yield client
        finally:
            client.close()
    finally:
        stash.close()


def registered_schemas(target: ShardTarget) -> tuple[pa.Schema, pa.Schema] | None:
    """The shard's registered ``(key_schema, value_schema)``, or ``None`` if no shard has
    that name yet."""
    from persist.errors import InvalidUsage
    from stash import StashError

    try:
        with persist_client(target, readonly=True) as client:
            state = client.inspect(target.shard)
    except (InvalidUsage, StashError) as e:
        if "no shard named" in str(e) or "does not exist" in str(e):
            return None
        raise
    return state.key_schema, state.value_schema


def plan_parts(batches: Sequence[Any], limit: int, full: bool) -> list[list[Any]]:
    """Split hollow batches into input partitions: lists of hollow batches, each holding
    a slice of one original batch's parts with its description (so that readers advance
    times exactly as :func:`persist.read.read_batches` does) and its runs (so that a slice
    holding parts of several runs is never taken for one consolidated run).

    One partition per part, except that consecutive small parts share a partition up to
    ``limit`` encoded bytes; ``full`` puts everything in one partition (then every update
    that could cancel another is read by the same task).
    """
    pieces: list[tuple[int, int]] = [
        (bi, pi) for bi, b in enumerate(batches) for pi in range(len(b.parts))
    ]
    if not pieces:
        return []
    if full:
        return [[b for b in batches if b.parts]]
    groups: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    size = 0
    for bi, pi in pieces:
        nbytes = batches[bi].parts[pi].encoded_size_bytes
        if current and size + nbytes > limit:
            groups.append(current)
            current, size = [], 0
        current.append((bi, pi))
        size += nbytes
    groups.append(current)
    out: list[list[Any]] = []
    for group in groups:
        by_batch: dict[int, list[int]] = {}
        for bi, pi in group:
            by_batch.setdefault(bi, []).append(pi)
        out.append([slice_batch(batches[bi], idx) for bi, idx in by_batch.items()])
    return out


def slice_batch(batch: Any, indexes: Sequence[int]) -> Any:
    """The hollow batch holding the parts of ``batch`` at ``indexes`` (ascending): same
    description, ``len`` the sliced parts' rows, and ``runs`` marking where the slice
    moves to another of ``batch``'s runs."""
    from persist.types import HollowBatch

    starts = [0, *batch.runs]
    run_of = [0] * len(batch.parts)
    for r, (a, b) in enumerate(zip(starts, [*batch.runs, len(batch.parts)], strict=True)):
        for i in range(a, b):
            run_of[i] = r
    parts = tuple(batch.parts[i] for i in indexes)
    runs = tuple(j for j in range(1, len(indexes)) if run_of[indexes[j]] != run_of[indexes[j - 1]])
    return HollowBatch(batch.desc, parts, sum(p.rows for p in parts), runs)


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
def _nullable(schema: pa.Schema) -> pa.Schema:
    return pa.schema([f.with_nullable(True) for f in schema])


def spark_to_arrow(schema: StructType) -> pa.Schema:
    """The Arrow schema (all fields nullable) Spark uses for ``schema``."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return _nullable(to_arrow_schema(schema, timezone="UTC"))


def arrow_to_spark(schema: pa.Schema) -> StructType:
    """The Spark schema of an Arrow schema (fields nullable). A timestamp with a time zone
    is Spark's ``timestamp`` (an instant), one without is ``timestamp_ntz`` (a wall-clock
    value), so that neither moves with the session time zone."""
    from pyspark.sql.pandas.types import from_arrow_schema

    st = from_arrow_schema(schema, prefer_timestamp_ntz=True)
    return StructType([StructField(f.name, f.dataType, True) for f in st.fields])


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


# -------------------------------------------------------------- the source
@dataclass(frozen=True)
class ReadSettings:
    """Parsed read options (picklable)."""

    target: ShardTarget
    key_schema: pa.Schema
    value_schema: pa.Schema
    as_of: int | None
    time_column: str | None
    diff_column: str | None
    partition_bytes: int
    consolidate: str
    expand: bool

    @property
    def full(self) -> bool:
        """Whether one task reads every part (the consolidated read)."""
        return self.consolidate == "full"

    @property
    def data_columns(self) -> list[str]:
        return list(self.key_schema.names) + list(self.value_schema.names)


class PersistDataSource(DataSource):
    """``format("persist")``: batch read/write and streaming read of a persist shard."""

    @classmethod
    def name(cls) -> str:
        return "persist"

    # ------------------------------------------------------------- reading
    def _read_settings(self, streaming: bool) -> ReadSettings:
        what = "a streaming read of the persist source" if streaming else "reading a persist shard"
        check_names(self.options, READ_OPTIONS, what, PersistSourceError)
        target = ShardTarget.from_options(self.options)
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
        )

    @staticmethod
    def _output_schema(s: ReadSettings) -> StructType:
        fields = list(arrow_to_spark(pa.schema(list(s.key_schema) + list(s.value_schema))).fields)
        if s.time_column is not None:
            fields.append(StructField(s.time_column, LongType(), True))
        if s.diff_column is not None:
            fields.append(StructField(s.diff_column, LongType(), True))
        return StructType(fields)

    def schema(self) -> StructType:
        """Key columns, value columns, then the time column (if asked) and diff column."""
        return self._output_schema(self._read_settings(False))

    def reader(self, schema: StructType) -> DataSourceReader:
        return PersistBatchReader(self._read_settings(False), schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return PersistStreamReader(self._read_settings(True), schema)

    # ------------------------------------------------------------- writing
    def writer(self, schema: StructType, overwrite: bool) -> PersistWriter:
        check_names(self.options, WRITE_OPTIONS, "writing a persist shard", PersistSourceError)
        if overwrite:
            raise PersistSourceError(SAVE_MODES)
        target = ShardTarget.from_options(self.options)
        return PersistWriter(
            WriteSettings.from_options(self.options, schema, registered_schemas(target))
        )


SAVE_MODES = (
    "the persist source only writes with mode('append'): a shard is an append-only log of "
    "updates at increasing times, so there is nothing to overwrite, and 'error'/'ignore' "
    "(which Spark itself refuses for Python data sources) would need the shard's existence "
    "checked as part of the commit. To replace rows, append their retractions (a diff "
    "column of -1) and the new rows"
)
"""Why only ``mode("append")`` works (the error for any other save mode)."""


@dataclass
class PartsPartition(InputPartition):
    """An input partition: the parts one task reads, and the read time."""

    parts: list[Any]
    as_of: int

    def __init__(self, parts: list[Any], as_of: int) -> None:
        self.parts = parts
        self.as_of = as_of


def resolve_as_of(read: Any, as_of: int | None, shard: str) -> int | None:
    """``as_of`` checked against the shard's since and upper (default ``upper - 1``);
    ``None`` when the shard has no complete time yet (upper ``{0}``).

    Raises:
        PersistSourceError: ``as_of`` is before the since or not before the upper.
    """
    since = read.shard_since().as_option()
    upper = read.fetch_recent_upper().as_option()
    latest = None if upper == 0 else (upper - 1 if upper is not None else None)
    if as_of is None:
        return latest
    if since is not None and as_of < since:
        raise PersistSourceError(
            f"as_of {as_of} is before shard {shard}'s since {{{since}}}: those times are compacted"
        )
    if upper is not None and as_of >= upper:
        raise PersistSourceError(
            f"as_of {as_of} is not before shard {shard}'s upper {{{upper}}}: not yet complete"
        )
    return as_of


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
@dataclass
class StreamPartition(InputPartition):
    """A micro-batch range: the snapshot at ``as_of`` (``snapshot``) or the updates at
    times in ``(start, end]`` read through ``listen(start)``."""

    kind: str
    start: int
    end: int

    def __init__(self, kind: str, start: int, end: int) -> None:
        self.kind = kind
        self.start = start
        self.end = end


class PersistStreamReader(DataSourceStreamReader):
    """Micro-batches of a shard: its snapshot at ``as_of`` first, then what ``listen``
    sees. Lives in Spark's long-running driver-side Python process; holds a read lease
    whose since follows the committed offset."""

    def __init__(self, settings: ReadSettings, schema: StructType) -> None:
        self.settings = settings
        self.schema = schema
        self._handles: contextlib.ExitStack | None = None
        self._read: Any = None
        self._last_heartbeat = 0.0

    def _reader(self) -> Any:
        if self._read is None:
            s = self.settings
            stack = contextlib.ExitStack()
            client = stack.enter_context(persist_client(s.target))
            read = stack.enter_context(
                client.open_reader(s.target.shard, s.key_schema, s.value_schema)
            )
            self._handles, self._read = stack, read
        return self._read

    def _upper(self) -> int | None:
        read = self._reader()
        now = time.monotonic()
        if now - self._last_heartbeat > HEARTBEAT_SECONDS:
            read.heartbeat()  # keep the lease (and its since hold) alive between batches
            self._last_heartbeat = now
        return read.fetch_recent_upper().as_option()  # type: ignore[no-any-return]

    def initialOffset(self) -> dict[str, Any]:
        as_of = resolve_as_of(self._reader(), self.settings.as_of, self.settings.target.shard)
        return {"as_of": -1 if as_of is None else as_of, "initial": True}

    def latestOffset(self, start: dict[str, Any], limit: Any = None) -> dict[str, Any]:
        upper = self._upper()
        latest = start["as_of"] if upper is None else max(upper - 1, start["as_of"])
        return {"as_of": latest, "initial": False}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        out: list[InputPartition] = []
        if start.get("initial") and start["as_of"] >= 0:
            out.append(StreamPartition("snapshot", start["as_of"], start["as_of"]))
        if end["as_of"] > start["as_of"]:
            out.append(StreamPartition("listen", start["as_of"], end["as_of"]))
        return out

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, StreamPartition)
        s = self.settings
        with (
            persist_client(s.target) as client,
            client.open_reader(s.target.shard, s.key_schema, s.value_schema) as read,
        ):
            if partition.kind == "snapshot":
                table = read.snapshot(partition.start)
                tables = [table]
            else:
                tables = list(_listen_between(read, partition.start, partition.end))
        cols = [*s.data_columns, TIME, DIFF]
        tables = [t.select(cols) for t in tables if t.num_rows]
        if not tables:
            return
        table = pa.concat_tables(tables)
        out = _to_output(table, self.schema, s.time_column, s.diff_column)
        yield from out.to_batches(max_chunksize=64 * 1024)

    def commit(self, end: dict[str, Any]) -> None:
        """Everything up to ``end`` is processed: let the shard's since follow."""
        if end["as_of"] >= 0:
            read = self._reader()
            if read.since.less_than(end["as_of"]):
                read.downgrade_since(end["as_of"])
            self._last_heartbeat = time.monotonic()

    def stop(self) -> None:
        if self._handles is not None:
            self._handles.close()
        self._handles, self._read = None, None


def _listen_between(read: Any, start: int, end: int) -> Iterator[pa.Table]:
    """Updates at times in ``(start, end]`` from ``read.listen(start)``; stops once the
    listen's progress passes ``end`` (which planning guaranteed is already committed)."""
    with read.listen(start) as listen:
        for event in listen:
            if event.kind == "updates" and event.updates is not None:
                t = event.updates
                yield t.filter(pc.less_equal(t.column(TIME), end))
            elif event.kind == "progress":
                upper = event.progress.as_option() if event.progress is not None else None
                if upper is None or upper > end:
                    return


# ---------------------------------------------------------------- writing
@dataclass(frozen=True)
class WriteSettings:
    """Parsed write options and the shard schemas derived from the DataFrame (picklable).

    ``time_mode``: ``"column"`` (``time_column``), ``"fixed"`` (``time``) or ``"auto"``
    (one new time at the shard's upper).
    """

    target: ShardTarget
    key_columns: list[str]
    value_columns: list[str]
    key_schema: pa.Schema
    value_schema: pa.Schema
    time_mode: str
    time: int | None = None
    time_column: str | None = None
    diff_column: str | None = None
    upper: int | None = None
    compaction: str = "off"
    unique_keys: bool = False

    @classmethod
    def from_options(
        cls,
        options: Any,
        schema: StructType,
        registered: tuple[pa.Schema, pa.Schema] | None = None,
    ) -> WriteSettings:
        """Parse options against the DataFrame's schema and, for a shard that exists, its
        ``registered`` ``(key_schema, value_schema)``.

        A column named ``_diff`` is the diff column unless ``diff_column`` names another
        (so a DataFrame read from the source writes back as is). For an existing shard
        the DataFrame's columns are matched to the shard's by name (any order) and each
        is cast to the shard's type when that is a safe widening (int8 -> int16 -> int32
        -> int64, float32 -> float64, string <-> large_string, binary <-> large_binary;
        a nullable column into a non-nullable one is checked for nulls as it is
        written).

        Raises:
            PersistSourceError: conflicting, unknown or missing columns, both ``time``
                and ``time_column``, a non-integer time or diff column, a column type
                that is not the shard's or a safe widening of it, ``key_columns`` /
                ``value_columns`` that differ from an existing shard's.
        """
        target = ShardTarget.from_options(options)
        names = schema.fieldNames()
        time_column = _opt(options, "time_column")
        fixed = _opt_int(options, "time")
        diff_column = _opt(options, "diff_column")
        shard_names = set(registered[0].names) | set(registered[1].names) if registered else set()
        if diff_column is None and DIFF in names and DIFF not in shard_names:
            diff_column = DIFF
        if time_column is not None and fixed is not None:
            raise PersistSourceError("give either option 'time' or 'time_column', not both")
        if time_column is not None and time_column == diff_column:
            raise PersistSourceError(f"time_column and diff_column are both {time_column!r}")
        for opt_name, col in (("time_column", time_column), ("diff_column", diff_column)):
            if col is not None:
                if col not in names:
                    raise PersistSourceError(
                        f"{opt_name} {col!r} is not a column of the DataFrame {names}"
                    )
                dtype = schema[col].dataType.typeName()
                if dtype not in ("long", "integer", "short", "byte"):
                    raise PersistSourceError(f"{opt_name} {col!r} must be an integer, not {dtype}")
        special = {c for c in (time_column, diff_column) if c is not None}
        data = [n for n in names if n not in special]
        dupes = sorted({n for n in data if data.count(n) > 1})
        if dupes:
            raise PersistSourceError(f"the DataFrame has duplicate column names {dupes}")
        keys = _opt_list(options, "key_columns")
        values = _opt_list(options, "value_columns")
        for opt_name, cols in (("key_columns", keys), ("value_columns", values)):
            for c in cols or []:
                if c not in data:
                    raise PersistSourceError(
                        f"{opt_name} names {c!r}, which is not a data column of {data}"
                    )
        arrow = spark_to_arrow(schema)
        if registered is not None:
            key_schema, value_schema = registered
            keys, values = _match_shard(target.shard, arrow, data, keys, values, registered)
        else:
            if keys is None and values is None:
                keys, values = data, []
            elif keys is None:
                assert values is not None
                keys = [c for c in data if c not in values]
            elif values is None:
                values = [c for c in data if c not in keys]
            both = set(keys) & set(values)
            if both:
                raise PersistSourceError(f"columns {sorted(both)} are both key and value columns")
            key_schema = pa.schema([arrow.field(c) for c in keys])
            value_schema = pa.schema([arrow.field(c) for c in values])
        compaction = (_opt(options, "compaction") or "off").lower()
        if compaction not in ("off", "inline", "background"):
            raise PersistSourceError(
                f"option compaction must be off, inline or background, got {compaction!r}"
            )
        mode = "column" if time_column else ("fixed" if fixed is not None else "auto")
        return cls(
            target=target,
            key_columns=keys,
            value_columns=values,
            key_schema=key_schema,
            value_schema=value_schema,
            time_mode=mode,
            time=fixed,
            time_column=time_column,
            diff_column=diff_column,
            upper=_opt_int(options, "upper"),
            compaction=compaction,
            unique_keys=_truthy(options, "unique_keys"),
        )

    @property
    def updates_schema(self) -> pa.Schema:
        return pa.schema(
            [
                *self.key_schema,
                *self.value_schema,
                pa.field(TIME, pa.int64(), False),
                pa.field(DIFF, pa.int64(), False),
            ]
        )


def _widens(src: pa.DataType, dst: pa.DataType) -> bool:
    """Whether a DataFrame column of Arrow type ``src`` may be written into a shard column
    of type ``dst``: equal, a safe widening (persist's schema-evolution rules), or a
    string/binary of the other offset width."""
    from persist.updates import is_safe_widening

    if is_safe_widening(src, dst):
        return True
    pairs = (
        (pa.types.is_string, pa.types.is_large_string),
        (pa.types.is_binary, pa.types.is_large_binary),
    )
    return any((a(src) and b(dst)) or (b(src) and a(dst)) for a, b in pairs)


def _match_shard(
    shard: str,
    arrow: pa.Schema,
    data: list[str],
    keys: list[str] | None,
    values: list[str] | None,
    registered: tuple[pa.Schema, pa.Schema],
) -> tuple[list[str], list[str]]:
    """Match the DataFrame's data columns to an existing shard's by name and check that
    each type is the shard's or widens to it. Returns the shard's key and value names.

    Raises:
        PersistSourceError: options or columns that differ from the shard's.
    """
    shard_keys, shard_values = list(registered[0].names), list(registered[1].names)
    layout = f"keys {shard_keys}, values {shard_values}"
    for opt_name, given, want in (
        ("key_columns", keys, shard_keys),
        ("value_columns", values, shard_values),
    ):
        if given is not None and set(given) != set(want):
            raise PersistSourceError(
                f"{opt_name} {given} differs from shard {shard}'s {want} ({layout})"
            )
    extra = [c for c in data if c not in shard_keys and c not in shard_values]
    missing = [c for c in shard_keys + shard_values if c not in data]
    if extra or missing:
        what = []
        if extra:
            what.append(f"has columns {extra} that shard {shard} does not")
        if missing:
            what.append(f"lacks shard {shard}'s columns {missing}")
        raise PersistSourceError(
            f"the DataFrame {' and '.join(what)} ({layout}; columns are matched by name, "
            "and a time or diff column must be named with time_column / diff_column)"
        )
    for f in [*registered[0], *registered[1]]:
        src = arrow.field(f.name).type
        if not _widens(src, f.type):
            raise PersistSourceError(
                f"column {f.name!r} has type {src}, shard {shard} stores {f.type}: only the "
                "same type or a safe widening (int8->int16->int32->int64, float32->float64, "
                "string<->large_string) is written"
            )
    return shard_keys, shard_values


@dataclass
class PersistCommitMessage(WriterCommitMessage):
    """What a write task reports: its batch (transmittable bytes) and a summary."""

    batch: bytes
    lower: int
    upper: int
    rows: int
    min_time: int | None
    max_time: int | None
    partition_id: int = -1
    extra: dict[str, Any] = field(default_factory=dict)


class PersistWriter(DataSourceArrowWriter):
    """Executors build batches; the driver commits them with one compare-and-append."""

    def __init__(self, settings: WriteSettings) -> None:
        self.settings = settings
        # Runs on the driver at planning time: create/check the shard, read its upper.
        t = settings.target
        with (
            persist_client(t) as client,
            client.open_writer(t.shard, settings.key_schema, settings.value_schema) as write,
        ):
            upper = write.fetch_recent_upper().as_option()
        if upper is None:
            raise PersistSourceError(
                f"shard {settings.target.shard} is closed (its upper is the empty frontier)"
            )
        if settings.time_mode == "fixed" and settings.time is not None and settings.time < upper:
            raise PersistSourceError(
                f"time {settings.time} is before shard {settings.target.shard}'s upper "
                f"{{{upper}}}; persist only appends at or after its upper"
            )
        self.lower: int = int(upper)

    # ------------------------------------------------------------ executor
    def _updates(self, rb: pa.RecordBatch) -> pa.Table:
        s = self.settings
        n = rb.num_rows
        cols: list[pa.Array | pa.ChunkedArray] = []
        for f in [*s.key_schema, *s.value_schema]:
            cols.append(rb.column(rb.schema.get_field_index(f.name)).cast(f.type))
        if s.time_mode == "column":
            assert s.time_column is not None
            times = rb.column(rb.schema.get_field_index(s.time_column)).cast(pa.int64())
            if times.null_count:
                raise PersistSourceError(f"time column {s.time_column!r} has null values")
        else:
            t = s.time if s.time_mode == "fixed" else self.lower
            times = pa.array([t] * n, pa.int64())
        if s.diff_column is not None:
            diffs = rb.column(rb.schema.get_field_index(s.diff_column)).cast(pa.int64())
            if diffs.null_count:
                raise PersistSourceError(f"diff column {s.diff_column!r} has null values")
        else:
            diffs = pa.array([1] * n, pa.int64())
        cols.extend([times, diffs])
        return pa.Table.from_arrays(cols, schema=s.updates_schema)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> PersistCommitMessage:
        from pyspark import TaskContext

        from stash import Antichain

        s = self.settings
        ctx = TaskContext.get()
        rows = 0
        min_t: int | None = None
        max_t: int | None = None
        with (
            persist_client(s.target) as client,
            client.open_writer(s.target.shard, s.key_schema, s.value_schema) as write,
        ):
            builder = write.builder(Antichain.from_elem(self.lower))
            try:
                for rb in iterator:
                    if rb.num_rows == 0:
                        continue
                    updates = self._updates(rb)
                    tmin, tmax = pc.min_max(updates.column(TIME)).values()
                    lo, hi = tmin.as_py(), tmax.as_py()
                    min_t = lo if min_t is None else min(min_t, lo)
                    max_t = hi if max_t is None else max(max_t, hi)
                    rows += updates.num_rows
                    builder.add(updates)
                upper = self._task_upper(max_t)
                batch = builder.finish(Antichain.from_elem(upper))
            except BaseException:
                builder.abort()  # delete the parts this task already uploaded
                raise
            payload = batch.into_transmittable()
        return PersistCommitMessage(
            batch=payload,
            lower=self.lower,
            upper=upper,
            rows=rows,
            min_time=min_t,
            max_time=max_t,
            partition_id=ctx.partitionId() if ctx is not None else -1,
        )

    def _task_upper(self, max_t: int | None) -> int:
        s = self.settings
        if s.upper is not None:
            return s.upper
        if s.time_mode == "auto":
            return self.lower + 1
        if s.time_mode == "fixed":
            assert s.time is not None
            return s.time + 1
        return (max_t + 1) if max_t is not None else self.lower + 1

    # -------------------------------------------------------------- driver
    def _new_upper(self, msgs: Sequence[PersistCommitMessage], expected: int) -> int:
        s = self.settings
        times = [m.max_time for m in msgs if m.max_time is not None]
        if s.time_mode == "auto":
            need = expected + 1
        elif s.time_mode == "fixed":
            assert s.time is not None
            need = s.time + 1
        else:
            need = max(times) + 1 if times else expected
        if s.upper is not None:
            if s.upper < need:
                raise PersistSourceError(
                    f"option upper {s.upper} is not beyond the largest time written ({need - 1})"
                )
            return s.upper
        return need

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Commit every task's batch with one ``compare_and_append_batch``; on an upper
        race, rewrite the batches' times in metadata (when the write's times allow it) and
        retry the commit alone.

        Raises:
            PersistSourceError: the shard's upper moved past a time this write must write
                at (nothing committed).
            persist.UpperMismatch: still racing after :data:`COMMIT_ATTEMPTS` attempts.
        """
        from tenacity import (
            Retrying,
            retry_if_exception_type,
            stop_after_attempt,
            wait_random_exponential,
        )

        from persist import UpperMismatch
        from stash import Antichain

        s = self.settings
        msgs = [m for m in messages if isinstance(m, PersistCommitMessage)]
        min_times = [m.min_time for m in msgs if m.min_time is not None]
        first_time = min(min_times) if min_times else None
        expected = self.lower
        with (
            persist_client(s.target, compaction=s.compaction) as client,
            client.open_writer(s.target.shard, s.key_schema, s.value_schema) as write,
        ):
            batches = [write.batch_from_transmittable(m.batch) for m in msgs]
            if s.unique_keys:
                try:
                    self._check_unique(client.blob, batches)
                except PersistSourceError:
                    for b in batches:
                        b.delete()
                    raise
            if first_time is None and s.upper is None:
                for b in batches:  # nothing written and no upper to advance: a no-op
                    b.delete()
                return
            for attempt in Retrying(
                stop=stop_after_attempt(COMMIT_ATTEMPTS),
                wait=wait_random_exponential(multiplier=0.02, max=1.0),
                retry=retry_if_exception_type(UpperMismatch),
                reraise=True,
            ):
                with attempt:
                    new_upper = self._new_upper(msgs, expected)
                    # A batch must cover [expected, new_upper) (the seed's
                    # validate_truncate_batch). After a lost race, or when tasks ended
                    # their batches at different uppers, a metadata-only rewrite makes it
                    # so. Times advance to `expected`: the new time of an "at the upper"
                    # write, a no-op for explicit times (they are all >= expected,
                    # checked in _after_race).
                    up = Antichain.from_elem(new_upper)
                    if expected != self.lower or any(b.upper != up for b in batches):
                        for b in batches:
                            b.rewrite_ts(Antichain.from_elem(expected), up)
                    try:
                        write.compare_and_append_batch(
                            batches, Antichain.from_elem(expected), Antichain.from_elem(new_upper)
                        )
                    except UpperMismatch as e:
                        expected = self._after_race(e, first_time)
                        raise

    def _check_unique(self, blob: Any, batches: Sequence[Any]) -> None:
        """With ``unique_keys``: every key is inserted at most once by this write (the
        positive diffs of its updates, over all tasks, sum to at most 1); retractions are
        not limited. Only the write itself is checked, not the rows already in the shard.

        Raises:
            PersistSourceError: a key is inserted more than once (names it).
        """
        from persist.parts import updates_schema
        from persist.read import read_batches

        s = self.settings
        hollow = [b.hollow for b in batches if b.len > 0]
        if not hollow:
            return
        table = read_batches(blob, hollow, updates_schema(s.key_schema, s.value_schema))
        keys = list(s.key_schema.names)
        inserts = table.select([*keys, DIFF]).filter(pc.greater(table.column(DIFF), 0))
        counts = inserts.group_by(keys, use_threads=False).aggregate([(DIFF, "sum")])
        dupes = counts.filter(pc.greater(counts.column(f"{DIFF}_sum"), 1))
        if dupes.num_rows:
            example = {k: dupes.column(k)[0].as_py() for k in keys}
            raise PersistSourceError(
                f"unique_keys=true: the write inserts {dupes.num_rows} key(s) of shard "
                f"{s.target.shard} more than once, e.g. {example} "
                f"({dupes.column(f'{DIFF}_sum')[0].as_py()} times); nothing was committed"
            )

    def _after_race(self, e: Any, first_time: int | None) -> int:
        """The expected upper of the next attempt after losing a race to ``e.current``.

        Raises:
            PersistSourceError: the race cannot be won by retrying (the shard is closed,
                or its upper passed a time this write must write at).
        """
        s = self.settings
        current = e.current.as_option()
        if current is None:
            raise PersistSourceError(
                f"shard {s.target.shard} was closed (empty upper) during the write; "
                "nothing was committed"
            ) from e
        if s.time_mode != "auto" and first_time is not None and current > first_time:
            raise PersistSourceError(
                f"shard {s.target.shard}'s upper moved to {{{current}}}, past time "
                f"{first_time} this write must write at; nothing was committed"
            ) from e
        if s.upper is not None and current >= s.upper:
            raise PersistSourceError(
                f"shard {s.target.shard}'s upper moved to {{{current}}}, not before the "
                f"upper {s.upper} this write asked for; nothing was committed"
            ) from e
        return int(current)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """Delete the batches of the tasks that reported one, unless the shard references
        any of their parts or retired them (an indeterminate commit may have landed and
        been compacted since: its parts are then GC's to delete, once no reader holds
        them)."""
        s = self.settings
        msgs = [m for m in messages if isinstance(m, PersistCommitMessage)]
        if not msgs:
            return
        from persist.batch import Batch

        with persist_client(s.target) as client:
            try:
                referenced = client.inspect(s.target.shard).referenced_blob_keys()
                retired = client.consensus.retired(client.shard_id(s.target.shard))
                live: set[str] | None = referenced | set(retired)
            except Exception as e:  # cannot read the state: deleting could lose data
                log.warning(
                    "abort of a write to shard %s: state unreadable (%s)", s.target.shard, e
                )
                live = None
            for m in msgs:
                batch = Batch.from_transmittable(client.blob, m.batch)
                if live is None or set(batch.blob_keys()) & live:
                    continue  # cannot prove it unreferenced: leave it to GC
                batch.delete()


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
