"""Key ranges of one collection: ``Stash.peek_range``, a page of sealed entries in key
order, read through the key index of each backend.

A range is given as keys (encoded with the collection's key codec) and compared as the
keys' stored JSON texts, in code point order: that is the order of the
``(collection_id, key)`` index on SQLite, and of the ``(collection_id, left(key::text,
1024) COLLATE "C")`` index on Postgres (``migrations/versions/0004_key_text_index.py``;
Postgres renders arrays with ``", "``, so bounds are rendered the same way there, and
strings and integers render as their canonical text).  So strings (and tuples of
strings) are in string order, and numbers are compared as text: range over string or
tuple keys.  Invariants kept here:

* a page holds at most ``limit`` entries, each key with its one sealed value (a key with
  several values or a multiplicity other than 1 raises, as ``peek_one`` does), all read
  at one time in one read transaction, in key order; ``next_after`` (the page's last
  key) given as ``after`` reads the next page, and ``more`` says whether there is one;
* rows are fetched in key order a bounded batch at a time and consolidated per key
  (a key's rows are adjacent in that order), so a page costs ``O(limit + its keys'
  history)``, not ``O(collection)``, on SQLite and Postgres; the memory backend (and
  ``Memory(inner)``'s cache) filters its rows in Python;
* a read at a time below the since (compacted away) or at or beyond the upper (not
  sealed) raises: its entries would not be those of that time.

Source of the idea: etcd's range requests (``key``, ``range_end``, ``limit``, ``more``)
and the key-granular reads Materialize's stash does through its ``(collection_id, key)``
index.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from stash.antichain import Antichain
from stash.collection import StashCollection
from stash.errors import StashError
from stash.txn import Txn

K = TypeVar("K")
V = TypeVar("V")

__all__ = ["KeyRange", "RangePage", "key_range", "peek_range", "read_range"]

#: Characters of a key's text the Postgres index holds (a btree entry holds at most
#: 2704 bytes; longer keys are ordered by their whole text after this prefix).
PG_INDEXED_CHARS = 1024
#: Rows fetched per statement while a page fills.
BATCH_ROWS = 512


@dataclass(frozen=True)
class RangePage(Generic[K, V]):
    """One page of :meth:`stash.base.Stash.peek_range`.

    Attributes:
        entries: ``[(key, value)]`` in key order (at most ``limit``).
        time: the time the page was read at (``upper - 1`` unless ``at`` was given).
        more: whether keys of the range follow the page.
        next_after: the last key of the page, to pass as ``after`` for the next page
            (``None`` for an empty page).
    """

    entries: list[tuple[K, V]]
    time: int
    more: bool
    next_after: K | None


@dataclass(frozen=True)
class KeyRange:
    """Bounds on stored key texts: ``lo`` (inclusive unless ``lo_open``), ``hi``
    (exclusive unless ``hi_closed``), and a text prefix ``starts`` (or the one text
    ``exact``) a key must have.  Texts are canonical; :meth:`for_postgres` renders them
    as Postgres renders ``jsonb``."""

    lo: str | None = None
    lo_open: bool = False
    hi: str | None = None
    hi_closed: bool = False
    starts: str | None = None
    exact: str | None = None

    def admits(self, k: str) -> bool:
        """Whether key text ``k`` is in the range."""
        if self.lo is not None and (k < self.lo or (self.lo_open and k == self.lo)):
            return False
        if self.hi is not None and (k > self.hi or (not self.hi_closed and k == self.hi)):
            return False
        return self.starts is None or k.startswith(self.starts) or k == self.exact

    def for_postgres(self) -> KeyRange:
        """The same range over texts as Postgres renders ``jsonb`` (``", "`` and
        ``": "`` separators, object keys by length then bytes)."""
        return KeyRange(
            _pg(self.lo),
            self.lo_open,
            _pg(self.hi),
            self.hi_closed,
            None if self.starts is None else _pg(self.starts),
            _pg(self.exact),
        )


def _pg_render(v: Any) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_pg_render(x) for x in v) + "]"
    if isinstance(v, dict):
        order = sorted(v, key=lambda k: (len(k.encode()), k.encode()))
        return "{" + ", ".join(f"{_pg_render(k)}: {_pg_render(v[k])}" for k in order) + "}"
    return json.dumps(v, ensure_ascii=False)


def _pg(text: str | None) -> str | None:
    if text is None or text[0] not in "[{":
        return text  # strings, numbers, literals: rendered alike
    if text.endswith(",") or text == "[":
        return _pg_prefix(text)  # a tuple prefix's bound
    return _pg_render(json.loads(text))


def _pg_prefix(starts: str) -> str:
    if starts.startswith("[") and starts.endswith(","):  # a tuple prefix "[a,b,"
        return _pg_render(json.loads(starts[:-1] + "]"))[:-1] + ", "
    return starts  # "[" or a string prefix '"abc': rendered alike


def key_range(
    collection: StashCollection[Any, Any],
    lower: Any = None,
    upper: Any = None,
    prefix: Any = None,
    after: Any = None,
    *,
    legacy: bool = False,
    stored: Mapping[str, str] | None = None,
) -> KeyRange:
    """The :class:`KeyRange` of ``peek_range``'s arguments: keys ``>= lower``, ``<
    upper``, ``> after`` (each encoded with the collection's key codec; ``stored``:
    ``{"lower"|"upper"|"after": the text that bound is stored under}``, where known,
    :func:`stored_texts`), and starting with ``prefix``: a
    ``str`` (string keys starting with it) or a tuple (array keys whose first items are
    its items; ``legacy``: as releases before the key rule wrote it, every field of a
    record in it written, see :func:`prefix_texts`).

    Raises:
        StashError: a bound does not encode with the key codec; ``prefix`` is neither a
            str nor a tuple (or does not encode as JSON).
    """
    kc = collection.key_codec
    known = stored or {}
    lows: list[tuple[str, bool]] = []
    highs: list[tuple[str, bool]] = []
    if lower is not None:
        lows.append((known.get("lower") or kc.encode(lower), False))
    if after is not None:
        lows.append((known.get("after") or kc.encode(after), True))
    if upper is not None:
        highs.append((known.get("upper") or kc.encode(upper), False))
    starts = exact = None
    if prefix is not None:
        starts, exact = _prefix(prefix, legacy)
        lows.append((starts, False))
        if exact is not None:
            highs.append((exact, True))
        else:
            highs.append((starts[:-1] + chr(ord(starts[-1]) + 1), False))
    # The tightest bounds; at equal texts an open bound is the tighter one.
    lo = max(lows, key=lambda b: (b[0], b[1]), default=(None, False))
    hi = min(highs, key=lambda b: (b[0], b[1]), default=(None, False))
    return KeyRange(lo[0], lo[1], hi[0], hi[1], starts, exact)


def prefix_texts(prefix: Any) -> int:
    """How many texts keys starting with ``prefix`` may be stored under: 2 for a tuple
    holding a record with a field at its default (the key rule's text, and every field
    as releases before it wrote them: :func:`stash.codec.json_key_texts`), else 1."""
    from stash.codec import json_key_texts

    return len(json_key_texts(prefix)) if isinstance(prefix, tuple) else 1


def _prefix(prefix: Any, legacy: bool = False) -> tuple[str, str | None]:
    """``(starts, exact)``: a str prefix is its JSON text without the closing quote; a
    tuple ``(a, b)`` admits texts starting ``[a,b,`` and the text ``[a,b]`` (records in
    it as keys store them, or with ``legacy`` as earlier releases stored them)."""
    from stash.codec import canonical_json, json_key_texts

    if isinstance(prefix, str):
        return canonical_json(prefix)[:-1], None
    if isinstance(prefix, tuple):
        text = json_key_texts(prefix)[-1 if legacy else 0]
        if not prefix:
            return "[", None
        return text[:-1] + ",", text
    raise StashError(f"peek_range prefix must be a str or a tuple, got {type(prefix).__name__}")


def read_time(stash: Any, tx: Txn, cid: int, at: int | None, name: str = "") -> int:
    """The time a range is read at: ``at``, or the peek time (``upper - 1``).

    Raises:
        PeekSinceUpperError: ``at`` is not given and nothing is readable, as for
            ``peek`` (``Stash._peek_ts``).
        StashError: ``at`` is below the since or not below the upper.
    """
    since, upper = tx.frontiers(cid)
    if at is None:
        return int(stash._peek_ts(name or str(cid), since, upper))
    s, u = Antichain.from_option(since), Antichain.from_option(upper)
    if since is None or at < since:
        raise StashError(f"cannot read at time {at}: it is compacted away (the since is {s})")
    if upper is not None and at >= upper:
        raise StashError(f"cannot read at time {at}: it is not sealed (the upper is {u})")
    return at


def _frozen(k: Any) -> Any:
    return tuple(_frozen(x) for x in k) if isinstance(k, list) else k


def peek_range(
    stash: Any,
    collection: StashCollection[K, V],
    lower: Any = None,
    upper: Any = None,
    prefix: Any = None,
    limit: int | None = None,
    after: Any = None,
    at: int | None = None,
) -> RangePage[K, V]:
    """A page of the sealed entries of a key range, in key order, read in one read
    transaction through the key index (``Stash.peek_range`` calls this).

    Args:
        stash: the stash.
        collection: the collection.
        lower: keys ``>= lower``; upper: keys ``< upper``; after: keys ``> after`` (the
            ``next_after`` of the previous page).  Keys compare as their stored JSON
            texts, in code point order: strings in string order, numbers as text
            (range over string or tuple keys).
        prefix: a ``str`` (string keys starting with it) or a tuple (array keys whose
            first items are its items).
        limit: at most this many entries (a positive int), or all.
        at: read at this time (``since <= at < upper``); default the peek time.

    Returns:
        A :class:`RangePage`: ``entries`` ``[(key, value)]``, ``time``, ``more`` and
        ``next_after``.

    Raises:
        StashError: a key of the page holds several values or a multiplicity other
            than 1; ``at`` is compacted away or not sealed; a bad bound, prefix or limit;
            the collection records other codecs than the handle's.
        PeekSinceUpperError: nothing is readable yet, as for ``peek``.
    """
    from stash.codec import decode_all

    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise StashError(f"peek_range limit must be a positive int or None, got {limit!r}")
    if at is not None and (isinstance(at, bool) or not isinstance(at, int)):
        raise StashError(f"peek_range at must be an int time or None, got {at!r}")
    rng = key_range(collection, lower, upper, prefix, after)
    cid = collection.id
    two = prefix_texts(prefix) > 1

    def read(tx: Txn) -> tuple[int, list[tuple[str, str, int]]]:
        ts = read_time(stash, tx, cid, at, collection.name)
        stored = stored_texts(tx, collection, ts, lower=lower, upper=upper, after=after)
        if two:
            got = _read_both(tx, collection, ts, (lower, upper, prefix, after, stored), limit)
        elif stored:
            rng2 = key_range(collection, lower, upper, prefix, after, stored=stored)
            got = read_range(tx, cid, ts, rng2, limit)
        else:
            got = read_range(tx, cid, ts, rng, limit)
        _check_no_other_text(tx, collection, ts, got)
        return ts, got

    ts, rows = stash._read(read, codecs=(collection,))
    distinct = list(dict.fromkeys(k for k, _, _ in rows))
    more = limit is not None and len(distinct) > limit
    if more:
        rows = [r for r in rows if r[0] != distinct[-1]]
    keys: list[str] = []
    for k, _, d in rows:
        if keys and keys[-1] == k:
            raise StashError(
                f"duplicate peek keys: collection {collection.name!r} holds key "
                f"{k[:200]} with two values; retract one of them, or read it with peek()"
            )
        if d != 1:
            raise StashError(
                f"unexpected peek multiplicity: collection {collection.name!r} holds key "
                f"{k[:200]} with multiplicity {d}; read it with peek()"
            )
        keys.append(k)
    decoded = decode_all(collection.key_codec, keys)
    if hasattr(collection.key_codec, "key_texts"):  # keys that may have two texts
        _check_one_text_per_key(collection, keys, decoded)
    values = decode_all(collection.value_codec, [v for _, v, _ in rows])
    entries = [(_frozen(k), v) for k, v in zip(decoded, values, strict=True)]
    return RangePage(entries, ts, more, entries[-1][0] if entries else None)


def _read_both(
    tx: Txn,
    collection: StashCollection[Any, Any],
    ts: int,
    args: tuple[Any, ...],
    limit: int | None,
) -> list[tuple[str, str, int]]:
    """The rows of a range whose prefix has two texts (:func:`prefix_texts`): both
    ranges read, merged in text order, up to ``limit + 1`` keys; the bounds are those
    of ``stored`` (:func:`stored_texts`, the last of ``args``)."""
    lower, upper, prefix, after, stored = args
    rows: set[tuple[str, str, int]] = set()
    for legacy in (False, True):
        rng = key_range(collection, lower, upper, prefix, after, legacy=legacy, stored=stored)
        rows.update(read_range(tx, collection.id, ts, rng, limit))
    merged = sorted(rows)
    return merged if limit is None else _first_keys(merged, limit + 1)


def stored_texts(
    tx: Txn, collection: StashCollection[Any, Any], ts: int, **bounds: Any
) -> dict[str, str]:
    """``{bound: text}`` for the range bounds (``lower``, ``upper``, ``after``: keys or
    ``None``) that have two candidate texts (:func:`stash.codec.key_texts`: a record
    with a field at its default, stored by an earlier release with every field or by
    the key rule without it): the text the key is STORED under, found by one statement
    probing them all, so ``lower`` admits the key itself and ``upper`` excludes it, and
    a page follows the previous one in stored text order, never skipping the keys that
    sort between the two texts.  A bound key stored under neither text is bounded by
    the key rule's text, ``after`` by its smallest (a page may then repeat keys, never
    skip them).  Bounds with one text are left out (the codec's encoding bounds them)."""
    from stash.codec import key_probe, key_texts

    cands = {n: key_texts(collection.key_codec, b) for n, b in bounds.items() if b is not None}
    cands = {n: t for n, t in cands.items() if len(t) > 1}
    if not cands:
        return {}
    probe = tuple(dict.fromkeys(t for texts in cands.values() for t in texts))
    found = {k for k, _, _ in tx.peek_rows(collection.id, ts, key_probe(probe))}
    out: dict[str, str] = {}
    for n, texts in cands.items():
        hit = [t for t in texts if t in found]
        out[n] = hit[0] if hit else min(texts) if n == "after" else texts[0]
    return out


def _check_no_other_text(
    tx: Txn, collection: StashCollection[Any, Any], ts: int, rows: list[tuple[str, str, int]]
) -> None:
    """Raise :func:`stash.codec.duplicate_key_error` if a key of a page is also stored
    under another of its candidate texts (:func:`stash.codec.key_texts`), which may lie
    outside the page (another page, or past a bound): one statement probing them all,
    only for key types that can have two texts (a record with a defaulted field)."""
    from stash.codec import (
        RecordCodec,
        TypedTupleCodec,
        canonical_json,
        decode_all,
        duplicate_key_error,
        key_probe,
        key_texts,
    )
    from stash.record_codec import _hint_reaches

    kc = collection.key_codec
    if type(kc) is RecordCodec:
        two = bool(getattr(kc, "_key_check", False))
    elif type(kc) is TypedTupleCodec:
        two = _hint_reaches(kc.hint, set())
    else:
        two = False  # no record decoded: one text per key
    if not two or not rows:
        return
    page = list(dict.fromkeys(k for k, _, _ in rows))
    others: dict[str, tuple[Any, str]] = {}
    for text, key in zip(page, decode_all(kc, page), strict=True):
        own = canonical_json(json.loads(text))  # a range's rows may hold jsonb's text
        for t in key_texts(kc, key):
            if t != own and t != text:  # text: the stored one a key remembers
                others.setdefault(t, (key, text))
    if not others:
        return
    for t, _, _ in tx.peek_rows(collection.id, ts, key_probe(tuple(others))):
        hit = others.get(t) or others.get(canonical_json(json.loads(t)))
        if hit is not None:
            raise duplicate_key_error(collection.name, hit[0], (hit[1], t))


def _check_one_text_per_key(
    collection: StashCollection[Any, Any], texts: list[str], keys: list[Any]
) -> None:
    """Raise :func:`stash.codec.duplicate_key_error` if two of ``texts`` are one key."""
    from stash.codec import duplicate_key_error, key_identity

    seen: dict[str, str] = {}
    for text, key in zip(texts, keys, strict=True):
        ident = key_identity(collection.key_codec, key)
        if seen.setdefault(ident, text) != text:
            raise duplicate_key_error(collection.name, key, (seen[ident], text))


def read_range(
    tx: Txn, cid: int, ts: int, rng: KeyRange, limit: int | None
) -> list[tuple[str, str, int]]:
    """Up to ``limit + 1`` live ``(key text, value text, diff)`` of the range at ``ts``,
    in key order (one per ``(key, value)``, zero sums dropped)."""
    stash = getattr(tx, "stash", None)
    backend = getattr(stash, "backend", None)
    want = None if limit is None else limit + 1
    if backend == "sqlite":
        return _scan(tx, cid, ts, rng, want, _sqlite_batch)
    if backend == "postgresql":
        return _scan(tx, cid, ts, rng.for_postgres(), want, _pg_batch)
    rows = [r for r in tx.peek_rows(cid, ts) if rng.admits(r[0])]
    rows.sort(key=lambda r: r[0])
    return rows if want is None else _first_keys(rows, want)


def _first_keys(rows: list[tuple[str, str, int]], n: int) -> list[tuple[str, str, int]]:
    keys: set[str] = set()
    out = []
    for r in rows:
        if r[0] not in keys:
            if len(keys) == n:
                break
            keys.add(r[0])
        out.append(r)
    return out


def _scan(
    tx: Txn, cid: int, ts: int, rng: KeyRange, want: int | None, batch: Any
) -> list[tuple[str, str, int]]:
    """Rows in key order, a batch at a time, consolidated per key, until ``want`` keys
    are live or the range ends.  A batch that ends inside a key is read again from that
    key (with a larger batch if one key filled it)."""
    # Rows inserted in this transaction are written before reading (SQL backends).
    flush = getattr(tx, "_flush", None) or getattr(tx, "_write_buffered", None)
    if flush is not None:
        flush()
    out: list[tuple[str, str, int]] = []
    keys = 0
    lo, lo_open = rng.lo, rng.lo_open
    size = BATCH_ROWS
    while True:
        rows = batch(tx, cid, ts, lo, lo_open, rng, size)
        full = len(rows) == size
        if full:
            last = rows[-1][0]
            rest = [r for r in rows if r[0] != last]
            if not rest:
                size *= 2  # one key's history filled the batch: read it whole
                continue
            rows, lo, lo_open = rest, last, False
        sums: dict[tuple[str, str], int] = {}
        for k, v, d in rows:
            sums[(k, v)] = sums.get((k, v), 0) + int(d)
        prev = None
        for (k, v), d in sums.items():  # insertion order: key order
            if d == 0 or not rng.admits(k):
                continue
            if k != prev:
                if want is not None and keys == want:
                    return out
                keys += 1
                prev = k
            out.append((k, v, d))
        if not full:
            return out


def _sqlite_batch(
    tx: Any, cid: int, ts: int, lo: str | None, lo_open: bool, rng: KeyRange, size: int
) -> list[tuple[str, str, int]]:
    where = ["collection_id = :c", "+time <= :ts"]
    params: dict[str, Any] = {"c": cid, "ts": ts, "n": size, "lo": lo, "hi": rng.hi}
    if lo is not None:
        where.append("key > :lo" if lo_open else "key >= :lo")
    if rng.hi is not None:
        where.append("key <= :hi" if rng.hi_closed else "key < :hi")
    sql = (
        "SELECT key, value, diff FROM data WHERE "  # noqa: S608 - constant fragments
        + " AND ".join(where)
        + " ORDER BY key LIMIT :n"
    )
    return [(str(k), str(v), int(d)) for k, v, d in tx.dbc.execute(sql, params).fetchall()]


_PG_KEY = f'left(key::text, {PG_INDEXED_CHARS}) COLLATE "C"'


def _pg_batch(
    tx: Any, cid: int, ts: int, lo: str | None, lo_open: bool, rng: KeyRange, size: int
) -> list[tuple[str, str, int]]:
    n = PG_INDEXED_CHARS
    where = ["collection_id = %(c)s", "(time <= %(ts)s) IS TRUE"]
    params: dict[str, Any] = {"c": cid, "ts": ts, "lim": size, "lo": lo, "hi": rng.hi}
    if lo is not None:
        # The index holds the first characters: bound them (truncation keeps order),
        # then compare the whole text.
        where.append(f"{_PG_KEY} >= left(%(lo)s, {n})")
        where.append('key::text COLLATE "C" ' + ("> %(lo)s" if lo_open else ">= %(lo)s"))
    if rng.hi is not None:
        where.append(f"{_PG_KEY} <= left(%(hi)s, {n})")
        where.append('key::text COLLATE "C" ' + ("<= %(hi)s" if rng.hi_closed else "< %(hi)s"))
    sql = (
        "SELECT key::text, value::text, diff FROM data WHERE "  # noqa: S608 - constant fragments
        + " AND ".join(where)
        + f' ORDER BY {_PG_KEY}, key::text COLLATE "C" LIMIT %(lim)s'
    )
    rows = tx.cur.execute(sql, params).fetchall()
    # Keys stay as Postgres renders them (the bounds and admits() compare those
    # renderings); values are made canonical (rows consolidate by text).
    return [(str(k), _canonical(v), int(d)) for k, v, d in rows]


def _canonical(text: str) -> str:
    """The canonical text of a ``jsonb::text`` (``"2.50"`` and ``"2.5"`` are one value)."""
    from stash.codec import JsonCodec, canonical_json

    if text[0] == '"' or text in ("true", "false", "null") or text.lstrip("-").isdigit():
        return text
    return canonical_json(JsonCodec().decode(text))
