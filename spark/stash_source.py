"""The ``stash`` Spark data source: a stash collection read as a DataFrame.

``spark.read.format("stash").option("url", URL).load("collection")`` returns the
collection's consolidated contents at its peek time (``upper - 1``, the seed's
``peek_timestamp``), one row per unit of multiplicity.

Columns (the "layout"):

* a JSON key or value that is an object contributes one column per field (``{"carrier":
  "9E"}`` gives a ``carrier`` column); any other key or value is one column named ``key``
  / ``value``; a value field whose name is also a key field is named ``value_<field>``;
* ``option("time_column", NAME)`` adds the peek time as a ``bigint`` column and
  ``option("diff_column", NAME)`` the multiplicity (then rows are not repeated);
* the schema is the user's (``.schema(ddl)`` or ``option("schema", ddl)``) or is inferred
  from the entries: ``bool`` -> boolean, ``int`` -> bigint, ``float`` (or a mix with
  ``int``) -> double, ``str`` -> string, objects/arrays/mixed types -> JSON string; the
  ``int``, ``str`` and ``bytes`` codecs give bigint, string and binary.

Invariants: a read sees one consistent peek of the collection (one stash read
transaction); a negative multiplicity is never silently dropped: without a diff column it
raises :class:`StashSourceError`; the stash is only ever opened ``readonly``.

Options: ``url`` (required; an absolute ``sqlite:///`` or ``postgresql+psycopg://`` URL:
the source runs in Spark's Python workers, so ``memory://`` stashes are not visible),
``path`` (what ``load()`` is given) or ``collection``, ``schema``, ``time_column``,
``diff_column``, ``flatten`` (``false`` keeps whole keys and values as JSON text in
``key``/``value``), ``key_column`` / ``value_column`` (names of the columns holding a
whole key / value; default ``key`` / ``value``).
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    ByteType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)


class StashSourceError(ValueError):
    """A stash collection cannot be read as asked (missing option or collection, bad
    schema, a value that does not fit its column, a negative multiplicity)."""


def _opt(options: Mapping[str, str], name: str, default: str | None = None) -> str | None:
    value = options.get(name)
    if value is None or value == "":
        return default
    return str(value)


def _truthy(value: str | None, default: bool) -> bool:
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


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
    ``{0}``) reads as empty at time ``-1``.

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
            ts = s.peek_timestamp(found)
            entries = s.peek(found)
        except PeekSinceUpperError:
            if s.upper(found).as_option() == 0:
                return _Snapshot([], -1, kname, vname)
            raise
        return _Snapshot(entries, ts, kname, vname)


# ------------------------------------------------------------------ layout
def _fields_of(part: Any, flatten: bool) -> list[str] | None:
    if flatten and isinstance(part, dict):
        return list(part)
    return None


def _column_names(
    snap: _Snapshot, flatten: bool, names: tuple[str, str] = ("key", "value")
) -> list[tuple[str, str, str | None]]:
    """``[(column, side, field)]``: side ``key``/``value``; field ``None`` = the whole part."""
    key_fields: dict[str, None] = {}
    value_fields: dict[str, None] = {}
    key_scalar = value_scalar = False
    for k, v, _ in snap.entries:
        kf = _fields_of(k, flatten)
        vf = _fields_of(v, flatten)
        if kf is None:
            key_scalar = True
        else:
            key_fields.update(dict.fromkeys(kf))
        if vf is None:
            value_scalar = True
        else:
            value_fields.update(dict.fromkeys(vf))
    if not snap.entries:
        key_scalar = value_scalar = True
    cols: list[tuple[str, str, str | None]] = []
    key_name, value_name = names
    if key_scalar:
        cols.append((key_name, "key", None))
    cols.extend((f, "key", f) for f in key_fields)
    taken = {c for c, _, _ in cols}
    if value_scalar:
        cols.append(
            (value_name if value_name not in taken else f"value_{value_name}", "value", None)
        )
    for f in value_fields:
        cols.append((f if f not in taken else f"value_{f}", "value", f))
    return cols


def _resolve(
    column: str, key: Any, value: Any, flatten: bool, names: tuple[str, str] = ("key", "value")
) -> Any:
    """The value of ``column`` in the entry ``(key, value)`` (``None`` if absent);
    ``names`` are the columns of a whole (non-object) key and value."""
    if flatten and isinstance(key, dict) and column in key:
        return key[column]
    if flatten and isinstance(value, dict) and column in value:
        return value[column]
    if column == names[0]:
        return None if flatten and isinstance(key, dict) else key
    if column == names[1] or column == f"value_{names[1]}":
        return None if flatten and isinstance(value, dict) else value
    if column.startswith("value_") and flatten and isinstance(value, dict):
        return value.get(column[len("value_") :])
    return None


_RANK = {"null": 0, "bool": 1, "int": 2, "float": 3}


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


def _infer_type(values: Sequence[Any], codec: str, whole: bool) -> DataType:
    if whole and codec == "int":
        return LongType()
    if whole and codec == "str":
        return StringType()
    if whole and codec == "bytes":
        return BinaryType()
    kinds = {_kind(x) for x in values} - {"null"}
    if not kinds:
        return StringType()
    if kinds == {"bool"}:
        return BooleanType()
    if kinds == {"int"}:
        return LongType()
    if kinds <= {"int", "float"}:
        return DoubleType()
    if kinds == {"bytes"}:
        return BinaryType()
    return StringType()


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

    @property
    def names(self) -> tuple[str, str]:
        return (self.key_column, self.value_column)


def infer_schema(snap: _Snapshot, o: ReadOptions) -> StructType:
    """The inferred Spark schema of a collection snapshot (see the module docstring).

    Raises:
        StashSourceError: the time or diff column name is already a key/value column.
    """
    fields = []
    for col, side, field in _column_names(snap, o.flatten, o.names):
        codec = snap.key_codec if side == "key" else snap.value_codec
        values = [_resolve(col, k, v, o.flatten, o.names) for k, v, _ in snap.entries]
        fields.append(StructField(col, _infer_type(values, codec, field is None), True))
    for extra in (o.time_column, o.diff_column):
        if extra is not None:
            if extra in {f.name for f in fields}:
                raise StashSourceError(
                    f"column {extra!r} asked for time/diff already names a key or value field"
                )
            fields.append(StructField(extra, LongType(), False))
    return StructType(fields)


# ------------------------------------------------------------- conversion
_INTS = (LongType, IntegerType, ShortType, ByteType)


def convert(value: Any, dtype: DataType, column: str) -> Any:
    """Turn a decoded JSON value into what Spark expects for ``dtype``.

    Raises:
        StashSourceError: the value does not fit (names the column and the value).
    """
    if value is None:
        return None
    try:
        if isinstance(dtype, StringType):
            if isinstance(value, str):
                return value
            if isinstance(value, bytes | bytearray):
                return base64.b64encode(bytes(value)).decode("ascii")
            return json.dumps(value, sort_keys=True, separators=(",", ":"))
        if isinstance(dtype, _INTS):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError("not an integer")
            return int(value)
        if isinstance(dtype, DoubleType | FloatType):
            return float(value)
        if isinstance(dtype, BooleanType):
            if not isinstance(value, bool):
                raise ValueError("not a boolean")
            return value
        if isinstance(dtype, DecimalType):
            return decimal.Decimal(str(value))
        if isinstance(dtype, TimestampType | TimestampNTZType):
            if isinstance(value, int | float):
                ts = dt.datetime.fromtimestamp(value, dt.UTC)
            else:
                ts = dt.datetime.fromisoformat(str(value))
            if isinstance(dtype, TimestampType) and ts.tzinfo is None:
                ts = ts.replace(tzinfo=dt.UTC)
            if isinstance(dtype, TimestampNTZType) and ts.tzinfo is not None:
                ts = ts.astimezone(dt.UTC).replace(tzinfo=None)
            return ts
        if isinstance(dtype, DateType):
            return dt.date.fromisoformat(str(value)[:10])
        if isinstance(dtype, BinaryType):
            if isinstance(value, str):
                return value.encode("utf-8")
            return bytes(value)
    except (TypeError, ValueError, decimal.InvalidOperation, OverflowError) as e:
        raise StashSourceError(
            f"column {column!r}: value {value!r} does not fit {dtype.simpleString()}: {e}"
        ) from None
    return value  # arrays, maps, structs: Spark converts lists and dicts itself


def rows_of(snap: _Snapshot, schema: StructType, o: ReadOptions) -> Iterator[tuple[Any, ...]]:
    """Yield the rows of ``snap`` in ``schema``'s column order.

    Raises:
        StashSourceError: a negative multiplicity without a diff column; a value that does
            not fit its column.
    """
    fields = list(schema.fields)
    for key, value, diff in snap.entries:
        row = []
        for f in fields:
            if f.name == o.time_column:
                row.append(snap.time)
            elif f.name == o.diff_column:
                row.append(diff)
            else:
                v = _resolve(f.name, key, value, o.flatten, o.names)
                row.append(convert(v, f.dataType, f.name))
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
        url = _opt(self.options, "url")
        if url is None:
            raise StashSourceError("the stash source needs option('url', STASH_URL)")
        name = _opt(self.options, "collection") or _opt(self.options, "path")
        if name is None:
            raise StashSourceError(
                "the stash source needs a collection: load('name') or option('collection', ...)"
            )
        return ReadOptions(
            url=url,
            collection=name,
            flatten=_truthy(_opt(self.options, "flatten"), True),
            time_column=_opt(self.options, "time_column"),
            diff_column=_opt(self.options, "diff_column"),
            key_column=_opt(self.options, "key_column", "key") or "key",
            value_column=_opt(self.options, "value_column", "value") or "value",
        )

    def schema(self) -> StructType | str:
        """The ``schema`` option (DDL) if given, else the schema inferred from a peek."""
        ddl = _opt(self.options, "schema")
        if ddl is not None:
            return ddl
        o = self._settings()
        return infer_schema(read_collection(o.url, o.collection), o)

    def reader(self, schema: StructType) -> DataSourceReader:
        return StashReader(self._settings(), schema)


class StashReader(DataSourceReader):
    """Reads the whole collection in one partition (catalog collections are small)."""

    def __init__(self, options: ReadOptions, schema: StructType) -> None:
        self.options = options
        self.schema = schema

    def partitions(self) -> Sequence[InputPartition]:
        return [InputPartition(self.options.collection)]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        o = self.options
        yield from rows_of(read_collection(o.url, o.collection), self.schema, o)
