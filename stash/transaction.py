"""Transactions with one consistent read: :class:`Transaction` and :func:`run_transaction`
(``Stash.with_transaction``), and the bound :class:`~stash.table.TableTransaction` of
``TypedCollection.table``.

A transaction reads lazily, each read in a read transaction of its own, and commits its
changes in one write transaction.  Invariants kept here:

* every read of a transaction sees the state of one moment: a read also reads the upper
  of every collection read before it and, if one moved, the attempt ends
  (:class:`~stash.errors.AppendLowerMismatch`) before the function sees anything newer.
  The contents a peek shows are a function of the upper (every time before the upper is
  sealed), so equal uppers mean equal contents;
* a commit locks every collection read or written, checks each is still at the upper
  read, then appends each written collection's changes at that lower (entries at the
  upper ``t``, new upper ``t + 1``, since ``t``, as ``make_batch``): all of it or
  nothing, and never over a newer write; a transaction that changed nothing writes
  nothing;
* ``run_transaction`` runs the function again on a conflict, up to ``retries`` times
  (tenacity, jittered backoff), then raises the last ``AppendLowerMismatch``;
* a collection nothing was ever appended to (upper ``{0}``) reads as empty; one whose
  since reached its upper (nothing readable) gets an empty append first, which bumps the
  upper, and the attempt starts again (as Materialize's stash does).

Source of the idea: the ``with_transaction`` API and ``Transaction`` type of later
versions of Materialize's stash (``src/stash/src/transaction.rs``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import tenacity

from stash.antichain import I64_MAX, Antichain
from stash.collection import AppendBatch, StashCollection
from stash.errors import AppendLowerMismatch, StashError
from stash.peek import frozen_key, peek_one_checked, peek_one_fast, peek_unique
from stash.table import TableTransaction
from stash.txn import Txn

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


class _NeedsBump(Exception):
    """Internal: a collection's since reached its upper; append an empty batch first."""

    def __init__(self, collection: StashCollection[Any, Any], upper: int) -> None:
        super().__init__(collection.name)
        self.collection = collection
        self.upper = upper


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


