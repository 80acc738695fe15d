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
* a codec has a KEY role (:func:`resolve_key_codec`, what every collection handle,
  ``upsert_key``, table transaction and migration encodes keys with): records in a key,
  at any depth, are written without the fields that hold their default
  (:func:`stash.record_codec.key_json`, the one definition), so a key type may gain a
  field with a default and every stored key is still found; in the value role every
  field is written.  A key type's defaults are part of its stored keys: changing one
  needs ``TypedCollection.migrate`` (see :class:`~stash.record_codec.RecordCodec`);
* a key's candidate texts (:func:`key_texts`, the one definition every key path calls)
  are the key rule's text and, where it differs, every field's (as releases before the
  key rule wrote keys): lookups probe both in one statement, writes retract the one
  stored and write the first; a key held under both is an error
  (:func:`duplicate_key_error`), never two entries silently;
* a record type may evolve additively (:class:`RecordCodec`): a stored object is read
  with defaults for the fields it lacks and without the fields the type does not know,
  so one value may have two stored encodings (before and after the change); a write
  that retracts a stored value retracts its stored text, never a re-encoding;
* the codec work of a record type (fields, defaults, ``typing.get_type_hints``, the
  converters of its fields) is done once per type (:mod:`stash.record_codec`), not per
  row;
* composite keys come back as the hashable type they went in as: the ``tuple`` codec
  decodes JSON arrays to tuples (nested ones too), and records (dataclasses, msgspec
  Structs, NamedTuples) decode fields holding records or annotated as tuples to those
  types, so a frozen record or NamedTuple key is hashable after a round trip;
* :func:`decode_all` (the bulk decode of ``peek_one``) returns exactly what one
  ``decode`` per text returns, and raises an error of the same type for a bad text.

