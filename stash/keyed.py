"""Key-granular read-modify-writes of one collection, each in one write transaction.

``TypedCollection.upsert_key``, ``insert_without_overwrite`` and ``upsert`` run here: the
transaction locks the collection, reads the sealed values of the keys it writes (at
``upper - 1``: every sealed time; at the upper itself when ``since == upper``, where
physical consolidation moved the rows before the since to it), and writes at the
upper ``t`` it read: the new entries, the retraction of each replaced value, the upper
``t + 1`` and the since ``t`` (the since a ``make_batch`` batch sets), or the since the
collection's retention keeps (:mod:`stash.feed`).  Invariants kept
here:

* the read and the write are one transaction under the collection's write lock, so no
  other writer can come between them: these never fail with ``AppendLowerMismatch``,
  and never commit over a newer write;
* a key is looked up under each of its candidate texts (:func:`stash.codec.key_texts`:
  the key rule's and, for a record at its defaults, every field's, as earlier releases
  wrote it) in one statement, replaced and retracted under the text that is stored, and
  written by the key rule; a key held under two texts is refused, committing nothing;
* a replaced value is retracted by its stored text, never by a re-encoding of its
  decoded value (an evolved record type re-encodes an old row differently, see
  :class:`stash.codec.RecordCodec`), so a key always keeps exactly one value; a stored
  JSON ``null`` is a value like any other;
* a change that changes nothing (every key already holds its new value, byte for byte)
  writes nothing: the upper stays;
* the codecs of the handle are checked against the recorded ones in the transaction
  (:meth:`stash.base.Stash._write_checked`), as for every write.

Source of the idea: Materialize's ``TypedCollection::upsert_key`` and
``insert_without_overwrite`` (``src/stash/src/lib.rs``), here without the separate read
transaction and its lower check.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from stash.antichain import I64_MAX, Antichain
from stash.base import Stash
from stash.checks import check_codecs_tx
from stash.codec import (
    CodecLike,
    JsonCodec,
    canonical_json,
    duplicate_key_error,
    key_probe,
    key_texts,
    resolve_codec,
    resolve_key_codec,
)
from stash.collection import StashCollection
from stash.errors import StashError
from stash.retention import RETENTION_COLLECTION, commit_since, now_ms
from stash.txn import Row, Txn

__all__ = ["Target", "insert_without_overwrite", "upsert", "upsert_key"]


def _tick(tx: Txn, c: StashCollection[Any, Any]) -> tuple[int, int]:
    """``(t, ts)``: the upper ``t`` of ``c`` that a write at the next tick writes at, and
    the time ``ts`` its current contents are read at: ``t - 1``, or ``t`` when the since
    reached the upper (a collection compacted to its upper: consolidation moves every row
    before the since to time ``t``, where a read at ``t - 1`` would miss them; the write
    at ``t`` seals that time, so what it holds there is what the write replaces).

    Raises:
        StashError: the upper is the empty frontier, or ``t + 1`` overflows i64.
    """
    since, upper = tx.frontiers(c.id)
    if upper is None:
        raise StashError("cannot determine batch timestamp")
    if upper >= I64_MAX:
        raise StashError("cannot determine new upper")
    return upper, upper if since is not None and since >= upper else upper - 1


def _canonical(text: str) -> str:
    """The canonical text of a stored value text (a whole collection's ``peek_rows``
    may render values otherwise; see :meth:`stash.txn.Txn.peek_rows`)."""
    return canonical_json(JsonCodec().decode(text))


def _held(c: StashCollection[Any, Any], rows: list[tuple[str, str, int]]) -> dict[str, str]:
    """``{key text: value text}`` of sealed rows ``(key, value, diff)``.

    Raises:
        StashError: a key holds several values or a multiplicity other than 1.
    """
    out: dict[str, str] = {}
    for k, v, d in rows:
        if d != 1 or k in out:
            raise StashError(
                f"multiple values unexpected: collection {c.name} holds key "
                f"{k[:200]} with {'multiplicity ' + str(d) if d != 1 else 'two values'}"
            )
        out[k] = v
    return out


def _commit(tx: Txn, c: StashCollection[Any, Any], t: int, rows: list[Row], now: int) -> None:
    """Write ``rows`` at ``t``; the upper becomes ``t + 1`` and the since ``t``, or the
    since the collection's retention keeps (:func:`stash.retention.commit_since`)."""
    since = commit_since(tx, c.id, c.name, t, now)
    tx.insert(c.id, rows)
    tx.set_upper(c.id, t + 1)
    Stash._compact_tx(tx, c.id, Antichain.from_elem(since))
    tx.consolidate(c.id, since, {k for k, _, _, _ in rows})


class Target(NamedTuple):
    """A collection by name and codec specs (see :func:`stash.codec.resolve_codec`): what
    a write here looks up inside its own transaction."""

    name: str
    key: CodecLike
    value: CodecLike


