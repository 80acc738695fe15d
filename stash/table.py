"""``TableTransaction``: SQL-table-like edits of one collection's contents, committed as
one append batch.

Invariants kept here:

* keys and values are compared by their canonical encodings, as the stash compares them
  (the collection's codecs when given, the key codec in its key role; else canonical
  JSON with records as objects of their fields, for keys by the key rule
  :func:`stash.codec.key_json`), never by Python equality: ``True`` and ``1`` are
  different keys and different values;
* a key's identity is its text by the key rule (:func:`stash.codec.key_identity`); a
  table read from a stash keeps the text each key was read under (an earlier release's
  text, every field written, is one of its candidate texts) and retracts exactly that
  text on commit; insertions are written by the key rule;
* ``items()`` is always the initial contents with the pending changes applied
  (read-your-writes);
* no two visible values violate the uniqueness predicate, and no key appears twice:
  an ``insert``/``update``/``set`` that would break this raises and changes nothing;
* ``pending()`` lists, in key order, for each changed key its retraction (diff -1) before
  its insertion (diff +1); a key set back to (a value encoding like) its initial value
  yields nothing;
* composite keys (tuples, frozen records, NamedTuples) work like any other key;
* a transaction bound to a read commits only if what it read is unchanged
  (``commit``), so it never commits over a newer write;
* a transaction with a lazy source (``_bind_source``) reads a key before it decides
  anything about it (a value's retraction needs the value) and every row before
  anything that needs them all, so ``pending()`` is always what it would be had every
  row been read up front.

Source of the idea: Materialize's ``TableTransaction`` (``src/stash/src/lib.rs``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

from stash.codec import (
    CodecLike,
    canonical_json,
    duplicate_key_error,
    json_sort_key,
    key_identity,
    key_json,
    resolve_codec,
    resolve_key_codec,
    to_json,
)
from stash.errors import StashError, UniquenessViolation

K = TypeVar("K")
V = TypeVar("V")

_DELETED: Any = object()


def _natural_token(x: Any, as_json: Callable[[Any], Any] = to_json) -> Any:
    """Canonical JSON of ``x`` (records as objects, tuples as arrays; ``as_json`` is
    :func:`~stash.codec.key_json` for keys); a value that is not JSON is compared by
    Python equality, tagged so it never equals a JSON text."""
    try:
        return canonical_json(as_json(x))
    except StashError:
        try:
            hash(x)
        except TypeError:
            raise StashError(
                f"table transaction: a {type(x).__name__} is neither JSON nor hashable"
            ) from None
        return ("python", x)


def _natural_key_token(x: Any) -> Any:
    """:func:`_natural_token` of a key: records written by the key rule
    (:func:`~stash.codec.key_json`), as a collection's key codec writes them."""
    return _natural_token(x, key_json)


def _natural_sort_key(x: Any) -> Any:
    try:
        return (0, json_sort_key(key_json(x)))
    except Exception:  # noqa: BLE001 - not JSON: after every JSON value, by repr
        return (1, repr(x))