class Transaction:
    """The reads and changes of one attempt of ``Stash.with_transaction``.

    Reads (:meth:`peek_one`, :meth:`peek_key_one`, :meth:`table`) all see one moment;
    changes are made through the :class:`~stash.table.TableTransaction` objects
    :meth:`table` returns and commit when the function returns.  Collections are given as
    handles (``stash.collection(...)``) or as :class:`~stash.TypedCollection` objects.
    """

    def __init__(self, stash: Stash) -> None:
        self._stash = stash
        # collection id -> (handle, the upper read)
        self._read: dict[int, tuple[StashCollection[Any, Any], int | None]] = {}
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

    def _rows(self, c: StashCollection[Any, Any], key: str | None) -> Rows:
        """The sealed rows of ``c`` (of one key), read with a check that every collection
        read before is still at the upper it was read at."""
        if self._done:
            raise StashError("transaction: used after it ended")
        earlier = list(self._read.items())

        def read(tx: Txn) -> tuple[int | None, Rows]:
            for cid, (h, up) in earlier:
                now = tx.frontiers(cid)[1]
                if now != up:
                    raise _Conflict(upper_moved(h.name, up, now))
            since, upper = tx.frontiers(c.id)
            if upper is None:
                return upper, tx.peek_rows(c.id, I64_MAX, key)
            if upper == 0:
                return upper, []  # nothing was ever appended
            if since is None or upper <= since:
                raise _NeedsBump(c, upper)
            return upper, tx.peek_rows(c.id, upper - 1, key)

        got: tuple[int | None, Rows] = self._stash._read(read, codecs=(c,))
        self._read.setdefault(c.id, (c, got[0]))
        return got[1]

    def peek_one(self, collection: Any) -> dict[Any, Any]:
        """The collection's contents as a dict (as ``Stash.peek_one``), with this
        transaction's changes to it applied."""
        c = self._handle(collection)
        if c.id in self._tables:
            return self._tables[c.id].items()
        rows = self._rows(c, None)
        fast = peek_one_fast(c, rows)
        return fast if fast is not None else peek_one_checked(c, rows)

    def peek_key_one(self, collection: Any, key: Any) -> Any:
        """The value of ``key`` or ``None`` (as ``Stash.peek_key_one``), with this
        transaction's changes applied."""
        c = self._handle(collection)
        if c.id in self._tables:
            return self._tables[c.id].get(key)
        rows = self._rows(c, c.key_codec.encode(key))
        if not rows:
            return None
        if len(rows) > 1 or rows[0][2] != 1:
            raise StashError(f"multiple values unexpected (collection {c.name})")
        return c.value_codec.decode(rows[0][1])

    def table(
        self, collection: Any, uniqueness_violation: Callable[[Any, Any], bool] | None = None
    ) -> TableTransaction[Any, Any]:
        """A :class:`~stash.table.TableTransaction` over the collection's contents, whose
        changes commit with this transaction (one per collection: asking again returns
        the same one)."""
        c = self._handle(collection)
        tt = self._tables.get(c.id)
        if tt is None:
            tt = self._table(c, uniqueness_violation)
            tt._commit = _owned_by_with_transaction
            self._tables[c.id] = tt
        return tt

    def _table(
        self, c: StashCollection[Any, Any], uniqueness_violation: Callable[[Any, Any], bool] | None
    ) -> TableTransaction[Any, Any]:
        uniq = peek_unique(c, self._rows(c, None))
        # Keys as peek_one gives them (a JSON array as a tuple): held in dicts.
        initial = [(frozen_key(k) if type(k) is list else k, v) for _, k, v in uniq]
        return TableTransaction(
            initial,
            uniqueness_violation,
            key_codec=c.key_codec,
            value_codec=c.value_codec,
            collection=c.name,
        )

    # --------------------------------------------------------------- commit
    def _batches(self) -> list[AppendBatch]:
        out: list[AppendBatch] = []
        for cid, tt in self._tables.items():
            pending = tt.pending()
            if not pending:
                continue
            c, upper = self._read[cid]
            if upper is None:
                raise StashError(f"collection {c.name} is sealed (empty upper): cannot write")
            if upper >= I64_MAX:
                raise StashError(f"collection {c.name}: cannot determine new upper")
            b = AppendBatch(
                collection=c,
                lower=Antichain.from_elem(upper),
                upper=Antichain.from_elem(upper + 1),
                compact=Antichain.from_elem(upper),
                timestamp=upper,
            )
            for k, v, d in pending:
                c.append_to_batch(b, k, v, d)
            out.append(b)
        return out

    def commit(self) -> None:
        """Commit the changes of every table at the uppers read (see the module
        docstring); nothing if nothing changed.

        Raises:
            AppendLowerMismatch: a collection read or written moved since it was read.
            StashError: as ``Stash.append``.
        """
        if self._done:
            raise StashError("transaction: committed already")
        self._done = True
        batches = self._batches()
        if not batches:
            return
        written = {b.collection.id for b in batches}
        only_read = [(h, up) for cid, (h, up) in self._read.items() if cid not in written]
        commit_batches(self._stash, batches, only_read)


def commit_batches(
    stash: Stash,
    batches: list[AppendBatch],
    only_read: list[tuple[StashCollection[Any, Any], int | None]],
) -> None:
    """Append ``batches`` (as ``Stash.append``) in one write transaction that first
    locks every collection of ``only_read`` too and checks it is still at the upper
    read (each pair's second item).

    Raises:
        AppendLowerMismatch: a collection moved (nothing committed); as ``Stash.append``.
    """
    entries = [b.canonical_entries() for b in batches]
    handles = [h for h, _ in only_read]
    ids = sorted({b.collection.id for b in batches} | {h.id for h in handles})

    def write(tx: Txn) -> None:
        tx.lock(ids)
        for h, up in only_read:
            now = tx.frontiers(h.id)[1]
            if now != up:
                raise upper_moved(h.name, up, now)
        stash._append_tx(tx, batches, entries)

    names = {b.collection.id: b.collection.name for b in batches}
    codecs = [b.collection for b in batches]
    stash._write_checked(names, write, codecs=codecs, handles=handles)


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
            if (b.collection.id, b.upper) in bumped:
                raise StashError(f"collection {b.collection.name}: nothing readable") from None
            bumped.add((b.collection.id, b.upper))
            _bump(stash, b.collection, b.upper)
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
    tx._done = False
    tx._tables[collection.id] = tt

    def commit() -> None:
        tx.commit()

    tt._commit = commit
    return tt
