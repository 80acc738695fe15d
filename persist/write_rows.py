"""The row-level changes of a write handle: ``upsert``, ``delete``, ``update`` and
``merge``, and what :func:`persist.rows.apply_change` needs of a writer
(``change_state``, ``read_live``), mixed into :class:`persist.write.WriteHandle`.

Each change is planned by :mod:`persist.rows` (or :mod:`persist.merge_into`) on the
live rows of one freshly read state version and committed with one
``compare_and_append`` at that version's upper; a lost race plans again.  Invariant kept
here: a change needs the shard's newest schema version (:meth:`change_state` refuses an
older handle), so its retractions name every column of the rows they cancel.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from persist import merge_into
from persist import rows as rows_mod
from persist.builder import Updates
from persist.commit_note import param_text
from persist.errors import SchemaMismatch
from persist.filters import check_filter
from persist.handle import ShardHandle
from persist.merge_into import MergeBuilder, MergeResult
from persist.rows import Planned, RowChanges
from persist.rows_read import read_live_rows
from persist.state import ShardState
from stash import Antichain

__all__ = ["RowChangeMethods"]


class RowChangeMethods(ShardHandle):
    """The row-level changes of :class:`persist.write.WriteHandle` (its base)."""

    def compare_and_append(
        self,
        updates: Updates,
        expected_upper: Antichain | int,
        new_upper: Antichain | int,
        *,
        idempotency_token: str | None = None,
    ) -> None:  # pragma: no cover - WriteHandle's
        raise NotImplementedError

    def upsert(self, rows: pa.Table | pa.RecordBatch) -> RowChanges:
        """Replace, for each row of ``rows``, every live row with its key by it, at one
        new time (:mod:`persist.rows`: serializable, re-planned on a lost race).  Keys
        are equal as consolidation has them (:mod:`persist.key_identity`: ``-0.0`` =
        ``0.0``, NaN = NaN, exact to the tick).  A row equal to its key's one live row
        is left alone; a change that changes nothing commits nothing (see
        :class:`persist.rows.RowChanges`).  Only the parts whose key statistics can
        hold one of the incoming keys are read.

        Args:
            rows: a pyarrow ``Table``/``RecordBatch`` of exactly the key and value
                columns (no ``_time`` or ``_diff``), each key at most once.

        Raises:
            InvalidUsage: bad columns, or two rows with one key (naming the key
                columns); nothing committed.
            SchemaMismatch: this handle's schema is older than the shard's newest.
            ChangeContended: the race for the upper was lost on every attempt.
            BlobError, ConsensusError: as :meth:`compare_and_append`.
        """
        self._check()
        table = rows_mod.conform_rows(rows, self.schema, f"upsert into shard {self.name!r}")
        keys, values = self.key_schema.names, self.value_schema.names
        rows_mod.check_distinct_keys(table, keys)  # before anything is read
        filt = rows_mod.key_filter(table, keys)

        def plan(read: Callable[[pc.Expression | None], pa.Table], upper: int) -> Planned:
            live = read(filt) if table.num_rows else self.schema.empty_table()
            return rows_mod.plan_upsert(live, table, keys, values)

        return rows_mod.apply_change(self, plan, op="upsert")

    def delete(self, filter: pc.Expression) -> RowChanges:
        """Retract every live row ``filter`` (a boolean ``pyarrow.compute`` expression
        over key and value columns, as in ``snapshot(filter=)``) keeps, at one new time
        (:mod:`persist.rows`).  Same errors as :meth:`upsert` (a bad filter:
        ``InvalidUsage``)."""
        self._check()
        keys, values = self.key_schema.names, self.value_schema.names
        check_filter(filter, self.schema, keys, values)

        def plan(read: Callable[[pc.Expression | None], pa.Table], upper: int) -> Planned:
            return rows_mod.plan_delete(read(filter), keys, values)

        return rows_mod.apply_change(self, plan, op="delete", params={"predicate": str(filter)})

    def update(self, filter: pc.Expression, set: Mapping[str, Any]) -> RowChanges:
        """Retract every live row ``filter`` keeps and insert it again with ``set``
        (``{column: scalar | pyarrow.compute expression}``, expressions evaluated on the
        old row, e.g. ``{"v": pc.field("v") + 1}``), keeping its count, at one new time
        (:mod:`persist.rows`).  A scalar is converted to its column's type exactly or
        refused (``InvalidUsage``: ``1.9`` for an int64, ``2**70``, a string for a
        number), before anything is read.  Key columns may change, unless two live rows
        would get one key that did not share it before (``InvalidUsage``, nothing
        committed).  Rows the update leaves equal are not rewritten.  Same errors as
        :meth:`upsert`."""
        self._check()
        keys, values = self.key_schema.names, self.value_schema.names
        check_filter(filter, self.schema, keys, values)
        changes = rows_mod.check_set(set, self.schema, keys, values)

        def plan(read: Callable[[pc.Expression | None], pa.Table], upper: int) -> Planned:
            live = read(filter)
            at_new = None
            if rows_mod.changes_key(changes, keys) and live.num_rows:
                new = rows_mod.new_values(live, changes, [*keys, *values])
                at_new = read(rows_mod.key_filter(new, keys))
            return rows_mod.plan_update(live, changes, keys, values, at_new)

        params = {"predicate": str(filter), "set": {k: param_text(v) for k, v in set.items()}}
        return rows_mod.apply_change(self, plan, op="update", params=params)

    def merge(
        self,
        source: Any,
        on: Sequence[str] | None = None,
        source_alias: str = "source",
        target_alias: str = "target",
    ) -> MergeBuilder[MergeResult]:
        """A MERGE INTO this shard (:mod:`persist.merge_into`, after Delta Lake's
        ``DeltaTable.merge``): chain ``when_*`` clauses, then ``execute()`` commits them
        as one change (serializable; planned again on a lost race).

        Args:
            source: the source rows: a pyarrow ``Table``/``RecordBatch``/reader, a pandas
                or polars DataFrame, or any object with ``__arrow_c_stream__``.
            on: the key columns to match on (default: every key column).
            source_alias, target_alias: the names conditions and values use for the
                source's and the target's columns.

        Raises:
            InvalidUsage: bad source, ``on`` or aliases (more at ``execute()``).
        """
        self._check()
        src = merge_into.as_source(source)
        keys = self.key_schema.names
        spec = merge_into.check_spec(on, source_alias, target_alias, keys)
        data = pa.schema([self.schema.field(n) for n in [*keys, *self.value_schema.names]])

        def run(spec: merge_into.MergeSpec) -> merge_into.MergeResult:
            self._check()
            return merge_into.run_merge(self, src, spec, data, keys)

        return MergeBuilder(spec, run)

    def change_state(self) -> ShardState:
        """The shard's state freshly read from consensus, for a row-level change: its
        upper is the change's time.

        Raises:
            SchemaMismatch: this handle's schema version is older than the shard's
                newest (its retractions could not name the newer columns).
        """
        st = self._machine.refresh()
        newest = st.schemas().newest
        if self.schema_id != newest:
            raise SchemaMismatch(
                repr(self.name),
                "*",
                f"a row change needs the shard's newest schema version {newest}",
                f"this handle has version {self.schema_id}; nothing was committed",
            )
        return st

    def read_live(self, state: ShardState, filter: pc.Expression | None) -> pa.Table:
        """The live rows of ``state`` (all its updates, consolidated, as of ``upper - 1``
        or its since if later), conformed to this handle's view, at least those
        ``filter`` keeps (parts and their row groups pruned by their statistics,
        :func:`persist.rows_read.read_live_rows`)."""
        upper, since = state.upper.as_option(), state.since.as_option()
        if not upper:
            return self.schema.empty_table()
        as_of = upper - 1 if since is None else max(upper - 1, since)
        return read_live_rows(
            self._ctx.blob,
            [b for b in state.batches() if b.len > 0],
            self.schema,
            self.key_schema.names,
            self.value_schema.names,
            as_of,
            max_workers=self._ctx.config.read_workers,
            schemas=(state.schemas(), self.schema_id),
            filter=filter,
        )
