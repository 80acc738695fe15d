"""Codecs: how keys and values of a collection become canonical JSON text and back.

A :class:`Codec` maps a Python value to a *canonical* JSON text (``encode``) and back
(``decode``).  Invariants kept here:

* two values are equal for the stash exactly when their encodings are equal (the
  encoding is canonical: sorted object keys, no insignificant spaces, one spelling per
  number), so consolidation can compare encodings;
* ``decode(encode(v)) == v`` for every value the codec accepts;
* ``sort_key`` gives a total order over accepted values (JSON: null < false < true <
  numbers < strings < arrays < objects), which is the order ``iter`` and ``peek`` return;
* a codec's ``name`` is recorded with the collection and checked when it is reopened
  (``json``, ``int``, ``str``, ``bytes``, ``tuple``, ``record:NAME(required fields)``;
  names recorded by earlier versions, such as ``record:module.Qualname``, resolve to
  or compare equal with the same codecs);
* a record type may evolve additively (:class:`RecordCodec`): a stored object is read
  with defaults for the fields it lacks and without the fields the type does not know,
  so one value may have two stored encodings (before and after the change); a write
  that retracts a stored value retracts its stored text, never a re-encoding;
* the codec work of a record type (fields, defaults, ``typing.get_type_hints``, the
  converters of its fields) is done once per type (:func:`_plan`), not per row;
* composite keys come back as the hashable type they went in as: the ``tuple`` codec
  decodes JSON arrays to tuples (nested ones too), and records (dataclasses, msgspec
  Structs, NamedTuples) decode fields holding records or annotated as tuples to those
  types, so a frozen record or NamedTuple key is hashable after a round trip;
* :func:`decode_all` (the bulk decode of ``peek_one``) returns exactly what one
  ``decode`` per text returns, and raises an error of the same type for a bad text.

The database stores the encodings: JSON text on SQLite, ``jsonb`` on Postgres, so the
data is readable with plain SQL.  Source of the idea: Materialize's ``Codec`` trait
(``src/stash/src/lib.rs`` uses ``mz_persist_types::Codec``) with JSON as the wire format.
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import json
import math
import re
import threading
import types
import typing
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from stash.errors import StashError

T = TypeVar("T")

MAX_JSON_DEPTH = 64
MAX_ENCODED_BYTES = 16 * 1024 * 1024


class Codec(Protocol[T]):
    """Turns values of one type into canonical JSON text and back.

    Attributes:
        name: the codec's recorded name (e.g. ``"json"``, ``"int"``).
    """

    name: str

    def encode(self, value: T) -> str:
        """Canonical JSON text of ``value``. Raises :class:`StashError` if not encodable."""
        ...

    def decode(self, text: str) -> T:
        """The value of a canonical JSON text. Raises :class:`StashError` if malformed."""
        ...

    def sort_key(self, value: T) -> Any:
        """A key giving the codec's total order over values."""
        ...


