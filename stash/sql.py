"""The SQL backend of the stash (:class:`SqlStash`): what SQLite (the embedded default)
and Postgres share, on a SQLAlchemy engine (pool, URL, dialect, alembic): opening,
retries, transactions, fencing, the schema check, and :class:`SqlTxn`, the primitive
transaction in SQLite's SQL (Postgres overrides it).  What differs per database is a
dialect's :class:`_Ops`, found by name (:data:`SQL_DIALECTS`): :mod:`stash.sqlite` and
:mod:`stash.postgres` import this module, never the reverse.

Transactions run on the pool's DBAPI connections (``sqlite3`` / ``psycopg``) with
hand-written SQL whose values are always bound parameters: the hot path of a stash is a
handful of tiny statements, and SQLAlchemy's per-statement machinery cost more than the
database did (see ``bench/bench_stash_append.py``).  The schema itself is SQLAlchemy
metadata (:mod:`stash.schema`), created only by alembic.

Invariants kept here:

* every public stash method runs as one database transaction; writers on SQLite take the
  write lock up front (``BEGIN IMMEDIATE``), so a transaction never fails half-way on a
  lock upgrade;
* transient failures ("database is locked", serialization failures and deadlocks, a
  connection lost before COMMIT, a collection created concurrently) are retried, the
  whole transaction again, with jittered exponential backoff (tenacity) until the retry
  budget is spent, so they never reach the caller while it lasts;
* consolidation (of the keys an append or update wrote, or of a whole collection) sums
  exactly (Python integers on SQLite, numeric on Postgres) and is checked against the
  rule on diff sums before anything commits; a whole collection's leaves the rows the
  memory backend holds; on SQLite an append's rows are buffered and merged with the
  stored rows of their keys before anything is written (a row that consolidation would
  delete in the same transaction is never written), and every buffered row is written
  before any read of its collection and before COMMIT;
* a COMMIT whose outcome cannot be known raises an
  :class:`~stash.errors.IndeterminateError`, never success or plain failure (Postgres
  first asks the server what became of the transaction, see :mod:`stash.postgres`);
* a writable handle runs its write transactions on one connection it holds (checked out
  of the pool at the first write, given back by ``close``); a thread that finds it in
  use takes a pooled connection; a held connection that was lost, or whose COMMIT's
  outcome is unknown, or that a failure left inside a transaction, is dropped (the
  next write checks out a new one);
* a fenced writable handle bumps ``fence.epoch`` at open and checks epoch and nonce in
  every transaction, before anything it writes; an older handle then fails with a
  :class:`~stash.errors.FenceError`;
* a database behind the alembic head fails to open with the revision found and the
  command to run, except that a handle with ``auto_migrate`` (the default of a writable
  SQLite stash) upgrades it, empty or at any earlier revision, one migration at a time
  (in the process and, on Postgres, in the database: :mod:`stash.migrate`);
* SQLite runs in WAL mode with ``synchronous=FULL`` by default; the database file is
  created readable by its owner only; a readonly handle never takes the write lock (not
  to check the schema, nor to set the journal mode) and never migrates;
* savepoint mode runs on one private connection inside one transaction that is never
  committed, against session-private (``TEMP``) copies of the stash tables taken at open:
  other handles see nothing and are never blocked by its row locks;
* no message, log line or repr carries a password (URLs go through
  :func:`stash.url.redact`).

Source of the idea: Materialize's ``Sqlite`` and ``Postgres`` stash backends
(``src/stash/src/lib.rs``).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import sqlalchemy as sa
import tenacity
from sqlalchemy.engine import URL

from stash import metrics as stash_metrics
from stash import schema
from stash.base import Mode, Stash, load_by_name
from stash.errors import IndeterminateError, MigrationRequired, StashError
from stash.migrate import (
    current_revision,
    known_revisions,
    lock_migrations,
    upgrade_connection,
)
from stash.sql_txn import SqlTxn
from stash.txn import Txn
from stash.url import redact

if TYPE_CHECKING:
    from sqlalchemy.pool import PoolProxiedConnection

log = logging.getLogger(__name__)
R = TypeVar("R")

#: The stash tables, each with its columns in order (savepoint copies use them).
TABLE_COLUMNS: dict[str, tuple[str, ...]] = {
    "fence": ("epoch", "nonce", "stash_id"),
    "collections": ("collection_id", "name", "key_codec", "value_codec"),
    "data": ("collection_id", "key", "value", "time", "diff"),
    "sinces": ("collection_id", "since"),
    "uppers": ("collection_id", "upper"),
    "commit_times": ("collection_id", "time", "committed_at"),
    "logs": ("name", "seqno", "rollup", "data"),
}


class EngineOptions(NamedTuple):
    """The options of :class:`SqlStash` that shape its engine (each dialect takes its own;
    see :class:`SqlStash` for what they mean)."""

    synchronous: str
    busy_timeout: float
    pool_size: int
    connect_timeout: float
    pre_ping: bool


class _Transient(Exception):
    """Internal: a transaction failed in a way that is safe to run again."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name if it has none), with
    anything that looks like a credential hidden (:func:`stash.url.redact`): a driver's
    message may quote a connection string."""
    text = str(e).strip()
    return redact(text.splitlines()[0]) if text else type(e).__name__


#: The SQL dialects, by the backend name of the URL (``URL.get_backend_name``): the
#: ``"module.Class"`` of each dialect's :class:`_Ops`, imported only when a stash of it
#: opens.  The dialect modules import this one; this one never imports them (SQLAlchemy's
#: ``dialects/__init__.py`` loads its dialects by name the same way).
SQL_DIALECTS: dict[str, str] = {
    "sqlite": "stash.sqlite.SqliteOps",
    "postgresql": "stash.postgres.PgOps",
}


def sql_dialect(backend: str) -> _Ops:
    """A new :class:`_Ops` of the SQL dialect named ``backend`` (see :data:`SQL_DIALECTS`).

    Raises:
        StashError: no SQL dialect of that name.
    """
    qualname = SQL_DIALECTS.get(backend)
    if qualname is None:
        raise StashError(f"no SQL stash backend {backend!r}; expected one of {list(SQL_DIALECTS)}")
    ops: _Ops = load_by_name(qualname)()
    return ops


class _Ops:
    """What differs between SQL backends: the URL they accept, their engine, and how a
    transaction begins, commits and fails.

    One instance per :class:`SqlStash`, chosen by name (:data:`SQL_DIALECTS`):
    ``SqliteOps`` in :mod:`stash.sqlite`, ``PgOps`` in :mod:`stash.postgres`.
    """

    name = "sql"

    def stash_url(self, url: URL) -> URL:
        """``url`` checked as a stash URL of this dialect and as the engine gets it.

        Raises:
            StashError: the URL breaks a rule of the dialect (the message says which).
        """
        return url

    def engine(self, url: URL, mode: Mode, options: EngineOptions) -> sa.Engine:
        """The SQLAlchemy engine (pool) of a stash at ``url`` opened in ``mode``.

        Raises:
            StashError: a bad option, or (SQLite) a file that cannot be created or is
                missing.
        """
        raise NotImplementedError

    def txn(self, stash: SqlStash, dbc: Any, write: bool, savepoint: bool) -> SqlTxn:
        """A primitive transaction on the DBAPI connection ``dbc``."""
        raise NotImplementedError

    def begin(self, dbc: Any, write: bool) -> None:
        """Start a transaction on ``dbc`` (``write``: take the write lock up front)."""
        raise NotImplementedError

    def commit(self, stash: SqlStash, tx: SqlTxn, dbc: Any) -> None:
        """Commit; raise :class:`_Transient` (not committed, run again),
        :class:`IndeterminateError` (outcome unknown) or :class:`StashError`."""
        raise NotImplementedError

    def rollback(self, dbc: Any) -> None:
        """Roll back whatever is open on ``dbc``; never raises."""
        raise NotImplementedError

    def is_idle(self, dbc: Any) -> bool:
        """Whether ``dbc`` is usable and outside any transaction (after a rollback)."""
        raise NotImplementedError

    def is_lost(self, e: BaseException, dbc: Any) -> bool:
        """Whether ``e`` means the connection is gone (never to be reused)."""
        return False

    def classify(self, e: BaseException, opening: bool) -> BaseException:
        """Map a failure to :class:`_Transient` (retry), a :class:`StashError`, or ``e``
        itself (a bug or an interrupt: re-raised as is)."""
        raise NotImplementedError

    def savepoint_open(self, dbc: Any, stash_id: str) -> str:
        """Start the never-committed transaction of a savepoint handle and copy the stash
        tables into session-private temporary tables that shadow them, the copy's identity
        being ``stash_id``; return the identity of the stash copied."""
        raise NotImplementedError

    def execute(self, dbc: Any, sql: str) -> None:
        """Run one parameterless statement (``SAVEPOINT`` and friends)."""
        dbc.execute(sql)


class SqlStash(Stash):
    """A stash in a SQL database: SQLite (``sqlite:///path``) or Postgres
    (``postgresql+psycopg://...``). Open it with :meth:`stash.Stash.open`.

    Args:
        url: a parsed SQLAlchemy URL.
        mode, fenced: see :meth:`stash.Stash.open`.
        synchronous: SQLite ``PRAGMA synchronous`` (``FULL`` default, or ``NORMAL``,
            ``EXTRA``, ``OFF``).
        busy_timeout: seconds SQLite waits on a lock before reporting busy (default 5).
        retry_budget: seconds of retries of transient failures before giving up
            (default 60); also bounds how long Postgres is asked about a lost COMMIT.
        pool_size: connections kept per handle (default 5).
        auto_migrate: upgrade a database behind the alembic head at open (default: true
            for writable SQLite, false otherwise).
        connect_timeout: Postgres: seconds to wait for a connection (default 10; an
            integer >= 2, libpq's rule).
        pre_ping: Postgres: test a pooled connection with a round trip before each
            transaction (default false: a dead connection fails the transaction before
            COMMIT, which is then run again on a new one, so the ping only costs time).

    Raises:
        StashError: unreachable database (at once, without retries), bad option, schema
            behind head.
    """

    def __init__(
        self,
        url: URL,
        *,
        mode: Mode = "writable",
        fenced: bool = True,
        synchronous: str = "FULL",
        busy_timeout: float = 5.0,
        retry_budget: float = 60.0,
        pool_size: int = 5,
        auto_migrate: bool | None = None,
        connect_timeout: float = 10.0,
        pre_ping: bool = False,
    ) -> None:
        super().__init__(mode, fenced)
        self._url = url
        self._redacted: tuple[URL, str] | None = None
        self.backend = url.get_backend_name()
        try:
            self.retry_budget = float(retry_budget)
            pool_size = int(pool_size)
        except (TypeError, ValueError):
            raise StashError("retry_budget must be a number and pool_size an integer") from None
        if self.retry_budget < 0 or pool_size < 1:
            raise StashError("retry_budget must be >= 0 and pool_size >= 1")
        self._epoch: int | None = None
        self._nonce = b""
        self._sp_fairy: PoolProxiedConnection | None = None
        self._sp_lock = threading.RLock()
        # The connection held for write transactions (see _attempt_held), checked out
        # at the first write; a thread that finds it in use takes a pooled one.  Not
        # with pre_ping: a held connection would skip the ping the caller asked for.
        self._held: PoolProxiedConnection | None = None
        self._pid = os.getpid()  # a forked child owns none of this process's connections
        self._held_lock = threading.Lock()
        self._hold = not pre_ping and mode == "writable"
        self._opening = True  # a server that is down at open fails fast, without retries
        self._ops = sql_dialect(self.backend)
        self.engine = self._ops.engine(
            url,
            mode,
            EngineOptions(synchronous, busy_timeout, pool_size, connect_timeout, pre_ping),
        )
        try:
            if auto_migrate is None:
                auto_migrate = self.backend == "sqlite" and mode == "writable"
            self._check_schema(auto_migrate)
            if mode == "savepoint":
                self._open_savepoint()
            if fenced and mode == "writable":
                self._take_epoch()
            self._opening = False
        except BaseException:
            self._close()
            raise

    @classmethod
    def _from_url(cls, url: URL, *, mode: Mode, fenced: bool, **options: Any) -> SqlStash:
        """See :meth:`stash.base.Stash._from_url`: the dialect checks the URL first."""
        return cls(
            sql_dialect(url.get_backend_name()).stash_url(url), mode=mode, fenced=fenced, **options
        )

    def __repr__(self) -> str:
        return f"SqlStash({redact(self._url)!r}, mode={self.mode!r}, fenced={self.fenced})"

    @property
    def redacted_url(self) -> str:
        # Redacted once per URL (a URL is immutable): every write names its handle by it.
        cached = self._redacted
        if cached is None or cached[0] is not self._url:
            cached = self._redacted = (self._url, redact(self._url))
        return cached[1]

    # ------------------------------------------------------------ open helpers
    def _check_schema(self, auto_migrate: bool) -> None:
        if self.mode == "readonly" and auto_migrate:
            raise StashError("a readonly stash cannot migrate its schema (auto_migrate=True)")

        def check() -> None:
            with self.engine.connect() as conn:
                # Only a handle that may migrate takes the write lock to check (a readonly
                # open never waits behind a writer, nor blocks one).
                conn.execution_options(stash_write=auto_migrate)
                with conn.begin():
                    if auto_migrate:
                        # Before reading the version: a migration running in another
                        # session (another process or thread) commits first.
                        lock_migrations(conn)
                    found = current_revision(conn)
                    if found == schema.SCHEMA_HEAD:
                        return
                    if not auto_migrate or not (found is None or found in known_revisions()):
                        raise MigrationRequired(
                            f"database {redact(self._url)} is at schema revision "
                            f"{found or 'none (empty database)'} but this code needs "
                            f"{schema.SCHEMA_HEAD}; run: stash migrate '{redact(self._url)}'"
                        )
                    log.info(
                        "upgrading stash schema of %s from %s to %s",
                        redact(self._url),
                        found,
                        schema.SCHEMA_HEAD,
                    )
                    upgrade_connection(conn, "head")

        self._retrying(check)

    def _take_epoch(self) -> None:
        nonce = secrets.token_bytes(16)
        self._epoch = self._run(True, lambda tx: _sql_txn(tx).bump_epoch(nonce))
        self._nonce = nonce
        log.info("stash %s: took leader epoch %d", redact(self._url), self._epoch)

    def _open_savepoint(self) -> None:
        def open_sp() -> PoolProxiedConnection:
            fairy = self.engine.raw_connection()
            try:
                self._savepoint_of = self._ops.savepoint_open(
                    fairy.driver_connection, uuid.uuid4().hex
                )
            except BaseException:
                fairy.invalidate()
                fairy.close()
                raise
            return fairy

        self._sp_fairy = self._retrying(open_sp)

    # --------------------------------------------------------- transactions
    def _retrying(self, attempt: Callable[[], R]) -> R:
        """Run ``attempt`` until it returns or fails for good; transient failures are
        retried with jittered exponential backoff within ``retry_budget`` seconds (the
        first try runs without building a tenacity loop: that costs tens of microseconds)."""
        try:
            return self._classified(attempt)
        except _Transient as t:
            stash_metrics.record_retry(self.backend)
            log.info(
                "stash %s: transient failure, running the transaction again: %s",
                redact(self._url),
                first_line(_driver_error(t.cause)),
            )
        retryer = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(_Transient),
            wait=tenacity.wait_random_exponential(multiplier=0.002, max=0.5),
            stop=tenacity.stop_after_delay(self.retry_budget),
            reraise=True,
            before_sleep=lambda _: stash_metrics.record_retry(self.backend),
        )
        try:
            for at in retryer:
                with at:
                    return self._classified(attempt)
        except _Transient as t:
            raise StashError(
                f"{self._ops.name}: {first_line(_driver_error(t.cause))}"
                f" (gave up after retrying for {self.retry_budget:g} s)"
            ) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _classified(self, attempt: Callable[[], R]) -> R:
        """One try; failures come out as :class:`_Transient`, a :class:`StashError`, or
        (bugs, interrupts) as they were."""
        try:
            return attempt()
        except _Transient:
            raise
        except BaseException as e:
            c = self._ops.classify(e, self._opening)
            if c is e:
                raise
            raise c from None

    def _run(self, write: bool, fn: Callable[[Txn], R]) -> R:
        if self._sp_fairy is not None:
            return self._run_savepoint(write, fn)
        return self._retrying(lambda: self._attempt(write, fn))

    def _attempt(self, write: bool, fn: Callable[[Txn], R]) -> R:
        """One try of a transaction: a write on the held connection when no other thread
        is using it (:meth:`_attempt_held`), anything else on a pooled connection."""
        if self._pid != os.getpid():
            self._forked()
        if write and self._hold and self._held_lock.acquire(blocking=False):
            try:
                return self._attempt_held(fn)
            finally:
                self._held_lock.release()
        fairy = self.engine.raw_connection()
        try:
            if self._closed:  # closed while this thread checked out: run nothing
                raise StashError("stash handle is closed")
            return self._once(fairy.driver_connection, write, fn)
        except BaseException as e:
            if self._broken(e, fairy.driver_connection):
                fairy.invalidate()  # never hand a broken connection to the next caller
            raise
        finally:
            if self._closed and fairy.is_valid:
                # The pool was (or is being) disposed: close the connection rather
                # than give it back to a pool nobody will dispose again.
                fairy.invalidate()
            fairy.close()

    def _forked(self) -> None:
        """In a child forked from the process that opened this handle (Spark forks its
        Python workers): the held and pooled connections (sockets, SQLite handles) are
        the parent's; leave them to it, untouched, and open new ones.  The held
        connection's lock is made anew: another thread of the parent may have held it
        at the fork, and no thread of the child would ever release it."""
        self._held_lock = threading.Lock()
        self._held = None
        self.engine.dispose(close=False)
        self._pid = os.getpid()

    def _attempt_held(self, fn: Callable[[Txn], R]) -> R:
        """One try of a write transaction on the connection this handle holds for its
        writes (checked out of the pool once, not per transaction: a one-entry append or
        log write is a handful of statements, and the pool's checkout and return, with
        its reset, cost as much CPU as they do).  The caller holds ``_held_lock``.  A
        connection that failed in a way that may have left it unusable (lost, an
        unknown COMMIT outcome, a transaction left open) is dropped; the next write
        checks out a new one."""
        fairy = self._held
        if fairy is None:
            if self._closed:  # closed concurrently: the pool says what that means
                raise StashError("stash handle is closed")
            fairy = self._held = self.engine.raw_connection()
        dbc = fairy.driver_connection
        try:
            return self._once(dbc, True, fn)
        except BaseException as e:
            if self._broken(e, dbc) or not self._ops.is_idle(dbc):
                self._held = None
                fairy.invalidate()
                fairy.close()
            raise

    def _once(self, dbc: Any, write: bool, fn: Callable[[Txn], R]) -> R:
        """Run ``fn`` as one transaction on the DBAPI connection ``dbc``, committed."""
        ops = self._ops
        ops.begin(dbc, write)
        tx: SqlTxn | None = None
        try:
            tx = ops.txn(self, dbc, write, False)
            result = fn(tx)
            tx.finish()
        except BaseException as e:
            try:
                if tx is not None:
                    tx.fence_before(e)
            finally:
                ops.rollback(dbc)
            raise
        ops.commit(self, tx, dbc)
        return result

    def _broken(self, e: BaseException, dbc: Any) -> bool:
        """Whether the failure ``e`` of a transaction on ``dbc`` means the connection
        must never be used again (lost, or its COMMIT's outcome unknown)."""
        cause = e.cause if isinstance(e, _Transient) else e
        return isinstance(e, IndeterminateError) or self._ops.is_lost(cause, dbc)

    def _run_savepoint(self, write: bool, fn: Callable[[Txn], R]) -> R:
        """One operation of a savepoint handle: a SAVEPOINT inside its open transaction,
        released on success and rolled back to on failure (no retries: a lost connection
        loses the savepoint's state, so it ends the handle's usefulness)."""
        ops = self._ops
        with self._sp_lock:
            fairy = self._sp_fairy
            if fairy is None:  # pragma: no cover - closed concurrently
                raise StashError("stash handle is closed")
            dbc = fairy.driver_connection
            try:
                ops.execute(dbc, "SAVEPOINT stash_op")
                try:
                    tx = ops.txn(self, dbc, write, True)
                    result = fn(tx)
                    tx.finish()
                except BaseException:
                    ops.execute(dbc, "ROLLBACK TO SAVEPOINT stash_op")
                    ops.execute(dbc, "RELEASE SAVEPOINT stash_op")
                    raise
                ops.execute(dbc, "RELEASE SAVEPOINT stash_op")
                return result
            except BaseException as e:
                cause = e.cause if isinstance(e, _Transient) else e
                if ops.is_lost(cause, dbc):
                    raise StashError(
                        f"{ops.name}: the connection of this savepoint handle was lost, and "
                        f"with it everything done through it: {first_line(_driver_error(cause))}"
                    ) from None
                c = ops.classify(cause, False)
                if isinstance(c, _Transient):
                    raise StashError(f"{ops.name}: {first_line(_driver_error(cause))}") from None
                if c is cause:
                    raise
                raise c from None

    @contextmanager
    def _txn(self, write: bool) -> Iterator[Txn]:
        """One transaction without retries (``_run`` is what the stash uses)."""
        fairy = self.engine.raw_connection()
        dbc = fairy.driver_connection
        try:
            self._ops.begin(dbc, write)
            tx = self._ops.txn(self, dbc, write, False)
            try:
                yield tx
                tx.finish()
            except BaseException as e:
                try:
                    tx.fence_before(e)
                finally:
                    self._ops.rollback(dbc)
                raise
            self._ops.commit(self, tx, dbc)
        finally:
            fairy.close()

    def _close(self) -> None:
        if self._pid != os.getpid():
            # A forked child closing its copy: the connections are the parent's (giving
            # the held one back would roll back on its socket, disposing would end its
            # sessions); leave them, and close only what the child opened since.
            self._forked()
            self._sp_fairy = None
        with self._held_lock:  # waits for a write running on the held connection
            held, self._held = self._held, None
        if held is not None:
            held.close()  # back to the pool, which dispose() below closes
        fairy, self._sp_fairy = self._sp_fairy, None
        if fairy is not None:
            with self._sp_lock:
                self._ops.rollback(fairy.driver_connection)
                # The connection held the savepoint's temporary tables: never reuse it.
                fairy.invalidate()
                fairy.close()
        self.engine.dispose()


def _driver_error(e: BaseException) -> BaseException:
    """The DBAPI exception inside a SQLAlchemy wrapper (or ``e`` itself)."""
    if isinstance(e, sa.exc.DBAPIError) and e.orig is not None:
        return e.orig
    return e


def _sql_txn(tx: Txn) -> SqlTxn:
    assert isinstance(tx, SqlTxn)
    return tx
