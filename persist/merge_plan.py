"""The planning of a MERGE INTO (pure: no I/O): the clauses and the spec
(:class:`MergeClause`, :class:`MergeSpec`), the evaluators of their SQL conditions and
values (:class:`Evaluator`; DuckDB's here), and :func:`plan_merge`, which turns live
target rows, source rows and clauses into the updates of one commit.

The semantics (Delta Lake's ``MERGE INTO``) are stated in :mod:`persist.merge_into`,
which runs a plan as one row change.  Invariants kept here:

* matching is key identity (:mod:`persist.key_identity`), never an evaluator's
  equality: an evaluator only sees which source row goes with which target row;
* a retraction is the stored live row exactly as read, and a value given as a plain
  ``alias.column`` reference is taken from the Arrow rows, never from what an evaluator
  converted; every other value is cast safely within its kind of values or refused;
* a plan refused for any reason has produced nothing to commit.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist.casts import cast_column
from persist.consolidation import _compare_pairs
from persist.errors import InvalidUsage
from persist.key_identity import aligned, duplicate_key, isin, show_key
from persist.parts import DIFF
from persist.rows import Planned, net_changes

__all__ = [
    "CLAUSE",
    "ClauseKind",
    "check_names",
    "out_of_scope",
    "S_ROW",
    "T_ROW",
    "DuckDBEvaluator",
    "Evaluator",
    "EvaluatorFactory",
    "Item",
    "MergeClause",
    "MergeCounts",
    "MergeResult",
    "MergeSpec",
    "plan_merge",
    "source_on",
]

ClauseKind = Literal["matched", "not_matched", "not_matched_by_source"]
Action = Literal["update", "delete", "insert"]


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
            out["condition"] = str(self.condition)  # SQL text (or a Spark Column's)
        if self.values is not None:
            out["set" if self.action == "update" else "values"] = {
                k: str(v) for k, v in self.values.items()
            }
        elif self.action != "delete":
            out["all"] = True
        return out


@dataclass(frozen=True)
class MergeResult:
    """The outcome of a committed merge.

    Attributes:
        time: the time the merge committed at (int); the shard's upper was then
            ``time + 1``.  A merge that changed nothing commits nothing: ``time`` is
            then ``upper - 1`` of the state version it read.
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

    def result(self, time: int) -> MergeResult:
        """These counts as the result of a merge committed at ``time``."""
        return MergeResult(
            time, self.source, self.inserted, self.updated, self.deleted, self.unchanged
        )

    def metrics(self) -> dict[str, int]:
        """These counts as history metrics (Delta's ``operationMetrics`` names)."""
        return {
            "num_source_rows": self.source,
            "num_target_rows_inserted": self.inserted,
            "num_target_rows_updated": self.updated,
            "num_target_rows_deleted": self.deleted,
            "num_target_rows_unchanged": self.unchanged,
        }


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


def _quote(name: str) -> str:
    """``name`` as a quoted SQL identifier (names are data, never SQL)."""
    return '"' + name.replace('"', '""') + '"'


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


CLAUSE = "__persist_merge_clause"
"""The column an :class:`Evaluator` gives the chosen clause in (its index, -1: none)."""
S_ROW, T_ROW = "__persist_merge_s", "__persist_merge_t"
"""The columns of the rows an :class:`Evaluator` evaluates on: source and target row
positions (int64).  Columns of a source or table may not start with ``__persist_merge``."""


@dataclass(frozen=True)
class Item:
    """An expression to evaluate: ``expr`` (SQL text; a Spark evaluator also takes a
    ``Column``), the output column ``name``, and ``what`` it is, for errors."""

    expr: Any
    name: str
    what: str


class Evaluator(Protocol):
    """Evaluates a merge's conditions and values over joined source and target rows:
    DuckDB's SQL here (:class:`DuckDBEvaluator`), Spark SQL in ``spark.merge``.  The
    matching itself is persist's (key identity); an evaluator only sees which source
    row goes with which target row."""

    def evaluate(
        self,
        kind: ClauseKind,
        rows: pa.Table,
        conditions: Sequence[Item | None],
        values: Sequence[Item],
    ) -> pa.Table:
        """Over ``rows`` (columns :data:`S_ROW` and/or :data:`T_ROW`: the source and
        target rows, ``<source_alias>.<col>`` and ``<target_alias>.<col>`` in scope as
        ``kind`` allows), a table of ``rows.num_rows`` rows in their order: column
        :data:`CLAUSE` (int64: the position of the first condition that holds, ``None``
        conditions always holding; -1 when none holds; SQL ``NULL`` does not hold), then
        one column per value item, named by it.

        Raises:
            InvalidUsage: an expression that does not parse, names an unknown column or
                one out of scope (naming the item).
        """
        ...

    def close(self) -> None:
        """Release what the evaluator holds."""
        ...