def _raise_not_json(value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise StashError(f"value {value!r} is not JSON: NaN and infinities are not allowed")
    raise StashError(f"value of type {type(value).__name__} is not JSON-encodable")


def _scan(value: Any, depth: int) -> bool:
    """Check that ``value`` is JSON the codec accepts (str keys, finite floats, at most
    ``MAX_JSON_DEPTH`` levels: a container at depth ``d`` holds keys and items at depth
    ``d + 1``); return whether it holds a whole float (to be written as an integer).
    Strings are checked later, on the encoded text (see :func:`canonical_json`)."""
    t = type(value)
    items: Any = None
    if t is dict:
        for k in value:
            if type(k) is not str and not isinstance(k, str):
                raise StashError(f"JSON object keys must be strings, got {type(k).__name__}")
        items = value.values()
    elif t is list or t is tuple:
        items = value
    if items is not None:
        if value and depth >= MAX_JSON_DEPTH:
            raise StashError(f"value is nested deeper than {MAX_JSON_DEPTH} levels")
        found = False
        for v in items:
            tv = type(v)
            if tv is str or tv is int or tv is bool or v is None:
                continue
            if _scan(v, depth + 1):
                found = True
        return found
    if t is float:
        if not math.isfinite(value):
            _raise_not_json(value)
        return bool(value.is_integer())
    if t is str or t is int or t is bool or value is None:
        return False
    # Subclasses (IntEnum, str enums, OrderedDict, ...): as their base type.
    if depth > MAX_JSON_DEPTH:
        raise StashError(f"value is nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, dict):
        return _scan(dict(value), depth)
    if isinstance(value, list | tuple):
        return _scan(list(value), depth)
    if isinstance(value, float):
        return _scan(float(value), depth)
    if isinstance(value, str | int):
        return False
    _raise_not_json(value)
    return False  # pragma: no cover - _raise_not_json always raises


def _check_strings(value: Any) -> None:
    """Raise for a NUL character anywhere in ``value``'s strings (keys included)."""
    if isinstance(value, str):
        if "\x00" in value:
            raise StashError("value contains a NUL character (\\u0000), which is not allowed")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k)
            _check_strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            _check_strings(v)


#: The encoder of :func:`canonical_json`, made once (``json.dumps`` with options builds
#: one per call); ``encode`` keeps no state between calls, so threads share it.
_encode = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
).encode


def canonical_json(value: Any) -> str:
    """Canonical JSON text: sorted keys, no spaces, UTF-8 kept, floats that are whole
    numbers written as integers (so ``1.0`` and ``1`` are the same value, as in ``jsonb``,
    which keeps a number's exact decimal).

    One pass in Python checks the structure (and finds whole floats); strings are checked
    on the encoded text, in C: a NUL is always escaped as ``\\u0000`` there (only then
    are the strings searched), and a lone surrogate makes the text unencodable as UTF-8.

    Raises:
        StashError: the value is not JSON (NaN, sets, objects, non-str keys, too deep,
            a NUL character or a lone surrogate in a string, larger than 16 MiB encoded).
    """
    if _scan(value, 0):
        value = _normalize(value)
    try:
        text = _encode(value)
    except (TypeError, ValueError) as e:
        raise StashError(f"value is not JSON-encodable: {e}") from None
    except RecursionError:
        raise StashError(f"value is nested deeper than {MAX_JSON_DEPTH} levels") from None
    if "\\u0000" in text:
        _check_strings(value)
    if not text.isascii():  # a lone surrogate is not ASCII (isascii reads a flag of the str)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise StashError("value contains a lone surrogate, which is not valid UTF-8") from None
    if len(text) > MAX_ENCODED_BYTES:
        raise StashError(f"encoded value is larger than {MAX_ENCODED_BYTES} bytes")
    return text


def _normalize(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, dict):
        return {k: _normalize(v) for k, v in value.items()}
    return [_normalize(v) for v in value]


def json_sort_key(value: Any) -> tuple[Any, ...]:
    """Total order over JSON values: null < false < true < numbers < strings < arrays <
    objects; arrays lexicographic; objects by their sorted (key, value) items."""
    t = type(value)
    if t is str:
        return (3, value)
    if t is int or t is float:
        return (2, value)
    if t is dict:
        return (5, tuple([(k, json_sort_key(value[k])) for k in sorted(value)]))
    if t is list or t is tuple:
        return (4, tuple([json_sort_key(v) for v in value]))
    if value is None:
        return (0,)
    if t is bool:
        return (1, value)
    # Subclasses of the JSON types.
    if isinstance(value, bool):
        return (1, value)
    if isinstance(value, int | float):
        return (2, value)
    if isinstance(value, str):
        return (3, value)
    if isinstance(value, list | tuple):
        return (4, tuple(json_sort_key(v) for v in value))
    if isinstance(value, dict):
        return (5, tuple((k, json_sort_key(value[k])) for k in sorted(value)))
    return (6, repr(value))