Canonical JSON text itself lives in :mod:`stash.canonical`, record codecs in
:mod:`stash.record_codec`; both are re-exported here.  The database stores the
encodings: JSON text on SQLite, ``jsonb`` on Postgres, so the data is readable with
plain SQL.  Source of the idea: Materialize's ``Codec`` trait (``src/stash/src/lib.rs``
uses ``mz_persist_types::Codec``) with JSON as the wire format.
"""

from __future__ import annotations

import base64
import copy
import importlib
import json
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

from stash.canonical import (
    MAX_ENCODED_BYTES,
    MAX_JSON_DEPTH,
    _loads,
    _loads_all,
    _normalize,
    canonical_json,
    json_sort_key,
)
from stash.errors import StashError
from stash.record_codec import (
    CodecName,
    RecordCodec,
    _converter,
    _hashable,
    json_key_texts,
    key_json,
    same_json,
    to_json,
)

__all__ = [
    "IDENTITY_SORT_CODECS",
    "MAX_ENCODED_BYTES",
    "MAX_JSON_DEPTH",
    "BytesCodec",
    "Codec",
    "CodecLike",
    "CodecName",
    "IntCodec",
    "JsonCodec",
    "RecordCodec",
    "StrCodec",
    "TupleCodec",
    "TypedTupleCodec",
    "canonical_json",
    "decode_all",
    "duplicate_key_error",
    "json_sort_key",
    "json_key_texts",
    "key_json",
    "key_identity",
    "key_probe",
    "key_texts",
    "resolve_codec",
    "resolve_key_codec",
    "same_json",
    "to_json",
]

T = TypeVar("T")


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


class TupleCodec:
    """Tuples (composite keys) stored as JSON arrays and decoded back to tuples.

    Items are JSON values; records inside are stored as objects (in the key role without
    the fields at their default: :func:`~stash.record_codec.key_json`), and nested arrays
    come back as tuples, so a tuple of scalars and tuples is hashable after a round trip
    (JSON objects inside come back as dicts).  Recorded name: ``tuple``.

    Attributes:
        key: whether this codec encodes keys (see :meth:`as_key`).

    Raises:
        StashError: the value is not a tuple, or an item is not JSON.
    """

    name = "tuple"
    key = False

    def as_key(self) -> TupleCodec:
        """This codec in the key role (the same name and decoding; records inside are
        encoded by :func:`~stash.record_codec.key_json`)."""
        if self.key:
            return self
        other = copy.copy(self)
        other.key = True
        return other

    def _json(self, value: tuple[Any, ...]) -> Any:
        return key_json(value) if self.key else to_json(value)

    def encode(self, value: tuple[Any, ...]) -> str:
        if not isinstance(value, tuple):
            raise StashError(f"tuple codec: expected a tuple, got {type(value).__name__}")
        return canonical_json(self._json(value))

    def key_texts(self, value: tuple[Any, ...]) -> tuple[str, ...]:
        """The texts ``value`` may be stored under as a key, today's first
        (:func:`~stash.record_codec.json_key_texts`); in the value role ``(encode,)``."""
        if not self.key:
            return (self.encode(value),)
        if not isinstance(value, tuple):
            raise StashError(f"tuple codec: expected a tuple, got {type(value).__name__}")
        return json_key_texts(value)

    def decode(self, text: str) -> tuple[Any, ...]:
        v = _loads(text, self.name)
        if not isinstance(v, list):
            raise StashError(f"tuple codec: stored value {text[:200]!r} is not an array")
        return _hashable(v)  # type: ignore[no-any-return]

    def sort_key(self, value: tuple[Any, ...]) -> Any:
        return json_sort_key(_normalize(self._json(value)))


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


def resolve_key_codec(spec: CodecLike) -> Any:
    """The codec of a collection's KEYS for ``spec`` (as :func:`resolve_codec` reads it):
    a record or tuple codec in its key role, which writes records without the fields
    that hold their default (:func:`~stash.record_codec.key_json`); any other codec as
    :func:`resolve_codec` gives it (JSON, ints, strings and bytes hold no records).  The
    recorded name is the same in both roles.  Every path that encodes a key gets its
    codec here (collection handles, ``upsert_key``, table transactions, ``migrate``), so
    they all encode a key to the same text.

    Raises:
        StashError: as :func:`resolve_codec`.
    """
    if (
        isinstance(spec, type)
        and spec not in (int, str, bytes, tuple)
        and not typing.get_origin(spec)
    ):
        return RecordCodec(spec, key=True)  # made once in its role (a handle makes one each)
    codec = resolve_codec(spec)
    if type(codec) in (RecordCodec, TupleCodec, TypedTupleCodec):
        return codec.as_key()
    return codec


def key_texts(codec: Codec[Any], key: Any) -> tuple[str, ...]:
    """The texts ``key`` may be stored under in a collection whose key codec is
    ``codec`` (in its key role, :func:`resolve_key_codec`): first the text the key rule
    writes today (``codec.encode(key)`` but for a record read from a stored text), then,
    where it differs, the text every release before the key rule wrote (every field,
    also those at their default).  One text for a key holding no record with a field at
    its default, and for codecs without records (JSON, ints, strings, bytes).

    The one definition of a key's identity on the stash: every key path (``peek_key_one``,
    ``upsert_key``, ``upsert``, ``insert_without_overwrite``, table transactions,
    ``with_transaction``) looks a key up under all of these texts in one statement,
    retracts the text it finds stored, and writes new keys as the first.

    Raises:
        StashError: ``key`` does not encode with ``codec``.
    """
    texts = getattr(codec, "key_texts", None)
    if texts is None:
        return (codec.encode(key),)
    got: tuple[str, ...] = texts(key)
    return got


def duplicate_key_error(name: str, key: Any, texts: Iterable[str]) -> StashError:
    """The error of collection ``name`` holding ``key`` under two of its candidate
    texts (:func:`stash.codec.key_texts`): one stored with fields at their default by a
    release before keys omitted them, one written since (by hand, or by a release that
    missed it).  Every key path and ``peek_one`` raise it, committing nothing."""
    a, b = (t if len(t) <= 200 else t[:200] + "..." for t in sorted(texts)[:2])
    return StashError(
        f"duplicate key: collection {name!r} holds key {key!r} twice, as {a} and "
        f"{b} (fields at their default written, as releases before keys omitted "
        "them wrote them, and not): retract one of them (read both with peek())"
    )


def key_identity(codec: Codec[Any], key: Any) -> str:
    """``key_texts(codec, key)[0]`` without the other texts: the text the key rule
    writes ``key`` as today, which tells keys apart (never the stored text a record
    read from a row remembers, :meth:`RecordCodec.encode`)."""
    new = getattr(codec, "encode_new", None)
    return str(new(key)) if new is not None else str(codec.encode(key))


def key_probe(texts: tuple[str, ...]) -> str | tuple[str, ...]:
    """What a backend's ``peek_rows`` is given for a key's candidate ``texts``
    (:func:`key_texts`): the text itself when there is one (the one-key statement), else
    the tuple (one statement with the texts as an IN list)."""
    return texts[0] if len(texts) == 1 else texts


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
