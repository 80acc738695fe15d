"""The ``stash`` Spark data source: a stash collection read as a DataFrame.

``spark.read.format("stash").option("url", URL).load("collection")`` returns the
collection's consolidated contents at its peek time (``upper - 1``, Materialize's
``peek_timestamp``), one row per unit of multiplicity.

Columns (the "layout", :func:`layout`), keys first:

* a JSON key or value that is an object contributes one column per field (``{"carrier":
  "9E"}`` gives a ``carrier`` column); any other key or value is one column named ``key``
  / ``value`` (``key_column`` / ``value_column``);
* key and value columns never collide, and each column reads only its own side: key
  columns keep their names (a key field named like the whole-key column becomes
  ``key_<field>``); a value column whose name a key column already has is prefixed
  with ``value_`` (``value_<field>``, repeated until the name is free). So a value
  ``{"key": "abc"}`` under the key ``"retention"`` reads as ``key='retention'``,
  ``value_key='abc'``;
* ``option("time_column", NAME)`` adds the peek time as a ``bigint`` column and
  ``option("diff_column", NAME)`` the multiplicity (then rows are not repeated);
* the schema is the user's (``.schema(ddl)`` or ``option("schema", ddl)``; columns are
  found by name in the layout as Spark resolves names, exactly else ignoring case, a
  name it lacks reads as nulls) or is inferred from the
  entries, exactly: ``bool`` -> boolean, ``str`` -> string, ``int`` -> bigint (or
  ``decimal(38,0)`` when some value is outside the 64-bit range), ``float`` -> double,
  a mix of ``int`` and ``float`` -> double when every integer is exactly a double;
  anything else (objects, arrays, mixed kinds, integers of more than 38 digits or too
  large for a double next to floats) -> a string column of JSON text, where every value,
  strings included, is JSON (``1`` reads as ``1``, ``"1"`` as ``"1"``); such columns
  carry the field metadata ``{"stash.json": true}``. The ``int``, ``str`` and ``bytes``
  codecs give bigint, string and binary. With a user schema, a string column holds
  strings as they are and other values as JSON text; every other type takes only the
  JSON values it holds exactly (:mod:`spark.stash_convert` lists them: no string is
  parsed as a number, no number read as a date, bytes or boolean): a value that does not
  fit its column (``2**70`` or ``"5"`` in a ``bigint``) raises :class:`StashSourceError`
  naming the column.

Invariants: a read sees one consistent peek of the collection, labelled with the time
it was read at (both in one read transaction, :meth:`stash.Stash.peek_at`); rows are read from a later peek than an inferred schema, and are given only
when that peek infers the same schema (else :class:`StashSourceError`: load again); a
negative multiplicity is never silently dropped: without a diff column it
raises :class:`StashSourceError`; no value is read into a column of another side or
field, nor rounded; the stash is only ever opened ``readonly``.

Options (:data:`OPTIONS`; any other name raises, suggesting the closest valid one):
``url`` or its other name ``stash`` (required; an absolute ``sqlite:///`` or
``postgresql+psycopg://`` URL: the source runs in Spark's Python workers, so
``memory://`` stashes are not visible), ``path`` (what ``load()`` is given) or
``collection``, ``schema``, ``time_column``, ``diff_column``, ``flatten`` (``false``
keeps whole keys and values as JSON text in ``key``/``value``; a boolean: anything but
true/false raises), ``key_column`` / ``value_column`` (names of the columns holding a
whole key / value; default ``key`` / ``value``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    DataType,
    DecimalType,
    DoubleType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from spark.options import check_names, parse_bool, redacted_repr
from spark.stash_convert import StashSourceError, check_readable, convert, find_field

__all__ = ["StashDataSource", "StashSourceError", "convert", "infer_schema", "layout"]


def _opt(options: Mapping[str, str], name: str, default: str | None = None) -> str | None:
    value = options.get(name)
    if value is None or value == "":
        return default
    return str(value)


OPTIONS = (
    "url",
    "stash",
    "path",
    "collection",
    "schema",
    "time_column",
    "diff_column",
    "flatten",
    "key_column",
    "value_column",
)
"""Every option the ``stash`` source understands (``stash`` is another name for ``url``)."""


class _Snapshot:
    """One consistent read of a collection: entries, peek time, codec names."""

    def __init__(
        self,
        entries: list[tuple[Any, Any, int]],
        time: int,
        key_codec: str,
        value_codec: str,
    ) -> None:
        self.entries = entries
        self.time = time
        self.key_codec = key_codec
        self.value_codec = value_codec


def read_collection(url: str, name: str) -> _Snapshot:
    """Peek the collection ``name`` of the stash at ``url`` (opened readonly).

    Returns the consolidated ``[(key, value, diff)]`` (sorted by key and value), the peek
    time, and the collection's codec names. A collection that was never sealed (upper
    ``{0}``) reads as empty at time ``-1``.  The entries are those at the returned
    time (:meth:`stash.Stash.peek_at`: both in one read transaction).

    Raises:
        StashSourceError: the collection does not exist.
        stash.StashError: the stash cannot be opened or read.
    """
    from stash import PeekSinceUpperError, Stash, redact

    with Stash.open(url, mode="readonly") as s:
        found = s.collections().get(name)
        if found is None:
            raise StashSourceError(f"stash collection {name!r} does not exist in {redact(url)}")
        kname = str(getattr(found.key_codec, "name", "json"))
        vname = str(getattr(found.value_codec, "name", "json"))
        try:
            ts, entries = s.peek_at(found)  # one read transaction: entries at that time
        except PeekSinceUpperError as e:
            if e.never_written():  # on the version the peek read, not a second read
                return _Snapshot([], -1, kname, vname)
            raise
        return _Snapshot(entries, ts, kname, vname)


# ------------------------------------------------------------------ layout
JSON_METADATA = "stash.json"
"""Field metadata marking an inferred string column whose every value is JSON text."""

KEY_PREFIX = "key_"
VALUE_PREFIX = "value_"


@dataclass(frozen=True)
class Column:
    """Where a column's values come from: ``side`` ``"key"`` or ``"value"``; ``field``
    the object field, or ``None`` for the whole (non-object) key or value."""

    name: str
    side: str
    field: str | None

    def get(self, key: Any, value: Any, flatten: bool) -> Any:
        """This column's value in the entry ``(key, value)`` (``None`` if absent)."""
        part = key if self.side == "key" else value
        spread = flatten and isinstance(part, dict)
        if self.field is None:
            return None if spread else part
        return part.get(self.field) if spread else None