#: The C scanner of the default JSON decoder: ``json.loads`` of a text without
#: surrounding whitespace is exactly ``_scan_once(text, 0)`` parsing the whole text, and
#: calling the scanner directly skips several Python-level calls per value (a 100,000
#: entry ``peek_one`` decodes 200,000 texts).
_scan_once: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _loads(text: str, codec: str) -> Any:
    """``json.loads(text)``; stored canonical texts take the direct scanner path, any
    other text (whitespace around it, not JSON, not a ``str``) goes through
    ``json.loads``, so values and errors are exactly those of ``json.loads``.

    Raises:
        StashError: the text is not JSON.
    """
    try:
        value, end = _scan_once(text, 0)
        if end == len(text):
            return value
    except (StopIteration, TypeError, ValueError):
        pass
    try:
        return json.loads(text)
    except (TypeError, ValueError) as e:
        raise StashError(f"{codec} codec: stored text is not JSON: {e}") from None


def _loads_all(texts: Sequence[str], codec: str) -> list[Any]:
    """``[_loads(t, codec) for t in texts]`` with the scanner called inline: the same
    values and errors, about three times faster than ``json.loads`` per text (a 100,000
    entry ``peek_one`` decodes 100,000 values this way)."""
    scan = _scan_once
    out: list[Any] = []
    app = out.append
    for t in texts:
        try:
            v, end = scan(t, 0)
            if end == len(t):
                app(v)
                continue
        except (StopIteration, TypeError, ValueError):
            pass
        # A text the scanner did not parse whole takes the checked path (json.loads).
        app(_loads(t, codec))
    return out


class JsonCodec:
    """The default codec: any JSON value (dict, list, str, int, float, bool, None)."""

    name = "json"

    def encode(self, value: Any) -> str:
        return canonical_json(value)

    def decode(self, text: str) -> Any:
        return _loads(text, self.name)

    def sort_key(self, value: Any) -> Any:
        return json_sort_key(value)


class IntCodec:
    """Python ``int`` values (arbitrary size is refused beyond i64), stored as JSON numbers."""

    name = "int"

    def encode(self, value: int) -> str:
        if isinstance(value, bool) or not isinstance(value, int):
            raise StashError(f"int codec: expected an int, got {type(value).__name__}")
        if not -(2**63) <= value < 2**63:
            raise StashError(f"int codec: {value} is outside the i64 range")
        return str(value)

    def decode(self, text: str) -> int:
        try:
            return int(text)  # the canonical form of an int is its decimal digits
        except ValueError:
            pass
        v = _loads(text, self.name)
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            raise StashError(f"int codec: stored value {text!r} is not an integer")
        return v

    def sort_key(self, value: int) -> Any:
        return value


class StrCodec:
    """Python ``str`` values, stored as JSON strings."""

    name = "str"

    def encode(self, value: str) -> str:
        if not isinstance(value, str):
            raise StashError(f"str codec: expected a str, got {type(value).__name__}")
        return canonical_json(value)

    def decode(self, text: str) -> str:
        v = _loads(text, self.name)
        if not isinstance(v, str):
            raise StashError(f"str codec: stored value {text!r} is not a string")
        return v

    def sort_key(self, value: str) -> Any:
        return value


class BytesCodec:
    """Python ``bytes`` values, stored as JSON strings of standard base64."""

    name = "bytes"

    def encode(self, value: bytes) -> str:
        if not isinstance(value, bytes | bytearray | memoryview):
            raise StashError(f"bytes codec: expected bytes, got {type(value).__name__}")
        return json.dumps(base64.b64encode(bytes(value)).decode("ascii"))

    def decode(self, text: str) -> bytes:
        v = _loads(text, self.name)
        if not isinstance(v, str):
            raise StashError(f"bytes codec: stored value {text!r} is not a base64 string")
        try:
            return base64.b64decode(v, validate=True)
        except ValueError as e:
            raise StashError(f"bytes codec: stored value is not base64: {e}") from None

    def sort_key(self, value: bytes) -> Any:
        return bytes(value)


