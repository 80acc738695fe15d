"""Record codecs: dataclasses, msgspec Structs and ``typing.NamedTuple`` classes stored
as JSON objects of their fields, and the one rule by which a record that is (or is part
of) a collection's KEY is encoded.

Invariants kept here:

* a record type's codec work (fields, defaults, ``typing.get_type_hints``, the converters
  of its fields) is done once per type (:func:`_plan`), not per row;
* a record VALUE is encoded with every field (:func:`to_json`), and evolves additively:
  a stored object is read with defaults for the fields it lacks and without the fields
  the type does not know;
* a record KEY is encoded without the fields that hold their default
  (:func:`key_json`, the only definition of a key's JSON: every codec in the key role
  calls it, for records at any depth of a key, inside records, tuples, lists and dicts),
  so a key type that gains a field with a default encodes every key that was stored
  before as it was stored, and lookups, upserts and retractions keep finding them; a
  type without defaulted fields encodes its keys exactly as the value rule does, as
  every release before this one stored them;
* a key has at most two candidate texts (:func:`json_key_texts`, the one definition):
  the key rule's, and where it differs the text every release before it wrote (every
  field); every key path looks a key up under both;
* a record read from a stored text that its codec would encode otherwise (an evolved
  row, or a key stored with a field at its default by an earlier release) encodes as
  that stored text while it is unchanged, so retracting it retracts what is stored;
* composite keys come back as the hashable type they went in as: fields holding records
  or annotated as tuples decode to those types.

Source of the idea: the key rule is protobuf's proto3 rule (a field at its default is
not written, so adding a field keeps every stored message's bytes), as Materialize's
stash keys are protobuf messages (``src/stash/src/lib.rs``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
import threading
import types
import typing
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from stash.canonical import _loads, _loads_all, _normalize, canonical_json, json_sort_key
from stash.errors import StashError

T = TypeVar("T")

log = logging.getLogger(__name__)


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
        hints: the type's resolved annotations (``typing.get_type_hints``, once).
        read_from: the records of the type read from evolved rows, by ``id``: a weak
            reference, the stored text and the record's encoding then (see
            :meth:`RecordCodec.encode`).

    The key rule's part (:meth:`key_defaults`, :meth:`key_differs`) is worked out on
    the type's first use as a key, so a value type never runs its default factories.
    """

    __slots__ = (
        "cls",
        "fields",
        "fieldset",
        "required",
        "convs",
        "read_from",
        "_key_defaults",
        "_key_differs",
        "legacy_keys_seen",
        "hints",
    )

    convs: tuple[tuple[str, Callable[[Any, str], Any]], ...]

    def __init__(self, cls: Any) -> None:
        self.cls = cls
        self.fields = _own_fields(cls)
        self.fieldset = frozenset(self.fields)
        self.required = frozenset(self.fields) - _defaulted(cls)
        self.convs = ()
        self.read_from: dict[int, tuple[weakref.ref[Any], str, str]] = {}
        self._key_defaults: dict[str, Any] | None = None
        self._key_differs: bool | None = None
        self.legacy_keys_seen = False  # see RecordCodec._from_dict
        self.hints: dict[str, Any] = {}  # its resolved annotations (set by _plan)

    def key_defaults(self) -> dict[str, Any]:
        """``{field: its default as key JSON}`` of the fields whose default is one fixed
        JSON value: the fields :func:`key_json` leaves out while they hold it.  A field
        whose default is not JSON, or whose ``default_factory`` fails or gives two
        different values on two calls (a ``uuid4``), has none here: it is always
        written.  Worked out once per type."""
        got = self._key_defaults
        if got is None:
            with _PLANS_LOCK:
                got = self._key_defaults
                if got is None:
                    if self in _KEY_DEFAULTS_MAKING:
                        return {}  # a default holding the type itself: all fields written
                    _KEY_DEFAULTS_MAKING.add(self)
                    try:
                        # Published only once whole: another thread waits on the lock.
                        got = self._key_defaults = _key_defaults(self.cls)
                    finally:
                        _KEY_DEFAULTS_MAKING.discard(self)
        return got

    def key_differs(self) -> bool:
        """Whether a key of this type can encode otherwise than its value (every field
        written): some record type its fields are annotated with, at any depth, this
        one included, has a field with a default, or a field may hold any record (an
        ``Any``, ``object``, bare container or unresolved annotation: :func:`key_json`
        walks the values, not the hints).  When not, a decoded key re-encodes
        as the stored text it was read from unless the row evolved (unknown fields)."""
        got = self._key_differs
        if got is None:
            got = self._key_differs = _reaches_defaults(self.cls, set())
        return got

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
#: The plans whose key defaults the thread holding ``_PLANS_LOCK`` is making.
_KEY_DEFAULTS_MAKING: set[_RecordPlan] = set()


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
            hints = plan.hints = _type_hints(cls)
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


