"""``TypedCollection``: a named collection with fixed codecs and read-modify-write helpers.

Invariants kept here: every helper reads the sealed state and writes one ``append`` batch
whose lower is the upper it read, so a concurrent writer makes it fail with
:class:`~stash.errors.AppendLowerMismatch` rather than lose an update; the helpers of one
stash handle run one at a time, so threads sharing a handle never fail each other; when since equals
upper (nothing readable yet) it first appends an empty batch to bump the upper and reads
again, as Materialize's stash does.  Keys are told apart by their canonical encodings (``upsert``
never needs them hashable, and ``True`` is not ``1``); composite keys (the ``tuple`` codec,
frozen records, NamedTuples) come back as the type they went in as, so ``peek_one`` and
:meth:`TypedCollection.table` work with them.

:meth:`TypedCollection.migrate` rewrites a collection's entries and its recorded codec
names in one transaction: it commits entirely (every entry mapped, the codecs changed,
the old encodings consolidated away, ``since`` at the migration's time) or not at all;
after it, every read that decodes and every write that encodes through a handle that
still has the old codecs (of any stash handle, the migrating one included) is refused
with an error naming both codec pairs, and ``Stash.collection`` (so
:meth:`TypedCollection.get`) with the old codecs fails: :class:`stash.base.Stash` checks
the recorded codec names in the transaction of each such call.  Alembic owns the SQL
tables themselves (``migrations/``); ``migrate`` owns one collection's data and codecs.

Source of the idea: Materialize's ``TypedCollection`` (``src/stash/src/lib.rs``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

from stash import keyed
from stash.antichain import I64_MAX, Antichain
from stash.base import Stash
from stash.codec import CodecLike, resolve_codec, resolve_key_codec
from stash.collection import AppendBatch, StashCollection
from stash.errors import PeekSinceUpperError, StashError
from stash.table import TableTransaction
from stash.transaction import bound_table
from stash.txn import Row, Txn

K = TypeVar("K")
V = TypeVar("V")
R = TypeVar("R")

_HANDLE_LOCKS: weakref.WeakKeyDictionary[Stash, threading.RLock] = weakref.WeakKeyDictionary()
_HANDLE_LOCKS_GUARD = threading.Lock()


def _handle_lock(stash: Stash) -> threading.RLock:
    """The lock that serializes the read-then-append helpers of one stash handle, so
    threads sharing a handle never make each other's append fail its lower check (a
    writer through another handle still does: ``AppendLowerMismatch``)."""
    with _HANDLE_LOCKS_GUARD:
        lock = _HANDLE_LOCKS.get(stash)
        if lock is None:
            lock = _HANDLE_LOCKS[stash] = threading.RLock()
        return lock


class TypedCollection(Generic[K, V]):
    """A collection name bound to its key and value codecs.

    Args:
        name: the collection's name.
        key, value: codecs (default canonical JSON); see :func:`stash.codec.resolve_codec`.
    """

    def __init__(self, name: str, key: CodecLike = None, value: CodecLike = None) -> None:
        self.name = name
        self.key = key
        self.value = value

    def __repr__(self) -> str:
        return f"TypedCollection({self.name!r})"

    def _target(self) -> keyed.Target:
        """The name and codecs the one-transaction writes of :mod:`stash.keyed` look
        the collection up with (inside their transaction)."""
        return keyed.Target(self.name, self.key, self.value)

    def migrate(
        self,
        stash: Stash,
        key_codec: CodecLike,
        value_codec: CodecLike,
        fn: Callable[[K, V], tuple[Any, Any]],
    ) -> TypedCollection[Any, Any]:
        """Rewrite the collection for new codecs, in one transaction: every entry
        ``(key, value)`` of its contents (decoded with this collection's codecs, the ones
        recorded for it) becomes ``fn(key, value)`` encoded with ``key_codec`` /
        ``value_codec``, keeping its diff, and the recorded codec names become theirs.
        Keys are written by the key rule (:func:`stash.codec.resolve_key_codec`: records
        without their fields at default), never as the stored text they were read from:
        so ``migrate(stash, K, V, lambda k, v: (k, v))`` with the collection's own codecs
        rewrites keys an earlier release stored with their defaults (every key path finds
        those stored with every field without it; keys stored when the type had fewer
        fields need it), and a migration from a key type to one with a changed default
        keeps what every stored key means.

        The new entries are written at the collection's upper ``t`` (the old ones are
        retracted there and consolidated away); the upper becomes ``t + 1`` and the
        since ``t``: history before the migration is not readable in either encoding.
        Entries already written at times beyond ``t`` (``update`` accepts any time at
        or beyond the upper) are rewritten at their own times, so no entry of any time
        is left in the old encoding.
        Collection handles made with the old codecs, through any stash handle, can no
        longer read or write it (``peek``, ``iter``, ``update``, ``append``... raise
        ``StashError`` naming both codec pairs; ``since``, ``upper`` and ``seal`` still
        work); reopen it with the returned collection.  Alembic migrations (``migrations/``) own the
        SQL tables every collection lives in; this owns one collection's entries and codecs.

        Args:
            stash: a writable stash handle.
            key_codec, value_codec: the new codecs (see :func:`stash.codec.resolve_codec`).
            fn: maps an old ``(key, value)`` to the new ``(key, value)``.

        Returns:
            A :class:`TypedCollection` of the same name with the new codecs.

        Raises:
            StashError: the collection's recorded codecs are not this object's; its upper
                is the empty frontier (closed) or the largest time; ``fn`` maps two keys
                of a collection with one value per key to one key; a new key or value
                does not encode with its codec; a diff sum would overflow.  Whatever
                ``fn`` raises is raised as is.  In every case nothing is committed.
        """
        new_kc, new_vc = resolve_key_codec(key_codec), resolve_codec(value_codec)
        old = self.get(stash)  # raises if the recorded codecs are not ours
        name = self.name

        def write(tx: Txn) -> None:
            cid = old.id
            _, upper = tx.frontiers(cid)
            if upper is None or upper >= I64_MAX:
                raise StashError(
                    f"collection {name} cannot be migrated: its upper "
                    f"{Antichain() if upper is None else Antichain.from_elem(upper)} leaves "
                    "no time to write the migrated entries at"
                )
            # Rows before the upper are the contents now (read at the upper); a row at
            # or beyond it (``update`` writes there) keeps its own time: every row, of
            # every time, is rewritten in the new encoding.
            acc: dict[tuple[str, str, int], int] = {}
            for kj, vj, t, d in tx.rows(cid):
                g = (kj, vj, max(t, upper))
                acc[g] = acc.get(g, 0) + d
            live = {g: d for g, d in acc.items() if d != 0}
            now = [kj for kj, _, t in live if t == upper]
            unique = len(set(now)) == len(now)
            out: dict[tuple[str, str, int], int] = {}
            first: dict[tuple[str, int], Any] = {}
            # Keys by the key rule as of now, never as the stored text a key read from an
            # earlier release's row (with its defaults) re-encodes to.
            encode_key = getattr(new_kc, "encode_new", new_kc.encode)
            for (kj, vj, t), d in live.items():
                k, v = old.key_codec.decode(kj), old.value_codec.decode(vj)
                k2, v2 = fn(k, v)
                try:
                    nk, nv = encode_key(k2), new_vc.encode(v2)
                except (StashError, TypeError, ValueError) as e:
                    raise StashError(
                        f"migrating collection {name}: entry {k!r} maps to a key or value "
                        f"that does not encode with ({new_kc.name}, {new_vc.name}): {e}"
                    ) from None
                if unique and t == upper and (nk, t) in first:
                    raise StashError(
                        f"migrating collection {name}: keys {first[(nk, t)]!r} and {k!r} "
                        f"both map to key {k2!r}; nothing was committed"
                    )
                first[(nk, t)] = k
                out[(nk, nv, t)] = out.get((nk, nv, t), 0) + d
            rows: list[Row] = [(kj, vj, t, -d) for (kj, vj, t), d in live.items()]
            rows += [(kj, vj, t, d) for (kj, vj, t), d in out.items() if d != 0]
            if rows:
                tx.insert(cid, rows)
            tx.set_upper(cid, upper + 1)
            tx.set_since(cid, upper)
            tx.consolidate(cid, upper, None)
            tx.set_collection_codecs(cid, new_kc.name, new_vc.name)

        with _handle_lock(stash):
            # Locks the collection and checks its recorded codecs are still ``old``'s.
            stash._write_checked({old.id: name}, write, codecs=(old,))
        return TypedCollection(name, new_kc, new_vc)

    def get(self, stash: Stash) -> StashCollection[K, V]:
        """The collection handle in ``stash`` (created if missing)."""
        return stash.collection(self.name, key=self.key, value=self.value)

    def upper(self, stash: Stash) -> Antichain:
        """The collection's upper frontier."""
        return stash.upper(self.get(stash))

    def peek_one(self, stash: Stash) -> dict[K, V]:
        """The sealed contents as a dict (see :meth:`Stash.peek_one`)."""
        return stash.peek_one(self.get(stash))

    def table(
        self, stash: Stash, uniqueness_violation: Callable[[V, V], bool] | None = None
    ) -> TableTransaction[K, V]:
        """A :class:`~stash.table.TableTransaction` over the sealed contents, comparing
        keys and values by this collection's codecs, bound to what it read: its
        ``commit()`` appends its changes in one transaction, and raises
        :class:`~stash.errors.AppendLowerMismatch` (committing nothing) if another
        writer changed what it read since (with ``uniqueness_violation``, every row is
        read now and any append conflicts; without one, keys are read as the table is
        asked about them, and only a write of those keys conflicts).  A new collection
        reads as empty.  To read and write several collections at one point, with
        retries, use ``Stash.with_transaction``.
        """
        return bound_table(stash, self.get(stash), uniqueness_violation)

    def peek_key_one(self, stash: Stash, key: K) -> V | None:
        """The sealed value of ``key`` or ``None`` (see :meth:`Stash.peek_key_one`)."""
        return stash.peek_key_one(self.get(stash), key)

    def _read_then_batch(
        self, stash: Stash, read: Callable[[StashCollection[K, V]], R]
    ) -> tuple[StashCollection[K, V], AppendBatch, R]:
        c = self.get(stash)
        batch = c.make_batch(stash)
        try:
            prev = read(c)
        except PeekSinceUpperError:
            # Nothing is readable yet (since == upper): bump the upper with an empty
            # batch, then read again.
            stash.append([batch])
            batch = c.make_batch(stash)
            prev = read(c)
        return c, batch, prev

    def insert_without_overwrite(self, stash: Stash, key: K, value: V) -> V:
        """Set ``key`` to ``value`` unless it already has a value (a stored ``null`` is
        one); return the value the key has afterwards.  One write transaction (see
        :mod:`stash.keyed`): no other writer can come between its read and its write.

        Raises:
            StashError: the key holds several values; the collection records other
                codecs; nothing is written then.
        """
        got: V = keyed.insert_without_overwrite(stash, self._target(), key, value)
        return got

    def upsert_key(self, stash: Stash, key: K, value: V) -> None:
        """Set ``key`` to ``value``, retracting its previous value (by its stored text),
        in one write transaction (see :mod:`stash.keyed`); an unchanged value writes
        nothing.

        Raises:
            StashError: the key holds several values; the collection records other
                codecs; nothing is written then.
        """
        keyed.upsert_key(stash, self._target(), key, value)

    def upsert(self, stash: Stash, entries: Iterable[tuple[K, V]]) -> None:
        """Set each ``(key, value)``, retracting previous values (by their stored
        texts), in one write transaction (see :mod:`stash.keyed`).

        Raises:
            StashError: a key written holds several values; the collection records
                other codecs; nothing is written then.
        """
        keyed.upsert(stash, self._target(), entries)
