"""Transactions with one consistent read: :class:`Transaction` and :func:`run_transaction`
(``Stash.with_transaction``), and the bound :class:`~stash.table.TableTransaction` of
``TypedCollection.table``.

A transaction reads lazily, each read in a read transaction of its own, and commits its
changes in one write transaction.  Invariants kept here:

* every read of a transaction sees the state of one moment: a read first checks that
  nothing read before changed (:meth:`_ReadSet.check`) and, if something did, the attempt
  ends (:class:`~stash.errors.AppendLowerMismatch`) before the function sees anything
  newer.  What was read is tracked per collection: all of it at an upper (the contents
  a peek shows are a function of the upper: every time before it is sealed), or some
  keys, each at the upper it was read at with the ``(value, diff)`` pairs it held (a key
  changed when it has a row at or after that upper, as writes land at or after the
  upper, or when its rows no longer sum to what was read: the consolidation of a later
  write may fold a deletion into the row it retracts, leaving no row at or after the
  upper);
* a commit locks every collection read or written, checks that nothing read changed,
  then appends each written collection's changes at its upper ``t`` (entries at ``t``,
  new upper ``t + 1``, since ``t`` or the since its retention keeps, as ``make_batch``;
  :func:`stash.retention.commit_since`): all of it or nothing, and never
  over a newer write of anything read, so transactions are serializable and writers of
  distinct keys do not conflict; a transaction that changed nothing writes nothing;
* a key is read under every candidate text (:func:`stash.codec.key_texts`) in one
  statement, each text recorded as read; a key held under two texts is refused;
* ``run_transaction`` runs the function again on a conflict, up to ``retries`` times
  (tenacity, jittered backoff), then raises the last ``AppendLowerMismatch``;
* a collection nothing was ever appended to (upper ``{0}``) reads as empty; one whose
  since reached its upper (nothing readable) gets an empty append first, which bumps the
  upper, and the attempt starts again (as Materialize's stash does).

Source of the idea: the ``with_transaction`` API and ``Transaction`` type of later
versions of Materialize's stash (``src/stash/src/transaction.rs``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import tenacity

from stash.antichain import I64_MAX, Antichain
from stash.codec import duplicate_key_error, key_identity, key_probe, key_texts
from stash.collection import AppendBatch, StashCollection
from stash.errors import AppendLowerMismatch, PeekSinceUpperError, StashError
from stash.peek import (
    frozen_key,
    key_entry,
    peek_one_checked,
    peek_one_fast,
    peek_unique,
)
from stash.retention import commit_since, now_ms
from stash.table import TableTransaction
from stash.txn import KeyProbe, Txn

#: A ``stash.base.Stash`` (not imported: ``stash.base`` imports this module).
Stash = Any

K = TypeVar("K")
V = TypeVar("V")
R = TypeVar("R")

DEFAULT_RETRIES = 10

Rows = list[tuple[str, str, int]]


class _Conflict(Exception):
    """Internal: a collection moved under an attempt (run it again)."""

    def __init__(self, mismatch: AppendLowerMismatch) -> None:
        super().__init__(str(mismatch))
        self.mismatch = mismatch


class _NeedsBump(PeekSinceUpperError):
    """Internal: a collection's since reached its upper; append an empty batch first
    (raised outside an attempt, it is the ``PeekSinceUpperError`` a peek raises)."""

    def __init__(
        self, collection: StashCollection[Any, Any], since: int | None, upper: int
    ) -> None:
        s, u = Antichain.from_option(since), Antichain.from_elem(upper)
        super().__init__(
            f"collection {collection.name} since {s} is not less than upper {u}", since=s, upper=u
        )
        self.collection = collection
        self.upper_time = upper


def upper_moved(name: str, read: int | None, now: int | None) -> AppendLowerMismatch:
    """The error of a collection ``name`` read at upper ``read`` and now at ``now``."""
    lower, cur = Antichain.from_option(read), Antichain.from_option(now)
    return AppendLowerMismatch(
        f"append lower {lower} does not match the current upper frontier {cur} of "
        f"collection {name}",
        name,
        lower,
        cur,
    )


@dataclass
class _ReadSet:
    """What a transaction read of one collection: all of it at ``upper`` (``full``), or
    some keys, each at the upper it was read at (key text -> upper) with the sorted
    ``(value text, diff)`` pairs it held then (key text -> pairs)."""

    handle: StashCollection[Any, Any]
    full: bool = False
    upper: int | None = None
    keys: dict[str, int | None] = field(default_factory=dict)
    held: dict[str, list[tuple[str, int]]] = field(default_factory=dict)

    def check(self, tx: Txn) -> None:
        """Raise :class:`_Conflict` if what was read may have changed: the upper moved
        (a whole read), or a key read has a row at or after the upper it was read at (a
        write of it since; a whole-collection ``consolidate`` may also move old rows
        there: a conflict that was not one, never the reverse), or its rows no longer
        sum to the pairs it held when read (a deletion consolidated with the row it
        retracted leaves no row at or after the upper, yet the key changed)."""
        cid = self.handle.id
        if self.full:
            now = tx.frontiers(cid)[1]
            if now != self.upper:
                raise _Conflict(upper_moved(self.handle.name, self.upper, now))
            return
        for kj, up in self.keys.items():
            if up is None:
                continue  # read at the empty upper: sealed for ever
            rows = tx.rows(cid, kj)
            held = _held((vj, d) for _, vj, _, d in rows)
            if any(t >= up for _, _, t, _ in rows) or held != self.held.get(kj, []):
                now = tx.frontiers(cid)[1]
                lower, cur = Antichain.from_option(up), Antichain.from_option(now)
                raise _Conflict(
                    AppendLowerMismatch(
                        f"key {kj} of collection {self.handle.name} was written after the "
                        f"transaction read it at upper {lower} (the upper is now {cur})",
                        self.handle.name,
                        lower,
                        cur,
                    )
                )


def _held(pairs: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
    """The sorted ``(value text, diff)`` sums of one key's ``(value text, diff)``
    ``pairs``, zero sums dropped: what the key holds (as read, and as its rows now sum
    to, compared by :meth:`_ReadSet.check`)."""
    sums: dict[str, int] = {}
    for vj, d in pairs:
        sums[vj] = sums.get(vj, 0) + d
    return sorted((vj, d) for vj, d in sums.items() if d != 0)


class Transaction:
    """The reads and changes of one attempt of ``Stash.with_transaction``.

    Reads (:meth:`peek_one`, :meth:`peek_key_one`, :meth:`table`) all see one moment;
    changes are made through the :class:`~stash.table.TableTransaction` objects
    :meth:`table` returns and commit when the function returns.  Collections are given as
    handles (``stash.collection(...)``) or as :class:`~stash.TypedCollection` objects.

    What is read is tracked by key where it can be: ``peek_key_one`` reads one key, and
    a table without a uniqueness rule reads only the keys it is asked about (``get``,
    ``set``, ``insert``) until something needs every row (``items``, ``update``,
    ``delete``).  A commit then checks only those keys, so transactions writing
    distinct keys of one collection both commit, each at the upper it finds.
    """

    def __init__(self, stash: Stash) -> None:
        self._stash = stash
        self._reads: dict[int, _ReadSet] = {}
        self._tables: dict[int, TableTransaction[Any, Any]] = {}
        self._done = False

    # ---------------------------------------------------------------- reads
    def _handle(self, collection: Any) -> StashCollection[Any, Any]:
        if isinstance(collection, StashCollection):
            return collection
        get = getattr(collection, "get", None)
        if callable(get):  # a TypedCollection
            handle = get(self._stash)
            if isinstance(handle, StashCollection):
                return handle
        raise StashError(
            f"a transaction reads StashCollection or TypedCollection objects, got "
            f"{type(collection).__name__}"
        )

    def _read_rows(self, c: StashCollection[Any, Any], keys: list[KeyProbe] | None) -> Rows:
        """The sealed rows of ``c`` (of ``keys``, or all; a key is given as its candidate
        texts, :func:`stash.codec.key_probe`, each key read in one statement), read in
        one read transaction with a check that nothing read before has changed, and
        recorded as read (every candidate text)."""
        if self._done:
            raise StashError("transaction: used after it ended")
        earlier = list(self._reads.values())

        def read(tx: Txn) -> tuple[int | None, Rows]:
            for r in earlier:
                r.check(tx)
            since, upper = tx.frontiers(c.id)
            if upper is None:
                ts = I64_MAX
            elif upper == 0:
                return upper, []  # nothing was ever appended
            elif since is None or upper <= since:
                raise _NeedsBump(c, since, upper)
            else:
                ts = upper - 1
            if keys is None:
                return upper, tx.peek_rows(c.id, ts)
            return upper, [row for kj in keys for row in tx.peek_rows(c.id, ts, kj)]

        got: tuple[int | None, Rows] = self._stash._read(read, codecs=(c,))
        upper, rows = got
        rec = self._reads.setdefault(c.id, _ReadSet(c))
        if keys is None:
            rec.full, rec.upper = True, upper
        elif not rec.full:
            for p in keys:
                for kj in (p,) if isinstance(p, str) else p:
                    if kj not in rec.keys:
                        rec.keys[kj] = upper
                        rec.held[kj] = _held((vj, d) for k, vj, d in rows if k == kj)
        return rows

    def _pairs(self, c: StashCollection[Any, Any], keys: list[Any] | None) -> list[Any]:
        """``[(stored key text, key, value)]`` of ``keys`` (or all) that hold a value,
        each key looked up under every candidate text (:func:`stash.codec.key_texts`)
        and checked as ``peek_one`` checks them; keys as ``peek_one`` gives them (lists
        as tuples).

        Raises:
            StashError: as ``peek_one``; a key held under two of its texts
                (:func:`stash.codec.duplicate_key_error`).
        """
        kc = c.key_codec
        probes = None if keys is None else [key_probe(key_texts(kc, k)) for k in keys]
        uniq = peek_unique(c, self._read_rows(c, probes))
        seen: dict[str, str] = {}
        out = []
        for kj, k, v in uniq:
            ident = key_identity(kc, k)
            if seen.setdefault(ident, kj) != kj:
                raise duplicate_key_error(c.name, k, (seen[ident], kj))
            out.append((kj, frozen_key(k) if type(k) is list else k, v))
        return out

    def peek_one(self, collection: Any) -> dict[Any, Any]:
        """The collection's contents as a dict (as ``Stash.peek_one``), with this
        transaction's changes to it applied."""
        c = self._handle(collection)
        if c.id in self._tables:
            return self._tables[c.id].items()
        rows = self._read_rows(c, None)
        fast = peek_one_fast(c, rows)
        return fast if fast is not None else peek_one_checked(c, rows)

    def peek_key_one(self, collection: Any, key: Any) -> Any:
        """The value of ``key`` or ``None`` (as ``Stash.peek_key_one``), with this
        transaction's changes applied; only this key is read."""
        c = self._handle(collection)
        if c.id in self._tables:
            return self._tables[c.id].get(key)
        rows = self._read_rows(c, [key_probe(key_texts(c.key_codec, key))])
        found = key_entry(c, key, rows, f" (collection {c.name})")
        return None if found is None else c.value_codec.decode(found[1])

    def table(
        self, collection: Any, uniqueness_violation: Callable[[Any, Any], bool] | None = None
    ) -> TableTransaction[Any, Any]:
        """A :class:`~stash.table.TableTransaction` over the collection's contents, whose
        changes commit with this transaction (one per collection: asking again returns
        the same one, and a uniqueness rule given again is enforced by it too, its
        pending changes checked against the rule now).  With a uniqueness rule every
        row is read now (a new value is checked against all of them); without one, keys
        are read as they are needed.

        Raises:
            UniquenessViolation: a rule given again is broken by the table's pending
                changes.
        """
        c = self._handle(collection)
        tt = self._tables.get(c.id)
        if tt is None:
            tt = self._table(c, uniqueness_violation)
            tt._commit = _owned_by_with_transaction
            self._tables[c.id] = tt
        elif uniqueness_violation is not None:
            tt._add_rule(uniqueness_violation)
        return tt

    def _table(
        self, c: StashCollection[Any, Any], uniqueness_violation: Callable[[Any, Any], bool] | None
    ) -> TableTransaction[Any, Any]:
        lazy = uniqueness_violation is None
        tt: TableTransaction[Any, Any] = TableTransaction(
            [],
            uniqueness_violation,
            key_codec=c.key_codec,
            value_codec=c.value_codec,
            collection=c.name,
        )
        if not lazy:
            tt._add_stored(self._pairs(c, None))
        else:
            self._read_rows(c, [])  # the frontiers: a since at the upper is bumped now
            tt._bind_source(lambda keys: self._pairs(c, keys), lambda: self._pairs(c, None))
        return tt

    # --------------------------------------------------------------- commit
    def commit(self) -> None:
        """Commit the changes of every table (see the module docstring); nothing if
        nothing changed.

        Raises:
            AppendLowerMismatch: something read changed since (a collection read whole
                moved, or a key read was written).
            StashError: as ``Stash.append``.
        """
        if self._done:
            raise StashError("transaction: committed already")
        self._done = True
        changes = [(self._reads[cid], tt._pending_texts()) for cid, tt in self._tables.items()]
        changes = [(r, p) for r, p in changes if p]
        if changes:
            commit_changes(self._stash, changes, list(self._reads.values()))