EvaluatorFactory = Callable[[MergeSpec, pa.Table, pa.Table], Evaluator]
"""``factory(spec, source, target)``: an evaluator over ``source`` and ``target`` (each
with its row position in :data:`S_ROW` / :data:`T_ROW`)."""


def check_names(
    con: duckdb.DuckDBPyConnection,
    names: Sequence[str],
    what: str,
    advice: str = "read it with to_arrow, or rename a column",
) -> None:
    """Refuse columns ``names`` that DuckDB does not tell apart: its identifiers are
    case-insensitive (ASCII letters), so of ``"A"`` and ``"a"`` it renames the second
    (``a_1``) when handed Arrow, and a projection of ``"a"`` reads ``"A"``.  Asked of
    DuckDB itself (the names it gives an empty Arrow table of these columns).
    ``what`` names the columns' owner, ``advice`` what to do instead.

    Raises:
        InvalidUsage: two names DuckDB takes for one, naming both.
    """
    got = con.from_arrow(pa.schema([(n, pa.null()) for n in names]).empty_table()).columns
    if list(got) == list(names):
        return
    folded = [n.translate(_ASCII_LOWER) for n in names]
    for i, (name, seen) in enumerate(zip(names, got, strict=True)):
        if name != seen:
            first = next((names[j] for j in range(i) if folded[j] == folded[i]), seen)
            raise InvalidUsage(
                f"{what}: columns {first!r} and {name!r} are one name to DuckDB (its "
                f"identifiers are case-insensitive): {advice}"
            )


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


@functools.lru_cache(maxsize=256)
def _duckdb_holds(t: pa.DataType) -> bool:
    """Whether DuckDB can read an Arrow column of type ``t``."""
    con = duckdb.connect(config={"enable_external_access": False})
    try:
        con.register("probe", pa.table({"c": pa.array([], t)}))
        con.sql("SELECT * FROM probe").to_arrow_table()
    except duckdb.Error:
        return False
    finally:
        con.close()
    return True


def _duckdb_columns(table: pa.Table) -> pa.Table:
    """``table`` without the columns DuckDB cannot read."""
    keep = [f.name for f in table.schema if _duckdb_holds(f.type)]
    return table if len(keep) == table.num_columns else table.select(keep)


#: What to do about names DuckDB does not tell apart, in a merge's conditions and values.
_RENAME = "rename a column, or write the change with upsert, update or delete"