def _is_record_type(cls: Any) -> bool:
    """Dataclasses, msgspec Structs and ``typing.NamedTuple`` classes."""
    return isinstance(cls, type) and (
        dataclasses.is_dataclass(cls)
        or hasattr(cls, "__struct_fields__")
        or (issubclass(cls, tuple) and hasattr(cls, "_fields"))
    )


def _record_fields(cls: Any) -> tuple[str, ...]:
    return _plan(cls).fields


class _RecordPlan:
    """What decoding a record type needs, worked out once per type (:func:`_plan`): its
    fields, which of them have defaults, and one converter per field (``None`` where the
    decoded JSON is the field's value as is).

    Attributes:
        cls: the record type.
        fields: its field names in order.
        fieldset: the same as a frozenset (compared with a stored object's keys).
        required: the fields without a default (an old row must hold them).
        convs: ``(field, converter)`` of the fields whose JSON needs converting.
        read_from: the records of the type read from evolved rows, by ``id``: a weak
            reference, the stored text and the record's encoding then (see
            :meth:`RecordCodec.encode`).
    """

    __slots__ = ("cls", "fields", "fieldset", "required", "convs", "read_from")

    convs: tuple[tuple[str, Callable[[Any, str], Any]], ...]

    def __init__(self, cls: Any) -> None:
        self.cls = cls
        self.fields = _own_fields(cls)
        self.fieldset = frozenset(self.fields)
        self.required = frozenset(self.fields) - _defaulted(cls)
        self.convs = ()
        self.read_from: dict[int, tuple[weakref.ref[Any], str, str]] = {}

    def build(self, d: dict[str, Any], where: str) -> Any:
        """The record of the decoded JSON object ``d``: a field missing from ``d`` takes
        its default, a key of ``d`` that is no field is ignored (the additive evolution
        rule of :class:`RecordCodec`).

        Raises:
            StashError: ``d`` lacks a field that has no default, or the type's
                constructor refuses the values.
        """
        if d.keys() != self.fieldset:
            missing = self.required - d.keys()
            if missing:
                raise StashError(
                    f"{where} codec: stored object with fields {sorted(d)} lacks the "
                    f"fields {sorted(missing)} of {self.cls.__qualname__}, which have no "
                    "default; a field added without a default needs a migration "
                    "(TypedCollection.migrate)"
                )
            d = {f: d[f] for f in self.fields if f in d}
            _EVOLVED.n = getattr(_EVOLVED, "n", 0) + 1  # see RecordCodec.decode
        elif self.convs:
            d = dict(d)
        for f, conv in self.convs:
            if f in d:
                d[f] = conv(d[f], where)
        try:
            return self.cls(**d)
        except TypeError as e:
            raise StashError(f"{where} codec: {e}") from None


#: Per thread: how many stored objects were read with defaults or without unknown
#: fields (evolved rows, :meth:`_RecordPlan.build`); ``RecordCodec`` reads it around a
#: decode to know whether re-encoding the record would give another text.
_EVOLVED = threading.local()


def _evolved() -> int:
    return int(getattr(_EVOLVED, "n", 0))


_PLANS: dict[Any, _RecordPlan] = {}
_PLANS_LOCK = threading.RLock()  # reentrant: a plan makes the plans of its field types


def _plan(cls: Any) -> _RecordPlan:
    """The decoding plan of record type ``cls``, made on first use and kept (a type's
    fields and annotations are fixed once its class body ran): ``typing.get_type_hints``
    runs once per type, never per row."""
    plan = _PLANS.get(cls)
    if plan is not None:
        return plan
    with _PLANS_LOCK:
        plan = _PLANS.get(cls)
        if plan is None:
            plan = _RecordPlan(cls)
            # Registered before its converters are made, so a type that refers to itself
            # (a tree of records) finds its plan instead of recursing.
            _PLANS[cls] = plan
            hints = _type_hints(cls)
            convs = ((f, _converter(hints.get(f, Any))) for f in plan.fields)
            plan.convs = tuple((f, c) for f, c in convs if c is not None)
    return plan