def _constant(value: Any) -> Callable[[], Any]:
    return lambda: value


def _default_makers(cls: Any) -> dict[str, Callable[[], Any]]:
    """``{field: a function giving its default}`` of the defaulted fields of ``cls``."""
    if dataclasses.is_dataclass(cls):
        out: dict[str, Callable[[], Any]] = {}
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[f.name] = _constant(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory
        return out
    if hasattr(cls, "__struct_fields__"):  # msgspec: defaults of the last fields
        names = cls.__struct_fields__
        defaults = tuple(getattr(cls, "__struct_defaults__", ()))
        out = {}
        for f, d in zip(names[len(names) - len(defaults) :], defaults, strict=True):
            factory = getattr(d, "factory", None) if type(d).__name__ == "Factory" else None
            out[f] = factory if callable(factory) else _constant(d)
        return out
    return {f: _constant(d) for f, d in getattr(cls, "_field_defaults", {}).items()}


def _key_defaults(cls: Any) -> dict[str, Any]:
    """See :meth:`_RecordPlan.key_defaults`."""
    out: dict[str, Any] = {}
    for f, make in _default_makers(cls).items():
        try:
            first = key_json(make())
            if canonical_json(first) != canonical_json(key_json(make())):
                continue  # a factory giving a new value per call: always written
        except Exception:  # noqa: BLE001 - not JSON, or the factory failed: always written
            continue
        out[f] = first
    return out


def _reaches_defaults(cls: Any, seen: set[Any]) -> bool:
    """Whether ``cls`` or a record type its fields are annotated with, at any depth, has
    a field with a default (see :meth:`_RecordPlan.key_differs`)."""
    if cls in seen:
        return False
    seen.add(cls)
    if _defaulted(cls):
        return True
    return any(_hint_reaches(h, seen) for h in _plan(cls).hints.values())


def _hint_reaches(hint: Any, seen: set[Any]) -> bool:
    if _is_record_type(hint):
        return _reaches_defaults(hint, seen)
    if hint is Any or hint is object or hint in (list, tuple, dict):
        return True  # may hold any record (key_json walks the values, not the hints)
    if isinstance(hint, str | typing.ForwardRef | typing.TypeVar):
        return True  # an annotation not resolved: as Any
    return any(_hint_reaches(a, seen) for a in typing.get_args(hint))


def same_json(a: Any, b: Any) -> bool:
    """Whether JSON values ``a`` and ``b`` have the same canonical text
    (:func:`stash.canonical.canonical_json`), without writing either: ``True`` is not
    ``1``, ``1.0`` is ``1``, tuples are lists, object keys compare as sets.  Values that
    are not JSON compare with ``==``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and bool(a) == bool(b)
    if a is None or b is None:
        return a is b
    if isinstance(a, int | float):
        return isinstance(b, int | float) and a == b
    if isinstance(a, str):
        return isinstance(b, str) and str.__eq__(a, b)
    if isinstance(a, list | tuple):
        return (
            isinstance(b, list | tuple)
            and len(a) == len(b)
            and all(same_json(x, y) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(same_json(v, b[k]) for k, v in a.items())
        )
    return bool(a == b)


def key_json(value: Any) -> Any:
    """``value`` as the JSON of a KEY: as :func:`to_json`, except that a record (at any
    depth: inside records, tuples, lists and dicts) is written without the fields that
    hold their default (:meth:`_RecordPlan.key_defaults`; "hold" by canonical JSON, so
    ``0.0`` holds a default ``0``).  The one definition of a key's JSON: every codec in
    the key role (:func:`stash.codec.resolve_key_codec`) and a table transaction's keys
    without a codec call it.  For a value holding no record with a defaulted field it
    equals :func:`to_json`, so such keys are stored exactly as earlier releases stored
    them."""
    t = type(value)
    if t is str or t is int or t is float or t is bool or value is None:
        return value
    if _is_record_type(t):
        return _key_object(value, _plan(t))
    if isinstance(value, list | tuple):
        return [key_json(v) for v in value]
    if isinstance(value, dict):
        return {k: key_json(v) for k, v in value.items()}
    return value


def _key_object(value: Any, plan: _RecordPlan) -> dict[str, Any]:
    defaults = plan.key_defaults()
    out: dict[str, Any] = {}
    for f in plan.fields:
        v = key_json(getattr(value, f))
        if defaults and f in defaults and same_json(v, defaults[f]):
            _OMITTED.n = getattr(_OMITTED, "n", 0) + 1
            continue
        out[f] = v
    return out


#: Per thread: how many fields :func:`key_json` left out (at their default); a key's
#: encoding that changed it has a second text whatever its type's annotations say (a
#: record in a field annotated ``Any`` or with a base class: the rule walks values).
_OMITTED = threading.local()


#: The types :func:`key_json` returns as they are (no record inside).
_SCALARS = frozenset({str, int, float, bool, type(None)})


def json_key_texts(value: Any) -> tuple[str, ...]:
    """The texts a KEY ``value`` may be stored under, the text of today first: its key
    rule text (:func:`key_json`) and, when it differs (a record with a field at its
    default), the text every release before the key rule wrote (:func:`to_json`, every
    field).  The one definition of a key's candidate texts: every codec in the key role
    (:meth:`RecordCodec.key_texts`, :meth:`stash.codec.TupleCodec.key_texts`) and a
    table transaction's keys without a codec call it, and every key path looks a key up
    under all of them (:func:`stash.codec.key_texts`)."""
    t = type(value)
    if (t is tuple or t is list) and all(type(v) in _SCALARS for v in value):
        return (canonical_json(value),)  # no record in it: one text, encoded once
    new = canonical_json(key_json(value))
    old = canonical_json(to_json(value))
    return (new,) if old == new else (new, old)


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

    **Keys.** In the key role (``key=True``, :meth:`as_key`; what
    :func:`stash.codec.resolve_key_codec` gives every path that encodes a collection's
    keys) a record is written without the fields that hold their default, at any depth
    (:func:`key_json`), as proto3 writes messages.  So ``KeyV1("a")`` and a ``KeyV2("a")``
    that gained ``region: str = ""`` are the same stored key: a key type may gain
    fields with defaults (an ``Optional`` field defaulting to ``None``, a
    ``default_factory`` of a fixed value such as ``list``) and every key stored before
    is still found, replaced and retracted.  A type with no defaulted field (at any
    depth) encodes its keys exactly as every release stored them.  The rules that
    follow from a default being part of the stored key:

    * changing a key field's default changes what its stored keys mean (a stored key
      without the field meant the old default): it is a change of identity the
      recorded name cannot show, so migrate, decoding with the old type and encoding
      with the new (``TypedCollection(name, Old, V).migrate(stash, New, V, fn)``);
    * dropping a defaulted field from a key type is safe only while no stored key holds
      it (every stored key had it at its default); otherwise migrate;
    * a field whose ``default_factory`` gives a new value per call (a ``uuid4``) or whose
      default is not JSON is always written: adding one to a key type needs a migration;
    * keys stored by releases before this rule (every field written, also those at
      their default) are found without a migration: every key path looks a key up under
      both of its texts (:meth:`key_texts`, :func:`stash.codec.key_texts`), retracts the
      one stored and writes by the rule; a key held under both is refused
      (:func:`stash.codec.duplicate_key_error`);
    * a key stored by such a release when the type had FEWER defaulted fields than
      today's holds some fields at their default and not others: neither text matches,
      a lookup misses it (reading one logs a warning, once per type); rewrite such a
      collection once with
      ``TypedCollection(name, K, V).migrate(stash, K, V, lambda k, v: (k, v))``.

    Args:
        cls: the record type.
        name: the ``NAME`` above: 1 to 200 characters, none of them a space, a
            parenthesis or a comma.
        key: the key role (see **Keys**); the recorded name is the same in both roles.

    Raises:
        StashError: ``cls`` is no record type, or ``name`` breaks its rule; at
            ``encode``, the value is not an instance of the type; at ``decode``, the
            stored object lacks a field that has no default.
    """

    def __init__(self, cls: type[T], name: str | None = None, *, key: bool = False) -> None:
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
        self.key = key
        # In the key role, whether a decoded key must be compared with its stored JSON
        # (see _from_dict); the type's default factories run on this first key use.
        self._key_check = key and self._plan.key_differs()
        if key:
            self._plan.key_defaults()

    def as_key(self) -> RecordCodec[T]:
        """This codec in the key role (see **Keys**): the same type, name and decoding."""
        if self.key:
            return self
        other = copy.copy(self)  # not __init__ again: a collection handle makes one each
        other.key = True
        other._key_check = self._plan.key_differs()
        self._plan.key_defaults()
        return other

    def _as_dict(self, value: T) -> dict[str, Any]:
        if not isinstance(value, self.cls):
            raise StashError(
                f"{self.name} codec: expected {self.cls.__qualname__}, got {type(value).__name__}"
            )
        if self.key:
            return _key_object(value, self._plan)
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

    def encode_new(self, value: T) -> str:
        """Canonical JSON of the record's fields by this codec's rule, never the stored
        text it was read from (what a migration writes: ``TypedCollection.migrate``)."""
        return canonical_json(self._as_dict(value))

    def key_texts(self, value: T) -> tuple[str, ...]:
        """The texts ``value`` may be stored under as a key (see :func:`json_key_texts`):
        :meth:`encode_new`'s first, then the full text of releases before the key rule
        if it differs, then the stored text ``value`` was read from if it is another
        (an evolved row).  In the value role: ``(encode(value),)``."""
        if not self.key:
            return (self.encode(value),)
        before = getattr(_OMITTED, "n", 0)
        new = canonical_json(self._as_dict(value))
        out: tuple[str, ...] = (new,)
        if self._key_check or getattr(_OMITTED, "n", 0) != before:
            old = canonical_json({f: to_json(getattr(value, f)) for f in self._fields})
            if old != new:
                out = (new, old)
        if self._read_from:
            hit = self._read_from.get(id(value))
            if hit is not None and hit[0]() is value and hit[2] == new and hit[1] not in out:
                out = (*out, hit[1])
        return out

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
        if self._key_check:
            # A key: its stored JSON may omit defaults (canonical) or, stored by an
            # earlier release, hold fields at their default (not): remember exactly the
            # keys whose encoding is not the stored JSON.
            if not same_json(self._as_dict(obj), d):
                self._remember(obj, text)
                if (
                    not self._plan.legacy_keys_seen
                    and d.keys() <= self._plan.fieldset
                    and not same_json(to_json(obj), d)
                ):
                    self._warn_legacy(d)
        elif _evolved() != before:
            self._remember(obj, text)
        return obj

    def _warn_legacy(self, d: dict[str, Any]) -> None:
        """Log, once per type, that a key is stored under a text that is neither of its
        candidate texts (:meth:`key_texts`): some fields at their default written and
        others not, as a release before the key rule wrote a key whose type had fewer
        defaulted fields then (or a hand-written key).  Point lookups miss such keys."""
        self._plan.legacy_keys_seen = True
        held = sorted(f for f in self._plan.key_defaults() if f in d)
        log.warning(
            "keys of %s are stored with some fields at their default (%s at the top "
            "level) but not all, as a release before keys omitted their defaults wrote "
            "them when the type had fewer fields: a lookup or upsert by key value misses "
            "such a key; rewrite the collection once with "
            "TypedCollection(name, K, V).migrate(stash, K, V, lambda k, v: (k, v))",
            self.name,
            ", ".join(held) or "in nested records",
        )

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
        # A key that may hold defaults is compared with its stored JSON (_from_dict).
        cls, n, direct = plan.cls, len(plan.fields), not plan.convs and not self._key_check
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
