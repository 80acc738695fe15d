"""The batch writer of the ``persist`` Spark source: tasks build batches, the driver commits.

Invariants kept here: each task uploads its parts and returns only a transmittable batch;
the driver commits every task's batch with one ``compare_and_append_batch`` (retrying an
upper race in metadata only, never uploading a part twice); a write that raised committed
nothing, and ``abort`` deletes only batches the shard does not reference.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from spark.persist_common import (
    COMMIT_ATTEMPTS,
    DIFF,
    TIME,
    PersistSourceError,
    ShardTarget,
    _opt,
    _opt_int,
    _opt_list,
    _truthy,
    arrow_to_spark,
    live_blob_keys,
    persist_client,
    spark_to_arrow,
)

log = logging.getLogger(__name__)


SAVE_MODES = (
    "the persist source only writes with mode('append'): a shard is an append-only log of "
    "updates at increasing times, so there is nothing to overwrite, and 'error'/'ignore' "
    "(which Spark itself refuses for Python data sources) would need the shard's existence "
    "checked as part of the commit. To replace rows, append their retractions (a diff "
    "column of -1) and the new rows"
)
"""Why only ``mode("append")`` works (the error for any other save mode)."""


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
        or the type the shard's column reads as through the source, each value
        converted exactly by pyarrow's safe cast; a nullable column into a non-nullable
        one is checked for nulls as it is written).

        With ``mergeSchema=true``, an existing shard's value schema is first evolved to
        take the DataFrame (:func:`_merged_value_schema`); the writer's open registers
        the new version when the write is planned (persist's compatible schema
        evolution: added columns read as null in older rows).

        Raises:
            PersistSourceError: conflicting, unknown or missing columns (extra columns
                without ``mergeSchema`` name the option), both ``time`` and
                ``time_column``, a non-integer time or diff column, a column type that is
                not the shard's or a safe widening of it, ``key_columns`` /
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
            if _truthy(options, "mergeSchema"):
                value_schema = _merged_value_schema(arrow, data, keys, registered)
                registered = (key_schema, value_schema)
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
    of type ``dst``: equal, a safe widening (persist's schema-evolution rules), a
    string/binary of the other offset width, or the type a ``dst`` column reads as
    through the source (:func:`_read_back`)."""
    from persist.updates import is_safe_widening

    if is_safe_widening(src, dst) or _read_back(src, dst):
        return True
    pairs = (
        (pa.types.is_string, pa.types.is_large_string),
        (pa.types.is_binary, pa.types.is_large_binary),
    )
    return any((a(src) and b(dst)) or (b(src) and a(dst)) for a, b in pairs)


def _read_back(src: pa.DataType, dst: pa.DataType) -> bool:
    """Whether ``src`` is the Arrow type of the DataFrame column a shard column of type
    ``dst`` reads as (:func:`spark.arrow_spark.spark_read_type`, then Spark's own Arrow
    type: ``uint8`` reads as ``int16``, ``uint64`` as ``decimal128(20, 0)``, ``date64``
    as ``date32``, a ``timestamp[ms]`` as ``timestamp[us]``, ``decimal256`` as
    ``decimal128``, ``fixed_size_binary`` as ``binary``...), so that a DataFrame read
    from the source writes back as is.  Such a column is cast back with pyarrow's safe
    cast as it is written (:meth:`PersistWriter._updates`): a value that does not
    convert exactly (out of range, finer than the unit, of another width) raises."""
    try:
        return src == spark_to_arrow(arrow_to_spark(pa.schema([("c", dst)]))).field(0).type
    except PersistSourceError:  # no Spark type reads it (decimal256 over 38 digits)
        return False


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
        hint = (
            "; to add them to the shard as nullable value columns, write with "
            'option("mergeSchema", "true")'
            if extra
            else ""
        )
        raise PersistSourceError(
            f"the DataFrame {' and '.join(what)} ({layout}; columns are matched by name, "
            f"and a time or diff column must be named with time_column / diff_column{hint})"
        )
    for f in [*registered[0], *registered[1]]:
        src = arrow.field(f.name).type
        if not _widens(src, f.type):
            raise PersistSourceError(
                f"column {f.name!r} has type {src}, shard {shard} stores {f.type}: only the "
                "same type, a safe widening (int8->int16->int32->int64, float32->float64, "
                "string<->large_string) or the type the shard's column reads as through "
                "the source (each value converted exactly) is written"
            )
    return shard_keys, shard_values


def _merged_value_schema(
    arrow: pa.Schema,
    data: list[str],
    keys: list[str] | None,
    registered: tuple[pa.Schema, pa.Schema],
) -> pa.Schema:
    """With ``mergeSchema``: the shard's newest value schema evolved to take the
    DataFrame (Delta Lake's ``mergeSchema``): its data columns the shard does not have
    (and ``key_columns`` does not name) are added as nullable value columns, in the
    DataFrame's order after the shard's; a value column the DataFrame holds in a wider
    type (int8->int16->int32->int64, float32->float64, string<->large_string) is
    widened.  The writer's ``open`` registers it (persist's compatible schema
    evolution); columns the shard has and the DataFrame lacks still
    raise (nothing is dropped by a write).  A column another write added after this
    plan was made is not in it: the writer's open then refuses the write with
    ``SchemaMismatch`` naming that column (persist drops only columns an evolution
    names), rather than drop the column and the values written to it."""
    from persist.updates import is_type_evolution

    key_names = set(registered[0].names)
    fields = []
    for f in registered[1]:
        if f.name in data and is_type_evolution(f.type, arrow.field(f.name).type):
            f = f.with_type(arrow.field(f.name).type)
        fields.append(f)
    have = key_names | set(registered[1].names)
    for c in data:
        if c not in have and (keys is None or c not in keys):
            fields.append(arrow.field(c).with_nullable(True))
    return pa.schema(fields)


