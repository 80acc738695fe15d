"""MERGE INTO a shard: Delta Lake's conditional clauses, planned as one row change.

This module holds the builder users chain (:class:`MergeBuilder`), the result
(:class:`MergeResult`) and :func:`run_merge`; the pure planning (live target rows, source
rows and clauses in, the updates of one commit out) is :mod:`persist.merge_plan`.  The handles run a plan through :func:`persist.rows.apply_change`,
so a merge is one ``compare_and_append`` planned on the shard's current state, and a
lost race plans again: serializable, like ``update``.

Semantics (Delta Lake's ``MERGE INTO``, as delta-spark's ``DeltaMergeBuilder`` and
delta-rs's ``TableMerger`` state them):

* a source row *matches* a target row when their ``on`` columns (key columns of the
  shard, by default all of them) are equal as key identity defines it
  (:mod:`persist.key_identity`: ``-0.0`` = ``0.0``, NaN = NaN, exact nanoseconds);
* each matched target row takes the first ``when_matched_*`` clause whose condition
  holds (none if none holds); each source row that matches no target row takes the first
  ``when_not_matched_*`` clause whose condition holds; each target row that no source
  row matches takes the first ``when_not_matched_by_source_*`` clause whose condition
  holds.  A condition that is SQL ``NULL`` does not hold;
* a target row matched by two or more source rows raises :class:`InvalidUsage` naming
  its key, when any ``when_matched_*`` clause is given;
* conditions and values are SQL expressions over ``<source_alias>.<col>`` and
  ``<target_alias>.<col>``, evaluated by DuckDB on an in-memory connection with external
  access disabled; a by-source clause may name target columns only, a not-matched clause
  source columns only;
* values are cast to the target column's type safely (no truncation, no overflow) or
  refused; a column given as a plain ``alias.column`` reference is taken from the Arrow
  rows themselves, so a value is never rebuilt from what DuckDB converted (DuckDB's
  ``TIME`` is microseconds);
* an update may not change a key column (refused, naming it); an insert must give every
  non-nullable column, and its key may not be the key of a live row or of another
  inserted row;
* a row whose new value equals its live value (as consolidation compares values) is
  neither retracted nor re-inserted, and not counted; source rows no clause touches cost
  nothing; counts are rows with their multiplicity (a live row of count 2 updated counts
  2);
* bad input (a condition that does not parse, an unknown column, a type that does not
  fit) raises :class:`InvalidUsage` before anything is written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Self, TypeVar

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from persist.arrow_input import as_arrow_table
from persist.commit_note import note_metrics
from persist.errors import InvalidUsage
from persist.key_identity import key_filter
from persist.merge_plan import (
    DuckDBEvaluator,
    EvaluatorFactory,
    MergeClause,
    MergeCounts,
    MergeResult,
    MergeSpec,
    plan_merge,
    source_on,
)
from persist.parts import DIFF
from persist.rows import ChangeWriter, Planned, apply_change

R = TypeVar("R")

__all__ = [
    "MergeBuilder",
    "MergeClause",
    "MergeResult",
    "MergeSpec",
    "as_source",
    "check_spec",
    "plan_on_read",
    "read_filter",
    "run_merge",
]

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class MergeBuilder(Generic[R]):
    """Chains a merge's clauses (delta-spark's ``DeltaMergeBuilder``); :meth:`execute`
    commits it.  Each ``when_*`` method returns the builder; clauses of one kind are
    tried in the order they were added."""

    def __init__(
        self,
        spec: MergeSpec,
        run: Callable[[MergeSpec], R],
        accepts: tuple[type, ...] = (str,),
    ) -> None:
        self._spec = spec
        self._run = run
        self._accepts = accepts

    def _add(self, clause: MergeClause) -> Self:
        kinds = " or ".join(t.__name__ for t in self._accepts)
        if clause.condition is not None and not isinstance(clause.condition, self._accepts):
            raise InvalidUsage(
                f"merge: a condition must be {kinds}, not {type(clause.condition).__name__}"
            )
        if clause.values is not None:
            if not isinstance(clause.values, Mapping) or not clause.values:
                raise InvalidUsage(
                    f"merge: when_{clause.kind}_{clause.action} needs a non-empty "
                    "{column: SQL expression} mapping"
                )
            bad = [c for c, v in clause.values.items() if not isinstance(v, self._accepts)]
            if bad:
                raise InvalidUsage(f"merge: the values of {bad} must be {kinds}")
        self._spec = MergeSpec(
            self._spec.on,
            self._spec.source_alias,
            self._spec.target_alias,
            (*self._spec.clauses, clause),
        )
        return self

    def when_matched_update(self, set: Mapping[str, str], condition: str | None = None) -> Self:
        """Matched target rows (where ``condition`` holds) take ``set``'s values."""
        return self._add(MergeClause("matched", "update", condition, dict(set)))

    def when_matched_update_all(self, condition: str | None = None) -> Self:
        """Matched target rows take every value column from the source column of the
        same name."""
        return self._add(MergeClause("matched", "update", condition, None))

    def when_matched_delete(self, condition: str | None = None) -> Self:
        """Matched target rows (where ``condition`` holds) are deleted."""
        return self._add(MergeClause("matched", "delete", condition, None))

    def when_not_matched_insert(
        self, values: Mapping[str, str], condition: str | None = None
    ) -> Self:
        """Source rows matching no target row are inserted with ``values`` (columns
        not named are null)."""
        return self._add(MergeClause("not_matched", "insert", condition, dict(values)))

    def when_not_matched_insert_all(self, condition: str | None = None) -> Self:
        """Source rows matching no target row are inserted as they are (every target
        column from the source column of the same name)."""
        return self._add(MergeClause("not_matched", "insert", condition, None))

    def when_not_matched_by_source_update(
        self, set: Mapping[str, str], condition: str | None = None
    ) -> Self:
        """Target rows no source row matches take ``set``'s values (target columns
        only)."""
        return self._add(MergeClause("not_matched_by_source", "update", condition, dict(set)))

    def when_not_matched_by_source_delete(self, condition: str | None = None) -> Self:
        """Target rows no source row matches (where ``condition`` holds) are deleted."""
        return self._add(MergeClause("not_matched_by_source", "delete", condition, None))

    @property
    def spec(self) -> MergeSpec:
        """The merge as asked so far."""
        return self._spec

    def execute(self) -> R:
        """Plan and commit the merge (one commit; planned again on a lost race) and
        return its :class:`MergeResult`; in a transaction (``Txn.merge``), add it to the
        transaction (planned and checked when it commits) and return ``None``.

        Raises:
            InvalidUsage: no clause, a condition or value that does not parse or names
                an unknown column, a type that does not fit, a key column changed, a
                target row matched twice, two inserted rows with one key; nothing
                committed.
            SchemaMismatch, ChangeContended, BlobError, ConsensusError: as ``upsert``.
        """
        if not self._spec.clauses:
            raise InvalidUsage("merge: give at least one when_* clause before execute()")
        return self._run(self._spec)


