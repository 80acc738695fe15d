"""The Stash: the whole contract of Materialize's ``Stash`` and ``Append`` traits, once.

:class:`Stash` implements every method of the contract (checks, exact error messages,
consolidation; the peek rules are :mod:`stash.peek`, the handle and codec checks
:mod:`stash.checks`, transactions :mod:`stash.transaction`) on top of the primitive
transactions of a backend (:mod:`stash.txn`).  Backends (:mod:`stash.memory`,
:mod:`stash.sql`) only store rows and frontiers; :meth:`Stash.open` finds the backend of a URL by name (:data:`BACKENDS`), so
this module never imports a backend (they import it).  Invariants kept here:

* every public method is one transaction: it commits entirely or not at all;
* ``since <= upper`` for every collection (``compact`` refuses a since beyond the upper,
  ``seal`` refuses to go backwards);
* ``append`` checks every batch before anything is written, so a bad batch anywhere
  commits nothing, whatever the order of the batches;
* ``iter`` and ``peek`` return consolidated data, times advanced to since, sorted by the
  codecs' order;
* every write merges the rows of the keys it wrote that share a
  ``(key, value, max(time, since))``, and refuses, committing nothing, a write after which
  the diffs of a (key, value) could sum beyond i64 (the rule of
  :mod:`stash.consolidation`, checked alike on every backend): no read on any backend
  ever overflows or disagrees;
* ``consolidate`` leaves the same physical rows on every backend: every row at
  ``max(time, since)``, one per (key, value, time), no zero diff;
* a readonly handle never writes; a fenced handle fails every later call with an
  unrecoverable error;
* every transaction runs through :meth:`Stash._read` or :meth:`Stash._write`, which take
  the collections whose codecs the transaction decodes or encodes with and check, inside
  that transaction and before anything else, that each collection still records the
  codec names of the handle (``TypedCollection.migrate`` through any handle may have
  changed them): a stale handle's read raises instead of misdecoding and its write
  commits nothing, so a collection never holds entries of two encodings.  The names come
  from the statement that reads the collection's frontiers (or takes its lock), so the
  check costs no query.  ``collection()`` always looks the collection up (no cache of
  codecs), so it never hands out a handle with codecs the collection no longer records.
  Calls that neither encode nor decode (``since``, ``upper``, ``peek_timestamp``,
  ``seal``, ``compact``, ``consolidate``) work through any handle of the collection;
* every write refuses a handle another stash made (:func:`stash.checks.check_handles_tx`:
  the identity and name come from the same statement as the codec names).

Source: Materialize's ``Stash`` trait (``src/stash/src/lib.rs``): ``Stash``, ``Append``,
``peek_timestamp``, ``peek``, ``peek_one``, ``peek_key_one``.
"""

from __future__ import annotations

import abc
import datetime as dt
import importlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from types import EllipsisType
from typing import Any, Literal, TypeVar

from sqlalchemy.engine import URL

from stash import metrics as stash_metrics
from stash.antichain import I64_MAX, Antichain
from stash.checks import check_handles_tx, with_codec_check
from stash.codec import CodecLike, key_probe, key_texts, resolve_codec, resolve_key_codec
from stash.collection import (
    AppendBatch,
    StashCollection,
    check_diff,
    check_time,
    validate_collection_name,
)
from stash.consolidation import DIFF_SUM_RULE, DiffSumOverflow, consolidate_updates
from stash.errors import (
    AppendLowerMismatch,
    PeekSinceUpperError,
    ReadOnlyError,
    StashError,
)
from stash.logs import LogEntry, checked_entries, insert_entries
from stash.peek import key_entry, peek_one_checked, peek_one_fast, peek_unique
from stash.retention import record_commit_time
from stash.transaction import DEFAULT_RETRIES, Transaction, run_transaction
from stash.txn import KeyProbe, Row, Txn
from stash.url import parse_url, redact

log = logging.getLogger(__name__)

K = TypeVar("K")
V = TypeVar("V")
R = TypeVar("R")

Mode = Literal["writable", "readonly", "savepoint"]
MODES = ("writable", "readonly", "savepoint")

#: The backends :meth:`Stash.open` knows, by the backend name of the URL's scheme
#: (SQLAlchemy's ``URL.get_backend_name``): the ``"module.Class"`` of the :class:`Stash`
#: subclass that opens it, imported only when a URL asks for it.  Looking backends up by
#: name keeps this module from importing what it builds (the backends import it), as
#: pyiceberg's ``pyiceberg/io/__init__.py`` maps schemes to ``FileIO`` class names and
#: SQLAlchemy's ``dialects/__init__.py`` loads a dialect by name.
BACKENDS: dict[str, str] = {
    "memory": "stash.memory.MemoryStash",
    "sqlite": "stash.sql.SqlStash",
    "postgresql": "stash.sql.SqlStash",
}