def updates_table(s: WriteSettings, rb: pa.RecordBatch, at: int) -> pa.Table:
    """The updates (key, value, ``_time``, ``_diff`` columns of ``s.updates_schema``) of a
    batch of DataFrame rows: each column cast to the shard's type (pyarrow's safe cast),
    times from the time column, ``s.time``, or ``at`` (``time_mode`` ``"auto"``), diffs
    from the diff column or 1.

    Raises:
        PersistSourceError: a value that does not convert exactly to its shard column's
            type, or a null time or diff.
    """
    n = rb.num_rows
    cols: list[pa.Array | pa.ChunkedArray] = []
    for f in [*s.key_schema, *s.value_schema]:
        col = rb.column(rb.schema.get_field_index(f.name))
        try:
            cols.append(col.cast(f.type, safe=True))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise PersistSourceError(
                f"column {f.name!r} ({col.type}) does not convert exactly to shard "
                f"{s.target.shard}'s {f.type}: {e}; nothing of this write is committed"
            ) from None
    if s.time_mode == "column":
        assert s.time_column is not None
        times = rb.column(rb.schema.get_field_index(s.time_column)).cast(pa.int64())
        if times.null_count:
            raise PersistSourceError(f"time column {s.time_column!r} has null values")
    else:
        t = s.time if s.time_mode == "fixed" else at
        times = pa.array([t] * n, pa.int64())
    if s.diff_column is not None:
        diffs = rb.column(rb.schema.get_field_index(s.diff_column)).cast(pa.int64())
        if diffs.null_count:
            raise PersistSourceError(f"diff column {s.diff_column!r} has null values")
    else:
        diffs = pa.array([1] * n, pa.int64())
    cols.extend([times, diffs])
    return pa.Table.from_arrays(cols, schema=s.updates_schema)


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
        with persist_client(t) as client:
            # Check what can be checked before opening the writer: opening registers a
            # ``mergeSchema`` evolution, which a refused write must not leave behind.
            if client.consensus.lookup(t.shard) is not None:
                self._check_upper(client.inspect(t.shard).upper.as_option())
            with client.open_writer(t.shard, settings.key_schema, settings.value_schema) as write:
                upper = write.fetch_recent_upper().as_option()
        self.lower: int = self._check_upper(upper)

    def _check_upper(self, upper: int | None) -> int:
        """``upper`` if the write may go at or after it.

        Raises:
            PersistSourceError: the shard is closed, or a fixed ``time`` lies before it.
        """
        settings = self.settings
        if upper is None:
            raise PersistSourceError(
                f"shard {settings.target.shard} is closed (its upper is the empty frontier)"
            )
        if settings.time_mode == "fixed" and settings.time is not None and settings.time < upper:
            raise PersistSourceError(
                f"time {settings.time} is before shard {settings.target.shard}'s upper "
                f"{{{upper}}}; persist only appends at or after its upper"
            )
        return int(upper)

    # ------------------------------------------------------------ executor
    def _updates(self, rb: pa.RecordBatch) -> pa.Table:
        return updates_table(self.settings, rb, self.lower)

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
                    # A batch must cover [expected, new_upper) (Materialize's
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
        from persist.fetch import read_batches
        from persist.parts import updates_schema

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
        """Delete the batches of the tasks that reported one (:func:`delete_unreferenced`)."""
        delete_unreferenced(self.settings, messages)


def delete_unreferenced(settings: WriteSettings, messages: Sequence[object]) -> None:
    """Delete the batches of the :class:`PersistCommitMessage` s among ``messages``,
    unless the shard references any of their parts or retired them (an indeterminate
    commit may have landed and been compacted since: its parts are then GC's to delete,
    once no reader holds them), both as of one state version
    (:func:`spark.persist_common.live_blob_keys`).  When the shard state cannot be
    read consistently, nothing is deleted (left to GC)."""
    s = settings
    msgs = [m for m in messages if isinstance(m, PersistCommitMessage)]
    if not msgs:
        return
    with persist_client(s.target) as client:
        try:
            # Referenced and retired as of one version: a commit landing between two
            # separate reads would be in neither.
            live = live_blob_keys(client, client.shard_id(s.target.shard))
        except Exception as e:  # cannot read the state: deleting could lose data
            log.warning("abort of a write to shard %s: state unreadable (%s)", s.target.shard, e)
            live = None
        if live is None:
            return  # cannot prove any unreferenced: leave them to GC
        with client.open_writer(s.target.shard, s.key_schema, s.value_schema) as write:
            for m in msgs:
                # Decoded by a handle, so that deleting it also counts it down from
                # the task writer's hand-off (the writer is then dropped at once).
                batch = write.batch_from_transmittable(m.batch)
                if set(batch.blob_keys()) & live:
                    batch.mark_consumed()  # maybe referenced: leave it to GC
                    continue
                batch.delete()