class TableTransaction(Generic[K, V]):
    """Pending edits over ``initial`` with uniqueness checks.

    Args:
        initial: the current contents, ``{key: value}`` or ``[(key, value)]`` (e.g.
            ``stash.peek_one(c)``, or :meth:`stash.TypedCollection.table`).
        uniqueness_violation: ``f(a, b) -> bool``, true when two distinct rows' values may
            not coexist (e.g. the same name); ``None`` for no constraint beyond the key.
        key_codec, value_codec: codecs whose encodings decide equality and whose
            ``sort_key`` orders keys (default: canonical JSON, records as objects).
        collection: the name of the collection the contents are of (for messages).

    A transaction made by :meth:`stash.TypedCollection.table` (or by
    ``Stash.with_transaction``'s ``tx.table``) is bound to the upper it read:
    :meth:`commit` appends :meth:`pending` at that lower.  One made from plain data has
    nothing to commit to (append :meth:`pending` yourself, with a batch made *before*
    the data was read).

    Raises:
        StashError: ``initial`` holds one key twice (by encoding).
    """

    def __init__(
        self,
        initial: Mapping[K, V] | Iterable[tuple[K, V]],
        uniqueness_violation: Callable[[V, V], bool] | None = None,
        *,
        key_codec: CodecLike = None,
        value_codec: CodecLike = None,
        collection: str | None = None,
    ) -> None:
        self.collection = collection
        self._commit: Callable[[], None] | None = None
        if key_codec is None:
            self._ktok: Callable[[Any], Any] = _natural_key_token
            self._ksort: Callable[[Any], Any] = _natural_sort_key
        else:
            kc = resolve_key_codec(key_codec)
            # A key's identity: its text by the key rule (never a stored text a record
            # read from a row remembers), so a key read under an earlier release's text
            # and the same key given fresh are one key.
            self._ktok, self._ksort = (lambda k: key_identity(kc, k)), kc.sort_key
        self._vtok: Callable[[Any], Any] = (
            _natural_token if value_codec is None else resolve_codec(value_codec).encode
        )
        pairs = initial.items() if isinstance(initial, Mapping) else initial
        self._initial: dict[Any, tuple[K, V]] = {}
        for k, v in pairs:
            t = self._ktok(k)
            if t in self._initial:
                raise StashError(f"table transaction: initial contents hold key {k!r} twice")
            self._initial[t] = (k, v)
        # The key text each initial key was read under (of a table read from a stash):
        # what a retraction of it writes, so it retracts what is stored.
        self._stored: dict[Any, str] = {}
        self._pending: dict[Any, tuple[K, Any]] = {}
        self._violates = uniqueness_violation
        # Lazy contents (see _bind_source): keys are read as they are needed.
        self._load_keys: Callable[[list[K]], list[tuple[str, K, V]]] | None = None
        self._load_all: Callable[[], list[tuple[str, K, V]]] | None = None
        self._looked_up: set[Any] = set()

    def _add_stored(self, rows: Iterable[tuple[str, K, V]]) -> None:
        """Add ``(stored key text, key, value)`` rows read from the collection to the
        initial contents, keeping each key's stored text for its retraction.

        Raises:
            StashError: two rows of one key (by its identity): two candidate texts of
                it stored (:func:`stash.codec.duplicate_key_error`), or ``initial`` twice.
        """
        for kj, k, v in rows:
            t = self._ktok(k)
            if t in self._initial:
                raise duplicate_key_error(self.collection or "", k, (self._stored[t], kj))
            self._initial[t] = (k, v)
            self._stored[t] = kj

    def _bind_source(
        self,
        load_keys: Callable[[list[K]], list[tuple[str, K, V]]],
        load_all: Callable[[], list[tuple[str, K, V]]],
    ) -> None:
        """Read the contents lazily: ``load_keys(keys)`` returns the ``(stored key text,
        key, value)`` rows of those keys that hold a value (each key looked up under
        every candidate text), ``load_all()`` every row.  A key is read
        before anything about it is decided (its retraction needs its value); anything
        that needs every row (``items``, ``update``, ``delete``, a uniqueness check)
        reads them all first."""
        self._load_keys, self._load_all = load_keys, load_all

    def _need(self, keys: Iterable[K]) -> None:
        if self._load_keys is None:
            return
        todo: dict[Any, K] = {}
        for k in keys:
            t = self._ktok(k)
            if t not in self._looked_up:
                todo.setdefault(t, k)
        if todo:
            self._add_stored(self._load_keys(list(todo.values())))
            self._looked_up.update(todo)

    def _need_all(self) -> None:
        load = self._load_all
        if load is None:
            return
        self._load_keys = self._load_all = None
        self._initial, self._stored = {}, {}
        self._add_stored(load())

    @property
    def initial(self) -> dict[K, V]:
        """The initial contents as a dict (see :meth:`items` for when that fails)."""
        self._need_all()
        return _as_dict(list(self._initial.values()))

    # ------------------------------------------------------------ reading
    def _visible_rows(self) -> list[tuple[Any, K, V]]:
        self._need_all()
        out = [(t, k, v) for t, (k, v) in self._pending.items() if v is not _DELETED]
        out += [(t, k, v) for t, (k, v) in self._initial.items() if t not in self._pending]
        return out

    def for_values(self, f: Callable[[K, V], None]) -> None:
        """Call ``f(key, value)`` for every visible row (pending changes applied)."""
        for _, k, v in self._visible_rows():
            f(k, v)

    def items(self) -> dict[K, V]:
        """The visible rows as a dict in key order.

        Raises:
            StashError: two visible keys are distinct but equal in Python (``True`` and
                ``1``), so one dict cannot hold both (:meth:`for_values` can).
        """
        rows = sorted(self._visible_rows(), key=lambda r: self._ksort(r[1]))
        return _as_dict([(k, v) for _, k, v in rows])

    def get(self, key: K) -> V | None:
        """The visible value of ``key`` or ``None``."""
        self._need([key])
        t = self._ktok(key)
        if t in self._pending:
            v = self._pending[t][1]
            return None if v is _DELETED else v
        found = self._initial.get(t)
        return None if found is None else found[1]

    def _visible(self, token: Any) -> bool:
        if token in self._pending:
            return self._pending[token][1] is not _DELETED
        return token in self._initial

    def pending(self) -> list[tuple[K, V, int]]:
        """The changes as ``[(key, value, diff)]``: per changed key in key order, the
        retraction of its initial value (-1) then its new value (+1)."""
        out: list[tuple[K, V, int]] = []
        for t in sorted(self._pending, key=lambda t: self._ksort(self._pending[t][0])):
            k, new = self._pending[t]
            if t in self._initial:
                ik, old = self._initial[t]
                if new is not _DELETED and self._vtok(new) == self._vtok(old):
                    continue
                out.append((ik, old, -1))
            if new is not _DELETED:
                out.append((k, new, 1))
        return out

    def _pending_texts(self) -> list[tuple[str | None, K, V, int]]:
        """:meth:`pending` with the key text each change writes: a retraction the text
        its key was read under (``None`` if not read from a stash), an insertion
        ``None`` (the key rule's text)."""
        out: list[tuple[str | None, K, V, int]] = []
        for k, v, d in self.pending():
            kj = self._stored.get(self._ktok(k)) if d < 0 else None
            out.append((kj, k, v, d))
        return out

    def commit(self) -> None:
        """Append :meth:`pending` to the collection at the upper the contents were read
        at, atomically; a transaction with nothing pending writes nothing.

        Raises:
            AppendLowerMismatch: another writer appended to the collection since it was
                read (nothing was committed: read again and redo the changes, or use
                ``Stash.with_transaction``, which does so).
            StashError: the transaction is not bound to a stash (made from plain data),
                belongs to a ``with_transaction`` function (which commits it), or was
                committed already; any error of ``Stash.append``.
        """
        if self._commit is None:
            raise StashError(
                "table transaction: not bound to a stash read; make it with "
                "TypedCollection.table(stash) or Stash.with_transaction"
            )
        self._commit()

    # ------------------------------------------------------------ checks
    def _add_rule(self, rule: Callable[[V, V], bool]) -> None:
        """Enforce ``rule`` from now on as well (``Stash.with_transaction``'s
        ``tx.table`` asked again with a uniqueness rule): every row is read, the pending
        changes are checked against it, and every later change against it and the
        rule the table had.

        Raises:
            UniquenessViolation: a pending change breaks ``rule``; the table keeps its
                rules then.
        """
        old = self._violates
        if old is rule:
            return
        self._need_all()
        live = {t: kv for t, kv in self._pending.items() if kv[1] is not _DELETED}
        self._violates = rule
        try:
            self._verify(live)
        finally:
            self._violates = old
        self._violates = rule if old is None else (lambda a, b: old(a, b) or rule(a, b))

    def _verify(self, changes: Mapping[Any, tuple[K, Any]]) -> None:
        violates = self._violates
        if violates is None:
            return
        self._need_all()
        trial = dict(self._pending)
        trial.update(changes)
        visible = [(t, k, v) for t, (k, v) in trial.items() if v is not _DELETED]
        visible += [(t, k, v) for t, (k, v) in self._initial.items() if t not in trial]
        changed = [(t, k, v) for t, (k, v) in changes.items() if v is not _DELETED]
        for ct, ck, cv in changed:
            for t, k, v in visible:
                if t != ct and (violates(cv, v) or violates(v, cv)):
                    raise UniquenessViolation(
                        self.collection, ck, k, "two rows' values may not coexist"
                    )

    def _change(self, key: K, value: Any) -> tuple[Any, tuple[K, Any]]:
        if value is not _DELETED:
            self._vtok(value)  # a value that cannot be encoded fails here, changing nothing
        return self._ktok(key), (key, value)

    # ------------------------------------------------------------ writing
    def insert(self, key: K, value: V) -> None:
        """Add a new row.

        Raises:
            StashError: the key exists (``key already exists``) or the value violates
                uniqueness (``uniqueness violation``); nothing changes then.
        """
        t, kv = self._change(key, value)
        self._need([key])
        if self._visible(t):
            raise UniquenessViolation(self.collection, key, key, "key already exists")
        self._verify({t: kv})
        self._pending[t] = kv

    def update(self, f: Callable[[K, V], V | None]) -> int:
        """Replace the value of every row for which ``f(key, value)`` returns a value;
        return the number of rows changed.

        Raises:
            StashError: the new values violate uniqueness; nothing changes then.
        """
        changes: dict[Any, tuple[K, Any]] = {}
        for t, k, v in self._visible_rows():
            new = f(k, v)
            if new is not None:
                changes[t] = self._change(k, new)[1]
        self._verify(changes)
        self._pending.update(changes)
        return len(changes)

    def delete(self, f: Callable[[K, V], bool]) -> list[tuple[K, V]]:
        """Delete every row for which ``f(key, value)`` is true; return them."""
        deleted = [(t, k, v) for t, k, v in self._visible_rows() if f(k, v)]
        for t, k, _ in deleted:
            self._pending[t] = (k, _DELETED)
        return [(k, v) for _, k, v in deleted]

    def set(self, key: K, value: V | None) -> None:
        """Set ``key`` to ``value`` (insert or replace); ``None`` deletes the key.

        Raises:
            StashError: the value violates uniqueness; nothing changes then.
        """
        t, kv = self._change(key, _DELETED if value is None else value)
        self._need([key])
        if value is not None:
            self._verify({t: kv})
        self._pending[t] = kv

    def set_many(self, entries: Iterable[tuple[K, V | None]]) -> None:
        """:meth:`set` for several keys, checked together (all or nothing)."""
        changes: dict[Any, tuple[K, Any]] = {}
        for k, v in entries:
            t, kv = self._change(k, _DELETED if v is None else v)
            changes[t] = kv
        self._need(k for k, _ in changes.values())
        self._verify(changes)
        self._pending.update(changes)


def _as_dict(pairs: list[tuple[K, V]]) -> dict[K, V]:
    out: dict[K, V] = {}
    held: dict[K, K] = {}
    for k, v in pairs:
        if k in held:
            raise StashError(
                f"table transaction: keys {held[k]!r} and {k!r} are distinct stash keys but "
                "equal in Python, so one dict cannot hold both; use for_values()"
            )
        held[k] = k
        out[k] = v
    return out