class DuckDBEvaluator:
    """:class:`Evaluator` on an in-memory DuckDB connection with external access
    disabled; conditions and values are DuckDB SQL text."""

    def __init__(self, spec: MergeSpec, source: pa.Table, target: pa.Table) -> None:
        self.spec = spec
        self.con = duckdb.connect(config={"enable_external_access": False})
        # Columns of a type DuckDB cannot hold (e.g. decimal256 beyond 38 digits) are
        # left out: an expression naming one is refused as naming an unknown column,
        # and a plain reference to it is taken from the Arrow rows anyway.
        self.con.register("merge_source", _duckdb_columns(source))
        self.con.register("merge_target", _duckdb_columns(target))
        self._names = (source.column_names, target.column_names)

    def close(self) -> None:
        self.con.close()

    def _from(self, kind: ClauseKind) -> str:
        s, t = _quote(self.spec.source_alias), _quote(self.spec.target_alias)
        src = f"JOIN merge_source AS {s} ON merge_rows.{_quote(S_ROW)} = {s}.{_quote(S_ROW)}"
        tgt = f"JOIN merge_target AS {t} ON merge_rows.{_quote(T_ROW)} = {t}.{_quote(T_ROW)}"
        joins = {"matched": f"{src} {tgt}", "not_matched": src, "not_matched_by_source": tgt}
        return f"merge_rows {joins[kind]}"

    def evaluate(
        self,
        kind: ClauseKind,
        rows: pa.Table,
        conditions: Sequence[Item | None],
        values: Sequence[Item],
    ) -> pa.Table:
        for item in [*conditions, *values]:
            if item is not None and not isinstance(item.expr, str):
                raise InvalidUsage(
                    f"merge: {item.what} must be SQL text, not {type(item.expr).__name__}"
                )
        # Names DuckDB does not tell apart ("A" and "a") would bind a condition or a
        # value to the other column: refused (plain column references are taken from
        # the Arrow rows, never evaluated here).
        if values or any(c is not None for c in conditions):
            for names, what in zip(self._names, ("source", "target"), strict=True):
                check_names(self.con, names, f"merge: the {what}", _RENAME)
        order = "__persist_merge_i"
        self.con.register(
            "merge_rows", rows.append_column(order, pa.array(range(rows.num_rows), pa.int64()))
        )
        whens = " ".join(
            f"WHEN ({'TRUE' if c is None else c.expr}) THEN {i}" for i, c in enumerate(conditions)
        )
        items = [f"CAST(CASE {whens} ELSE -1 END AS BIGINT) AS {_quote(CLAUSE)}"]
        items += [f"({v.expr}) AS {_quote(v.name)}" for v in values]
        q = (
            f"SELECT {', '.join(items)} FROM {self._from(kind)} "  # noqa: S608 - names quoted
            f"ORDER BY merge_rows.{_quote(order)}"
        )
        try:
            return self.con.sql(q).to_arrow_table()
        except duckdb.Error as e:
            raise self._explain(kind, [c for c in conditions if c is not None], values, e) from None
        finally:
            self.con.unregister("merge_rows")

    def _explain(
        self,
        kind: ClauseKind,
        conditions: Sequence[Item],
        values: Sequence[Item],
        e: duckdb.Error,
    ) -> InvalidUsage:
        # Find the item at fault by binding each alone (cheap: no row is read).
        for item in [*conditions, *values]:
            try:
                self.con.sql(
                    f"SELECT ({item.expr}) FROM {self._from(kind)} LIMIT 0"  # noqa: S608
                ).to_arrow_table()
            except duckdb.Error as inner:
                return out_of_scope(self.spec, kind, item, str(inner).splitlines()[0])
        return InvalidUsage(f"merge: the clauses cannot be evaluated: {e}; nothing was committed")


def out_of_scope(spec: MergeSpec, kind: ClauseKind, item: Item, msg: str) -> InvalidUsage:
    """The error for ``item`` failing to evaluate with ``msg``, saying which columns a
    clause of ``kind`` may use."""
    hint = ""
    if kind == "not_matched_by_source":
        hint = f" (a by-source clause may use {spec.target_alias} columns only)"
    elif kind == "not_matched":
        hint = f" (a not-matched clause may use {spec.source_alias} columns only)"
    return InvalidUsage(
        f"merge: {item.what} {item.expr!r} cannot be evaluated{hint}: {msg}; nothing was committed"
    )


def _cast(arr: pa.ChunkedArray | pa.Array, f: pa.Field, what: str) -> pa.ChunkedArray:
    """``arr`` cast into ``f`` by the one rule of every path
    (:func:`persist.casts.cast_column`)."""
    return cast_column(arr, f, f"merge: {what}")


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


# ------------------------------------------------------------------ planning
def source_on(source: pa.Table, spec: MergeSpec, schema: pa.Schema) -> pa.Table:
    """The source's ``on`` columns cast (safely) to the key columns' types.  A null
    matches a null, as key identity (and ``upsert``) has it; a null in a non-nullable
    key column is refused.

    Raises:
        InvalidUsage: a column is missing or does not fit.
    """
    cols = []
    for c in spec.on:
        if c not in source.column_names:
            raise InvalidUsage(
                f"merge: the source has no column {c!r} to match on (it has {source.column_names})"
            )
        cols.append(_cast(source.column(c), schema.field(c), f"the source's on column {c!r}"))
    return pa.Table.from_arrays(cols, names=list(spec.on))