def _write_keys(
    stash: Stash,
    target: Target,
    entries: Iterable[tuple[Any, Any]],
    overwrite: bool,
) -> tuple[StashCollection[Any, Any], dict[str, str]]:
    """Set each ``(key, value)`` of ``entries`` (a later one of a key wins; ``overwrite=False``:
    only keys without a value) in one write transaction, which also looks the
    collection up (the lookup of ``Stash.collection`` without a transaction of its own);
    return the handle and the stored value texts the keys held before (of the keys that
    held one).  A missing collection is created first (``Stash.collection``)."""
    kc, vc = resolve_key_codec(target.key), resolve_codec(target.value)
    # The key's text of today (its identity) -> (the key, its candidate texts, the value).
    encoded: dict[str, tuple[Any, tuple[str, ...], str]] = {}
    for k, v in entries:
        texts = key_texts(kc, k)
        encoded[texts[0]] = (k, texts, vc.encode(v))
    owner = {text: ident for ident, (_, texts, _) in encoded.items() for text in texts}

    def write(tx: Txn) -> tuple[StashCollection[Any, Any], dict[str, str]] | None:
        prefetch = getattr(tx, "prefetch_key", None)
        if prefetch is not None and len(encoded) == 1:
            # Postgres: the reads below, sent ahead in one round trip (PgTxn.prefetch_key).
            probe = key_probe(next(iter(encoded.values()))[1])
            prefetch(target.name, probe, RETENTION_COLLECTION, canonical_json(target.name))
        found = tx.lookup_collection(target.name)
        if found is None:
            return None
        cid, kname, vname = found
        if (kname, vname) != (kc.name, vc.name):
            raise StashError(
                f"collection {target.name} was created with codecs (key={kname}, "
                f"value={vname}) (or migrated to them) but opened with (key={kc.name}, "
                f"value={vc.name})"
            )
        tx.lock([cid])  # (its statement also reads the stash's identity)
        c: StashCollection[Any, Any] = StashCollection(
            cid, target.name, kc, vc, stash_id=tx.stash_id(), stash_url=stash._handle_url
        )
        check_codecs_tx(tx, c, True)  # as recorded once the collection is locked
        t, ts = _tick(tx, c)
        if len(encoded) == 1:
            # Every candidate text of the key in one statement (stash.codec.key_texts).
            rows = tx.peek_rows(cid, ts, key_probe(next(iter(encoded.values()))[1]))
        else:
            rows = [r for r in tx.peek_rows(cid, ts) if r[0] in owner]
        # The key's identity -> (the text it is stored under, its value text).
        prev: dict[str, tuple[str, str]] = {}
        for kj, vj in _held(c, rows).items():
            ident = owner[kj]
            if ident in prev:
                raise duplicate_key_error(c.name, encoded[ident][0], (prev[ident][0], kj))
            prev[ident] = (kj, vj)
        out: list[Row] = []
        for ident, (_, _, vj) in encoded.items():
            old = prev.get(ident)
            if old is not None and (not overwrite or _canonical(old[1]) == vj):
                continue
            if old is not None:
                out.append((old[0], old[1], t, -1))  # the text stored, never a re-encoding
            out.append((ident, vj, t, 1))
        if out:
            _commit(tx, c, t, out, now_ms(stash))
        return c, {ident: vj for ident, (_, vj) in prev.items()}

    done = stash._write_checked({}, write, codecs=())
    if done is None:
        stash.collection(target.name, key=kc, value=vc)  # create it, then write
        done = stash._write_checked({}, write, codecs=())
        assert done is not None
    return done


def upsert_key(stash: Stash, target: Target, key: Any, value: Any) -> None:
    """Set ``key`` to ``value`` in one write transaction, retracting its previous value.

    Raises:
        StashError: the key holds several values (``multiple values unexpected``); the
            key or value does not encode; the collection records other codecs than
            ``target``'s; nothing is written then.
    """
    _write_keys(stash, target, [(key, value)], True)


def insert_without_overwrite(stash: Stash, target: Target, key: Any, value: Any) -> Any:
    """Set ``key`` to ``value`` unless it holds a value (a stored ``null`` is one), in
    one write transaction; return the value the key holds afterwards.

    Raises: as :func:`upsert_key`.
    """
    c, prev = _write_keys(stash, target, [(key, value)], False)
    old = prev.get(key_texts(c.key_codec, key)[0])
    return value if old is None else c.value_codec.decode(old)


def upsert(stash: Stash, target: Target, entries: Iterable[tuple[Any, Any]]) -> None:
    """Set each ``(key, value)`` (a later entry of a key wins), retracting previous
    values, in one write transaction.

    Raises: as :func:`upsert_key`.
    """
    _write_keys(stash, target, entries, True)
