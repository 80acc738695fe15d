"""The relational side of the ``persist`` CLI (``persist cat`` and ``persist sql``):
consolidated snapshots as relations, rows as strict JSON lines, a locked DuckDB
connection, and the shards a query's table names refer to.

Invariants kept here: a relation holds one row per unit of multiplicity and is refused,
never half-built, when a negative multiplicity makes it no relation or the expansion
would pass its limit; every JSON line is strict JSON (RFC 8259) with its keys in column
order; the DuckDB connection reaches nothing outside itself.
"""

from __future__ import annotations

import decimal
import json
import math
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from persist.errors import InvalidUsage
from persist.relation import check_multiplicities, expand_rows, expanded_count

if TYPE_CHECKING:
    import duckdb

__all__ = [
    "MAX_EXPANDED_ROWS",
    "as_rows",
    "first_line",
    "json_line",
    "locked_duckdb",
    "rest_lines",
    "shards_named",
]


MAX_EXPANDED_ROWS = 10_000_000
"""Default of ``persist sql --max-expanded-rows``: how many rows expanding a shard's
multiplicities above 1 may add to its consolidated snapshot."""


def as_rows(table: pa.Table, shard: str, max_expanded_rows: int = MAX_EXPANDED_ROWS) -> pa.Table:
    """A consolidated snapshot as a relation: one row per unit of multiplicity (a row
    with ``_diff`` 3 appears three times), without ``_time``/``_diff``.

    Args:
        table: a consolidated snapshot (key and value columns, ``_time``, ``_diff``).
        shard: its name, for messages.
        max_expanded_rows: at most this many rows may be added by the expansion
            (``sum(_diff) - rows``); the relation is built in memory, so a multiplicity
            like ``2**50`` is refused rather than exhausting memory.

    Raises:
        InvalidUsage: a negative multiplicity (the shard is not a collection at this
            time: more retractions than insertions), naming the shard and the count;
            an expansion adding more than ``max_expanded_rows`` rows, naming the shard,
            its consolidated and expanded row counts, the limit and ways around it.
    """
    try:
        check_multiplicities(table, shard)
    except InvalidUsage as e:
        raise InvalidUsage(f"{e}: SQL cannot query it") from None
    total = expanded_count(table)
    if total - len(table) > max_expanded_rows:
        raise InvalidUsage(
            f"persist sql: shard {shard!r} holds {len(table)} consolidated row(s) that "
            f"stand for {total} rows (multiplicities above 1); expanding them to one row "
            f"per unit of multiplicity would add {total - len(table)} rows, over the limit "
            f"of {max_expanded_rows} (--max-expanded-rows); see the rows with their _diff "
            f"with `persist cat {shard}`, or raise the limit"
        )
    return expand_rows(table, shard)


def json_value(v: Any) -> Any:
    """``v`` with every non-finite float, at any depth, replaced by the string
    ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (JSON has no such numbers; the strings
    are the ones Spark's and Jackson's JSON use, and Python's ``float()`` reads them)."""
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, dict):
        return {k: json_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_value(x) for x in v]
    return v


def json_default(v: Any) -> Any:
    """JSON of values ``json`` lacks: integral decimals (DuckDB's ``sum`` of integers is
    a 128-bit integer, which Arrow carries as a decimal) as ints, the rest as text."""
    if isinstance(v, decimal.Decimal) and v == v.to_integral_value():
        return int(v)
    return str(v)


def json_line(row: dict[str, Any]) -> str:
    """One row as strict JSON (RFC 8259: no ``NaN``/``Infinity`` tokens, see
    :func:`json_value`; other values as :func:`json_default`), its keys in the
    row's column order (a shard's key columns, then its value columns, then
    ``_diff``; a query's columns as it selects them)."""
    return json.dumps(json_value(row), default=json_default, allow_nan=False)


def first_line(e: Exception) -> str:
    """The first line of ``e``'s message (DuckDB's error itself)."""
    return str(e).split("\n", 1)[0]


def rest_lines(e: Exception) -> str | None:
    """``e``'s message after its first line (DuckDB's caret under the error, its hints),
    for printing as lines of their own; ``None`` if there is none."""
    _, _, rest = str(e).partition("\n")
    return rest.strip("\n") or None


def locked_duckdb() -> duckdb.DuckDBPyConnection:
    """A private DuckDB connection that reaches nothing outside itself: external access
    (files, network, extensions) off and the configuration locked, so no statement can
    turn it back on.  Every use of the user's query (parsing it too) goes through it."""
    import duckdb

    con = duckdb.connect(":memory:")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def shards_named(names: set[str] | list[str], known: set[str]) -> list[str]:
    """The shards a query's table ``names`` refer to.  DuckDB resolves table names
    without regard to case, so a name matches its shard exactly or, failing that, the
    one shard equal to it but for case (``FROM orders`` reads shard ``Orders``).

    Raises:
        InvalidUsage: the query refers to two shards whose names differ only in case
            (DuckDB cannot tell their tables apart).
    """
    by_fold: dict[str, list[str]] = {}
    for k in known:
        by_fold.setdefault(k.casefold(), []).append(k)
    wanted: set[str] = set()
    for n in names:
        if n in known:
            wanted.add(n)
        else:
            alike = by_fold.get(n.casefold(), [])
            if len(alike) == 1:
                wanted.add(alike[0])
    folded: dict[str, str] = {}
    for w in sorted(wanted):
        other = folded.setdefault(w.casefold(), w)
        if other != w:
            raise InvalidUsage(
                f"persist sql: shards {other!r} and {w!r} differ only in case, and DuckDB "
                "does not tell table names apart by case: query them separately"
            )
    return sorted(wanted)