def plan_merge(
    live: pa.Table,
    source: pa.Table,
    spec: MergeSpec,
    schema: pa.Schema,
    key_names: Sequence[str],
    read_keys: Callable[[pa.Table], pa.Table],
    evaluator: EvaluatorFactory = DuckDBEvaluator,
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
        evaluator: evaluates conditions and values (default: DuckDB's SQL).

    Returns:
        the :class:`persist.rows.Planned` updates (``_diff`` -count for retractions,
        +count for insertions) and the :class:`MergeCounts`.

    Raises:
        InvalidUsage: see :meth:`MergeBuilder.execute`.
    """
    names = schema.names
    target = live.select([*names, DIFF])
    reserved = [n for n in [*names, *source.column_names] if n.startswith("__persist_merge")]
    if reserved:
        raise InvalidUsage(
            f"merge: column names starting with __persist_merge are reserved: {reserved}"
        )
    on_cols = source_on(source, spec, schema)
    # key identity of the source's on columns (cast to the key types) and the target's
    s_ident, t_ident = aligned([on_cols, target], spec.on)
    pairs = _pairs(s_ident, t_ident)
    if any(c.kind == "matched" for c in spec.clauses):
        _check_matched_once(pairs, target, key_names)
    rows = {
        "matched": pairs,
        "not_matched": pa.table({S_ROW: _missing(source.num_rows, pairs.column(S_ROW))}),
        "not_matched_by_source": pa.table({T_ROW: _missing(target.num_rows, pairs.column(T_ROW))}),
    }
    ev = evaluator(
        spec,
        source.append_column(S_ROW, pa.array(range(source.num_rows), pa.int64())),
        target.append_column(T_ROW, pa.array(range(target.num_rows), pa.int64())),
    )
    counts = MergeCounts(source=source.num_rows)
    retract_rows: list[int] = []  # target row positions retracted
    new_tables: list[pa.Table] = []  # new rows (names + _diff)
    insert_tables: list[pa.Table] = []  # those of them that insert clauses give
    try:
        for kind in ("matched", "not_matched", "not_matched_by_source"):
            clauses = [c for c in spec.clauses if c.kind == kind]
            if not clauses:
                continue
            planned = _plan_kind(
                ev, kind, rows[kind], clauses, spec, schema, key_names, target, source
            )
            retract_rows.extend(planned.retract)
            new_tables.extend(planned.new)
            insert_tables.extend(planned.inserts)
            counts.inserted += planned.inserted
            counts.updated += planned.updated
            counts.deleted += planned.deleted
            counts.unchanged += planned.unchanged
    finally:
        ev.close()
    out_schema = pa.schema([schema.field(n) for n in names] + [pa.field(DIFF, pa.int64(), False)])
    retracted_tbl = target.take(pa.array(sorted(set(retract_rows)), pa.int64()))
    retractions = retracted_tbl.set_column(len(names), DIFF, pc.negate(retracted_tbl.column(DIFF)))
    inserts = [t for t in new_tables if t.num_rows]
    # Updated rows keep the key of the live row they replace (checked above), so only
    # inserted rows can bring a key twice: two distinct live rows of one key (a table is
    # a multiset) are both updated, as two copies of one row are.
    _check_new_keys([t for t in insert_tables if t.num_rows], retracted_tbl, key_names, read_keys)
    parts = [retractions.cast(out_schema), *[t.cast(out_schema) for t in inserts]]
    value_names = [n for n in names if n not in key_names]
    roles = (True, *[False] * len(inserts))
    return net_changes(parts, key_names, value_names, retracting=roles), counts


@dataclass
class _KindPlan:
    retract: list[int] = field(default_factory=list)
    new: list[pa.Table] = field(default_factory=list)
    inserts: list[pa.Table] = field(default_factory=list)  # the insert clauses' part of new
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
    ev: Evaluator,
    kind: ClauseKind,
    rows: pa.Table,
    clauses: list[MergeClause],
    spec: MergeSpec,
    schema: pa.Schema,
    key_names: Sequence[str],
    target: pa.Table,
    source: pa.Table,
) -> _KindPlan:
    """The retractions and insertions of the clauses of one ``kind`` over ``rows``
    (the source/target row positions of that kind)."""
    s_alias, t_alias = spec.source_alias, spec.target_alias
    conditions = [
        None if c.condition is None else Item(c.condition, "", f"the condition of {_name(c, i)}")
        for i, c in enumerate(clauses)
    ]
    items: list[Item] = []
    values: dict[int, dict[str, Any]] = {}
    from_arrow: dict[tuple[int, str], tuple[str, str]] = {}  # -> (side, column)
    for i, c in enumerate(clauses):
        if c.action == "delete":
            continue
        vals = _values_of(c, schema, key_names, source, s_alias)
        values[i] = vals
        for col, expr in vals.items():
            text = isinstance(expr, str)
            ref_s = _simple_ref(expr, s_alias) if text and kind != "not_matched_by_source" else None
            ref_t = _simple_ref(expr, t_alias) if text and kind != "not_matched" else None
            if ref_s is not None and ref_s in source.column_names:
                from_arrow[(i, col)] = ("s", ref_s)
            elif ref_t is not None and ref_t in target.column_names:
                from_arrow[(i, col)] = ("t", ref_t)
            else:
                what = f"the value of {col!r} in {_name(c, i)}"
                items.append(Item(expr, f"v{i}:{col}", what))
    res = ev.evaluate(kind, rows, conditions, items)
    chosen = res.column(CLAUSE)
    out = _KindPlan()
    for i, c in enumerate(clauses):
        mask = pc.equal(chosen, i)
        if not pc.any(mask).as_py():
            continue
        t_rows = rows.column(T_ROW).filter(mask) if kind != "not_matched" else None
        s_rows = rows.column(S_ROW).filter(mask) if kind != "not_matched_by_source" else None
        if c.action == "delete":
            assert t_rows is not None
            out.retract.extend(t_rows.to_pylist())
            out.deleted += int(pc.sum(target.column(DIFF).take(t_rows)).as_py() or 0)
            continue
        vals = values[i]
        cols: list[pa.ChunkedArray] = []
        old = target.take(t_rows) if t_rows is not None else None
        src_rows = source.take(s_rows) if s_rows is not None else None
        n = len(t_rows) if t_rows is not None else len(s_rows) if s_rows is not None else 0
        for name in schema.names:
            f = schema.field(name)
            what = f"the value of {name!r} in {_name(c, i)}"
            if name in vals:
                side = from_arrow.get((i, name))
                if side is not None:
                    base = src_rows if side[0] == "s" else old
                    assert base is not None
                    arr = base.column(side[1])
                else:
                    arr = res.column(f"v{i}:{name}").filter(mask)
                cols.append(_cast(arr, f, what))
            elif old is not None:
                cols.append(old.column(name))
            else:
                cols.append(_cast(pa.nulls(n, f.type), f, what))
        new = pa.Table.from_arrays(cols, schema=schema)
        if c.action == "insert":
            out.new.append(new.append_column(DIFF, pa.array([1] * new.num_rows, pa.int64())))
            out.inserts.append(out.new[-1])
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
                    f"{show_key(old, key_names, bad)}; a merge may not change keys; "
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


def _pairs(s_ident: pa.Table, t_ident: pa.Table) -> pa.Table:
    """The matching (source row, target row) positions: equal identity columns."""
    names = s_ident.column_names
    left = s_ident.append_column(S_ROW, pa.array(range(s_ident.num_rows), pa.int64()))
    right = t_ident.append_column(T_ROW, pa.array(range(t_ident.num_rows), pa.int64()))
    if not names:
        return pa.table({S_ROW: pa.array([], pa.int64()), T_ROW: pa.array([], pa.int64())})
    joined = left.join(right, keys=names, join_type="inner", use_threads=False)
    return joined.select([S_ROW, T_ROW]).sort_by([(T_ROW, "ascending"), (S_ROW, "ascending")])


def _missing(n: int, present: pa.ChunkedArray) -> pa.Array:
    """The positions ``0..n-1`` not in ``present``, in order."""
    mask = np.ones(n, dtype=bool)
    if len(present):
        mask[np.asarray(present.to_numpy(), dtype=np.int64)] = False
    return pa.array(np.flatnonzero(mask), pa.int64())


def _check_matched_once(pairs: pa.Table, target: pa.Table, key_names: Sequence[str]) -> None:
    """Refuse a target row matched by two or more source rows (Delta's rule)."""
    counts = pairs.group_by(T_ROW, use_threads=False).aggregate([([], "count_all")])
    dup = counts.filter(pc.greater(counts.column("count_all"), 1))
    if dup.num_rows:
        row = dup.column(T_ROW)[0].as_py()
        raise InvalidUsage(
            f"merge: the target row with key {list(key_names)} = "
            f"{show_key(target, key_names, row)} is matched by "
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
            f"{show_key(new, key_names, dup)}; nothing was committed"
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
            f"{show_key(live, key_names, row)} of a live row the merge keeps; "
            "nothing was committed"
        )