# ------------------------------------------------------------------ checks
def check_spec(
    on: Sequence[str] | None,
    source_alias: str,
    target_alias: str,
    key_names: Sequence[str],
) -> MergeSpec:
    """A :class:`MergeSpec` with no clauses, its ``on`` and aliases checked.

    Raises:
        InvalidUsage: an alias is not a plain SQL identifier or both are one name; ``on``
            is empty or names a column that is not a key column.
    """
    for what, a in (("source_alias", source_alias), ("target_alias", target_alias)):
        if not isinstance(a, str) or not _IDENT.match(a):
            raise InvalidUsage(f"merge: {what} {a!r} must be a plain SQL identifier")
    if source_alias.lower() == target_alias.lower():
        raise InvalidUsage(f"merge: source and target aliases are both {source_alias!r}")
    cols = list(key_names) if on is None else ([on] if isinstance(on, str) else list(on))
    if not cols:
        raise InvalidUsage("merge: on must name at least one key column")
    bad = [c for c in cols if c not in key_names]
    if bad:
        raise InvalidUsage(f"merge: on names {bad}, which are not key columns {list(key_names)}")
    if len(set(cols)) != len(cols):
        raise InvalidUsage(f"merge: on names a column twice: {cols}")
    return MergeSpec(tuple(cols), source_alias, target_alias)


# ------------------------------------------------------------------ running
def as_source(data: Any) -> pa.Table:
    """A merge source as an Arrow table: anything ``Table.append`` takes
    (:func:`persist.arrow_input.as_arrow_table`: a ``pa.Table``, ``RecordBatch``,
    ``RecordBatchReader``, a pandas or polars DataFrame, any object with
    ``__arrow_c_stream__``).

    Raises:
        InvalidUsage: anything else.
    """
    return as_arrow_table(data, "merge source")


_COMPARE = {
    "COMPARE_EQUAL": ("==", "=="),
    "COMPARE_GREATERTHAN": (">", "<"),
    "COMPARE_GREATERTHANOREQUALTO": (">=", "<="),
    "COMPARE_LESSTHAN": ("<", ">"),
    "COMPARE_LESSTHANOREQUALTO": ("<=", ">="),
}
_NUMBER_LITERALS = {"INTEGER", "BIGINT", "HUGEINT", "SMALLINT", "TINYINT", "UBIGINT"}


def _key_bounds(
    condition: str | None, alias: str, schema: pa.Schema, key_names: Sequence[str]
) -> pc.Expression | None:
    """A filter every target row ``condition`` holds for passes, from the comparisons of
    a key column with a constant that ``condition`` is a conjunction of
    (``target.k >= 10 AND target.k < 20 AND ...``); ``None`` when it has none (any row
    may pass).  DuckDB parses the condition (``json_serialize_sql``); the filter only
    prunes the read: the condition itself is still evaluated on every row read."""
    if condition is None:
        return None
    con = duckdb.connect(config={"enable_external_access": False})
    try:
        text = con.execute("SELECT json_serialize_sql(?)", [f"SELECT {condition}"]).fetchone()
    except duckdb.Error:
        return None
    finally:
        con.close()
    try:
        tree = json.loads(text[0]) if text else {}
        node = tree["statements"][0]["node"]["select_list"][0]
    except (KeyError, IndexError, TypeError, ValueError):
        return None  # not parsed: execute() reports the condition
    terms = node.get("children", []) if node.get("type") == "CONJUNCTION_AND" else [node]
    out: pc.Expression | None = None
    for term in terms:
        e = _bound(term, alias, schema, key_names)
        if e is not None:
            out = e if out is None else out & e
    return out