def commit_changes(
    stash: Stash, changes: list[tuple[_ReadSet, list[Any]]], reads: list[_ReadSet]
) -> None:
    """Append each collection's ``(stored key text or None, key, value, diff)`` changes
    (:meth:`~stash.table.TableTransaction._pending_texts`) in one write transaction
    that first locks every collection read or written and checks nothing read changed
    (:meth:`_ReadSet.check`).  A collection read whole is appended to at the upper read
    (which the check found unchanged); one read by key at its current upper.

    Raises:
        AppendLowerMismatch: something read changed (nothing committed); as
            ``Stash.append``.
    """
    handles = [r.handle for r in reads]
    ids = sorted({h.id for h in handles})

    def write(tx: Txn) -> None:
        tx.lock(ids)
        for r in reads:
            r.check(tx)
        now = now_ms(stash)
        batches = [_batch(tx, r.handle, p, now) for r, p in changes]
        stash._append_tx(tx, batches, [b.entries for b in batches])

    written = [r.handle for r, _ in changes]
    names = {h.id: h.name for h in handles}
    stash._write_checked(names, write, codecs=written, handles=handles)


def _batch(tx: Txn, c: StashCollection[Any, Any], pending: list[Any], now: int) -> AppendBatch:
    """The batch of ``pending`` changes at the upper of ``c`` in ``tx``, compacting to the
    since its retention keeps at wall clock ``now`` (Unix ms), as ``make_batch``."""
    upper = tx.frontiers(c.id)[1]
    if upper is None:
        raise StashError(f"collection {c.name} is sealed (empty upper): cannot write")
    if upper >= I64_MAX:
        raise StashError(f"collection {c.name}: cannot determine new upper")
    b = AppendBatch(
        collection=c,
        lower=Antichain.from_elem(upper),
        upper=Antichain.from_elem(upper + 1),
        compact=Antichain.from_elem(commit_since(tx, c.id, c.name, upper, now)),
        timestamp=upper,
    )
    kc = c.key_codec
    for kj, k, v, d in pending:
        # A retraction by the key text read (stored), an insertion by the key rule.
        c.append_to_batch(b, k, v, d, key_text=kj if kj is not None else key_identity(kc, k))
    return b


