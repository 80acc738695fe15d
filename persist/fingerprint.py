"""What an idempotency token names: one append exactly.

An append records its idempotency token in the shard state together with a
*fingerprint* of the append (``token + TOKEN_SEP + fingerprint``, see
:data:`persist.state.TOKEN_SEP`, in :mod:`persist.landed`'s records).  A later call
passing the same token is taken as a retry of that append only if its own fingerprint
is equal; a token reused on any other append is refused (:func:`check_same_append`),
also by the commit of an append that raced the one recording it, so a retry is never
acknowledged for rows that were not written.

The fingerprint names the append's bounds (``expected_upper``, ``new_upper``) and its
contents, as a 128-bit digest (hex) after a one-letter version:

* ``compare_and_append``: the updates as given (normalized to the shard's schema, in
  the given row order), by their values (:func:`_hash_column`): each column's name,
  type, validity and the bytes of its non-null values, never the bytes of the Arrow
  buffers as they lie, which are not a function of the values (a sliced array keeps
  its parent's bits and offsets, the bytes under a null slot are undefined).  So
  chunking, slicing and whatever lies under null slots do not change it; all NaNs are
  one value (as to consolidation), ``-0.0`` is not ``0.0`` (a filter tells them
  apart); a retry must pass the same updates in the same order;
  ``X``: the values hashed by XXH3-128 (``xxhash``'s ``xxh3_128``), written now; ``V``:
  the same values hashed by SHA-256 (its first 128 bits), written before.  A retry
  whose record is a ``V`` is checked by computing its own ``V`` fingerprint
  (:func:`check_same_append`'s ``earlier``), so appends recorded before the change of
  hash are still recognised, and a token reused on other updates still refused;
* ``compare_and_append_batch``: ``B``, each batch's description and rewrite frontier,
  and each of its parts' blob key (or ``inline``), row count, encoded size and SHA-256
  checksum, hashed by SHA-256.

Why XXH3 for the updates: fingerprinting a large append by SHA-256 cost half as much
CPU as encoding its parts (47 ms against 92 ms for a 336,776-row flights append, 61 MB
in Arrow); by XXH3-128 it costs ~7 ms, most of it reading the columns (the hash itself
is a thirteenth of SHA-256's).  It is not a cryptographic hash, and need not be: the fingerprint tells one caller's appends apart for that caller's own tokens
(a caller that crafted two colliding appends would only fool its own retry), and 128
bits make an accidental collision of two appends under one token negligible.

Forms recorded by earlier versions (the token alone, ``r<rows>d<diff sum>``,
``b<digest of checksums>``) named at most an append's shape, and ``U<digest>`` named
the Arrow IPC bytes of the updates (not a function of their values); a retry against
one of them cannot be checked and is refused, naming that (nothing is written).  Transactions record
``t<ts>``.

Source of the idea: persist-client's ``WriterState`` (``internal/state.rs``) records a
writer's most recent idempotency token together with that write's upper
(``most_recent_write_token``, ``most_recent_write_upper``), and its
``compare_and_append`` takes a retry by the token only at that upper; here the
contents are named too, and the shard keeps the records (:mod:`persist.landed`).
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import pyarrow as pa
import xxhash

from persist.errors import InvalidUsage
from persist.lease_state import TOKEN_SEP
from stash import Antichain

if TYPE_CHECKING:
    from persist.batch import Batch

__all__ = ["batches_fingerprint", "check_same_append", "updates_fingerprint"]

#: Prefixes of the fingerprints recorded here: updates (XXH3-128), batches.
UPDATES, BATCHES = "X", "B"
#: Prefix of the updates fingerprints recorded before (SHA-256 of the same values):
#: never recorded any more, computed to check a retry against such a record.
UPDATES_SHA256 = "V"
#: Prefixes of the fingerprints of earlier versions: shape only (``r``, ``b``), or
#: the IPC bytes of the updates (``U``).
_LEGACY = ("r", "b", "U")


class _Hash(Protocol):
    """What :func:`updates_fingerprint` needs of a hash object (``hashlib``'s and
    ``xxhash``'s have it)."""

    def update(self, data: bytes | memoryview | pa.Buffer, /) -> None: ...

    def hexdigest(self) -> str: ...


#: The hash of each version of the updates fingerprint, by its prefix.
_UPDATES_HASHES: dict[str, Callable[[bytes], _Hash]] = {
    UPDATES: xxhash.xxh3_128,
    UPDATES_SHA256: hashlib.sha256,
}


def _bounds(expected: Antichain, new: Antichain) -> bytes:
    return repr((expected.to_json(), new.to_json())).encode()


def updates_fingerprint(
    expected: Antichain, new: Antichain, table: pa.Table, version: str = UPDATES
) -> str:
    """The fingerprint of ``compare_and_append(table, expected, new)``: ``version``
    (``"X"``, or ``"V"`` as recorded before) and 32 hex digits (see the module
    docstring).  ``table`` is the normalized updates table (its columns of the types
    :func:`persist.updates.is_supported_type` accepts, no dictionaries); equal tables
    (``a.equals(b)``, NaN equal to NaN) have equal fingerprints, whatever their chunks,
    offsets or bytes under null slots.

    ``partial(updates_fingerprint, expected, new, table)`` is what
    :func:`check_same_append` takes as ``earlier``.

    Raises:
        TypeError: a column of a type a shard does not hold (nested, dictionary).
        ValueError: ``version`` is not a version of the updates fingerprint.
    """
    try:
        make = _UPDATES_HASHES[version]
    except KeyError:
        raise ValueError(
            f"no updates fingerprint of version {version!r} (known: {sorted(_UPDATES_HASHES)})"
        ) from None
    h = make(_bounds(expected, new))
    h.update(b"%d;" % table.num_rows)
    if table.num_rows:
        # The columns' names and types (not the schema's metadata).
        text, kinds = _schema_text(table.schema)
        h.update(text)
        # One chunk a column (no copy when there is one already); the offsets of its
        # arrays are read, not assumed zero.
        batches = table.to_batches()
        if len(batches) != 1:
            batches = table.combine_chunks().to_batches()
        for column, kind in zip(batches[0].columns, kinds, strict=True):
            _hash_column(h, column, kind)
    return version + h.hexdigest()[:32]


#: The schema :func:`_schema_text` saw last, its text and kinds (replaced whole, never
#: mutated: threads).
_LAST_SCHEMA: tuple[pa.Schema, bytes, tuple[tuple[int, int], ...]] | None = None


def _schema_text(schema: pa.Schema) -> tuple[bytes, tuple[tuple[int, int], ...]]:
    """The names and types of ``schema`` as printed (UTF-8) and its
    :func:`_schema_kinds`; those of the last schema seen when ``schema`` equals it
    (names, types and nullability, what the text prints: ``Schema.equals`` costs a
    fortieth of printing it)."""
    global _LAST_SCHEMA
    last = _LAST_SCHEMA
    if last is not None and last[0].equals(schema):
        return last[1], last[2]
    text: str = schema.to_string(show_field_metadata=False, show_schema_metadata=False)
    kinds = _schema_kinds(text, schema)
    _LAST_SCHEMA = (schema, text.encode(), kinds)
    return _LAST_SCHEMA[1], kinds


#: :func:`_schema_kinds` by the schema's text (names and types), with the schema it was
#: made for: a writer fingerprints tables of one schema over and over.  Replaced whole,
#: never mutated (threads).
_KINDS: dict[str, tuple[pa.Schema, tuple[tuple[int, int], ...]]] = {}
_KINDS_KEPT = 64


def _schema_kinds(text: str, schema: pa.Schema) -> tuple[tuple[int, int], ...]:
    """``(kind, byte width)`` of each column of ``schema`` (``text``: its names and
    types as printed), the width ``0`` when the kind reads no fixed width.

    Found by ``text`` and taken only for a schema equal to the one it was made for
    (``Schema.equals``, a fraction of a microsecond): names are data, so two schemas
    of different types can print the same text (a name holding a newline and
    ``": "``), and the kinds of one would misread the other's columns.

    Raises:
        TypeError: a column of a type a shard does not hold.
    """
    global _KINDS
    seen = _KINDS.get(text)
    if seen is not None and seen[0].equals(schema):
        return seen[1]
    got = tuple(
        (k, t.byte_width if k in (_FIXED, _FLOAT) else 0) for t in schema.types for k in (_kind(t),)
    )
    _KINDS = {**(_KINDS if len(_KINDS) < _KINDS_KEPT else {}), text: (schema, got)}
    return got


# How :func:`_hash_column` reads the values of a type.
_BOOL, _VAR32, _VAR64, _FIXED, _FLOAT = range(5)


@functools.lru_cache(maxsize=256)
def _kind(t: pa.DataType) -> int:
    """How the values of ``t`` are read (``_BOOL`` ... ``_FLOAT``).

    Raises:
        TypeError: a type a shard does not hold.
    """
    if pa.types.is_boolean(t):
        return _BOOL
    if pa.types.is_string(t) or pa.types.is_binary(t):
        return _VAR32
    if pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        return _VAR64
    if pa.types.is_floating(t):
        return _FLOAT
    if (
        pa.types.is_integer(t)
        or pa.types.is_temporal(t)
        or pa.types.is_decimal(t)
        or pa.types.is_fixed_size_binary(t)
    ):
        return _FIXED
    raise TypeError(f"no fingerprint of a column of type {t} (not a type a shard holds)")


def _hash_column(h: _Hash, arr: pa.Array, kind_width: tuple[int, int] | None = None) -> None:
    """Feed ``h`` the values of ``arr``: its validity (one byte a row, when it has
    nulls), then its non-null values: fixed-width ones as their bytes (floats with
    every NaN as the one NaN), booleans one byte each, strings and binaries as their
    lengths and bytes.  Only the slots of the array are read: never its parent's
    bits, nor the bytes under a null slot (the array is compacted by
    ``pyarrow.compute.drop_null``). ``kind_width``: the column's
    :func:`_schema_kinds` entry (looked up when not given)."""
    if kind_width is None:
        t = arr.type
        kind = _kind(t)
        w = t.byte_width if kind in (_FIXED, _FLOAT) else 0
    else:
        kind, w = kind_width
    if arr.null_count:
        h.update(b"N")
        h.update(_validity_bytes(arr))
        arr = arr.drop_null()
    else:
        h.update(b"A")
    if kind == _BOOL:
        h.update(arr.to_numpy(zero_copy_only=False).tobytes())
    elif kind == _VAR32:
        _hash_var_width(h, arr, np.int32)
    elif kind == _VAR64:
        _hash_var_width(h, arr, np.int64)
    else:
        n = len(arr)
        data = arr.buffers()[1]
        if data is None or not n:
            return
        raw = data.slice(arr.offset * w, n * w)
        if kind == _FLOAT and _has_nan(raw, w, n):
            values = np.frombuffer(raw, np.dtype(f"f{w}"))
            raw = np.where(np.isnan(values), np.nan, values).astype(values.dtype).tobytes()
        h.update(raw)


def _validity_bytes(arr: pa.Array) -> bytes:
    """One byte a slot of ``arr`` (which has nulls, so a validity bitmap): 1 valid, 0
    null; the bytes of ``pyarrow.compute.is_valid(arr)`` as a numpy bool array, unpacked from the
    bitmap by numpy (a sixteenth of the time for 336,776 rows)."""
    bitmap = arr.buffers()[0]
    assert bitmap is not None  # an array with nulls has a validity bitmap
    off, n = arr.offset, len(arr)
    first = off // 8
    raw = np.frombuffer(bitmap, np.uint8, count=(off + n + 7) // 8 - first, offset=first)
    bits = np.unpackbits(raw, bitorder="little")
    return bits[off % 8 : off % 8 + n].tobytes()


#: Up to this many values, NaNs are looked for in Python (cheaper than numpy's calls).
_FEW = 16
#: Native-order ``struct`` formats of ``n`` 32- or 64-bit integers (``array``'s and
#: numpy's byte order), by letter and ``n <= _FEW + 1``.
_STRUCTS = {c: [struct.Struct(f"={n}{c}") for n in range(_FEW + 2)] for c in "iq"}


def _has_nan(raw: pa.Buffer, width: int, n: int) -> bool:
    """Whether the ``n`` floats of ``width`` bytes in ``raw`` hold a NaN."""
    if n <= _FEW and width in (4, 8):
        values = memoryview(raw).cast("f" if width == 4 else "d")
        if n == 1:
            return bool(values[0] != values[0])
        return any(x != x for x in values)
    return bool(np.isnan(np.frombuffer(raw, np.dtype(f"f{width}"))).any())


def batches_fingerprint(expected: Antichain, new: Antichain, batches: Sequence[Batch]) -> str:
    """The fingerprint of ``compare_and_append_batch(batches, expected, new)``: ``"B"``
    and 32 hex digits (see the module docstring).  Two decodings of one transmitted
    batch have equal fingerprints."""
    h = hashlib.sha256(_bounds(expected, new))
    for b in batches:
        f = b.rewrite_frontier
        h.update(repr((b.hollow.desc.to_json(), None if f is None else f.to_json())).encode())
        for p in b.hollow.parts:
            h.update(repr((p.key or "inline", p.rows, p.encoded_size_bytes, p.checksum)).encode())
    return BATCHES + h.hexdigest()[:32]


def _hash_var_width(h: _Hash, arr: pa.Array, width: type[np.signedinteger]) -> None:
    """Feed ``h`` the lengths and bytes of the values of a string or binary ``arr``
    without nulls (``width``: its offsets' integer type), read from its own slots."""
    n, off = len(arr), arr.offset
    if not n:
        return
    _, offsets, data = arr.buffers()
    if n <= _FEW:  # the same bytes, without numpy's calls
        size = 4 if width is np.int32 else 8
        own = _STRUCTS["i" if size == 4 else "q"][n + 1].unpack_from(offsets, off * size)
        first, last = own[0], own[-1]
        h.update(_STRUCTS["q"][n + 1].pack(*[e - first for e in own]))
        if data is not None and last > first:
            h.update(data.slice(first, last - first))
        return
    ends = np.frombuffer(offsets, width)[off : off + n + 1].astype(np.int64)
    h.update((ends - ends[0]).tobytes())
    if data is not None and ends[-1] > ends[0]:
        h.update(data.slice(int(ends[0]), int(ends[-1] - ends[0])))


def check_same_append(
    entry: str,
    token: str,
    fingerprint: str,
    earlier: Callable[[str], str] | None = None,
) -> None:
    """A caller's token that landed (recorded as ``entry``) must name *this* append
    (``fingerprint``), else acknowledging it would claim rows that were never written.

    ``earlier``: for an append of updates, this append's fingerprint in another
    version, by the version's prefix (``partial(updates_fingerprint, expected, new,
    table)``): a record of the ``V`` version (made before the ``X`` one) is compared
    with this append's own ``V`` fingerprint, computed only then.

    Raises:
        InvalidUsage: the token was used by a different append, or recorded by an
            earlier version that did not record what it names (nothing is written).
    """
    _, sep, recorded = entry.partition(TOKEN_SEP)
    if sep and recorded == fingerprint:
        return
    version = recorded[:1]
    if (
        sep
        and earlier is not None
        and version != fingerprint[:1]
        and version in _UPDATES_HASHES
        and fingerprint[:1] in _UPDATES_HASHES
        and earlier(version) == recorded
    ):
        return  # recorded by the other version of the updates fingerprint
    if not sep or recorded[:1] in _LEGACY:
        raise InvalidUsage(
            f"idempotency_token {token!r} was recorded by an earlier version of persist "
            "that did not record which append it names, so whether it is this append "
            "cannot be told: nothing was written; read the shard to see whether its "
            "updates are there"
        )
    raise InvalidUsage(
        f"idempotency_token {token!r} names a different append that already landed "
        "(other bounds, updates or batches); a token may only retry the append it was "
        "given for: nothing was written"
    )