def _own_fields(cls: Any) -> tuple[str, ...]:
    if dataclasses.is_dataclass(cls):
        return tuple(f.name for f in dataclasses.fields(cls))
    if hasattr(cls, "__struct_fields__"):
        return tuple(cls.__struct_fields__)
    return tuple(cls._fields)


def _defaulted(cls: Any) -> frozenset[str]:
    """The fields of record type ``cls`` that have a default."""
    if dataclasses.is_dataclass(cls):
        missing = dataclasses.MISSING
        return frozenset(
            f.name
            for f in dataclasses.fields(cls)
            if f.default is not missing or f.default_factory is not missing
        )
    if hasattr(cls, "__struct_fields__"):  # msgspec: defaults belong to the last fields
        n = len(getattr(cls, "__struct_defaults__", ()))
        return frozenset(cls.__struct_fields__[len(cls.__struct_fields__) - n :])
    return frozenset(getattr(cls, "_field_defaults", {}))


def to_json(value: Any) -> Any:
    """``value`` with records (dataclass, Struct, NamedTuple instances) turned into JSON
    objects of their fields and tuples into lists, recursively."""
    t = type(value)
    if t is str or t is int or t is float or t is bool or value is None:
        return value
    if _is_record_type(t):
        return {f: to_json(getattr(value, f)) for f in _record_fields(t)}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    return value


def _hashable(data: Any) -> Any:
    """JSON arrays as tuples, recursively (objects are left as dicts)."""
    if isinstance(data, list):
        return tuple(_hashable(v) for v in data)
    return data


_Conv = Callable[[Any, str], Any] | None


def _converter(hint: Any) -> _Conv:
    """The function rebuilding, from decoded JSON, the value type hint ``hint`` describes
    (records from objects, tuples from arrays, also inside lists, dicts and optional
    types), called as ``conv(data, where)``; ``None`` where the decoded JSON is the value
    as is.  Made once per hint (record types through their cached :func:`_plan`)."""
    if hint is Any or hint is None or isinstance(hint, str | typing.ForwardRef):
        return None  # unresolved annotation: keep the data as decoded
    if _is_record_type(hint):
        plan = _plan(hint)

        def record(data: Any, where: str) -> Any:
            return plan.build(data, where) if isinstance(data, dict) else data

        return record
    if hint is tuple:
        return lambda data, where: _hashable(data)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is tuple:
        return _tuple_converter(args)
    if origin is list and args:
        item = _converter(args[0])
        if item is None:
            return None
        return lambda data, where: (
            [item(v, where) for v in data] if isinstance(data, list) else data
        )
    if origin is dict and len(args) == 2:
        val = _converter(args[1])
        if val is None:
            return None
        return lambda data, where: (
            {k: val(v, where) for k, v in data.items()} if isinstance(data, dict) else data
        )
    if origin in (typing.Union, types.UnionType):
        # The first alternative that rebuilds the data's kind: a record from an object,
        # a tuple from an array.
        on_dict = next((_converter(a) for a in args if _is_record_type(a)), None)
        on_list = next(
            (_converter(a) for a in args if a is tuple or typing.get_origin(a) is tuple), None
        )
        if on_dict is None and on_list is None:
            return None

        def union(data: Any, where: str) -> Any:
            if on_dict is not None and isinstance(data, dict):
                return on_dict(data, where)
            if on_list is not None and isinstance(data, list):
                return on_list(data, where)
            return data

        return union
    return None


def _tuple_converter(args: tuple[Any, ...]) -> _Conv:
    if len(args) == 2 and args[1] is Ellipsis:
        item = _converter(args[0])

        def variadic(data: Any, where: str) -> Any:
            if not isinstance(data, list):
                return data
            if item is None:
                return tuple(data)
            return tuple([item(v, where) for v in data])

        return variadic
    items = [_converter(a) for a in args]

    def fixed(data: Any, where: str) -> Any:
        if not isinstance(data, list):
            return data
        if args and len(args) == len(data):
            return tuple(
                [v if c is None else c(v, where) for c, v in zip(items, data, strict=True)]
            )
        return _hashable(data)

    return fixed