def _unique(name: str, prefix: str, taken: set[str]) -> str:
    """``name``, prefixed until no taken name equals it ignoring case (Spark resolves
    column names case-insensitively by default); ``taken`` holds lower-cased names."""
    while name.lower() in taken:
        name = prefix + name
    taken.add(name.lower())
    return name


def layout(
    snap: _Snapshot, flatten: bool, names: tuple[str, str] = ("key", "value")
) -> list[Column]:
    """The columns of a snapshot, keys first: the whole key (``names[0]``) if some key is
    not an object, then the key objects' fields; the whole value (``names[1]``) if some
    value is not an object, then the value objects' fields, in order of first
    appearance. Names never collide: a key field named like the whole-key column gets
    ``key_`` in front, a value column named like any key column gets ``value_`` in
    front (repeated until the name is free), so key and value fields that share a name
    stay apart."""
    key_fields: dict[str, None] = {}
    value_fields: dict[str, None] = {}
    key_scalar = value_scalar = not snap.entries
    for k, v, _ in snap.entries:
        if flatten and isinstance(k, dict):
            key_fields.update(dict.fromkeys(k))
        else:
            key_scalar = True
        if flatten and isinstance(v, dict):
            value_fields.update(dict.fromkeys(v))
        else:
            value_scalar = True
    taken: set[str] = set()
    cols: list[Column] = []
    if key_scalar:
        cols.append(Column(_unique(names[0], KEY_PREFIX, taken), "key", None))
    cols.extend(Column(_unique(f, KEY_PREFIX, taken), "key", f) for f in key_fields)
    if value_scalar:
        cols.append(Column(_unique(names[1], VALUE_PREFIX, taken), "value", None))
    cols.extend(Column(_unique(f, VALUE_PREFIX, taken), "value", f) for f in value_fields)
    return cols


_INT64 = (-(2**63), 2**63 - 1)
_EXACT_FLOAT_INT = 2**53


def _kind(x: Any) -> str:
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, int):
        return "int"
    if isinstance(x, float):
        return "float"
    if isinstance(x, str):
        return "str"
    if isinstance(x, bytes | bytearray):
        return "bytes"
    return "json"


def _json_text() -> tuple[DataType, bool]:
    return StringType(), True