def _owned_by_with_transaction() -> None:
    raise StashError(
        "table transaction: this table commits when its with_transaction function returns"
    )


def _bump(stash: Stash, c: StashCollection[Any, Any], upper: int) -> None:
    """Append an empty batch at ``upper`` (someone else's append is as good)."""
    batch = AppendBatch(
        collection=c,
        lower=Antichain.from_elem(upper),
        upper=Antichain.from_elem(upper + 1),
        compact=Antichain.from_elem(upper),
        timestamp=upper,
    )
    try:
        stash.append([batch])
    except AppendLowerMismatch:
        pass


def _attempt(stash: Stash, fn: Callable[[Transaction], R]) -> R:
    """One run of ``fn`` and its commit; a collection whose since reached its upper is
    bumped and the run started again (at most once per collection and upper)."""
    bumped: set[tuple[int, int]] = set()
    while True:
        tx = Transaction(stash)
        try:
            result = fn(tx)
            tx.commit()
            return result
        except AppendLowerMismatch as e:
            raise _Conflict(e) from None
        except _NeedsBump as b:
            if (b.collection.id, b.upper_time) in bumped:
                raise StashError(f"collection {b.collection.name}: nothing readable") from None
            bumped.add((b.collection.id, b.upper_time))
            _bump(stash, b.collection, b.upper_time)
        finally:
            tx._done = True


