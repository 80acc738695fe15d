"""The ``persist`` Spark data source: read, write and stream persist shards.

Batch read::

    spark.read.format("persist").option("stash", STASH_URL).option("blob", BLOB_URI)
         .option("as_of", 42).load("flights")

gives the shard's contents at ``as_of`` (default: the latest complete time, ``upper - 1``)
as *updates*: the key and value columns plus a diff column (``_diff``, renamed with
``diff_column``). Planning (on the driver) lists the parts of every batch that can hold
times ``<= as_of`` and makes one input partition per part, or per group of small parts
(``partition_bytes``, default 128 MiB of Parquet); each task fetches its parts from the
blob store, advances times to ``as_of``, drops later updates, consolidates and yields
Arrow ``RecordBatch``es (no row-at-a-time conversion on either side). Rows are
consolidated within a partition; summing the diff per distinct row over the whole
DataFrame gives the snapshot (:func:`consolidated` does that with a ``groupBy``).
``consolidate=full`` reads all parts in one partition instead, so each distinct row appears
once; ``expand=true`` (which implies ``full``) drops the diff column and repeats each row by
its multiplicity (a negative multiplicity raises). ``time_column`` adds the read time.

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
    raw = _opt(options, name)
    return raw is not None and raw.lower() in ("1", "true", "yes", "on")


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
    a slice of one original batch's parts (its description kept, so that readers advance
    times exactly as :func:`persist.read.read_batches` does).

    One partition per part, except that consecutive small parts share a partition up to
    ``limit`` encoded bytes; ``full`` puts everything in one partition.
    """
    from persist.types import HollowBatch

    pieces: list[tuple[Any, Any]] = [(b, p) for b in batches for p in b.parts]
    if not pieces:
        return []
    if full:
        return [list(batches)]
    groups: list[list[tuple[Any, Any]]] = []
    current: list[tuple[Any, Any]] = []
    size = 0
    for batch, part in pieces:
        if current and size + part.encoded_size_bytes > limit:
            groups.append(current)
            current, size = [], 0
        current.append((batch, part))
        size += part.encoded_size_bytes
    groups.append(current)
    out: list[list[Any]] = []
    for group in groups:
        slices: list[Any] = []
        for batch, part in group:
            if slices and slices[-1].desc == batch.desc and _same_batch(slices[-1], batch):
                last = slices[-1]
                slices[-1] = HollowBatch(last.desc, (*last.parts, part), last.len + part.rows)
            else:
                slices.append(HollowBatch(batch.desc, (part,), part.rows))
        out.append(slices)
    return out


def _same_batch(piece: Any, batch: Any) -> bool:
    return bool(piece.parts) and piece.parts[0] in batch.parts


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


# ---------------------------------------------------------- arrow helpers
def _nullable(schema: pa.Schema) -> pa.Schema:
    return pa.schema([f.with_nullable(True) for f in schema])