def _infer_type(values: Sequence[Any], codec: str, whole: bool) -> tuple[DataType, bool]:
    """The Spark type of a column holding ``values`` and whether it is JSON text."""
    if whole and codec == "int":
        return LongType(), False
    if whole and codec == "str":
        return StringType(), False
    if whole and codec == "bytes":
        return BinaryType(), False
    present = [x for x in values if x is not None]
    kinds = {_kind(x) for x in present}
    if not kinds:
        return StringType(), False
    if kinds == {"bool"}:
        return BooleanType(), False
    if kinds == {"str"}:
        return StringType(), False
    if kinds == {"bytes"}:
        return BinaryType(), False
    if kinds == {"float"}:
        return DoubleType(), False
    if kinds == {"int"}:
        if all(_INT64[0] <= x <= _INT64[1] for x in present):
            return LongType(), False
        if all(len(str(abs(x))) <= 38 for x in present):
            return DecimalType(38, 0), False
        return _json_text()  # exact digits, as JSON text
    if kinds == {"int", "float"}:
        if all(abs(x) <= _EXACT_FLOAT_INT for x in present if _kind(x) == "int"):
            return DoubleType(), False
        return _json_text()  # a double would round some integer
    return _json_text()


@dataclass(frozen=True)
class ReadOptions:
    """Parsed options of a ``stash`` read (picklable)."""

    url: str
    collection: str
    flatten: bool = True
    time_column: str | None = None
    diff_column: str | None = None
    key_column: str = "key"
    value_column: str = "value"

    def __repr__(self) -> str:
        return redacted_repr(self, "url")

    @property
    def names(self) -> tuple[str, str]:
        return (self.key_column, self.value_column)


def infer_schema(snap: _Snapshot, o: ReadOptions) -> StructType:
    """The inferred Spark schema of a collection snapshot (see the module docstring).
    A string column inferred from mixed or nested values carries the field metadata
    ``{"stash.json": true}``: its every value is JSON text.

    Raises:
        StashSourceError: the time or diff column name is already a key/value column.
    """
    fields = []
    for col in layout(snap, o.flatten, o.names):
        codec = snap.key_codec if col.side == "key" else snap.value_codec
        values = [col.get(k, v, o.flatten) for k, v, _ in snap.entries]
        dtype, is_json = _infer_type(values, codec, col.field is None)
        meta = {JSON_METADATA: True} if is_json else {}
        fields.append(StructField(col.name, dtype, True, meta))
    for extra in (o.time_column, o.diff_column):
        if extra is not None:
            if extra.lower() in {f.name.lower() for f in fields}:
                raise StashSourceError(
                    f"column {extra!r} asked for time/diff already names a key or value "
                    "field (column names are compared ignoring case, as Spark does)"
                )
            fields.append(StructField(extra, LongType(), False))
    return StructType(fields)


# ------------------------------------------------------------- conversion


def rows_of(snap: _Snapshot, schema: StructType, o: ReadOptions) -> Iterator[tuple[Any, ...]]:
    """Yield the rows of ``snap`` in ``schema``'s column order. Columns are found by name
    in the snapshot's :func:`layout` (a name it lacks is all nulls) as Spark resolves
    names: exactly, else ignoring case (PySpark hands a Python source no session
    settings, so ``spark.sql.caseSensitive`` cannot be seen; the layout's names never
    differ only in case). Each column only ever reads its own side (key or value) and
    field; values convert as :mod:`spark.stash_convert` says.

    Raises:
        StashSourceError: a negative multiplicity without a diff column; a value that does
            not fit its column.
    """
    cols = layout(snap, o.flatten, o.names)
    names = [c.name for c in cols]
    plan: list[tuple[str, Column | None, StructField]] = []
    for f in schema.fields:
        if o.time_column is not None and find_field([o.time_column], f.name) is not None:
            plan.append(("time", None, f))
        elif o.diff_column is not None and find_field([o.diff_column], f.name) is not None:
            plan.append(("diff", None, f))
        else:
            i = find_field(names, f.name)
            plan.append(("column", None if i is None else cols[i], f))
    json_columns = {f.name for f in schema.fields if (f.metadata or {}).get(JSON_METADATA)}
    for key, value, diff in snap.entries:
        row: list[Any] = []
        for what, col, f in plan:
            if what == "time":
                row.append(snap.time)
            elif what == "diff":
                row.append(diff)
            elif col is None:
                row.append(None)
            else:
                v = col.get(key, value, o.flatten)
                row.append(convert(v, f.dataType, f.name, f.name in json_columns))
        if o.diff_column is not None:
            yield tuple(row)
            continue
        if diff < 0:
            raise StashSourceError(
                f"stash collection {o.collection!r} holds key {key!r} with negative "
                f"multiplicity {diff}; read it with option('diff_column', ...) to see diffs"
            )
        t = tuple(row)
        for _ in range(diff):
            yield t


