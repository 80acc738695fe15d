"""MERGE INTO a shard: Delta Lake's conditional clauses, planned as one row change.

This module holds the clause list (:class:`MergeClause`), the builder users chain
(:class:`MergeBuilder`), the result (:class:`MergeResult`) and the pure planning
(:func:`plan_merge`: live target rows, source rows and clauses in, the updates of one
commit out; no I/O).  The handles run a plan through :func:`persist.rows.apply_change`,
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
from dataclasses import dataclass, field
from typing import Any, Literal

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from persist.consolidation import _compare_pairs
from persist.errors import InvalidUsage
from persist.key_identity import aligned, duplicate_key, isin, key_filter
from persist.parts import DIFF
from persist.rows import ChangeWriter, Planned, apply_change

__all__ = ["MergeBuilder", "MergeClause", "MergeResult", "plan_merge", "run_merge"]

ClauseKind = Literal["matched", "not_matched", "not_matched_by_source"]
Action = Literal["update", "delete", "insert"]

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class MergeClause:
    """One ``WHEN`` clause: its kind, its action, its condition (SQL text or ``None``)
    and, for updates and inserts, ``values`` (column -> SQL text), ``None`` for the
    ``*_all`` forms (every column from the source column of the same name)."""

    kind: ClauseKind
    action: Action
    condition: str | None = None
    values: Mapping[str, str] | None = None

    def describe(self) -> dict[str, Any]:
        """The clause as JSON-able parameters (for history)."""
        out: dict[str, Any] = {"clause": f"when_{self.kind}_{self.action}"}
        if self.condition is not None:
            out["condition"] = self.condition
        if self.values is not None:
            out["set" if self.action == "update" else "values"] = dict(self.values)
        elif self.action != "delete":
            out["all"] = True
        return out


@dataclass(frozen=True)
class MergeResult:
    """The outcome of a committed merge.

    Attributes:
        time: the time the merge committed at (int); the shard's upper was then
            ``time + 1``.
        num_source_rows: rows of the source (int).
        num_target_rows_inserted: rows inserted by ``when_not_matched_*`` clauses.
        num_target_rows_updated: live rows given another value (with multiplicity).
        num_target_rows_deleted: live rows retracted by delete clauses (with
            multiplicity).
        num_target_rows_unchanged: rows an update clause took whose value did not change
            (nothing written for them).
    """

    time: int
    num_source_rows: int
    num_target_rows_inserted: int
    num_target_rows_updated: int
    num_target_rows_deleted: int
    num_target_rows_unchanged: int = 0


@dataclass
class MergeCounts:
    """The counts of one plan (the last plan's become the :class:`MergeResult`)."""

    source: int = 0
    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    unchanged: int = 0


@dataclass(frozen=True)
class MergeSpec:
    """What a merge was asked: the ``on`` columns, the aliases and the clauses."""

    on: tuple[str, ...]
    source_alias: str
    target_alias: str
    clauses: tuple[MergeClause, ...] = field(default_factory=tuple)

    def parameters(self) -> dict[str, Any]:
        """The merge's parameters as JSON-able values (its predicate and clauses)."""
        s, t = self.source_alias, self.target_alias
        return {
            "predicate": " AND ".join(f"{s}.{c} = {t}.{c}" for c in self.on),
            "clauses": [c.describe() for c in self.clauses],
        }


class MergeBuilder:
    """Chains a merge's clauses (delta-spark's ``DeltaMergeBuilder``); :meth:`execute`
    commits it.  Each ``when_*`` method returns the builder; clauses of one kind are
    tried in the order they were added."""

    def __init__(self, spec: MergeSpec, run: Callable[[MergeSpec], MergeResult]) -> None:
        self._spec = spec
        self._run = run

    def _add(self, clause: MergeClause) -> MergeBuilder:
        if clause.condition is not None and not isinstance(clause.condition, str):
            raise InvalidUsage(
                f"merge: a condition must be SQL text, not {type(clause.condition).__name__}"
            )
        if clause.values is not None:
            if not isinstance(clause.values, Mapping) or not clause.values:
                raise InvalidUsage(
                    f"merge: when_{clause.kind}_{clause.action} needs a non-empty "
                    "{column: SQL expression} mapping"
                )
            bad = [c for c, v in clause.values.items() if not isinstance(v, str)]
            if bad:
                raise InvalidUsage(f"merge: the values of {bad} must be SQL text")
        self._spec = MergeSpec(
            self._spec.on,
            self._spec.source_alias,
            self._spec.target_alias,
            (*self._spec.clauses, clause),
        )
        return self

    def when_matched_update(
        self, set: Mapping[str, str], condition: str | None = None
    ) -> MergeBuilder:
        """Matched target rows (where ``condition`` holds) take ``set``'s values."""
        return self._add(MergeClause("matched", "update", condition, dict(set)))

    def when_matched_update_all(self, condition: str | None = None) -> MergeBuilder:
        """Matched target rows take every value column from the source column of the
        same name."""
        return self._add(MergeClause("matched", "update", condition, None))

    def when_matched_delete(self, condition: str | None = None) -> MergeBuilder:
        """Matched target rows (where ``condition`` holds) are deleted."""
        return self._add(MergeClause("matched", "delete", condition, None))

    def when_not_matched_insert(
        self, values: Mapping[str, str], condition: str | None = None
    ) -> MergeBuilder:
        """Source rows matching no target row are inserted with ``values`` (columns
        not named are null)."""
        return self._add(MergeClause("not_matched", "insert", condition, dict(values)))

    def when_not_matched_insert_all(self, condition: str | None = None) -> MergeBuilder:
        """Source rows matching no target row are inserted as they are (every target
        column from the source column of the same name)."""
        return self._add(MergeClause("not_matched", "insert", condition, None))

    def when_not_matched_by_source_update(
        self, set: Mapping[str, str], condition: str | None = None
    ) -> MergeBuilder:
        """Target rows no source row matches take ``set``'s values (target columns
        only)."""
        return self._add(MergeClause("not_matched_by_source", "update", condition, dict(set)))

    def when_not_matched_by_source_delete(self, condition: str | None = None) -> MergeBuilder:
        """Target rows no source row matches (where ``condition`` holds) are deleted."""
        return self._add(MergeClause("not_matched_by_source", "delete", condition, None))

    @property
    def spec(self) -> MergeSpec:
        """The merge as asked so far."""
        return self._spec

    def execute(self) -> MergeResult:
        """Plan and commit the merge (one commit; planned again on a lost race).

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


def _quote(name: str) -> str:
    """``name`` as a quoted SQL identifier (names are data, never SQL)."""
    return '"' + name.replace('"', '""') + '"'


def _prefix(*tables: pa.Table) -> str:
    """A column-name prefix no column of ``tables`` starts with."""
    names = [n for t in tables for n in t.column_names]
    p = "__pm_"
    while any(n.startswith(p) for n in names):
        p = "_" + p
    return p


def _simple_ref(expr: str, alias: str) -> str | None:
    """The column ``expr`` names when it is exactly ``alias.column`` (quoted or not),
    else ``None``."""
    m = re.fullmatch(
        r'\s*(?:"((?:[^"]|"")+)"|([A-Za-z_][A-Za-z0-9_]*))\s*\.\s*'
        r'(?:"((?:[^"]|"")+)"|([A-Za-z_][A-Za-z0-9_]*))\s*',
        expr,
    )
    if not m:
        return None
    a = m.group(1).replace('""', '"') if m.group(1) is not None else m.group(2)
    if a.lower() != alias.lower():
        return None
    return m.group(3).replace('""', '"') if m.group(3) is not None else m.group(4)


class _Sql:
    """One DuckDB connection over the target's live rows and the source, with the
    joins the clauses are evaluated on.  Errors name the clause and the expression."""

    def __init__(
        self, spec: MergeSpec, target: pa.Table, source: pa.Table, p: str, width: int
    ) -> None:
        self.spec = spec
        self.p = p
        self.con = duckdb.connect(config={"enable_external_access": False})
        self.con.register(f"{p}target", target)
        self.con.register(f"{p}source", source)
        s, t = _quote(spec.source_alias), _quote(spec.target_alias)
        on = " AND ".join(
            f"{s}.{_quote(f'{p}k{i}')} = {t}.{_quote(f'{p}k{i}')}" for i in range(width)
        )
        self.from_ = {
            "matched": f"{_quote(p + 'source')} AS {s} JOIN {_quote(p + 'target')} AS {t} ON {on}",
            "not_matched": (
                f"{_quote(p + 'source')} AS {s} ANTI JOIN {_quote(p + 'target')} AS {t} ON {on}"
            ),
            "not_matched_by_source": (
                f"{_quote(p + 'target')} AS {t} ANTI JOIN {_quote(p + 'source')} AS {s} ON {on}"
            ),
        }

    def close(self) -> None:
        self.con.close()

    def query(self, kind: ClauseKind, select: list[tuple[str, str, str]]) -> pa.Table:
        """``SELECT`` the ``(sql, name, what)`` items over ``kind``'s join."""
        items = ", ".join(f"({sql}) AS {_quote(name)}" for sql, name, _ in select)
        q = f"SELECT {items} FROM {self.from_[kind]}"  # noqa: S608 - names quoted
        try:
            return self.con.sql(q).to_arrow_table()
        except duckdb.Error as e:
            raise self._explain(kind, select, e) from None

    def _explain(
        self, kind: ClauseKind, select: list[tuple[str, str, str]], e: duckdb.Error
    ) -> InvalidUsage:
        # Find the item at fault by binding each alone (cheap: the query is re-planned).
        for sql, name, what in select:
            if not what:
                continue
            try:
                self.con.sql(
                    f"SELECT ({sql}) AS {_quote(name)} FROM {self.from_[kind]} LIMIT 0"  # noqa: S608
                ).to_arrow_table()
            except duckdb.Error as inner:
                msg = str(inner).splitlines()[0]
                hint = ""
                other = self.spec.source_alias if kind != "matched" else None
                if kind == "not_matched_by_source":
                    hint = f" (a by-source clause may use {self.spec.target_alias} columns only)"
                elif kind == "not_matched":
                    other = self.spec.target_alias
                    hint = f" (a not-matched clause may use {self.spec.source_alias} columns only)"
                del other
                return InvalidUsage(
                    f"merge: {what} {sql!r} cannot be evaluated{hint}: {msg}; nothing was committed"
                )
        return InvalidUsage(f"merge: the clauses cannot be evaluated: {e}; nothing was committed")


def _family(t: pa.DataType) -> str | None:
    """The kind of values ``t`` holds, for the rule that a value is cast only within
    its kind (numbers to numbers, text to text, ...); ``None`` for the null type."""
    if pa.types.is_null(t):
        return None
    if pa.types.is_dictionary(t):
        return _family(t.value_type)
    for name, test in (
        ("number", lambda x: pa.types.is_integer(x) or pa.types.is_floating(x)),
        ("number", pa.types.is_decimal),
        ("text", lambda x: pa.types.is_string(x) or pa.types.is_large_string(x)),
        ("bytes", lambda x: pa.types.is_binary(x) or pa.types.is_large_binary(x)),
        ("bytes", pa.types.is_fixed_size_binary),
        ("boolean", pa.types.is_boolean),
        ("timestamp", pa.types.is_timestamp),
        ("date", pa.types.is_date),
        ("time", pa.types.is_time),
        ("duration", pa.types.is_duration),
    ):
        if test(t):
            return name
    return str(t)


def _cast(arr: pa.ChunkedArray | pa.Array, f: pa.Field, what: str) -> pa.ChunkedArray:
    """``arr`` cast safely to ``f``'s type (within its kind of values: no text to a
    number; no truncation or overflow), nulls refused in a non-nullable column.

    Raises:
        InvalidUsage: the values do not fit (naming the column and the rule).
    """
    have = _family(arr.type)
    if have is not None and have != _family(f.type):
        raise InvalidUsage(
            f"merge: {what} gives {arr.type} values to column {f.name!r} ({f.type}); "
            "a value is cast only within its kind (numbers, text, ...); nothing was committed"
        )
    try:
        out = pc.cast(arr, f.type, safe=True)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
        raise InvalidUsage(
            f"merge: {what} for column {f.name!r} ({f.type}) does not fit: {e}; "
            "nothing was committed"
        ) from None
    if not f.nullable and out.null_count:
        raise InvalidUsage(
            f"merge: {what} gives nulls to the non-nullable column {f.name!r}; "
            "nothing was committed"
        )
    return out if isinstance(out, pa.ChunkedArray) else pa.chunked_array([out])


def rows_equal(a: pa.Table, b: pa.Table) -> pa.ChunkedArray:
    """Row by row, whether ``a`` and ``b`` (one row count, the same column names) hold
    equal values as consolidation compares them (nulls equal, NaN equal to NaN, ``-0.0``
    equal to ``0.0``)."""
    out: Any = pa.array([True] * a.num_rows, pa.bool_())
    for name in a.column_names:
        x, y = a.column(name).combine_chunks(), b.column(name).combine_chunks()
        try:
            eq, _ = _compare_pairs(x, y, False)
        except (pa.ArrowNotImplementedError, pa.ArrowTypeError):
            eq = pa.array([u == v for u, v in zip(x.to_pylist(), y.to_pylist(), strict=True)])
        out = pc.and_(out, eq)
    return pa.chunked_array([out])


def _key_of(table: pa.Table, row: int, key_names: Sequence[str]) -> list[Any]:
    return [table.column(k)[row].as_py() for k in key_names]


# ------------------------------------------------------------------ planning
def _with_identity(table: pa.Table, ident: pa.Table, p: str, index: str) -> pa.Table:
    """``table`` with its key identity columns (named ``<p>k<i>``) and its row index."""
    out = table
    for i, name in enumerate(ident.column_names):
        out = out.append_column(f"{p}k{i}", ident.column(name))
    return out.append_column(index, pa.array(range(table.num_rows), pa.int64()))


def source_on(source: pa.Table, spec: MergeSpec, schema: pa.Schema) -> pa.Table:
    """The source's ``on`` columns cast (safely) to the key columns' types, checked
    present and free of nulls (a null key matches nothing and may not be inserted).

    Raises:
        InvalidUsage: a column is missing, does not fit, or holds a null.
    """
    cols = []
    for c in spec.on:
        if c not in source.column_names:
            raise InvalidUsage(
                f"merge: the source has no column {c!r} to match on (it has {source.column_names})"
            )
        col = _cast(source.column(c), schema.field(c), f"the source's on column {c!r}")
        if col.null_count:
            raise InvalidUsage(
                f"merge: the source's on column {c!r} holds a null; a null key matches "
                "nothing and may not be inserted; nothing was committed"
            )
        cols.append(col)
    return pa.Table.from_arrays(cols, names=list(spec.on))


def plan_merge(
    live: pa.Table,
    source: pa.Table,
    spec: MergeSpec,
    schema: pa.Schema,
    key_names: Sequence[str],
    read_keys: Callable[[pa.Table], pa.Table],
) -> tuple[Planned, MergeCounts]:
    """The updates of one merge (pure; no commit).

    Args:
        live: the consolidated live rows (key, value columns and ``_diff``) the merge
            can touch: all of them when a by-source clause is given, else at least
            those whose ``on`` columns equal a source row's.
        source: the source rows (any columns; those the clauses use).
        spec: the ``on`` columns, aliases and clauses.
        schema: the shard's key and value columns (no ``_time``/``_diff``).
        key_names: the shard's key columns.
        read_keys: ``read_keys(keys)`` gives at least the live rows whose key is one of
            ``keys``' (to refuse an insert onto a live key ``live`` may not hold).

    Returns:
        the :class:`persist.rows.Planned` updates (``_diff`` -count for retractions,
        +count for insertions) and the :class:`MergeCounts`.

    Raises:
        InvalidUsage: see :meth:`MergeBuilder.execute`.
    """
    names = schema.names
    value_names = [n for n in names if n not in key_names]
    target = live.select([*names, DIFF])
    p = _prefix(target, source)
    on_cols = source_on(source, spec, schema)
    s_idx, t_idx = f"{p}s", f"{p}t"
    # key identity of the source's on columns (cast to the key types) and the target's
    s_ident, t_ident = aligned([on_cols, target], spec.on)
    src = _with_identity(source, s_ident, p, s_idx)
    tgt = _with_identity(target, t_ident, p, t_idx)
    sql = _Sql(spec, tgt, src, p, t_ident.num_columns)
    counts = MergeCounts(source=source.num_rows)
    retract_rows: list[int] = []  # target row indexes retracted
    new_tables: list[pa.Table] = []  # new rows (names + _diff)
    try:
        by_kind: dict[ClauseKind, list[MergeClause]] = {}
        for c in spec.clauses:
            by_kind.setdefault(c.kind, []).append(c)
        for kind in ("matched", "not_matched", "not_matched_by_source"):
            clauses = by_kind.get(kind)
            if not clauses:
                continue
            planned = _plan_kind(
                sql, kind, clauses, spec, schema, key_names, value_names, target, source, p
            )
            retract_rows.extend(planned.retract)
            new_tables.extend(planned.new)
            counts.inserted += planned.inserted
            counts.updated += planned.updated
            counts.deleted += planned.deleted
            counts.unchanged += planned.unchanged
    finally:
        sql.close()
    out_schema = pa.schema([schema.field(n) for n in names] + [pa.field(DIFF, pa.int64(), False)])
    retracted_tbl = target.take(pa.array(sorted(set(retract_rows)), pa.int64()))
    retractions = retracted_tbl.set_column(len(names), DIFF, pc.negate(retracted_tbl.column(DIFF)))
    inserts = [t for t in new_tables if t.num_rows]
    _check_new_keys(inserts, retracted_tbl, key_names, read_keys)
    out = pa.concat_tables([retractions.cast(out_schema), *[t.cast(out_schema) for t in inserts]])
    retracted = int(pc.sum(retracted_tbl.column(DIFF)).as_py() or 0)
    inserted = sum(int(pc.sum(t.column(DIFF)).as_py() or 0) for t in inserts)
    return Planned(out, inserted, retracted), counts


@dataclass
class _KindPlan:
    retract: list[int] = field(default_factory=list)
    new: list[pa.Table] = field(default_factory=list)
    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    unchanged: int = 0


def _values_of(
    clause: MergeClause, schema: pa.Schema, key_names: Sequence[str], source: pa.Table, alias: str
) -> dict[str, str]:
    """The clause's ``{column: SQL}``; for the ``*_all`` forms every target column
    (updates: every value column) from the source column of the same name.

    Raises:
        InvalidUsage: a column that is not the table's, or (``*_all``) one the source
            lacks.
    """
    cols = (
        [n for n in schema.names if n not in key_names]
        if clause.action == "update"
        else list(schema.names)
    )
    if clause.values is None:
        missing = [c for c in cols if c not in source.column_names]
        if missing:
            raise InvalidUsage(
                f"merge: when_{clause.kind}_{clause.action}_all needs the source columns "
                f"{missing}; nothing was committed"
            )
        return {c: f"{_quote(alias)}.{_quote(c)}" for c in cols}
    bad = [c for c in clause.values if c not in schema.names]
    if bad:
        raise InvalidUsage(
            f"merge: when_{clause.kind}_{clause.action} names {bad}, which are not columns "
            f"of the table {schema.names}; nothing was committed"
        )
    return dict(clause.values)


def _name(c: MergeClause, i: int) -> str:
    """A clause as the user wrote it: ``when_matched_update (clause 2)``."""
    return f"when_{c.kind}_{c.action} (clause {i + 1} of its kind)"


def _plan_kind(
    sql: _Sql,
    kind: ClauseKind,
    clauses: list[MergeClause],
    spec: MergeSpec,
    schema: pa.Schema,
    key_names: Sequence[str],
    value_names: Sequence[str],
    target: pa.Table,
    source: pa.Table,
    p: str,
) -> _KindPlan:
    s_alias, t_alias = spec.source_alias, spec.target_alias
    s_idx, t_idx = f"{p}s", f"{p}t"
    select: list[tuple[str, str, str]] = []
    if kind != "not_matched_by_source":
        select.append((f"{_quote(s_alias)}.{_quote(s_idx)}", s_idx, ""))
    if kind != "not_matched":
        select.append((f"{_quote(t_alias)}.{_quote(t_idx)}", t_idx, ""))
    whens = []
    for i, c in enumerate(clauses):
        cond = "TRUE" if c.condition is None else c.condition
        whens.append(f"WHEN ({cond}) THEN {i}")
        if c.condition is not None:
            select.append((c.condition, f"{p}c{i}", f"the condition of {_name(c, i)}"))
    select.append((f"CASE {' '.join(whens)} ELSE -1 END", f"{p}clause", ""))
    values: dict[int, dict[str, str]] = {}
    from_arrow: dict[tuple[int, str], tuple[str, str]] = {}  # -> (side, column)
    for i, c in enumerate(clauses):
        if c.action == "delete":
            continue
        vals = _values_of(c, schema, key_names, source, s_alias)
        values[i] = vals
        for col, expr in vals.items():
            ref_s = _simple_ref(expr, s_alias) if kind != "not_matched_by_source" else None
            ref_t = _simple_ref(expr, t_alias) if kind != "not_matched" else None
            if ref_s is not None and ref_s in source.column_names:
                from_arrow[(i, col)] = ("s", ref_s)
            elif ref_t is not None and ref_t in target.column_names:
                from_arrow[(i, col)] = ("t", ref_t)
            else:
                select.append((expr, f"{p}v{i}_{col}", f"the value of {col!r} in {_name(c, i)}"))
    res = sql.query(kind, select)
    chosen = res.column(f"{p}clause")
    out = _KindPlan()
    if kind == "matched" and res.num_rows:
        _check_matched_once(res, t_idx, target, key_names)
    for i, c in enumerate(clauses):
        mask = pc.equal(chosen, i)
        rows = res.filter(mask)
        if not rows.num_rows:
            continue
        t_rows = rows.column(t_idx) if kind != "not_matched" else None
        s_rows = rows.column(s_idx) if kind != "not_matched_by_source" else None
        if c.action == "delete":
            assert t_rows is not None
            idx = t_rows.to_pylist()
            out.retract.extend(idx)
            out.deleted += int(pc.sum(target.column(DIFF).take(t_rows)).as_py() or 0)
            continue
        vals = values[i]
        cols: list[pa.ChunkedArray] = []
        old = target.take(t_rows) if t_rows is not None else None
        src_rows = source.take(s_rows) if s_rows is not None else None
        for n in schema.names:
            f = schema.field(n)
            what = f"the value of {n!r} in {_name(c, i)}"
            if n in vals:
                side = from_arrow.get((i, n))
                if side is not None:
                    base = src_rows if side[0] == "s" else old
                    assert base is not None
                    arr = base.column(side[1])
                else:
                    arr = rows.column(f"{p}v{i}_{n}")
                cols.append(_cast(arr, f, what))
            elif old is not None:
                cols.append(old.column(n))
            else:
                cols.append(_cast(pa.nulls(rows.num_rows, f.type), f, what))
        new = pa.Table.from_arrays(cols, schema=schema)
        if c.action == "insert":
            out.new.append(new.append_column(DIFF, pa.array([1] * new.num_rows, pa.int64())))
            out.inserted += new.num_rows
            continue
        assert old is not None and t_rows is not None
        changed_key = [k for k in key_names if k in vals]
        if changed_key:
            before, after = aligned([old, new], changed_key)
            same = rows_equal(before, after)
            if not pc.all(same).as_py():
                bad = pc.index(same, False).as_py()
                raise InvalidUsage(
                    f"merge: when_{c.kind}_update would change the key column(s) "
                    f"{changed_key} of the row with key {list(key_names)} = "
                    f"{_key_of(old, bad, key_names)}; a merge may not change keys; "
                    "nothing was committed"
                )
            # keep the stored key exactly (an equal key may be another representation)
            for k in changed_key:
                new = new.set_column(new.schema.get_field_index(k), k, old.column(k))
        same = rows_equal(old.select(list(schema.names)), new)
        changed = pc.invert(same)
        diff = old.column(DIFF)
        out.unchanged += int(pc.sum(pc.filter(diff, same)).as_py() or 0)
        moved = int(pc.sum(pc.filter(diff, changed)).as_py() or 0)
        out.updated += moved
        if moved:
            out.retract.extend(pc.filter(t_rows, changed).to_pylist())
            out.new.append(new.filter(changed).append_column(DIFF, pc.filter(diff, changed)))
    return out


def _check_matched_once(
    res: pa.Table, t_idx: str, target: pa.Table, key_names: Sequence[str]
) -> None:
    """Refuse a target row matched by two or more source rows (Delta's rule)."""
    counts = res.group_by(t_idx).aggregate([([], "count_all")])
    dup = counts.filter(pc.greater(counts.column("count_all"), 1))
    if dup.num_rows:
        row = dup.column(t_idx)[0].as_py()
        raise InvalidUsage(
            f"merge: the target row with key {list(key_names)} = "
            f"{_key_of(target, row, key_names)} is matched by "
            f"{dup.column('count_all')[0].as_py()} source rows; each target row may match "
            "one source row at most; nothing was committed"
        )


def _check_new_keys(
    inserts: list[pa.Table],
    retracted: pa.Table,
    key_names: Sequence[str],
    read_keys: Callable[[pa.Table], pa.Table],
) -> None:
    """Refuse inserted rows sharing a key, or taking the key of a live row the merge
    does not retract (the table keeps one live row per key)."""
    if not inserts:
        return
    new = pa.concat_tables([t.select(list(key_names)) for t in inserts])
    dup = duplicate_key(new, key_names)
    if dup is not None:
        raise InvalidUsage(
            f"merge: two inserted rows have one key {list(key_names)} = "
            f"{_key_of(new, dup, key_names)}; nothing was committed"
        )
    live = read_keys(new)
    if not live.num_rows:
        return
    hit = isin(live, new, key_names)
    if retracted.num_rows:
        hit = pc.and_(hit, pc.invert(isin(live, retracted, key_names)))
    if pc.any(hit).as_py():
        row = pc.index(hit, True).as_py()
        raise InvalidUsage(
            f"merge: an inserted row has the key {list(key_names)} = "
            f"{_key_of(live, row, key_names)} of a live row the merge keeps; "
            "nothing was committed"
        )


# ------------------------------------------------------------------ running
def as_source(data: Any) -> pa.Table:
    """A merge source as an Arrow table: a ``pa.Table``, ``RecordBatch``,
    ``RecordBatchReader``, a pandas or polars DataFrame, or any object with
    ``__arrow_c_stream__``.

    Raises:
        InvalidUsage: anything else.
    """
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if isinstance(data, pa.RecordBatchReader):
        return data.read_all()
    try:
        return pa.table(data)
    except (TypeError, pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise InvalidUsage(
            f"merge: the source must be Arrow data (a pyarrow Table, RecordBatch, reader, "
            f"a pandas or polars DataFrame), not {type(data).__name__}: {e}"
        ) from None


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


def run_merge(
    writer: ChangeWriter,
    source: pa.Table,
    spec: MergeSpec,
    schema: pa.Schema,
    key_names: Sequence[str],
) -> MergeResult:
    """Plan and commit ``spec`` through ``writer`` (:func:`persist.rows.apply_change`:
    one ``compare_and_append``, planned again on a lost race).  Only the live rows whose
    ``on`` columns can equal a source row's are read (part statistics and key-range row
    groups, as ``upsert`` reads), unless a by-source clause needs every live row.

    Args:
        schema: the shard's key and value columns (no ``_time``/``_diff``).

    Raises:
        see :meth:`MergeBuilder.execute`.
    """
    on_cols = source_on(source, spec, schema)  # refused before anything is read
    filt = key_filter(on_cols, spec.on)
    by_source = [c for c in spec.clauses if c.kind == "not_matched_by_source"]
    if by_source:
        bounds = [_key_bounds(c.condition, spec.target_alias, schema, key_names) for c in by_source]
        if any(b is None for b in bounds):
            filt = None  # a by-source clause may touch any live row: read them all
        else:
            for b in bounds:
                filt = b if filt is None else filt | b
    last: list[MergeCounts] = []

    def plan(read: Callable[[pc.Expression | None], pa.Table], upper: int) -> Planned:
        if by_source or source.num_rows:
            live = read(filt)
        else:
            live = schema.empty_table().append_column(DIFF, pa.array([], pa.int64()))

        def read_keys(keys: pa.Table) -> pa.Table:
            return read(key_filter(keys, key_names))

        planned, counts = plan_merge(live, source, spec, schema, key_names, read_keys)
        last[:] = [counts]
        return planned

    changes = apply_change(writer, plan)
    c = last[0]
    return MergeResult(changes.time, c.source, c.inserted, c.updated, c.deleted, c.unchanged)