def _type_hints(cls: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - unresolvable annotations: no conversion
        return {}


class CodecName(str):
    """A codec's recorded name that also equals, as a string, the names earlier releases
    recorded for the same codec (its ``aliases``), so a collection recorded under an
    old-style name keeps opening, and is checked, through the codec of today.  The stash
    compares recorded names with ``==``; ``str(name)`` (what is recorded for a new
    collection) is the name of today.  Hashes as the name of today only.
    """

    aliases: frozenset[str]

    def __new__(cls, name: str, aliases: Sequence[str] = ()) -> CodecName:
        self = super().__new__(cls, name)
        self.aliases = frozenset(str(a) for a in aliases)
        return self

    def __eq__(self, other: object) -> bool:
        same = str.__eq__(self, other)
        if same is NotImplemented:
            return NotImplemented
        return bool(same) or str(other) in self.aliases

    def __ne__(self, other: object) -> bool:
        same = self.__eq__(other)
        return same if same is NotImplemented else not same

    __hash__ = str.__hash__


_RECORD_NAME = re.compile(r"[^\s(),]{1,200}")


class RecordCodec(Generic[T]):
    """Typed records stored as JSON objects: dataclasses, msgspec Structs and
    ``typing.NamedTuple`` classes.

    Fields are encoded by name, so the database row is a readable JSON object.  A field
    holding a record, or annotated as a tuple, is decoded back to that type (so a frozen
    dataclass or a NamedTuple of scalars and tuples is hashable again after a round trip,
    and can be a key).

    **Identity.** The recorded name is ``record:NAME(f1,f2,...)``: ``NAME`` is the
    ``name`` argument, else the type's ``__stash_name__`` attribute, else its
    ``__qualname__`` (never its module: a type may move between modules), and the
    fields listed are those without a default, sorted.  A collection recorded under the
    name of earlier releases, ``record:module.Qualname``, opens with the codec of the
    same type (:class:`CodecName`).

    **Evolution without migration.** A stored object may lack fields that have a
    default (they take it) and may hold fields the type does not know (ignored).  So a
    type may gain fields with defaults and lose fields that had one, and old and new
    releases read each other's rows; such a change keeps the recorded name.  Any other
    change (a field without a default added or removed, a new ``NAME``) changes the
    name, so the collection opens only after ``TypedCollection.migrate``.  The codec
    work of a type (its fields, defaults and ``typing.get_type_hints``) is done once per
    type, not per row.

    Args:
        cls: the record type.
        name: the ``NAME`` above: 1 to 200 characters, none of them a space, a
            parenthesis or a comma.

    Raises:
        StashError: ``cls`` is no record type, or ``name`` breaks its rule; at
            ``encode``, the value is not an instance of the type; at ``decode``, the
            stored object lacks a field that has no default.
    """

    def __init__(self, cls: type[T], name: str | None = None) -> None:
        if not _is_record_type(cls):
            raise StashError(
                f"record codec: {cls!r} is not a dataclass, msgspec Struct or NamedTuple"
            )
        self.cls = cls
        self._plan = _plan(cls)
        base = name if name is not None else getattr(cls, "__stash_name__", None)
        base = cls.__qualname__ if base is None else base
        if not isinstance(base, str) or not _RECORD_NAME.fullmatch(base):
            raise StashError(
                f"record codec name {base!r} of {cls.__qualname__} must be 1 to 200 "
                "characters, none of them a space, a parenthesis or a comma"
            )
        self.record_name = base
        self.name = CodecName(
            f"record:{base}({','.join(sorted(self._plan.required))})",
            aliases=(f"record:{cls.__module__}.{cls.__qualname__}",),
        )
        self._fields: tuple[str, ...] = self._plan.fields
        # id(record) -> (weak reference, stored text, its encoding when read) of the
        # records of this type read from evolved rows (see encode), shared by every
        # codec of the type (a handle's codec may not be the one that read it).
        self._read_from = self._plan.read_from

    def _as_dict(self, value: T) -> dict[str, Any]:
        if not isinstance(value, self.cls):
            raise StashError(
                f"{self.name} codec: expected {self.cls.__qualname__}, got {type(value).__name__}"
            )
        return {f: to_json(getattr(value, f)) for f in self._fields}

    def encode(self, value: T) -> str:
        """Canonical JSON of the record's fields; a record decoded from an evolved row
        (read with defaults or without unknown fields) and unchanged since encodes as
        the stored text it was read from, so retracting it retracts what is stored."""
        text = canonical_json(self._as_dict(value))
        if self._read_from:
            hit = self._read_from.get(id(value))
            if hit is not None and hit[0]() is value and hit[2] == text:
                return hit[1]
        return text

    def _remember(self, obj: Any, text: str) -> None:
        """Remember that ``obj`` was read from the evolved row ``text``."""
        key = id(obj)
        try:
            ref = weakref.ref(obj, lambda _r: self._read_from.pop(key, None))
        except TypeError:  # not weakly referable (a NamedTuple): re-encoded instead
            return
        self._read_from[key] = (ref, text, canonical_json(self._as_dict(obj)))

    def _from_dict(self, d: dict[str, Any], text: str) -> T:
        before = _evolved()
        obj: T = self._plan.build(d, self.name)
        if _evolved() != before:
            self._remember(obj, text)
        return obj

    def decode(self, text: str) -> T:
        d = _loads(text, self.name)
        if not isinstance(d, dict):
            raise StashError(
                f"{self.name} codec: stored value {text[:200]!r} does not have "
                f"the fields {list(self._fields)}"
            )
        return self._from_dict(d, text)

    def decode_all(self, texts: Sequence[str]) -> list[T]:
        """``[self.decode(t) for t in texts]``, the JSON scanned in one pass first."""
        plan, name = self._plan, self.name
        cls, n, direct = plan.cls, len(plan.fields), not plan.convs
        out: list[T] = []
        app = out.append
        for text, d in zip(texts, _loads_all(texts, name), strict=True):
            if direct and type(d) is dict and len(d) == n:
                # The common row: as many keys as the type has fields, which the
                # constructor checks are its fields; any other row (a TypeError, an
                # evolved row) takes the checked path, which ignores unknown fields or
                # raises the error it always raises.
                try:
                    app(cls(**d))
                    continue
                except TypeError:
                    pass
            app(self._from_dict(d, text) if type(d) is dict else self.decode(text))
        return out

    def sort_key(self, value: T) -> Any:
        return json_sort_key(_normalize(self._as_dict(value)))


class TupleCodec:
    """Tuples (composite keys) stored as JSON arrays and decoded back to tuples.

    Items are JSON values; records inside are stored as objects, and nested arrays come
    back as tuples, so a tuple of scalars and tuples is hashable after a round trip (JSON
    objects inside come back as dicts).  Recorded name: ``tuple``.

    Raises:
        StashError: the value is not a tuple, or an item is not JSON.
    """

    name = "tuple"

    def encode(self, value: tuple[Any, ...]) -> str:
        if not isinstance(value, tuple):
            raise StashError(f"tuple codec: expected a tuple, got {type(value).__name__}")
        return canonical_json(to_json(value))

    def decode(self, text: str) -> tuple[Any, ...]:
        v = _loads(text, self.name)
        if not isinstance(v, list):
            raise StashError(f"tuple codec: stored value {text[:200]!r} is not an array")
        return _hashable(v)  # type: ignore[no-any-return]

    def sort_key(self, value: tuple[Any, ...]) -> Any:
        return json_sort_key(_normalize(to_json(value)))


class TypedTupleCodec(TupleCodec):
    """A tuple type with item types, e.g. ``tuple[str, Point]``: items are decoded to
    their annotated types (records, nested tuples).  Recorded as ``tuple`` like
    :class:`TupleCodec` (the stored JSON is the same)."""

    def __init__(self, hint: Any) -> None:
        self.hint = hint
        self._conv = _converter(hint)

    def decode(self, text: str) -> tuple[Any, ...]:
        v = _loads(text, self.name)
        if not isinstance(v, list):
            raise StashError(f"tuple codec: stored value {text[:200]!r} is not an array")
        out = v if self._conv is None else self._conv(v, self.name)
        return out if isinstance(out, tuple) else tuple(_hashable(out))


_BUILTIN: dict[str, Callable[[], Any]] = {
    "json": JsonCodec,
    "int": IntCodec,
    "str": StrCodec,
    "bytes": BytesCodec,
    "tuple": TupleCodec,
}

CodecLike = Any  # a Codec, a builtin codec name, or a record type


def resolve_codec(spec: CodecLike) -> Any:
    """Turn a codec spec into a codec: a codec instance, a builtin name (``"json"``,
    ``"int"``, ``"str"``, ``"bytes"``, ``"tuple"``), ``int``/``str``/``bytes``/``tuple``,
    a tuple type such as ``tuple[str, int]``, a dataclass, msgspec Struct or NamedTuple
    type, or a name recorded by earlier releases, ``record:module.Qualname``.

    Raises:
        StashError: unknown name or type.
    """
    if spec is None:
        return JsonCodec()
    if isinstance(spec, str):
        if spec in _BUILTIN:
            return _BUILTIN[spec]()
        if spec.startswith("record:") and spec.endswith(")"):
            raise StashError(
                f"record codec {spec!r} names no importable type: pass the record type "
                "(or a RecordCodec of it) as the codec"
            )
        if spec.startswith("record:"):
            module, _, qual = spec[len("record:") :].rpartition(".")
            try:
                obj: Any = importlib.import_module(module)
                for part in qual.split("."):
                    obj = getattr(obj, part)
            except (ImportError, AttributeError, ValueError):
                raise StashError(f"unknown record codec {spec!r}: cannot import it") from None
            return RecordCodec(obj)
        raise StashError(
            f"unknown codec {spec!r}; expected one of {sorted(_BUILTIN)}, "
            "a record type, or a codec object"
        )
    if spec is int:
        return IntCodec()
    if spec is str:
        return StrCodec()
    if spec is bytes:
        return BytesCodec()
    if spec is tuple:
        return TupleCodec()
    origin: Any = typing.get_origin(spec)
    if origin is tuple:
        return TypedTupleCodec(spec)
    if isinstance(spec, type):
        return RecordCodec(spec)
    if hasattr(spec, "encode") and hasattr(spec, "decode") and hasattr(spec, "name"):
        return spec
    raise StashError(f"cannot use {spec!r} as a codec")


#: Built-in codecs whose ``sort_key`` is the decoded value itself (ints, strs): their
#: decoded keys sort with ``<`` directly.  Exact types only: a subclass may override
#: ``sort_key``.
IDENTITY_SORT_CODECS: tuple[type, ...] = (IntCodec, StrCodec)


def decode_all(codec: Codec[Any], texts: Sequence[str]) -> list[Any]:
    """``[codec.decode(t) for t in texts]``: the same values and, for a bad text, an
    error of the same type, with per-text Python calls cut for the built-in JSON and
    int codecs (the bulk decode of ``peek_one``).  Which text an error names can differ
    from the one-by-one loop only in that the loop might have failed first on another
    text; callers that must name the first bad entry re-decode one by one on error.

    Raises:
        StashError: a text the codec cannot decode (as ``codec.decode`` raises).
    """
    t: type = type(codec)
    if t is JsonCodec:
        return _loads_all(texts, JsonCodec.name)
    if t is RecordCodec:
        return codec.decode_all(texts)  # type: ignore[attr-defined, no-any-return]
    if t is IntCodec:
        try:
            # IntCodec.decode tries int() first; a text int() refuses takes its slow path.
            return list(map(int, texts))
        except (TypeError, ValueError):
            pass
    return list(map(codec.decode, texts))