# ------------------------------------------------------------- the source
class StashDataSource(DataSource):
    """``format("stash")``: batch read of one stash collection (see the module docstring)."""

    @classmethod
    def name(cls) -> str:
        return "stash"

    def _settings(self) -> ReadOptions:
        check_names(self.options, OPTIONS, "reading a stash collection", StashSourceError)
        url = _opt(self.options, "url")
        alias = _opt(self.options, "stash")
        if url is not None and alias is not None and url != alias:
            from stash import redact

            raise StashSourceError(
                f"options 'url' ({redact(url)!r}) and 'stash' ({redact(alias)!r}) name "
                "different stashes; give one of them"
            )
        url = url or alias
        if url is None:
            raise StashSourceError(
                "the stash source needs option('url', STASH_URL) (or option('stash', ...), "
                "as the persist source calls it)"
            )
        name = _opt(self.options, "collection") or _opt(self.options, "path")
        if name is None:
            raise StashSourceError(
                "the stash source needs a collection: load('name') or option('collection', ...)"
            )
        o = ReadOptions(
            url=url,
            collection=name,
            flatten=parse_bool("flatten", _opt(self.options, "flatten"), True, StashSourceError),
            time_column=_opt(self.options, "time_column"),
            diff_column=_opt(self.options, "diff_column"),
            key_column=_opt(self.options, "key_column", "key") or "key",
            value_column=_opt(self.options, "value_column", "value") or "value",
        )
        if o.time_column is not None and o.time_column == o.diff_column:
            raise StashSourceError(f"time_column and diff_column are both {o.time_column!r}")
        if o.key_column == o.value_column:
            raise StashSourceError(f"key_column and value_column are both {o.key_column!r}")
        return o

    def schema(self) -> StructType | str:
        """The ``schema`` option (DDL) if given, else the schema inferred from a peek."""
        ddl = _opt(self.options, "schema")
        if ddl is not None:
            return ddl
        o = self._settings()
        snap = read_collection(o.url, o.collection)
        inferred = infer_schema(snap, o)
        # Kept for reader() (Spark pickles this instance after schema()): the rows are
        # read from a later peek, which must infer the same schema.
        self._inferred_at: int | None = snap.time
        return inferred

    def reader(self, schema: StructType) -> DataSourceReader:
        """The reader of the collection in ``schema``.

        Raises:
            StashSourceError: a column's type cannot hold JSON values (names it).
        """
        o = self._settings()
        for f in schema.fields:
            if f.name not in (o.time_column, o.diff_column):
                check_readable(f.dataType, f.name)
        return StashReader(o, schema, getattr(self, "_inferred_at", None))


class StashReader(DataSourceReader):
    """Reads the whole collection in one partition (catalog collections are small)."""

    def __init__(
        self, options: ReadOptions, schema: StructType, inferred_at: int | None = None
    ) -> None:
        """``inferred_at``: the peek time ``schema`` was inferred at (``None``: the
        user's schema)."""
        self.options = options
        self.schema = schema
        self.inferred_at = inferred_at

    def partitions(self) -> Sequence[InputPartition]:
        return [InputPartition(self.options.collection)]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        """The rows of one peek.  With an inferred schema, that peek must infer the same
        schema: a value appended since the inference could read like another (the
        number ``5`` and the string ``"5"`` in a column inferred as plain strings).

        Raises:
            StashSourceError: as :func:`rows_of`; the collection changed since its
                schema was inferred so that it infers another (naming the first column
                that differs).
        """
        o = self.options
        snap = read_collection(o.url, o.collection)
        if self.inferred_at is not None and snap.time != self.inferred_at:
            _check_inference(snap, self.schema, o, self.inferred_at)
        yield from rows_of(snap, self.schema, o)


def _check_inference(snap: _Snapshot, schema: StructType, o: ReadOptions, at: int) -> None:
    """Raise unless ``snap`` infers ``schema`` (inferred at peek time ``at``)."""
    now = infer_schema(snap, o)
    if now == schema:
        return
    old = {f.name: f for f in schema.fields}
    new = {f.name: f for f in now.fields}
    col = next(n for n in [*old, *new] if old.get(n) != new.get(n))

    def shown(f: StructField | None) -> str:
        if f is None:
            return "absent"
        json_text = " of JSON text" if (f.metadata or {}).get(JSON_METADATA) else ""
        return f"{f.dataType.simpleString()}{json_text}"

    raise StashSourceError(
        f"stash collection {o.collection!r} changed since its schema was inferred at time "
        f"{at}: as of time {snap.time} column {col!r} reads as {shown(new.get(col))}, not "
        f"{shown(old.get(col))}; load the collection again (or give a schema)"
    )