def _bound(
    term: dict[str, Any], alias: str, schema: pa.Schema, key_names: Sequence[str]
) -> pc.Expression | None:
    """``target.k <op> constant`` (either side) as a pyarrow expression, else ``None``."""
    ops = _COMPARE.get(term.get("type", ""))
    if ops is None:
        return None
    left, right = term.get("left", {}), term.get("right", {})
    if left.get("class") == "COLUMN_REF":
        col, const, op = left, right, ops[0]
    else:
        col, const, op = right, left, ops[1]
    names = col.get("column_names", [])
    if (
        col.get("class") != "COLUMN_REF"
        or const.get("class") != "CONSTANT"
        or len(names) != 2
        or names[0].lower() != alias.lower()
        or names[1] not in key_names
    ):
        return None
    lit = const.get("literal", {})
    t = schema.field(names[1]).type
    value: Any
    if lit.get("kind") in _NUMBER_LITERALS and pa.types.is_integer(t):
        value = int(lit["text"])
    elif lit.get("kind") == "STRING" and (pa.types.is_string(t) or pa.types.is_large_string(t)):
        value = str(lit["text"])
    else:
        return None
    f = pc.field(names[1])
    return {
        "==": f == value,
        ">": f > value,
        ">=": f >= value,
        "<": f < value,
        "<=": f <= value,
    }[op]


def read_filter(
    source: pa.Table, spec: MergeSpec, schema: pa.Schema, key_names: Sequence[str]
) -> tuple[bool, pc.Expression | None]:
    """What a merge reads of the live rows: ``(read anything, filter)``.  Only the rows
    whose ``on`` columns can equal a source row's (part statistics and key-range row
    groups prune, as ``upsert`` reads), and those of the key ranges its by-source
    clauses are restricted to; every live row when a by-source clause is not.

    Raises:
        InvalidUsage: the source's ``on`` columns are missing, do not fit or hold nulls.
    """
    on_cols = source_on(source, spec, schema)  # refused before anything is read
    filt = key_filter(on_cols, spec.on)
    by_source = [c for c in spec.clauses if c.kind == "not_matched_by_source"]
    if not by_source:
        return source.num_rows > 0, filt
    bounds = [_key_bounds(c.condition, spec.target_alias, schema, key_names) for c in by_source]
    if any(b is None for b in bounds):
        return True, None  # a by-source clause may touch any live row: read them all
    for b in bounds:
        filt = b if filt is None else filt | b
    return True, filt


def plan_on_read(
    read: Callable[[pc.Expression | None], pa.Table],
    source: pa.Table,
    spec: MergeSpec,
    schema: pa.Schema,
    key_names: Sequence[str],
    evaluator: EvaluatorFactory = DuckDBEvaluator,
) -> tuple[Planned, MergeCounts]:
    """Plan ``spec`` on the live rows ``read(filter)`` gives (:func:`read_filter`
    decides what is read; :func:`persist.merge_plan.plan_merge` plans)."""
    needs, filt = read_filter(source, spec, schema, key_names)
    if needs:
        live = read(filt)
    else:
        live = schema.empty_table().append_column(DIFF, pa.array([], pa.int64()))

    def read_keys(keys: pa.Table) -> pa.Table:
        return read(key_filter(keys, key_names))

    return plan_merge(live, source, spec, schema, key_names, read_keys, evaluator)


def run_merge(
    writer: ChangeWriter,
    source: pa.Table,
    spec: MergeSpec,
    schema: pa.Schema,
    key_names: Sequence[str],
    evaluator: EvaluatorFactory = DuckDBEvaluator,
) -> MergeResult:
    """Plan and commit ``spec`` through ``writer`` (:func:`persist.rows.apply_change`:
    one ``compare_and_append``, planned again on a lost race; a merge that changes
    nothing commits nothing), reading what :func:`read_filter` says.

    Args:
        schema: the shard's key and value columns (no ``_time``/``_diff``).

    Raises:
        see :meth:`MergeBuilder.execute`.
    """
    read_filter(source, spec, schema, key_names)  # refused before anything is read
    last: list[MergeCounts] = []

    def plan(read: Callable[[pc.Expression | None], pa.Table], upper: int) -> Planned:
        planned, counts = plan_on_read(read, source, spec, schema, key_names, evaluator)
        last[:] = [counts]
        note_metrics(counts.metrics())
        return planned

    changes = apply_change(writer, plan, op="merge", params=spec.parameters())
    return last[0].result(changes.time)
