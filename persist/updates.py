"""Updates tables: the Arrow schema of a shard's updates and conforming input to it.

A shard's updates are Arrow tables with the shard's key columns, value columns, ``_time``
(int64) and ``_diff`` (int64). :func:`updates_schema` builds that schema
from the key and value schemas; :func:`to_updates_table` turns rows or an Arrow table into
it, widening types where that is lossless.

Invariants kept here:

* an updates table has exactly the columns of :func:`updates_schema`, in its order and
  types; ``_time`` and ``_diff`` are non-null int64; column names never start with ``_``
  (reserved for persist) and keys and values share no name;
* a column is conformed only by a safe widening (:func:`is_safe_widening`); anything else
  raises :class:`~persist.errors.InvalidUsage` naming the column;
* schema evolution: :func:`check_schema_evolution` accepts exactly
  the compatible changes of a value schema (add a nullable column, drop a column it
  names, widen int8->int16->int32->int64 / float32->float64 / string<->large_string,
  make nullable; the key schema and the relative order of kept columns never change) and raises
  :class:`~persist.errors.SchemaMismatch` naming the column and the rule otherwise;
* :class:`SchemaHistory` conforms updates written under any version to the view of any
  version by name: a column is read only if every version from the older of the two up
  to the newest has it (else null: added later, dropped and re-added, or dropped), so a
  view never depends on whether compaction rewrote a part under the newest version, and
  rows equal under the newest version are equal under every view.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from persist.errors import InvalidUsage, PersistError, SchemaMismatch
from persist.schemacache import schema_cache

TIME = "_time"
DIFF = "_diff"


# ------------------------------------------------------------------------- schemas


def is_supported_type(t: pa.DataType) -> bool:
    """Types that Arrow can sort, compare and round-trip through Parquet."""
    known = _SUPPORTED.get(t)
    if known is None:
        known = _is_supported_type(t)
        if len(_SUPPORTED) < 4096:  # bounded: parameterised types are countless
            _SUPPORTED[t] = known
    return known


#: :func:`is_supported_type` by type (a hash lookup costs a third of the test).
_SUPPORTED: dict[pa.DataType, bool] = {}


def _is_supported_type(t: pa.DataType) -> bool:
    return bool(
        pa.types.is_integer(t)
        or pa.types.is_float32(t)
        or pa.types.is_float64(t)
        or pa.types.is_boolean(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or pa.types.is_date(t)
        or pa.types.is_time(t)
        or pa.types.is_timestamp(t)
        or pa.types.is_duration(t)
        or pa.types.is_decimal(t)
    )


def updates_schema(key_schema: pa.Schema, value_schema: pa.Schema) -> pa.Schema:
    """The Arrow schema of a shard's updates: key columns, value columns, ``_time``,
    ``_diff`` (both non-null int64). Schema-level metadata is dropped.

    Column types must be sortable scalars: integers, float32/64, bool, (large) string,
    (large/fixed-size) binary, date, time, timestamp, duration, decimal.

    Raises:
        InvalidUsage: a name is empty, holds a NUL character, starts with ``_``
            (reserved for persist, e.g. ``_time``/``_diff``), repeats within a schema or
            is shared by keys and values, or a column type is unsupported (nested,
            dictionary, view, float16, null) or holds a NUL character (a time zone).
    """
    if not isinstance(key_schema, pa.Schema) or not isinstance(value_schema, pa.Schema):
        raise InvalidUsage(
            "key_schema and value_schema must be pyarrow.Schema, got "
            f"{type(key_schema).__name__} and {type(value_schema).__name__}"
        )
    return _updates_schema(key_schema, value_schema)


@schema_cache(256)
def _updates_schema(key_schema: pa.Schema, value_schema: pa.Schema) -> pa.Schema:
    """:func:`updates_schema` after the type check (cached: writers call it per append)."""
    seen: dict[str, str] = {}
    for role, schema in (("key", key_schema), ("value", value_schema)):
        for f in schema:
            if f.name == "":
                raise InvalidUsage(f"{role} schema has a column with an empty name")
            if "\x00" in f.name:
                raise InvalidUsage(
                    f"{role} column {f.name!r}: names may not contain NUL (\\x00): the "
                    "stash stores schemas as JSON, which cannot hold it (Postgres jsonb)"
                )
            if f.name.startswith("_"):
                raise InvalidUsage(
                    f"{role} column {f.name!r}: names starting with '_' are reserved for "
                    f"persist ({TIME!r}, {DIFF!r})"
                )
            if f.name in seen:
                where = (
                    f"twice in the {role} schema"
                    if seen[f.name] == role
                    else "in both the key and the value schema"
                )
                raise InvalidUsage(f"column {f.name!r} appears {where}")
            seen[f.name] = role
            if not is_supported_type(f.type):
                raise InvalidUsage(
                    f"{role} column {f.name!r} has unsupported type {f.type}: use a "
                    "sortable scalar type (integer, float32/64, bool, string, binary, "
                    "date, time, timestamp, duration, decimal)"
                )
            if "\x00" in str(f.type):  # a time zone is free text
                raise InvalidUsage(
                    f"{role} column {f.name!r}: its type {str(f.type)!r} holds NUL (\\x00), "
                    "which a type (a time zone) may not: the stash stores schemas as JSON, "
                    "which cannot hold it (Postgres jsonb)"
                )
    return pa.schema(
        [
            *key_schema,
            *value_schema,
            pa.field(TIME, pa.int64(), nullable=False),
            pa.field(DIFF, pa.int64(), nullable=False),
        ]
    )


# ------------------------------------------------------------------ updates tables


def is_safe_widening(src: pa.DataType, dst: pa.DataType) -> bool:
    """True when every ``src`` value is exactly representable as a ``dst`` value."""
    if src == dst:
        return True
    if pa.types.is_null(src):
        return True
    if pa.types.is_dictionary(src):
        return is_safe_widening(src.value_type, dst)
    if pa.types.is_integer(src) and pa.types.is_integer(dst):
        sb, db = src.bit_width, dst.bit_width
        if pa.types.is_signed_integer(src):
            return bool(pa.types.is_signed_integer(dst) and db >= sb)
        return bool(db >= sb if pa.types.is_unsigned_integer(dst) else db > sb)
    if pa.types.is_floating(src) and pa.types.is_floating(dst):
        return bool(dst.bit_width >= src.bit_width)
    if pa.types.is_integer(src) and pa.types.is_floating(dst):
        mantissa = {16: 11, 32: 24, 64: 53}[dst.bit_width]
        bits = src.bit_width - (1 if pa.types.is_signed_integer(src) else 0)
        return bool(bits <= mantissa)
    if pa.types.is_string(src) and pa.types.is_large_string(dst):
        return True
    if pa.types.is_binary(src) and pa.types.is_large_binary(dst):
        return True
    return False


def _conform_column(
    name: str, col: pa.ChunkedArray | pa.Array, field: pa.Field
) -> pa.ChunkedArray | pa.Array:
    if col.type != field.type:
        if not is_safe_widening(col.type, field.type):
            raise InvalidUsage(
                f"column {name!r} has type {col.type}, the schema says {field.type} "
                "(only safe widenings are cast)"
            )
        try:
            col = col.cast(field.type, safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise InvalidUsage(
                f"column {name!r} of type {col.type} cannot be cast to {field.type}: {e}"
            ) from None
    if not field.nullable and col.null_count:
        raise InvalidUsage(f"column {name!r} has {col.null_count} nulls but is not nullable")
    return col


def _from_rows(rows: Sequence[Any], schema: pa.Schema, nkeys: int) -> pa.Table:
    nvals = len(schema) - 2 - nkeys
    keys: list[Any] = []
    vals: list[Any] = []
    times: list[Any] = []
    diffs: list[Any] = []
    for i, row in enumerate(rows):
        try:
            (k, v), t, d = row
        except (TypeError, ValueError):
            raise InvalidUsage(
                f"update {i} is not ((key_tuple, value_tuple), time, diff): {row!r:.200}"
            ) from None
        if not isinstance(k, (tuple, list)) or len(k) != nkeys:
            raise InvalidUsage(f"update {i}: key {k!r:.200} is not a tuple of {nkeys} values")
        if not isinstance(v, (tuple, list)) or len(v) != nvals:
            raise InvalidUsage(f"update {i}: value {v!r:.200} is not a tuple of {nvals} values")
        if isinstance(t, bool) or not isinstance(t, int):
            raise InvalidUsage(f"update {i}: time {t!r:.100} is not an int")
        if isinstance(d, bool) or not isinstance(d, int):
            raise InvalidUsage(f"update {i}: diff {d!r:.100} is not an int")
        keys.append(k)
        vals.append(v)
        times.append(t)
        diffs.append(d)
    columns: list[list[Any]] = [list(c) for c in zip(*keys, strict=True)] if keys else []
    if not columns:
        columns = [[] for _ in range(nkeys)]
    vcols: list[list[Any]] = [list(c) for c in zip(*vals, strict=True)] if vals else []
    if not vcols:
        vcols = [[] for _ in range(nvals)]
    arrays: list[pa.Array] = []
    for f, data in zip(schema, [*columns, *vcols, times, diffs], strict=True):
        try:
            arr = pa.array(data, type=f.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as e:
            raise InvalidUsage(
                f"column {f.name!r}: values do not fit type {f.type}: {str(e)[:200]}"
            ) from None
        if not f.nullable and arr.null_count:
            raise InvalidUsage(f"column {f.name!r} has {arr.null_count} nulls but is not nullable")
        arrays.append(arr)
    return pa.Table.from_arrays(arrays, schema=schema)


def to_updates_table(
    updates: pa.Table | pa.RecordBatch | Sequence[Any],
    key_schema: pa.Schema,
    value_schema: pa.Schema,
) -> pa.Table:
    """Normalise updates to a table with exactly :func:`updates_schema`'s columns.

    Args:
        updates: a ``pyarrow.Table`` or ``RecordBatch`` with the key columns, the value
            columns, ``_time`` and ``_diff`` (any order; matched by name; types equal or
            safely widened, e.g. int32 -> int64, string -> large_string, dictionary ->
            its value type), or a sequence of ``((key_tuple, value_tuple), time, diff)``.
        key_schema, value_schema: the shard's schemas.

    Returns:
        A table with the schema's columns in order (chunks as given).

    Raises:
        InvalidUsage: bad schemas; a column missing, extra, of another type (naming the
            column and both types), or null where it may not be (``_time``, ``_diff``
            and non-nullable fields); a malformed update row; a ``date64`` value that is
            not a whole day (:func:`check_whole_days`); a string that is not UTF-8
            (:func:`check_utf8`).
    """
    schema = updates_schema(key_schema, value_schema)
    if isinstance(updates, pa.RecordBatch):
        updates = pa.Table.from_batches([updates])
    if isinstance(updates, pa.Table):
        names = updates.column_names
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise InvalidUsage(f"updates have duplicate columns {dup}")
        missing = [f.name for f in schema if f.name not in names]
        extra = [n for n in names if schema.get_field_index(n) < 0]
        if missing or extra:
            raise InvalidUsage(
                f"updates columns do not match the shard schema: missing {missing}, "
                f"unexpected {extra}"
            )
        cols = [_conform_column(f.name, updates.column(f.name), f) for f in schema]
        table = pa.Table.from_arrays(cols, schema=schema)
        return check_utf8(check_whole_days(table), string_columns(schema))
    if isinstance(updates, (str, bytes)) or not isinstance(updates, Sequence):
        raise InvalidUsage(
            "updates must be a pyarrow Table/RecordBatch or a list of "
            f"((key, value), time, diff), not {type(updates).__name__}"
        )
    return check_whole_days(_from_rows(updates, schema, len(key_schema)))


def string_columns(schema: pa.Schema) -> list[int]:
    """The positions of ``schema``'s string and large_string columns (what
    :func:`check_utf8` checks)."""
    return [
        i
        for i, t in enumerate(schema.types)
        if pa.types.is_string(t) or pa.types.is_large_string(t)
    ]


def check_utf8(table: pa.Table, columns: Sequence[int]) -> pa.Table:
    """Refuse the string columns of ``table`` at positions ``columns``
    (:func:`string_columns`) whose bytes are not UTF-8.  Arrow does not check the bytes
    of a string array it did not build itself (``Array.from_buffers``, IPC or Parquet
    written elsewhere); such values have no Python, Spark or DuckDB string.  Returns
    ``table``; raises :class:`InvalidUsage` naming the column and its first offending
    row.  Costs about 0.7 us per column of a few rows (Arrow's ``validate(full=True)``),
    a few milliseconds per 40 MB of strings."""
    for i in columns:
        col = table.column(i)
        try:
            col.validate(full=True)
        except pa.ArrowInvalid as e:
            raise InvalidUsage(
                f"column {table.schema.field(i).name!r} ({col.type}) holds a value that is "
                f"not UTF-8 at row {_first_not_utf8(col)}: string values must be UTF-8 ({e})"
            ) from None
    return table


def _first_not_utf8(col: pa.ChunkedArray) -> int | None:
    """The first row of ``col`` whose bytes are not UTF-8 (``None``: none found)."""
    for i, v in enumerate(col.cast(pa.large_binary()).to_pylist()):
        if v is not None:
            try:
                v.decode("utf-8")
            except UnicodeDecodeError:
                return i
    return None


_MS_PER_DAY = 86_400_000


def check_whole_days(table: pa.Table) -> pa.Table:
    """Refuse ``date64`` values that are not whole days.  Parquet has no ``date64``: it
    stores a date as days (``DATE``), so a part would read back ``1 ms`` as ``0`` while
    an inline part kept it; Arrow's own docs say ``date64`` values are to be multiples
    of 86,400,000 ms.  Returns ``table``; raises :class:`InvalidUsage` naming the column
    and its first offending value."""
    for f in table.schema:
        if not pa.types.is_date64(f.type):
            continue
        ms = table.column(f.name).cast(pa.int64())
        bad = pc.not_equal(pc.multiply(pc.divide(ms, _MS_PER_DAY), _MS_PER_DAY), ms)
        if pc.any(bad).as_py():
            first = ms.filter(bad)[0].as_py()
            raise InvalidUsage(
                f"column {f.name!r} (date64) holds {first} ms, not a whole day: date64 "
                "values must be multiples of 86,400,000 ms (Parquet stores dates as days)"
            )
    return table


# ------------------------------------------------------------ schema evolution
#
# After persist-client's schema registry (``schema.rs``: a shard's
# schemas are registered in its state under increasing ids; each part names the id it
# was written with and reads migrate it to the reader's).  Only the value schema evolves.

_INT_CHAINS = (
    (pa.int8(), pa.int16(), pa.int32(), pa.int64()),
    (pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64()),
)

#: The rule a refused evolution broke, in the words of :class:`SchemaMismatch`.
EVOLUTION_RULES = (
    "compatible changes are: add a nullable value column, drop a value column named in "
    "drop=[...], widen a value column (int8->int16->int32->int64, float32->float64, string<->large_string), "
    "make a value column nullable"
)


def is_type_evolution(old: pa.DataType, new: pa.DataType) -> bool:
    """Whether a value column of type ``old`` may become ``new`` in a compatible schema
    evolution: equal, an integer widening of the same signedness (int8 -> int16 -> int32
    -> int64, likewise unsigned), float32 -> float64, ``string`` <-> ``large_string`` or
    ``binary`` <-> ``large_binary``."""
    if old == new:
        return True
    for chain in _INT_CHAINS:
        if old in chain and new in chain:
            return chain.index(new) > chain.index(old)
    if pa.types.is_float32(old) and pa.types.is_float64(new):
        return True
    strings = (pa.string(), pa.large_string())
    binaries = (pa.binary(), pa.large_binary())
    return (old in strings and new in strings) or (old in binaries and new in binaries)


def check_schema_evolution(
    shard: str,
    key_schema: pa.Schema,
    value_schema: pa.Schema,
    new_key_schema: pa.Schema,
    new_value_schema: pa.Schema,
    drop: Collection[str] = (),
) -> None:
    """Check that ``(new_key_schema, new_value_schema)`` is a compatible evolution of a
    shard's newest ``(key_schema, value_schema)``.

    Compatible: the key schema is equal (names, types, nullability, order); every new
    value column is nullable; a kept value column keeps its type or widens it
    (:func:`is_type_evolution`), stays or becomes nullable, and keeps its order relative
    to the other kept columns; a value column may be dropped only if ``drop`` names it.
    A drop is explicit so that a writer whose schema merely lacks a column another
    writer added meanwhile (both planned against an older version) is refused instead
    of dropping that column and the values written to it (Delta Lake likewise drops a
    column only on an explicit ``DROP COLUMN``; ``mergeSchema`` never drops).

    Args:
        drop: value column names this evolution drops (names of columns the newest
            version no longer has are ignored: dropped already).

    Raises:
        SchemaMismatch: naming the first column that breaks a rule, and the rule.
        InvalidUsage: the new schemas are not valid shard schemas at all; ``drop``
            names a column of the new schemas.
    """
    updates_schema(new_key_schema, new_value_schema)
    if isinstance(drop, str):
        raise InvalidUsage(f"drop must be a collection of column names, not the str {drop!r}")
    kept_too = sorted(set(drop) & {*new_key_schema.names, *new_value_schema.names})
    if kept_too:
        raise InvalidUsage(
            f"shard {shard}: drop names {kept_too}, which the schemas opened with keep"
        )
    both = (
        f"the shard's newest schemas are key ({_fmt(key_schema)}) and value "
        f"({_fmt(value_schema)}), it was opened with key ({_fmt(new_key_schema)}) and "
        f"value ({_fmt(new_value_schema)}); nothing was changed"
    )

    def mismatch(column: str, rule: str) -> SchemaMismatch:
        return SchemaMismatch(shard, column, rule, both)

    if not new_key_schema.equals(key_schema):
        old_k = {f.name: f for f in key_schema}
        new_k = {f.name: f for f in new_key_schema}
        for f in key_schema:
            g = new_k.get(f.name)
            if g is None:
                raise mismatch(f.name, "key column dropped (the key schema never changes)")
            if not g.equals(f):
                raise mismatch(
                    f.name,
                    f"key column changed from {f.type}{'' if f.nullable else ' not null'} to "
                    f"{g.type}{'' if g.nullable else ' not null'} (the key schema never changes)",
                )
        for g in new_key_schema:
            if g.name not in old_k:
                raise mismatch(g.name, "key column added (the key schema never changes)")
        raise mismatch(
            ",".join(new_key_schema.names),
            f"key columns reordered from {key_schema.names} (the key schema never changes)",
        )
    old = {f.name: f for f in value_schema}
    kept: list[str] = []
    for g in new_value_schema:
        f = old.get(g.name)
        if f is None:
            if not g.nullable:
                raise mismatch(
                    g.name,
                    f"value column added as not null ({g.type}): an added value column "
                    "must be nullable (its rows written before it existed read as null)",
                )
            continue
        kept.append(g.name)
        if not is_type_evolution(f.type, g.type):
            raise mismatch(
                g.name,
                f"value column type {f.type} -> {g.type} is not a widening ({EVOLUTION_RULES})",
            )
        if f.nullable and not g.nullable:
            raise mismatch(
                g.name,
                "value column was nullable and may not become not null (a column may only "
                "become nullable)",
            )
    order = [n for n in value_schema.names if n in set(kept)]
    if order != kept:
        first = next(a for a, b in zip(kept, order, strict=True) if a != b)
        raise mismatch(
            first,
            f"kept value columns reordered from {order} to {kept} (kept columns keep "
            "their relative order; add new ones anywhere)",
        )
    for f in value_schema:
        if f.name not in kept and f.name not in drop:
            raise mismatch(
                f.name,
                "value column missing from the schema opened with: a column is dropped "
                f"only when the evolution names it (drop=[{f.name!r}]); if another writer "
                "added it since your schema was planned, plan again on the newest schema "
                "(open with it plus your own columns)",
            )


def _fmt(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name}: {f.type}{'' if f.nullable else ' not null'}" for f in schema)


def _relaxed(field: pa.Field, nullable: bool) -> pa.Field:
    return field if field.nullable or not nullable else field.with_nullable(True)


class SchemaHistory:
    """The versions of a shard's value schema, by id (the index), and the conforming of
    updates written under one version to the view of another.

    A reader with version ``dst`` sees, for a part written under ``src``: its own value
    columns, in its order; a column present (by name) in every version from the older
    of ``src`` and ``dst`` up to the newest is read from the part and cast to the
    reader's type (a widening when ``dst`` is newer; for an *older* reader the cast back
    must keep the value exactly, a float round-tripping, else
    :class:`~persist.errors.SchemaMismatch`), any other is null (added after the part
    was written; dropped and added again in between, which makes it
    another column; or dropped by a later version: dropped columns are gone for every
    reader); columns the reader does not have are gone.  So a reader's view is the same
    before and after compaction rewrites a part under the newest version, and rows equal
    in the newest version's view are equal in every view (consolidating under the
    newest version is right for every reader).  The view's columns are those of version
    ``dst``, made nullable where a later version holds nulls (dropped or made nullable
    there), so that one view fits every part.  Instances are immutable and hashable
    (plans are cached per history).

    Attributes:
        key_schema: the shard's key schema.
        versions: the value schemas, ``versions[i]`` being schema id ``i``.
    """

    __slots__ = ("_hash", "key_schema", "versions")

    def __init__(self, key_schema: pa.Schema, versions: Sequence[pa.Schema]) -> None:
        if not versions:
            raise InvalidUsage("a schema history has at least one version")
        self.key_schema = key_schema
        self.versions = tuple(versions)
        self._hash = hash((key_schema, self.versions))  # plans are looked up per part

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, SchemaHistory)
            and self.key_schema.equals(other.key_schema, check_metadata=True)
            and len(self.versions) == len(other.versions)
            and all(
                a.equals(b, check_metadata=True)
                for a, b in zip(self.versions, other.versions, strict=True)
            )
        )

    def __hash__(self) -> int:
        return self._hash

    def __getstate__(self) -> tuple[pa.Schema, tuple[pa.Schema, ...]]:
        return self.key_schema, self.versions

    def __setstate__(self, state: tuple[pa.Schema, tuple[pa.Schema, ...]]) -> None:
        self.__init__(*state)  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"SchemaHistory({len(self.versions)} versions)"

    @property
    def newest(self) -> int:
        """The id of the newest version."""
        return len(self.versions) - 1

    def id_of(self, value_schema: pa.Schema) -> int | None:
        """The newest id whose value schema equals ``value_schema`` and none of whose
        columns a later version dropped (:meth:`dropped_after`); ``None``: none.  A
        version that lost a column is not reused: values written under it in that column
        would read as null for every reader, so such a schema is an evolution of the
        newest one instead (the column added again)."""
        for i in range(len(self.versions) - 1, -1, -1):
            if self.versions[i].equals(value_schema) and not self.dropped_after(i):
                return i
        return None

    def dropped_after(self, schema_id: int) -> list[str]:
        """The value columns of version ``schema_id`` that some later version does not
        have (by name): every reader sees null in them for updates written under
        ``schema_id``, so a writer of that version may no longer append."""
        later = self.versions[schema_id + 1 :]
        return [
            n
            for n in self.versions[schema_id].names
            if any(v.get_field_index(n) < 0 for v in later)
        ]

    def check_id(self, schema_id: int, what: str = "part") -> None:
        """Raise unless ``schema_id`` names a version.

        Raises:
            PersistError: naming ``what`` and the id.
        """
        if not 0 <= schema_id < len(self.versions):
            raise PersistError(
                f"{what} was written with schema id {schema_id}, but the shard state has "
                f"{len(self.versions)} schema version(s)"
            )

    def updates_schema(self, schema_id: int) -> pa.Schema:
        """The updates schema (key, value, ``_time``, ``_diff``) parts of version
        ``schema_id`` are written with."""
        return updates_schema(self.key_schema, self.versions[schema_id])

    def view_schema(self, read_id: int) -> pa.Schema:
        """The updates schema a reader of version ``read_id`` gets (see the class)."""
        return _view_schema(self, read_id)

    def plan(self, src: int, dst: int) -> ConformPlan:
        """How a part of version ``src`` is conformed to the view of ``dst`` (cached)."""
        return _plan(self, src, dst)

    def conform(
        self, table: pa.Table, src: int, dst: int, columns: Sequence[str] | None = None
    ) -> pa.Table:
        """``table`` (updates of version ``src``, or its :meth:`ConformPlan.source_columns`
        for ``columns``) as the view of version ``dst`` (only ``columns``, if given).

        Raises:
            SchemaMismatch: an older reader's column cannot hold a value written later.
        """
        return self.plan(src, dst).apply(table, columns)


@functools.lru_cache(maxsize=256)
def _view_schema(history: SchemaHistory, read_id: int) -> pa.Schema:
    mine = history.versions[read_id]
    later = history.versions[read_id + 1 :]
    fields = []
    for f in mine:
        nullable = False
        for v in later:
            i = v.get_field_index(f.name)
            if i < 0 or v.field(i).nullable:
                nullable = True
                break
        fields.append(_relaxed(f, nullable))
    return updates_schema(history.key_schema, pa.schema(fields))


class ConformPlan:
    """The conforming of one version's updates to another's view (see
    :class:`SchemaHistory`).

    Attributes:
        identity: the part is read as it is (same columns, types and nullability).
        keeps_runs: conforming keeps a sorted, consolidated run sorted and consolidated
            (no source value column is dropped and the kept ones keep their order; casts
            and null columns are injective and order-preserving), so snapshot fast paths
            over a single run stay valid; when false, conformed rows may collide and
            must be consolidated.
        target: the view's updates schema.
        sources: per target column, the source column name or ``None`` (null).
    """

    __slots__ = ("dst", "identity", "keeps_runs", "source", "sources", "src", "target")

    def __init__(self, history: SchemaHistory, src: int, dst: int) -> None:
        self.src, self.dst = src, dst
        self.source = history.updates_schema(src)
        self.target = history.view_schema(dst)
        # A column is read from the part only if it is present (by name) in every
        # version from the older of the two to the *newest*: a column a later version
        # dropped is gone for every reader (an older reader's view of it is null), so
        # that what a reader sees never depends on whether compaction (which rewrites
        # under the newest version) has run.
        span = history.versions[min(src, dst) :]
        key_names = set(history.key_schema.names)
        sources: list[str | None] = []
        for f in self.target:
            if f.name in key_names or f.name in (TIME, DIFF):
                sources.append(f.name)
            elif all(v.get_field_index(f.name) >= 0 for v in span):
                sources.append(f.name)
            else:
                sources.append(None)
        self.sources = tuple(sources)
        self.identity = self.source.equals(self.target) and None not in sources
        src_values = history.versions[src].names
        mapped = [s for s in sources if s is not None and s in set(src_values)]
        self.keeps_runs = self.identity or (
            set(mapped) == set(src_values) and mapped == [n for n in src_values if n in mapped]
        )

    def source_columns(self, columns: Sequence[str] | None) -> list[str] | None:
        """The part's columns to decode for the view's ``columns`` (``None``: all)."""
        if columns is None:
            return None
        by_name = dict(zip(self.target.names, self.sources, strict=True))
        out = []
        for c in columns:
            if c not in by_name:
                raise InvalidUsage(f"column {c!r} is not in the reader's schema")
            s = by_name[c]
            if s is not None:
                out.append(s)
        return out

    def apply(self, table: pa.Table, columns: Sequence[str] | None = None) -> pa.Table:
        """Conform ``table`` (see :meth:`SchemaHistory.conform`).

        Raises:
            SchemaMismatch: a value does not fit an older reader's narrower type.
        """
        if self.identity and columns is None:
            return table
        wanted = self.target.names if columns is None else list(columns)
        by_name = dict(zip(self.target.names, self.sources, strict=True))
        arrays = []
        fields = []
        for name in wanted:
            f = self.target.field(name)
            s = by_name[name]
            if s is None:
                col: pa.ChunkedArray | pa.Array = pa.nulls(table.num_rows, f.type)
            else:
                col = table.column(s)
                if col.type != f.type:
                    try:
                        narrowed = col.cast(f.type, safe=True)
                        if (
                            pa.types.is_floating(f.type)
                            and pa.types.is_floating(col.type)
                            and f.type.bit_width < col.type.bit_width
                        ):
                            # Arrow's safe cast of a float to a narrower float rounds,
                            # flushes to zero and overflows to infinity: refuse any loss.
                            _check_round_trip(col, narrowed)
                        col = narrowed
                    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                        raise SchemaMismatch(
                            f"(read as schema version {self.dst})",
                            name,
                            f"a value written under schema version {self.src} ({col.type}) "
                            f"does not fit this reader's older type {f.type} (open the "
                            f"shard with its newest schema): {str(e)[:200]}",
                        ) from None
            arrays.append(col)
            fields.append(f)
        return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def _check_round_trip(wide: pa.ChunkedArray | pa.Array, narrow: pa.ChunkedArray | pa.Array) -> None:
    """Raise ``ArrowInvalid`` unless every value of ``wide`` survives its cast to the
    narrower float type ``narrow`` exactly: cast back, it equals the value written
    (NaN, infinities and nulls round-trip).  Arrow's "safe" float cast rounds (``0.1``),
    flushes to zero (``1e-50``) and overflows to infinity (``1e300``) without an error;
    each gives a reader a value nobody wrote, and two distinct rows that round to one
    value would consolidate into one (their diffs cancelling)."""
    back = narrow.cast(wide.type)
    lost = pc.and_kleene(pc.invert(pc.equal(back, wide)), pc.invert(pc.is_nan(wide)))
    if pc.any(lost).as_py():
        i = pc.index(lost, True).as_py()
        value, read = wide[i].as_py(), narrow[i].as_py()
        why = "beyond the range of" if math.isinf(read) else "not exactly representable as"
        raise pa.ArrowInvalid(
            f"float value {value!r} is {why} {narrow.type} (it would read as {read!r})"
        )


@functools.lru_cache(maxsize=1024)
def _plan(history: SchemaHistory, src: int, dst: int) -> ConformPlan:
    return ConformPlan(history, src, dst)
