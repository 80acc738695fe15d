"""Filters and projections of a read: checking them against a shard's updates schema,
the columns a filter reads, the filter applied to updates before they are consolidated,
and applying a filter with Arrow's errors reported as ``InvalidUsage``.

Invariant kept here: a read filtered with ``f`` and projected to ``c`` returns exactly
``snapshot.filter(f).select(c)``; the filter :func:`check_filter` lets a read apply to
updates before consolidating (:func:`update_filter`) keeps all updates of a
consolidated row or none, and the read applies ``f`` itself to the consolidated rows.

Sources: Arrow's expression binding (``Table.filter`` of an empty table binds a filter
to a schema without reading data) and Materialize persist's filter pushdown over part
statistics (``persist-client``'s ``stats``), whose idea (not code) the read follows.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc

from persist.errors import InvalidUsage

__all__ = [
    "FILTER_ERRORS",
    "apply_filter",
    "check_columns",
    "check_filter",
    "filter_columns",
    "update_filter",
]


#: What Arrow raises for a filter it cannot bind to a schema or evaluate on some rows.
FILTER_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, pa.ArrowKeyError)


def apply_filter(table: pa.Table, filter: pc.Expression) -> pa.Table:
    """``table.filter(filter)``, Arrow's errors (e.g. an ``is_in`` value set that cannot
    be cast to its column's type, which Arrow reports only once it sees rows) reported
    as ``InvalidUsage`` naming the filter.

    Raises:
        InvalidUsage: Arrow cannot evaluate ``filter`` on ``table``.
    """
    try:
        return table.filter(filter)
    except FILTER_ERRORS as e:
        raise InvalidUsage(
            f"filter {filter} cannot be evaluated on the shard's rows: {e}"
        ) from None


def check_filter(
    filter: pc.Expression | None,
    schema: pa.Schema,
    key_names: Sequence[str],
    value_names: Sequence[str],
) -> tuple[pc.Expression | None, bool]:
    """``filter`` checked against the updates ``schema``, and whether it is a *row*
    filter: one over key and value columns only.

    A row filter may be used to prune parts by their statistics, and applied to updates
    before they are consolidated: a (key, value) row's diff is the sum of its updates'
    diffs, and every update of that row has the same key and value columns, so the
    filter keeps all of them or none; consolidating the kept updates gives exactly the
    kept rows of the consolidated snapshot. Updates of one row may differ in a float
    column, though: consolidation takes ``-0.0`` for ``0.0`` and every NaN for one
    value, which a filter can tell apart (``is_in`` tells ``-0.0`` from ``0.0``). So the
    filter applied to updates also keeps every update with a zero or NaN in a float
    column the filter reads (:func:`update_filter`), and the filter itself is applied
    to the consolidated rows. Pruning stays sound: statistics hold no float column, so
    a part is pruned only when the filter is false whatever its floats. Which of the
    equal values (``0.0`` or ``-0.0``, which NaN) a consolidated row shows is not
    specified. A filter that reads ``_time`` or ``_diff`` is only applied to the
    consolidated snapshot (where ``_time`` is the read time and ``_diff`` the summed
    diff).

    Raises:
        InvalidUsage: ``filter`` is not a ``pyarrow.compute.Expression``, references a
            column the shard does not have, or is not boolean.
    """
    if filter is None:
        return None, False
    if not isinstance(filter, pc.Expression):
        raise InvalidUsage(
            f"filter must be a pyarrow.compute.Expression, got {type(filter).__name__}"
        )
    try:
        schema.empty_table().filter(filter)
    except FILTER_ERRORS as e:
        raise InvalidUsage(f"filter {filter} does not apply to the shard's rows: {e}") from None
    rows = pa.schema([schema.field(n) for n in [*key_names, *value_names]])
    try:
        rows.empty_table().filter(filter)
    except FILTER_ERRORS:
        return filter, False
    return filter, True


def filter_columns(
    filter: pc.Expression, schema: pa.Schema, among: Sequence[str] | None = None
) -> list[str]:
    """The columns of ``schema`` (only those named in ``among``, if given) that
    ``filter`` (which applies to ``schema``) reads: those without which it no longer
    binds."""
    out = []
    for name in schema.names if among is None else among:
        rest = pa.schema([f for f in schema if f.name != name])
        try:
            rest.empty_table().filter(filter)
        except FILTER_ERRORS:
            out.append(name)
    return out


def _float_columns_read(filter: pc.Expression, schema: pa.Schema) -> list[str]:
    """The float columns of ``schema`` that ``filter`` (which applies to it) reads."""
    text = str(filter)  # names every column the filter reads (binding is much slower)
    floats = [f.name for f in schema if pa.types.is_floating(f.type) and f.name in text]
    return filter_columns(filter, schema, floats) if floats else []


def update_filter(filter: pc.Expression, schema: pa.Schema) -> pc.Expression:
    """The filter a row filter applies to *updates* before they are consolidated (see
    :func:`check_filter`): ``filter`` itself, or, when it reads float columns, ``filter``
    or any of them is a zero or NaN (the values whose updates consolidation may merge
    while the filter tells them apart: all updates of such a row are kept, and the
    exact filter is applied to the consolidated rows)."""
    ambiguous: pc.Expression | None = None
    for name in _float_columns_read(filter, schema):
        f = pc.field(name)
        zero = pa.scalar(0.0, schema.field(name).type)
        either = pc.is_nan(f) | (f == zero)
        ambiguous = either if ambiguous is None else ambiguous | either
    return filter if ambiguous is None else filter | ambiguous


def check_columns(columns: Sequence[str] | None, schema: pa.Schema) -> list[str] | None:
    """``columns`` as a list, checked: names of ``schema``'s columns, none twice.

    Raises:
        InvalidUsage: not a sequence of names, an unknown name, or a repeated one.
    """
    if columns is None:
        return None
    if isinstance(columns, (str, bytes)) or not isinstance(columns, Sequence):
        raise InvalidUsage(f"columns must be a list of column names, got {type(columns).__name__}")
    out = list(columns)
    unknown = [c for c in out if not isinstance(c, str) or schema.get_field_index(c) < 0]
    if unknown:
        raise InvalidUsage(f"columns {unknown} are not columns of the shard ({schema.names})")
    if len(set(out)) != len(out):
        raise InvalidUsage(f"columns {out} name a column twice")
    return out
