"""Writing runs of parts: :class:`RunWriter` (shared by a write handle and its builders)
and :class:`BatchBuilder` (a batch built piece by piece).

A run is one sorted, consolidated sequence of parts (:func:`persist.parts.write_parts`):
uploaded to blob, or kept inline in the state when small (Materialize's inline writes,
``src/persist-client/src/batch.rs``).

Invariants kept here:

* a run's part keys name its writer and are stamped when the run is written
  (``<shard_id>/b/<writer id>-<unix ms>-<uuid>.parquet``, :mod:`persist.keys`), and the
  writer is registered in the shard state before the first upload (the ``before_upload``
  function a :class:`RunWriter` is given: the handle's registration);
* each part records the value schema version it was written with;
* a :class:`BatchBuilder` checks times at ``add`` (``>= lower``) and ``finish``
  (``< upper``); a failed ``add`` leaves it exactly as before the call and a failed
  ``finish`` leaves it unfinished with every accepted update, so a finished batch never
  misses an accepted row; flushed chunks in (key, value, time) order extend one run;
  ``abort`` after a successful ``finish`` does nothing (the batch owns the parts).

This module never imports :mod:`persist.write`: a builder reaches its handle only through
:class:`BuilderHost` (its run writer, and the handle's lease holding and counting of the
batches it hands out).  Sources: the persist-client ``BatchBuilder`` (Materialize's
``src/persist-client/src/batch.rs``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from persist import parts
from persist.batch import Batch
from persist.blob import Blob
from persist.config import PersistConfig
from persist.consolidation import _adjacent
from persist.encoding import EncodingPlan, encoding_plan
from persist.errors import (
    DiffOverflow,
    InvalidBounds,
    InvalidUsage,
    UpdateBeyondUpper,
    UpdateNotBeyondLower,
)
from persist.keys import part_name_prefix
from persist.machine import ShardMachine
from persist.parts import (
    TIME,
    consolidate_order,
    to_updates_table,
    updates_schema,
    write_parts,
)
from persist.pool import Background, in_background
from persist.types import Description, HollowBatch, PartRef, as_frontier
from persist.updates import check_utf8, check_whole_days, string_columns
from stash import Antichain

__all__ = ["BatchBuilder", "BuilderHost", "RunWriter", "Updates", "time_range"]

Updates = Any
"""A ``pyarrow.Table``/``RecordBatch`` or a list of ``((key, value), time, diff)``."""


#: Tables of fewer rows are not measured (``nbytes``) to plan their encoding ahead
#: (:meth:`RunWriter.write_run`): their parts are planned as they are encoded.
_PLAN_AHEAD_ROWS = 4096

#: Tables of at most this many rows take the pure-Python paths of :func:`time_range`
#: (a pyarrow compute call costs tens of microseconds however small its input).
_SMALL_ROWS = 32


def time_range(table: pa.Table) -> tuple[int, int] | None:
    """The least and greatest ``_time`` of a normalized updates ``table`` (``_time`` is
    non-null int64), or ``None`` when it is empty."""
    n = table.num_rows
    if n == 0:
        return None
    if n <= _SMALL_ROWS:
        times = table.column(TIME).to_pylist()
        return min(times), max(times)
    mm = pc.min_max(table.column(TIME))
    return int(mm["min"].as_py()), int(mm["max"].as_py())


class RunWriter:
    """Normalizes updates to one shard's schema and writes them as runs of parts, for
    one writer.

    Args:
        blob: the blob store.  config: the client's knobs (target part size, inline
            limits, upload workers).
        machine: the shard's machine (its clock stamps part keys; its cached state tells
            how many inline bytes the state holds).
        name: the shard's name (in error messages).
        key_schema, value_schema: the writer's schemas (``pyarrow.Schema``).
        writer_id: the writer whose parts these are.
        before_upload: called before each upload (the writer registers in the shard
            state or renews its lease there); a plain function, run by
            :func:`persist.parts.write_parts`.
    """

    def __init__(
        self,
        blob: Blob,
        config: PersistConfig,
        machine: ShardMachine,
        name: str,
        key_schema: pa.Schema,
        value_schema: pa.Schema,
        writer_id: str,
        before_upload: Callable[[], None],
    ) -> None:
        self.blob = blob
        self.config = config
        self._machine = machine
        self.shard_id = machine.shard_id
        self.name = name
        self.key_schema = key_schema
        self.value_schema = value_schema
        self.schema = updates_schema(key_schema, value_schema)
        self.writer_id = writer_id
        self._before_upload = before_upload
        # normalize: the last input schema found to have this writer's column names and
        # types in order, and the columns that must hold no null.
        self._conforming: pa.Schema | None = None
        # inline_schema: (the state's key schema and schema versions, by identity, the
        # schema id, the updates schema of that id or None).
        self._inline_schema: tuple[object, object, int, pa.Schema | None] | None = None
        self._not_null = [i for i, f in enumerate(self.schema) if not f.nullable]
        # Whether check_whole_days has a column to check (it looks each field up).
        self._date64 = any(pa.types.is_date64(t) for t in self.schema.types)
        # The columns check_utf8 checks.
        self._strings = string_columns(self.schema)

    def key_prefix(self, kind: str = "b") -> str:
        """The stem of a run's blob keys, ``<shard_id>/<kind>/<writer id>-<unix ms>``,
        stamped now (call it per run); its parts are ``<stem>-<uuid>.parquet`` (see
        :mod:`persist.keys`): one flat directory per shard and kind."""
        name = part_name_prefix(self.writer_id, self._machine.now_ms())
        return f"{self.shard_id}/{kind}/{name[:-1]}"

    def inline_schema(self, schema_id: int) -> pa.Schema | None:
        """The shard's updates schema of version ``schema_id`` (``None``: unknown to the
        state in hand): a table of exactly this schema is kept inline without its schema
        message (:func:`persist.encoding.encode_inline_part`). Cached while the state's
        schema versions are the same objects (looking it up costs about 20 us)."""
        st = self._machine.state()
        c = self._inline_schema
        if (
            c is not None
            and c[0] is st.key_schema
            and c[1] is st.schema_history
            and c[2] == schema_id
        ):
            return c[3]
        history = st.schemas()
        schema = history.updates_schema(schema_id) if schema_id <= history.newest else None
        self._inline_schema = (st.key_schema, st.schema_history, schema_id, schema)
        return schema

    def inline_max(self) -> int:
        """Inline writes are allowed while the state holds less than the total budget."""
        cfg = self.config
        if self._machine.state().inline_bytes() >= cfg.inline_total_max_bytes:
            return 0
        return cfg.inline_max_bytes

    def normalize(self, updates: Updates) -> pa.Table:
        """``updates`` as a table of exactly :attr:`schema` (:func:`to_updates_table`).
        A table whose columns already have the schema's names and types, in order, with
        no null in a non-nullable column, is only relabelled with the schema (returned as
        it is if its schema is equal, metadata included): what :func:`to_updates_table`
        would rebuild it into, without looking each column up by name.

        Raises:
            InvalidUsage: bad columns or types.
        """
        if isinstance(updates, pa.Table):
            schema = self.schema
            us = updates.schema
            if us.equals(schema, check_metadata=True):
                same = True
            elif self._conforming is not None and us.equals(self._conforming, check_metadata=True):
                same = False  # names and types checked before (``.types`` costs ~60 µs)
            elif us.names == schema.names and us.types == schema.types:
                self._conforming, same = us, False
            else:
                return to_updates_table(updates, self.key_schema, self.value_schema)
            if all(updates.column(i).null_count == 0 for i in self._not_null):
                table = updates if same else pa.Table.from_arrays(updates.columns, schema=schema)
                if self._strings:
                    check_utf8(table, self._strings)
                return check_whole_days(table) if self._date64 else table
        return to_updates_table(updates, self.key_schema, self.value_schema)

    def write_run(
        self, table: pa.Table, schema_id: int, value_schema: pa.Schema | None = None
    ) -> list[PartRef]:
        """Consolidate (sort) ``table`` and write it as one run (:meth:`write_sorted`);
        ``table`` has this writer's value schema, or ``value_schema``, of version
        ``schema_id``.

        Raises:
            DiffOverflow: the diffs of one row sum beyond int64 (nothing written).
            BlobError: an upload failed (what was uploaded is deleted).
        """
        vs = self.value_schema if value_schema is None else value_schema
        # A table that will be cut into parts encoded in parallel: their common
        # encoding plan (a strided sample of its rows, which sorting only permutes) is
        # made in the shared pool while the rows are sorted, instead of by an encoding
        # thread while the other one waits for it.
        planning: Background[EncodingPlan] | None = None
        workers = self.config.write_workers
        if (
            workers > 1
            and table.num_rows >= _PLAN_AHEAD_ROWS
            and table.nbytes >= 2 * parts.MIN_PARALLEL_PART_BYTES
        ):
            planning = in_background(partial(encoding_plan, table))
        try:
            try:
                table, order = consolidate_order(table, self.key_schema.names, vs.names)
            except DiffOverflow as e:
                raise e.in_shard(f"{self.name!r} ({self.shard_id})") from e
            if (table.num_rows if order is None else len(order)) == 0:
                return []
            return self.write_sorted(
                table, order, schema_id, None if planning is None else planning.result
            )
        finally:
            if planning is not None:
                planning.wait()  # no work of this call goes on after it

    def write_sorted(
        self,
        table: pa.Table,
        order: Any,
        schema_id: int,
        plan: Callable[[], EncodingPlan] | None = None,
    ) -> list[PartRef]:
        """Write ``table`` (in ``order``, from :func:`consolidate_order`) as one run, its
        parts' keys stamped now (:meth:`key_prefix`), ``before_upload`` called before
        the first upload; each part records ``schema_id``. ``plan``: the encoding plan
        of ``table``'s rows, if the caller has it made (see
        :func:`persist.parts.write_parts`)."""
        cfg = self.config
        directory, name = self.key_prefix().rsplit("/", 1)
        schema = self.inline_schema(schema_id)
        refs = write_parts(
            self.blob,
            table,
            directory,
            target_part_bytes=cfg.target_part_bytes,
            inline_max_bytes=self.inline_max(),
            max_workers=cfg.write_workers,
            order=order,
            name_prefix=name + "-",
            before_upload=self._before_upload,
            key_names=self.key_schema.names,
            schema=schema,
            plan=plan,
        )
        return refs if not schema_id else [replace(r, schema_id=schema_id) for r in refs]


class BuilderHost(Protocol):
    """What a :class:`BatchBuilder` needs of the write handle that made it
    (:class:`persist.write.WriteHandle` is one)."""

    shard_id: str
    writer_id: str
    schema_id: int
    runs: RunWriter

    def hold(self, holder: object, owners: Sequence[str], alive: Callable[[], bool]) -> int:
        """Keep the leases of ``owners`` alive while ``holder`` lives and ``alive()``."""
        ...

    def release_hold(self, ident: int) -> None:
        """Stop a :meth:`hold`."""
        ...

    def handed_out(self, batch: Batch) -> Batch:
        """A finished batch, before the builder returns it (its leases held)."""
        ...

    def builder_aborted(self) -> None:
        """A builder was aborted: no batch of it will be appended."""
        ...


class BatchBuilder:
    """Builds a :class:`Batch` piece by piece (the persist-client ``BatchBuilder``).

    Updates are buffered; whenever the buffer exceeds the client's target part size
    (in-memory Arrow bytes) it is consolidated and written as parts.  A flushed chunk
    extends the current run when its first (key, value, time) sorts strictly after the
    run's last one (chunks arriving in order make one run, as Materialize's builder does);
    otherwise it starts a new run.

    Exception safety: a failed :meth:`add` leaves the builder exactly as it was before
    the call (the updates of earlier calls stay buffered or written; the failed call's
    updates are not added), so :meth:`finish` never returns a batch missing a row that
    an ``add`` accepted.  A failed :meth:`finish` leaves it unfinished, to retry or
    :meth:`abort`.  Safe to share between threads: ``add``, ``finish`` and ``abort`` are
    serialized.

    Made by :meth:`persist.write.WriteHandle.builder` (``handle``, a
    :class:`BuilderHost`): it writes through the handle's :class:`RunWriter` and has the
    handle hold its writer's lease while it holds uploaded parts.
    """

    def __init__(self, handle: BuilderHost, lower: Antichain) -> None:
        self._h = handle
        self.lower = lower
        self._buffer: list[pa.Table] = []
        self._buffered_bytes = 0
        self._parts: list[PartRef] = []
        self._runs: list[int] = []
        self._run_last: pa.Table | None = None  # last (key, value, time) of the run
        self._min_time: int | None = None
        self._max_time: int | None = None
        self._finished = False
        self._hold_id: int | None = None  # WriteHandle.hold of its writer's lease
        self._lock = threading.RLock()  # add, finish and abort are serialized

    def add(self, updates: Updates) -> None:
        """Add updates (a Table/RecordBatch or a list of ``((k, v), t, d)``).

        Raises:
            UpdateNotBeyondLower: a ``_time`` is before ``lower`` (nothing is added).
            InvalidUsage: bad columns, or the builder is finished.
            BlobError: writing a full buffer failed; the builder is as before the call
                (these updates were not added; earlier ones are kept).
        """
        with self._lock:
            self._add(updates)

    def _add(self, updates: Updates) -> None:
        if self._finished:
            raise InvalidUsage("cannot add to a finished BatchBuilder")
        table = self._h.runs.normalize(updates)
        rng = time_range(table)
        if rng is None:
            return
        if not self.lower.less_equal(rng[0]):
            raise UpdateNotBeyondLower(rng[0], self.lower)
        before = (self._min_time, self._max_time, self._buffered_bytes)
        self._min_time = rng[0] if self._min_time is None else min(self._min_time, rng[0])
        self._max_time = rng[1] if self._max_time is None else max(self._max_time, rng[1])
        self._buffer.append(table)
        self._buffered_bytes += table.nbytes
        if self._buffered_bytes >= self._h.runs.config.target_part_bytes:
            try:
                self._flush()
            except BaseException:
                # Roll back to the state before this call: nothing of it was written
                # (write_parts deletes what a failed write uploaded).
                self._buffer.pop()
                self._min_time, self._max_time, self._buffered_bytes = before
                raise

    def _flush(self) -> None:
        """Write the buffer as parts; the buffer is emptied only once they are written."""
        if not self._buffer:
            return
        h = self._h
        table = pa.concat_tables(self._buffer)
        table, order = consolidate_order(table, h.runs.key_schema.names, h.runs.value_schema.names)
        n = table.num_rows if order is None else len(order)
        if n:
            run = h.runs.write_sorted(table, order, h.schema_id)  # keys stamped now, per run
            cols = [*h.runs.key_schema.names, *h.runs.value_schema.names, TIME]
            ends = [0, n - 1] if order is None else [int(order[0]), int(order[-1])]
            bounds = table.select(cols).take(pa.array(ends, pa.int64()))
            if self._parts and not self._extends_run(bounds.slice(0, 1)):
                self._runs.append(len(self._parts))
            if run and self._hold_id is None:
                # Uploaded parts: keep this writer's lease alive until finished.
                me = weakref.ref(self)
                self._hold_id = h.hold(
                    self, [h.writer_id], lambda: (b := me()) is not None and not b._finished
                )
            self._parts.extend(run)
            self._run_last = bounds.slice(1, 1)
        self._buffer, self._buffered_bytes = [], 0

    def _extends_run(self, first: pa.Table) -> bool:
        """Whether a chunk starting at ``first`` sorts strictly after the current run."""
        if self._run_last is None:
            return False
        pair = pa.concat_tables([self._run_last, first])
        in_order, same = _adjacent(pair, pair.schema.names, check_order=True)
        return in_order and same is None

    def finish(self, upper: Antichain | int) -> Batch:
        """Write what is buffered and return the :class:`Batch` ``[lower, upper)``.

        Raises:
            InvalidBounds: ``upper`` is before ``lower``.
            UpdateBeyondUpper: an added ``_time`` is not before ``upper`` (the parts
                already written are deleted).
            BlobError: writing the buffer failed; the builder stays unfinished with every
                accepted update (call ``finish`` again or :meth:`abort`).
        """
        with self._lock:
            return self._finish(upper)

    def _finish(self, upper: Antichain | int) -> Batch:
        if self._finished:
            raise InvalidUsage("BatchBuilder.finish was already called")
        up = as_frontier(upper, "upper")
        if not self.lower <= up:
            raise InvalidBounds(self.lower, up)
        if self._max_time is not None and up.less_equal(self._max_time):
            self.abort()
            raise UpdateBeyondUpper(self._max_time, up)
        self._flush()
        self._finished = True
        self._release_hold()
        hollow = HollowBatch(
            desc=Description(self.lower, up),
            parts=tuple(self._parts),
            len=sum(p.rows for p in self._parts),
            runs=tuple(self._runs),
        )
        time_range = None
        if self._min_time is not None and self._max_time is not None:
            time_range = (self._min_time, self._max_time)
        return self._h.handed_out(
            Batch(self._h.runs.blob, self._h.shard_id, hollow, time_range=time_range)
        )

    def _release_hold(self) -> None:
        """Stop renewing the writer's lease for this builder (it holds no parts now: a
        finished batch holds them itself)."""
        ident, self._hold_id = self._hold_id, None
        if ident is not None:
            self._h.release_hold(ident)

    def abort(self) -> None:
        """Drop the buffer and delete the parts already written.  Idempotent; after a
        successful :meth:`finish` it does nothing (the batch owns the parts)."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
            self._h.builder_aborted()  # no batch of it will travel
            self._release_hold()
            self._buffer = []
            Batch(
                self._h.runs.blob,
                self._h.shard_id,
                HollowBatch(Description(self.lower, self.lower), tuple(self._parts)),
            ).delete()