def run_transaction(stash: Stash, fn: Callable[[Transaction], R], retries: int) -> R:
    """``Stash.with_transaction``: see there."""
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise StashError(f"with_transaction: retries must be an int >= 0, got {retries!r}")
    retryer = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(_Conflict),
        stop=tenacity.stop_after_attempt(retries + 1),
        wait=tenacity.wait_random_exponential(multiplier=0.001, max=0.05),
        reraise=True,
    )
    try:
        result: R = retryer(_attempt, stash, fn)
        return result
    except _Conflict as c:
        raise c.mismatch from None


def bound_table(
    stash: Stash,
    collection: StashCollection[K, V],
    uniqueness_violation: Callable[[V, V], bool] | None,
) -> TableTransaction[K, V]:
    """``TypedCollection.table``: a table over the contents read now, whose
    :meth:`~stash.table.TableTransaction.commit` appends its changes at the upper read
    (``AppendLowerMismatch`` if the collection moved since; nothing commits then)."""

    def read(tx: Transaction) -> tuple[Transaction, TableTransaction[Any, Any]]:
        return tx, tx._table(collection, uniqueness_violation)

    # Read-only: nothing to commit, so no conflict either; a since at the upper is bumped.
    tx, tt = _attempt(stash, read)
    tx._done = False  # its table may still read (lazily) and commit
    tx._tables[collection.id] = tt
    tt._commit = _plain(tx.commit)
    if tt._load_keys is not None and tt._load_all is not None:
        tt._bind_source(_plain(tt._load_keys), _plain(tt._load_all))
    return tt


def _plain(fn: Callable[..., R]) -> Callable[..., R]:
    """``fn`` raising a conflict as the plain :class:`AppendLowerMismatch` (outside
    ``with_transaction`` nothing runs again)."""

    def run(*args: Any) -> R:
        try:
            return fn(*args)
        except _Conflict as c:
            raise c.mismatch from None

    return run