def spark_to_arrow(schema: StructType) -> pa.Schema:
    """The Arrow schema (all fields nullable) Spark uses for ``schema``."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return _nullable(to_arrow_schema(schema, timezone="UTC"))


def arrow_to_spark(schema: pa.Schema) -> StructType:
    """The Spark schema of an Arrow schema (fields nullable, tz timestamps -> timestamp)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    st = from_arrow_schema(schema, prefer_timestamp_ntz=False)
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
    full: bool
    expand: bool

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
        target = ShardTarget.from_options(self.options)
        schemas = registered_schemas(target)
        if schemas is None:
            raise PersistSourceError(
                f"persist shard {target.shard} does not exist in {target.stash_url}; "
                "write to it first"
            )
        expand = _truthy(self.options, "expand")
        if expand and streaming:
            raise PersistSourceError("expand=true is not available for streaming reads")
        time_column = _opt(self.options, "time_column")
        diff_column = None if expand else (_opt(self.options, "diff_column") or DIFF)
        consolidate = (_opt(self.options, "consolidate") or "partition").lower()
        if consolidate not in ("partition", "full"):
            raise PersistSourceError(
                f"option consolidate must be 'partition' or 'full', got {consolidate!r}"
            )
        names = list(schemas[0].names) + list(schemas[1].names)
        for extra in (time_column, diff_column):
            if extra is not None and extra in names:
                raise PersistSourceError(
                    f"column name {extra!r} for time/diff is already a key or value column"
                )
        return ReadSettings(
            target=target,
            key_schema=schemas[0],
            value_schema=schemas[1],
            as_of=_opt_int(self.options, "as_of"),
            time_column=time_column,
            diff_column=diff_column,
            partition_bytes=_opt_int(self.options, "partition_bytes") or DEFAULT_PARTITION_BYTES,
            full=expand or consolidate == "full",
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
        if overwrite:
            raise PersistSourceError(
                "persist shards are append-only: use mode('append'); to replace rows, "
                "write retractions (a diff column with -1) and the new rows"
            )
        return PersistWriter(WriteSettings.from_options(self.options, schema))


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

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, PartsPartition)
        s = self.settings
        from persist.blob import open_blob
        from persist.client import RetryingBlob
        from persist.parts import updates_schema

        blob = RetryingBlob(open_blob(s.target.blob_uri))
        try:
            table = read_snapshot(
                blob,
                partition.parts,
                updates_schema(s.key_schema, s.value_schema),
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

    @classmethod
    def from_options(cls, options: Any, schema: StructType) -> WriteSettings:
        """Parse options against the DataFrame's schema.

        Raises:
            PersistSourceError: conflicting or unknown columns, both ``time`` and
                ``time_column``, a non-integer time or diff column.
        """
        target = ShardTarget.from_options(options)
        names = schema.fieldNames()
        time_column = _opt(options, "time_column")
        fixed = _opt_int(options, "time")
        diff_column = _opt(options, "diff_column")
        if time_column is not None and fixed is not None:
            raise PersistSourceError("give either option 'time' or 'time_column', not both")
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
        keys = _opt_list(options, "key_columns")
        values = _opt_list(options, "value_columns")
        for opt_name, cols in (("key_columns", keys), ("value_columns", values)):
            for c in cols or []:
                if c not in data:
                    raise PersistSourceError(
                        f"{opt_name} names {c!r}, which is not a data column of {data}"
                    )
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
        compaction = (_opt(options, "compaction") or "off").lower()
        if compaction not in ("off", "inline", "background"):
            raise PersistSourceError(
                f"option compaction must be off, inline or background, got {compaction!r}"
            )
        arrow = spark_to_arrow(schema)
        mode = "column" if time_column else ("fixed" if fixed is not None else "auto")
        return cls(
            target=target,
            key_columns=keys,
            value_columns=values,
            key_schema=pa.schema([arrow.field(c) for c in keys]),
            value_schema=pa.schema([arrow.field(c) for c in values]),
            time_mode=mode,
            time=fixed,
            time_column=time_column,
            diff_column=diff_column,
            upper=_opt_int(options, "upper"),
            compaction=compaction,
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
                    if expected != self.lower:
                        # Lost a race: metadata-only rewrite so each batch lies within
                        # [expected, new_upper). Times advance to `expected`: the new time
                        # of an "at the upper" write, a no-op for explicit times (they are
                        # all >= expected, checked in _after_race).
                        for b in batches:
                            b.rewrite_ts(
                                Antichain.from_elem(expected), Antichain.from_elem(new_upper)
                            )
                    try:
                        write.compare_and_append_batch(
                            batches, Antichain.from_elem(expected), Antichain.from_elem(new_upper)
                        )
                    except UpperMismatch as e:
                        expected = self._after_race(e, first_time)
                        raise

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
        any of their parts (an indeterminate commit may have landed)."""
        s = self.settings
        msgs = [m for m in messages if isinstance(m, PersistCommitMessage)]
        if not msgs:
            return
        from persist.batch import Batch

        with persist_client(s.target) as client:
            try:
                live: set[str] | None = client.inspect(s.target.shard).referenced_blob_keys()
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