def load_by_name(qualname: str) -> Any:
    """The object a ``"package.module.Name"`` string names, its module imported now.

    Raises:
        ImportError: the module does not import.
        AttributeError: the module has no such name.
    """
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _ac(t: int | None) -> Antichain:
    return Antichain.from_option(t)


def _le(a: int | None, b: int | None) -> bool:
    """``Antichain.from_option(a) <= Antichain.from_option(b)`` without building them
    (``None``, the empty frontier, is the greatest): the frontier checks of every append."""
    return b is None or (a is not None and a <= b)


def _check_antichain(value: object, what: str) -> Antichain:
    if not isinstance(value, Antichain):
        raise StashError(f"{what} must be an Antichain, got {type(value).__name__}")
    return value


class Stash(abc.ABC):
    """A durable metadata store of named collections of ``((key, value), time, diff)``.

    Open one with :meth:`Stash.open`.  A handle is safe to share between threads; every
    method is a transaction of its own.  Use it as a context manager to close it.

    Attributes:
        mode: ``"writable"``, ``"readonly"`` or ``"savepoint"``.
        fenced: whether this handle took (and checks) the leader epoch.
        clock: the wall clock (seconds since the Unix epoch, as ``time.time``) that
            stamps commits and measures retentions by duration (``Stash.open(...,
            clock=...)`` replaces it, e.g. in tests).
    """

    mode: Mode
    fenced: bool
    clock: Callable[[], float] = staticmethod(time.time)

    def __init__(self, mode: Mode, fenced: bool) -> None:
        if mode not in MODES:
            raise StashError(f"unknown mode {mode!r}; expected one of {list(MODES)}")
        self.mode = mode
        self.fenced = fenced
        self._closed = False
        # A savepoint handle's copy of the stash records an identity of its own (its
        # handles are refused by the real stash); this is the identity of the stash it
        # copied, whose handles it accepts for collections of the same id and name.
        self._savepoint_of: str | None = None

    # ----------------------------------------------------------------- opening
    @staticmethod
    def open(url: str, *, mode: Mode = "writable", fenced: bool = True, **options: Any) -> Stash:
        """Open a stash.

        Args:
            url: ``memory://`` (a fresh in-process store; ``memory://NAME`` shares a named
                one within the process), ``sqlite:///path/to/file.db`` (the embedded
                default), or ``postgresql+psycopg://user:pass@host:port/db``.
            mode: ``"writable"``; ``"readonly"`` (reads only, the epoch untouched);
                ``"savepoint"`` (everything works, nothing is ever committed).
            fenced: in writable mode, take the leader epoch so that older handles are
                fenced, and check it on every transaction.  ``fenced=False`` handles are
                optimistic multi-writers: they never fence and are never fenced.
            options: backend options (e.g. ``synchronous="NORMAL"`` for SQLite), and
                ``clock`` (every backend): the :attr:`clock` to use.

        Raises:
            StashError: malformed URL, unknown scheme, unreachable server, schema behind
                the alembic head (with the command to run).
        """
        u = parse_url(url)
        backend = BACKENDS.get(u.get_backend_name())
        if backend is None:
            raise StashError(
                f"unknown stash URL scheme {u.drivername!r} in {redact(u)!r}: expected memory, "
                "sqlite or postgresql+psycopg"
            )
        cls: type[Stash] = load_by_name(backend)
        clock = options.pop("clock", None)
        if clock is not None and not callable(clock):
            raise StashError(f"clock must be a callable returning seconds, got {clock!r}")
        opened = cls._from_url(u, mode=mode, fenced=fenced, **options)
        if clock is not None:
            opened.clock = clock
        return opened

    @classmethod
    def _from_url(cls, url: URL, *, mode: Mode, fenced: bool, **options: Any) -> Stash:
        """Open the stash of the parsed ``url`` whose backend name :data:`BACKENDS` maps
        to this class (each backend checks the rest of the URL its own way).

        Raises:
            StashError: the URL does not suit the backend, or the open fails.
        """
        raise NotImplementedError(f"{cls.__name__} cannot be opened from a URL")

    # ----------------------------------------------------- backend obligations
    @abc.abstractmethod
    def _txn(self, write: bool) -> AbstractContextManager[Txn]:
        """A transaction; ``write=True`` takes the write lock up front."""

    @property
    def redacted_url(self) -> str:
        """This stash's URL with every secret redacted (``***``), for messages."""
        return repr(self)

    def _close(self) -> None:  # noqa: B027 - optional hook
        """Release backend resources."""

    # ---------------------------------------------------------------- helpers
    def _run(self, write: bool, fn: Callable[[Txn], R]) -> R:
        """Run ``fn`` in one transaction. Backends override this to retry transient
        failures (a busy database, a serialization failure) by running ``fn`` again."""
        with self._txn(write) as tx:
            return fn(tx)

    def _write(
        self,
        fn: Callable[[Txn], R],
        *,
        codecs: Sequence[StashCollection[Any, Any]],
        handles: Sequence[StashCollection[Any, Any]] = (),
    ) -> R:
        """Run ``fn`` in one write transaction (every write goes through here).

        Args:
            fn: the transaction's work.
            codecs: the collections whose handles' codecs ``fn`` encodes with: locked
                (in id order) and checked against their recorded codec names first.
            handles: further handles ``fn`` writes through (codecs unchecked): locked
                with ``codecs``; every handle of both is checked to be this stash's
                (:func:`stash.checks.check_handles_tx`) before anything else.

        Raises:
            ReadOnlyError: a readonly handle.
            StashError: a handle of another stash (see
                :func:`stash.checks.check_handles_tx`); a collection records other codecs
                (see :func:`stash.checks.check_codecs_tx`).
        """
        self._check_open()
        if self.mode == "readonly":
            raise ReadOnlyError("cannot write through a stash opened in readonly mode")
        run = with_codec_check(fn, codecs, True, handles, self._check_handles)
        return stash_metrics.observe_txn(self, True, lambda: self._run(True, run))

    def _read(self, fn: Callable[[Txn], R], *, codecs: Sequence[StashCollection[Any, Any]]) -> R:
        """Run ``fn`` in one read transaction (every read goes through here).

        Args:
            fn: the transaction's work.
            codecs: the collections whose handles' codecs the caller decodes ``fn``'s
                result with: checked against their recorded codec names first, in the
                same transaction (so in the snapshot the rows are read from).

        Raises:
            StashError: a collection records other codecs (see
                :func:`stash.checks.check_codecs_tx`).
        """
        self._check_open()
        run = with_codec_check(fn, codecs, False, (), self._check_handles)
        return stash_metrics.observe_txn(self, False, lambda: self._run(False, run))

    def _check_handles(self, tx: Txn, handles: Sequence[StashCollection[Any, Any]]) -> None:
        """:func:`stash.checks.check_handles_tx` for this stash."""
        check_handles_tx(tx, handles, savepoint_of=self._savepoint_of, handle_url=self._handle_url)

    @property
    def _handle_url(self) -> str:
        """The URL (redacted) this handle's collection handles name as their maker."""
        return self.redacted_url + (" (a savepoint)" if self.mode == "savepoint" else "")

    def _check_open(self) -> None:
        if self._closed:
            raise StashError("stash handle is closed")

    @staticmethod
    def _cid(collection: StashCollection[Any, Any]) -> int:
        if not isinstance(collection, StashCollection):
            raise StashError(f"expected a StashCollection, got {type(collection).__name__}")
        return collection.id

    # ---------------------------------------------------------- collections
    def collection(
        self, name: str, key: CodecLike = None, value: CodecLike = None
    ) -> StashCollection[Any, Any]:
        """Load or create the named collection.

        A new collection has no entries, since ``{0}`` and upper ``{0}``.

        Args:
            name: 1 to 255 characters, no control characters.
            key, value: codecs (default canonical JSON); see :func:`stash.codec.resolve_codec`.

        Returns: a :class:`StashCollection` carrying the codecs.

        Raises:
            StashError: bad name; the collection exists with other codecs (naming both);
                it does not exist and this handle is readonly.
        """
        validate_collection_name(name)
        kc, vc = resolve_key_codec(key), resolve_codec(value)
        # Looked up every time: a cached answer would be stale after another handle's
        # migration (TypedCollection.migrate) of the collection.
        sid, found = self._read(lambda tx: (tx.stash_id(), tx.lookup_collection(name)), codecs=())
        if found is None:
            if self.mode == "readonly":
                raise StashError(f"collection {name} does not exist (readonly stash)")

            def create(tx: Txn) -> tuple[str, tuple[int, str, str]]:
                got = tx.lookup_collection(name)
                if got is None:
                    got = (tx.create_collection(name, kc.name, vc.name), kc.name, vc.name)
                return tx.stash_id(), got

            sid, found = self._write(create, codecs=())
        cid, kname, vname = found
        if (kname, vname) != (kc.name, vc.name):
            raise StashError(
                f"collection {name} was created with codecs (key={kname}, value={vname}) "
                f"(or migrated to them) but opened with (key={kc.name}, value={vc.name})"
            )
        return StashCollection(cid, name, kc, vc, stash_id=sid, stash_url=self._handle_url)

    def collections(self) -> dict[str, StashCollection[Any, Any]]:
        """Every collection by name, with the codecs it was created with."""
        sid, listed = self._read(lambda tx: (tx.stash_id(), tx.list_collections()), codecs=())
        out: dict[str, StashCollection[Any, Any]] = {}
        for name, cid, kname, vname in sorted(listed):
            try:
                kc, vc = resolve_codec(kname), resolve_codec(vname)
            except StashError:
                # A codec that cannot be imported here: read its JSON as JSON.  The handle
                # remembers the recorded names (checked by every read and write).
                kc, vc = resolve_codec("json"), resolve_codec("json")
            recorded = None if (kc.name, vc.name) == (kname, vname) else (kname, vname)
            out[name] = StashCollection(
                cid, name, kc, vc, recorded, stash_id=sid, stash_url=self._handle_url
            )
        return out

    # ------------------------------------------------------------------ reads
    def since(self, collection: StashCollection[Any, Any]) -> Antichain:
        """The collection's since (compaction) frontier."""
        cid = self._cid(collection)
        return _ac(self._read(lambda tx: tx.frontiers(cid), codecs=())[0])

    def upper(self, collection: StashCollection[Any, Any]) -> Antichain:
        """The collection's upper frontier: every time before it is sealed."""
        cid = self._cid(collection)
        return _ac(self._read(lambda tx: tx.frontiers(cid), codecs=())[1])

    def iter(self, collection: StashCollection[K, V]) -> list[tuple[tuple[K, V], int, int]]:
        """Every entry as ``((key, value), time, diff)``: consolidated, times advanced to
        the since, sorted by (key, value, time). Times may be beyond the upper.

        Raises:
            StashError: the since is the empty frontier
                (``cannot iterate collection with empty since frontier``); the
                collection records other codecs than the handle's (a migration since
                the handle was made), naming both pairs.
        """
        cid = self._cid(collection)
        since, rows = self._read(lambda tx: self._iter_rows(tx, cid, None), codecs=(collection,))
        cons = consolidate_updates(((k, v), max(t, since), d) for k, v, t, d in rows)
        kc, vc = collection.key_codec, collection.value_codec
        out = [((kc.decode(k), vc.decode(v)), t, d) for (k, v), t, d in cons]
        out.sort(key=lambda e: (kc.sort_key(e[0][0]), vc.sort_key(e[0][1]), e[1]))
        return out

    def iter_key(self, collection: StashCollection[K, V], key: K) -> list[tuple[V, int, int]]:
        """Entries of one key as ``(value, time, diff)``: consolidated, times advanced to
        the since, sorted by (value, time).

        Raises:
            StashError: the since is the empty frontier; the collection records other
                codecs than the handle's (naming both pairs).
        """
        cid = self._cid(collection)
        kj = key_texts(collection.key_codec, key)  # its history under each of its texts
        since, rows = self._read(lambda tx: self._iter_rows(tx, cid, kj), codecs=(collection,))
        cons = consolidate_updates((v, max(t, since), d) for _, v, t, d in rows)
        vc = collection.value_codec
        out = [(vc.decode(v), t, d) for v, t, d in cons]
        out.sort(key=lambda e: (vc.sort_key(e[0]), e[1]))
        return out

    @staticmethod
    def _iter_rows(tx: Txn, cid: int, key: tuple[str, ...] | None) -> tuple[int, list[Row]]:
        since, _ = tx.frontiers(cid)
        if since is None:
            raise StashError("cannot iterate collection with empty since frontier")
        return since, tx.rows(cid) if key is None else [r for k in key for r in tx.rows(cid, k)]

    @staticmethod
    def _peek_ts(name: str, since: int | None, upper: int | None) -> int:
        s, u = _ac(since), _ac(upper)
        if u <= s:
            raise PeekSinceUpperError(
                f"collection {name} since {s} is not less than upper {u}", since=s, upper=u
            )
        if upper is None:
            return I64_MAX
        return upper - 1

    def peek_timestamp(self, collection: StashCollection[Any, Any]) -> int:
        """The latest time at which sealed entries can be read: ``upper - 1`` (or the
        maximum i64 for the empty upper).

        Raises:
            PeekSinceUpperError: ``since`` is not less than ``upper``
                (``collection orders since {0} is not less than upper {0}``).
        """
        cid = self._cid(collection)
        name = collection.name
        return self._read(lambda tx: self._peek_ts(name, *tx.frontiers(cid)), codecs=())

    def _peek_raw_at(
        self, collection: StashCollection[Any, Any], key: KeyProbe | None = None
    ) -> tuple[int, list[tuple[str, str, int]]]:
        """The peek time and the raw rows at it, both read in one read transaction."""
        cid = self._cid(collection)

        def peek(tx: Txn) -> tuple[int, list[tuple[str, str, int]]]:
            ts = self._peek_ts(collection.name, *tx.frontiers(cid))
            return ts, tx.peek_rows(cid, ts, key)

        return self._read(peek, codecs=(collection,))

    def _peek_raw(
        self, collection: StashCollection[Any, Any], key: KeyProbe | None = None
    ) -> list[tuple[str, str, int]]:
        return self._peek_raw_at(collection, key)[1]

    def peek(self, collection: StashCollection[K, V]) -> list[tuple[K, V, int]]:
        """The sealed contents as ``(key, value, diff)``: consolidated, sorted by
        (key, value).

        Raises:
            PeekSinceUpperError: since is not less than upper.
            StashError: the collection records other codecs than the handle's (a
                migration since the handle was made), naming both pairs.
        """
        return self.peek_at(collection)[1]

    def peek_at(self, collection: StashCollection[K, V]) -> tuple[int, list[tuple[K, V, int]]]:
        """``(time, entries)``: the peek time (:meth:`peek_timestamp`) and the sealed
        contents at it (:meth:`peek`), read in one read transaction, so the entries are
        exactly those at that time even while another handle appends (two calls could
        pair a time with entries of a later one).

        Raises: as :meth:`peek`.
        """
        kc, vc = collection.key_codec, collection.value_codec
        ts, rows = self._peek_raw_at(collection)
        # Sort by key; only keys with several values need their values' sort keys.
        rows.sort(key=lambda r: r[0])
        dup = {rows[i][0] for i in range(1, len(rows)) if rows[i][0] == rows[i - 1][0]}
        out = [(kc.decode(k), vc.decode(v), d) for k, v, d in rows]
        if dup:
            out.sort(key=lambda e: vc.sort_key(e[1]))
        out.sort(key=lambda e: kc.sort_key(e[0]))
        return ts, out

    def _peek_unique(
        self,
        collection: StashCollection[K, V],
        rows: list[tuple[str, str, int]] | None = None,
    ) -> list[tuple[str, K, V]]:
        """:func:`stash.peek.peek_unique` of ``rows`` (read here if ``None``)."""
        return peek_unique(collection, self._peek_raw(collection) if rows is None else rows)

    def peek_one(self, collection: StashCollection[K, V]) -> dict[K, V]:
        """The sealed contents as a ``{key: value}`` dict (in key order); ``{}`` for a
        collection nothing was ever appended to (upper ``{0}``).

        Keys are told apart by their canonical encodings (``true`` is not ``1``).  A key
        that decodes to a list (a tuple written with the default JSON codec) is returned
        as a tuple, recursively.

        Raises:
            StashError: a multiplicity other than 1 (``unexpected peek multiplicity``); a
                key with two values; a key that is not hashable (a JSON object: use a
                frozen record type for record keys); two
                distinct keys that Python's dict cannot tell apart (``True`` and ``1``);
                the collection records other codecs than the handle's (naming both);
                PeekSinceUpperError as for :meth:`peek` when something was appended
                (a since at the upper leaves nothing readable; that is not "empty").
        """
        try:
            rows = self._peek_raw(collection)
        except PeekSinceUpperError as e:
            if e.never_written():
                return {}
            raise
        fast = peek_one_fast(collection, rows)
        if fast is not None:
            return fast
        return peek_one_checked(collection, rows)

    def peek_key_one(self, collection: StashCollection[K, V], key: K) -> V | None:
        """The sealed value of one key, or ``None`` (also for a collection nothing was
        ever appended to).

        Raises:
            StashError: the key has several values or a multiplicity other than 1
                (``multiple values unexpected``); the collection records other codecs
                than the handle's (naming both); PeekSinceUpperError as for
                :meth:`peek_one`.
        """
        return self._peek_key_entry(collection, key)[1]

    def _peek_key_entry(self, collection: StashCollection[K, V], key: K) -> tuple[bool, V | None]:
        """``(held, value)``: whether ``key`` holds a sealed value, and the value (a
        stored JSON ``null`` is held: ``(True, None)``).  Raises as :meth:`peek_key_one`."""
        try:
            rows = self._peek_raw(collection, key_probe(key_texts(collection.key_codec, key)))
        except PeekSinceUpperError as e:
            if e.never_written():
                return False, None
            raise
        found = key_entry(collection, key, rows)  # under any of its texts, one of them
        return (False, None) if found is None else (True, collection.value_codec.decode(found[1]))

    # ----------------------------------------------------------------- writes
    def update(
        self, collection: StashCollection[K, V], data: tuple[K, V], time: int, diff: int
    ) -> None:
        """Add one entry; its time must be at or beyond the upper. Durable on return."""
        self.update_many(collection, [(data, time, diff)])

    def update_many(
        self,
        collection: StashCollection[K, V],
        entries: Iterable[tuple[tuple[K, V], int, int]],
    ) -> None:
        """Add entries atomically; each time must be at or beyond the upper.

        Raises:
            StashError: ``entry time 2 is less than the current upper frontier {3}``; an
                entry that does not encode; the diffs of a ``(key, value)`` would sum
                beyond i64 (``diff sums must fit in i64``, see
                :mod:`stash.consolidation`); the collection records other codecs than
                the handle's (a migration since the handle was made: its entries would be
                of the old encoding), naming both pairs; the handle was made by another
                stash (naming both); nothing is written then.
        """
        cid = self._cid(collection)
        rows: list[Row] = []
        for (k, v), t, d in entries:
            kj, vj = collection.encode_entry(k, v)
            rows.append((kj, vj, check_time(t), check_diff(d)))

        def write(tx: Txn) -> None:
            since, upper = tx.frontiers(cid)
            self._check_entry_times(rows, upper)
            if rows:
                tx.insert(cid, rows)
                # Keep the keys written consolidated (and check their diff sums).
                tx.consolidate(cid, since, {k for k, _, _, _ in rows})

        self._write_checked({cid: collection.name}, write, codecs=(collection,))

    @staticmethod
    def _check_entry_times(rows: Sequence[Row], upper: int | None) -> None:
        for _, _, t, _ in rows:
            if upper is None or t < upper:
                raise StashError(
                    f"entry time {t} is less than the current upper frontier {_ac(upper)}"
                )

    def seal(self, collection: StashCollection[Any, Any], upper: Antichain) -> None:
        """Advance the upper: every time before ``upper`` becomes definite.

        Raises:
            StashError: ``seal request {2} is less than the current upper frontier {3}``.
        """
        self.seal_batch([(collection, upper)])

    def seal_batch(self, seals: Sequence[tuple[StashCollection[Any, Any], Antichain]]) -> None:
        """Several seals in one transaction (all or none)."""
        items = [(self._cid(c), _check_antichain(u, "seal request")) for c, u in seals]

        def write(tx: Txn) -> None:
            tx.lock(sorted({cid for cid, _ in items}))
            for cid, new in items:
                self._seal_tx(tx, cid, new)

        # Frontiers only: no entry is encoded (any handle of the collection will do).
        self._write(write, codecs=(), handles=[c for c, _ in seals])

    @staticmethod
    def _seal_tx(tx: Txn, cid: int, new: Antichain) -> None:
        _, upper = tx.frontiers(cid)
        if not _le(upper, new.as_option()):
            raise StashError(
                f"seal request {new} is less than the current upper frontier {_ac(upper)}"
            )
        tx.set_upper(cid, new.as_option())

    def compact(self, collection: StashCollection[Any, Any], since: Antichain) -> None:
        """Advance the since (logical compaction): earlier times read as ``since``.

        Raises:
            StashError: ``compact request {2} is less than the current since frontier
                {3}`` or ``compact request {4} is greater than the current upper frontier
                {3}``.
        """
        self.compact_batch([(collection, since)])

    def compact_batch(
        self, compactions: Sequence[tuple[StashCollection[Any, Any], Antichain]]
    ) -> None:
        """Several compactions in one transaction (all or none)."""
        items = [(self._cid(c), _check_antichain(s, "compact request")) for c, s in compactions]

        def write(tx: Txn) -> None:
            tx.lock(sorted({cid for cid, _ in items}))
            for cid, new in items:
                self._compact_tx(tx, cid, new)

        # Frontiers only: no entry is encoded (any handle of the collection will do).
        self._write(write, codecs=(), handles=[c for c, _ in compactions])

    @staticmethod
    def _compact_tx(tx: Txn, cid: int, new: Antichain) -> None:
        since, upper = tx.frontiers(cid)
        n = new.as_option()
        if not _le(since, n):
            raise StashError(
                f"compact request {new} is less than the current since frontier {_ac(since)}"
            )
        if not _le(n, upper):
            raise StashError(
                f"compact request {new} is greater than the current upper frontier {_ac(upper)}"
            )
        if n != since:  # an unchanged since writes nothing
            tx.set_since(cid, n)

    def consolidate(self, collection: StashCollection[Any, Any]) -> None:
        """Physical compaction, the same rows on every backend: every row moves to
        ``max(time, since)``, one row per (key, value, time), zero diffs dropped (all
        rows go if the since is empty)."""
        self.consolidate_batch([collection])

    def consolidate_batch(self, collections: Sequence[StashCollection[Any, Any]]) -> None:
        """Consolidate several collections in one transaction."""
        ids = sorted({self._cid(c) for c in collections})

        def write(tx: Txn) -> None:
            tx.lock(ids)
            for cid in ids:
                tx.consolidate(cid, tx.frontiers(cid)[0], None)

        # Rows are merged by their stored text, never decoded or encoded: any handle of
        # the collection may consolidate it.
        names = {c.id: c.name for c in collections}
        self._write_checked(names, write, codecs=(), handles=collections)

    def append(self, batches: Iterable[AppendBatch | LogEntry]) -> None:
        """Atomically add entries to, seal and compact several collections (Materialize's
        ``Append``), and add entries to compare-and-set logs (:mod:`stash.logs`: each a
        :class:`~stash.logs.LogEntry`, written first, on top of its expected head).

        For each batch: ``lower`` must equal the collection's upper (then ``upper`` is the
        new upper and ``compact`` the new since); entries must be at or beyond ``lower``.
        Batches are checked in the order given (two batches of one collection chain).
        Entries encoded by hand (not by ``append_to_batch``) must decode with the
        collection's codecs and are stored as the codecs encode them again (canonical),
        alike on every backend.

        Raises:
            AppendLowerMismatch: ``append lower {1} does not match the current upper
                frontier {2} of collection orders``; :class:`~stash.errors.LogRaceLost`
                (a subclass) when a log's head is not a log entry's expected one;
            StashError: any seal/compact/entry-time rule of the single methods; the
                diffs of a ``(key, value)`` would sum beyond i64 (``diff sums must fit
                in i64``); a batch's collection records other codecs than its handle's
                (a migration since the handle was made), naming both pairs; a batch's
                handle was made by another stash (its ``stash_id`` is not the one this
                stash records), naming both stashes (URLs redacted) and their ids; an
                entry encoded by hand that is not an encoding of the collection's codec.
            In every case nothing is committed.
        """
        items = list(batches)
        logs = checked_entries([x for x in items if isinstance(x, LogEntry)])
        checked: list[AppendBatch] = []
        for b in items:
            if isinstance(b, LogEntry):
                continue
            if not isinstance(b, AppendBatch):
                raise StashError(
                    f"append takes AppendBatch (or LogEntry) objects, got {type(b).__name__}"
                )
            _check_antichain(b.lower, "append lower")
            _check_antichain(b.upper, "append upper")
            _check_antichain(b.compact, "append compact")
            checked.append(b)
        entries = [b.canonical_entries() for b in checked]
        for es in entries:
            for _, t, d in es:
                check_time(t)
                check_diff(d)
        # No batch still runs the (empty) transaction: a fenced-out leader learns it here
        # as from any other write.
        names = {b.collection.id: b.collection.name for b in checked}
        self._write_checked(
            names,
            lambda tx: self._append_tx(tx, checked, entries, logs),
            codecs=[b.collection for b in checked],
        )

    def _write_checked(
        self,
        names: dict[int, str],
        fn: Callable[[Txn], R],
        *,
        codecs: Sequence[StashCollection[Any, Any]],
        handles: Sequence[StashCollection[Any, Any]] = (),
    ) -> R:
        """:meth:`_write`, reporting a broken rule on diff sums with the collection's name
        (the same error on every backend; the transaction was rolled back)."""
        try:
            return self._write(fn, codecs=codecs, handles=handles)
        except DiffSumOverflow as e:
            name = names.get(e.collection_id, f"id {e.collection_id}")
            raise StashError(
                f"write to collection {name} refused, nothing committed: {DIFF_SUM_RULE}"
            ) from None

    def _append_tx(
        self,
        tx: Txn,
        batches: list[AppendBatch],
        entries: list[list[tuple[tuple[str, str], int, int]]],
        logs: Sequence[LogEntry] = (),
    ) -> None:
        if logs:
            insert_entries(tx, logs)  # first: a lost race ends the transaction at once
            if not batches:
                return
        tx.lock(sorted({b.collection.id for b in batches}))
        for b, es in zip(batches, entries, strict=True):
            cid = b.collection.id
            _, upper = tx.frontiers(cid)
            if upper != b.lower.as_option():
                raise AppendLowerMismatch(
                    f"append lower {b.lower} does not match the current upper frontier "
                    f"{_ac(upper)} of collection {b.collection.name}",
                    b.collection.name,
                    b.lower,
                    _ac(upper),
                )
            rows = [(k, v, t, d) for (k, v), t, d in es]
            self._check_entry_times(rows, upper)
            if rows:
                tx.insert(cid, rows)
            self._seal_tx(tx, cid, b.upper)
            self._compact_tx(tx, cid, b.compact)
            if b._stamp:  # make_batch under a retention by duration (stash.retention)
                since = b.compact.as_option()
                at_ms = int(self.clock() * 1000)
                record_commit_time(
                    tx, cid, b.timestamp, at_ms, b.timestamp if since is None else since
                )
            if rows:
                # Keep the collection physically consolidated where this batch touched it.
                tx.consolidate(cid, b.compact.as_option(), {k for k, _, _, _ in rows})

    # ----------------------------------------------------------- transactions
    def with_transaction(
        self, fn: Callable[[Transaction], R], *, retries: int = DEFAULT_RETRIES
    ) -> R:
        """Run ``fn(tx)`` with reads at one consistent point and commit its changes
        atomically, only if nothing it read has changed since (Materialize's
        ``with_transaction``): a collection read whole must still be at the upper read,
        a key read must not have been written since, so writers of distinct keys do not
        conflict.

        ``tx.peek_one(c)``, ``tx.peek_key_one(c, key)`` and
        ``tx.table(c, uniqueness_violation=None)`` (a :class:`~stash.TableTransaction`
        whose changes commit with ``fn``; without a uniqueness rule it reads keys as it
        is asked about them) read; ``c`` is a collection handle or a
        :class:`~stash.TypedCollection`.  On a conflict ``fn`` runs again from scratch,
        so it must not have other side effects.  See :mod:`stash.transaction`.

        Args:
            fn: the transaction's work; its result is returned.
            retries: how many times ``fn`` may run again after a conflict (>= 0).

        Returns: ``fn``'s result.

        Raises:
            AppendLowerMismatch: still conflicting after ``retries`` runs again (nothing
                was committed).
            StashError: as ``append`` (a uniqueness violation, a readonly handle...);
                whatever ``fn`` raises is raised as is; nothing is committed then.
        """
        self._check_open()
        return run_transaction(self, fn, retries)

    # ------------------------------------------------------------- leadership
    def confirm_leadership(self) -> None:
        """Check that this handle is still the leader.

        Raises:
            FenceError: a newer handle took the epoch (unrecoverable).
        """
        self._read(lambda tx: tx.check_fence(), codecs=())

    def close(self) -> None:
        """Release the handle's resources. Idempotent."""
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self) -> Stash:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Any]:  # pragma: no cover - guard against misuse
        raise TypeError("a Stash is not iterable; use stash.iter(collection)")

    # ------------------------------------- key ranges, change feed, operations
    # Thin entry points to the modules that hold these features (found by name, as the
    # backends are: those modules sit above this one); each documents its arguments.
    def peek_range(
        self,
        collection: StashCollection[K, V],
        lower: K | None = None,
        upper: K | None = None,
        prefix: Any = None,
        limit: int | None = None,
        *,
        after: K | None = None,
        at: int | None = None,
    ) -> Any:
        """A page of sealed entries of a key range in key order, through the key index
        (:func:`stash.ranges.peek_range`): a :class:`stash.ranges.RangePage`."""
        fn = load_by_name("stash.ranges.peek_range")
        return fn(self, collection, lower, upper, prefix, limit, after, at)

    def subscribe(
        self,
        collections: Sequence[StashCollection[Any, Any]],
        as_of: int | dict[str, int],
        *,
        snapshot: bool = True,
        poll_interval: float = 0.2,
        idle_timeout: float | None = None,
    ) -> Iterator[Any]:
        """A change feed of ``Change`` and ``Progress`` events, resumable from a
        progress upper (:func:`stash.feed.subscribe`)."""
        fn = load_by_name("stash.feed.subscribe")
        it: Iterator[Any] = fn(
            self,
            collections,
            as_of,
            snapshot=snapshot,
            poll_interval=poll_interval,
            idle_timeout=idle_timeout,
        )
        return it

    def set_retention(
        self,
        collection: StashCollection[Any, Any],
        *,
        keep_times: int | None | EllipsisType = ...,
        keep_for: dt.timedelta | None = None,
    ) -> None:
        """Make the collection's since follow a retention instead of every append: the
        last ``keep_times`` times, every time committed within ``keep_for`` of
        :attr:`clock`, or both (:func:`stash.feed.set_retention`)."""
        load_by_name("stash.feed.set_retention")(self, collection, keep_times, keep_for)

    def batch_frontiers(
        self, collection: StashCollection[Any, Any]
    ) -> tuple[int | None, int, bool]:
        """``(upper, compact, stamp)`` of a new batch (``StashCollection.make_batch``),
        read in one read transaction (:func:`stash.retention.batch_frontiers`)."""
        result: tuple[int | None, int, bool] = load_by_name("stash.retention.batch_frontiers")(
            self, collection
        )
        return result
