"""The peek rules: what ``Stash.peek_one`` (and the read-modify-write helpers of
:mod:`stash.typed`) make of a collection's sealed rows, as plain functions of the rows.

The rows are those a backend returns for a peek, ``[(key_json, value_json, diff)]``,
consolidated: one row per ``(key, value)``, no zero diff.  Invariants kept here:

* a collection peeks as a map only when it holds each key (by its canonical encoding)
  once with multiplicity 1; otherwise the error names the collection and the first
  offending key (:func:`peek_unique`);
* :func:`peek_one_fast` answers only when every check of :func:`peek_one_checked` passes
  provably, and then with the same dict in the same order; otherwise the checked path
  runs and raises the error it always raised;
* keys that decode to lists (tuples written with the JSON codec) come back as tuples,
  recursively (:func:`frozen_key`), so they can be dict keys.

Source: Materialize's ``peek_one`` (``src/stash/src/lib.rs``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

from stash.codec import IDENTITY_SORT_CODECS, decode_all, duplicate_key_error, key_texts
from stash.collection import StashCollection
from stash.errors import StashError

K = TypeVar("K")
V = TypeVar("V")


def shown(encoded: str, limit: int = 200) -> str:
    """A stored key's text for a message: as stored, cut to ``limit`` characters."""
    return encoded if len(encoded) <= limit else encoded[:limit] + "..."


def first_repeat(items: Iterable[str]) -> str:
    """The first item equal to an earlier one (the caller knows there is one)."""
    seen: set[str] = set()
    for x in items:
        if x in seen:
            return x
        seen.add(x)
    raise AssertionError("no repeated item")  # pragma: no cover


def frozen_key(k: Any) -> Any:
    """A key as ``peek_one`` returns it: a JSON array (a tuple written with the default
    JSON codec) becomes a tuple, recursively, so it can be a dict key."""
    if isinstance(k, list):
        return tuple(frozen_key(x) for x in k)
    return k


def key_entry(
    collection: StashCollection[Any, Any],
    key: Any,
    rows: list[tuple[str, str, int]],
    where: str = "",
) -> tuple[str, str] | None:
    """``(stored key text, value text)`` of ``key`` among ``rows``, the sealed rows of
    its candidate texts (a probe of :func:`stash.codec.key_texts`), or ``None``.

    Raises:
        StashError: the key is held under two texts (:func:`duplicate_key_error`); it
            holds several values or a multiplicity other than 1 (``multiple values
            unexpected`` and ``where``).
    """
    if not rows:
        return None
    texts = {k for k, _, _ in rows}
    if len(texts) > 1:
        raise duplicate_key_error(collection.name, key, texts)
    if len(rows) > 1 or rows[0][2] != 1:
        raise StashError(f"multiple values unexpected{where}")
    return rows[0][0], rows[0][1]


def peek_unique(
    collection: StashCollection[K, V], rows: list[tuple[str, str, int]]
) -> list[tuple[str, K, V]]:
    """The sealed contents (``rows`` as ``Stash._peek_raw`` returns them) as
    ``[(key_json, key, value)]`` in key order, checked to hold each key (by its canonical
    encoding) once with multiplicity 1.

    Raises:
        StashError: ``unexpected peek multiplicity`` (naming the collection, the
            first such key and its multiplicity), or a key with two values (naming
            the collection and the key).
    """
    kc, vc = collection.key_codec, collection.value_codec
    bad = next(((k, d) for k, _, d in rows if d != 1), None)
    if bad is not None:
        raise StashError(
            f"unexpected peek multiplicity: collection {collection.name!r} holds key "
            f"{shown(bad[0])} with multiplicity {bad[1]}, and each key must be held "
            "once with multiplicity 1 — was the same update written twice? Retract "
            "the extra one, or read the collection with peek()"
        )
    if len({k for k, _, _ in rows}) != len(rows):
        dup = first_repeat(k for k, _, _ in rows)
        raise StashError(
            f"duplicate peek keys: collection {collection.name!r} holds key "
            f"{shown(dup)} with two values — retract one of them, or read the "
            "collection with peek()"
        )
    kd, vd = kc.decode, vc.decode
    out = [(k, kd(k), vd(v)) for k, v, _ in rows]
    sk = kc.sort_key
    out.sort(key=lambda e: sk(e[1]))
    return out


def peek_one_fast(
    collection: StashCollection[K, V], rows: list[tuple[str, str, int]]
) -> dict[K, V] | None:
    """``Stash.peek_one`` of ``rows`` (consolidated by the backend: one row per
    ``(key, value)``, no zero diff) in whole-column passes, or ``None`` when the
    rows need :func:`peek_one_checked` (which then raises, or turns list keys into
    tuples).

    The fast path returns only when every check of the checked path passes
    provably: every diff is 1, the key texts are distinct, no decoded key is a
    list, the decoded keys are hashable and pairwise unequal in Python (the dict
    holds as many entries as there are rows), and decoding and sorting raised
    nothing.  It then returns the same dict in the same order: entries sorted by the
    key codec's ``sort_key``, ties in the backend's row order (both sorts are
    stable).  Any failure falls back to the checked path, which raises the error it
    always raised, so errors are unchanged.
    """
    n = len(rows)
    if n == 0:
        return {}
    ks, vs, ds = zip(*rows, strict=True)
    if ds.count(1) != n or len(set(ks)) != n:
        return None
    kc, vc = collection.key_codec, collection.value_codec
    try:
        keys = decode_all(kc, ks)
        if list in set(map(type, keys)):
            return None
        held = dict(zip(keys, decode_all(vc, vs), strict=True))
        if len(held) != n:
            return None
        # Sorting the keys alone and looking each value up is about three times
        # faster than sorting the (key, value) items.
        order = sorted(held) if type(kc) in IDENTITY_SORT_CODECS else sorted(held, key=kc.sort_key)
        return {k: held[k] for k in order}
    except Exception:  # the checked path raises the error it always raised
        return None


def peek_one_checked(
    collection: StashCollection[K, V], rows: list[tuple[str, str, int]]
) -> dict[K, V]:
    """``Stash.peek_one`` of ``rows`` one entry at a time, with every check and its
    error (the reference the fast path is tested against)."""
    uniq = peek_unique(collection, rows)
    res: dict[K, V] = {}
    for _, k0, v in uniq:
        k = frozen_key(k0) if type(k0) is list else k0
        try:
            res[k] = v
        except TypeError:
            raise StashError(
                f"peek_one needs hashable keys, but collection {collection.name} has a "
                f"{type(k).__name__} key; use key=tuple (the tuple codec) or a frozen "
                "record type for composite keys, or peek()"
            ) from None
    if len(res) != len(uniq):
        # Keys are distinct by their encodings, so two of them are equal in Python
        # (True and 1): name the first such pair.
        held: dict[K, tuple[K, str]] = {}
        kc = collection.key_codec
        for kj, k0, _v in uniq:
            k = frozen_key(k0)
            if k in held:
                hk, hj = held[k]
                if type(hk) is type(k0) and key_texts(kc, hk)[0] == key_texts(kc, k0)[0]:
                    raise duplicate_key_error(collection.name, k0, (hj, kj))
                raise StashError(
                    f"peek_one: keys {hk!r} and {k!r} of collection "
                    f"{collection.name} are distinct stash keys but equal in Python, so "
                    "one dict cannot hold both; use peek()"
                )
            held[k] = (k0, kj)
    return res
