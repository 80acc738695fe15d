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

import json
import logging
import secrets
import sqlite3
import threading
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import sqlalchemy as sa
import tenacity
from sqlalchemy.engine import URL

from stash import metrics as stash_metrics
from stash import schema
from stash.base import Mode, Stash, load_by_name
from stash.consolidation import DiffSumOverflow, diff_sums_fit
from stash.errors import FenceError, IndeterminateError, MigrationRequired, StashError
from stash.migrate import (
    current_revision,
    known_revisions,
    lock_migrations,
    upgrade_connection,
)
from stash.txn import LogRow, Row, Txn
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


def fence_error(mine: int, found: int | None) -> FenceError:
    """The unrecoverable error of a handle whose epoch ``mine`` was superseded."""
    return FenceError(
        f"stash fenced: this handle's epoch {mine} was superseded by epoch {found}; "
        "another handle opened the stash with fenced=True"
    )


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
        """One try of a transaction on a pooled connection."""
        ops = self._ops
        fairy = self.engine.raw_connection()
        dbc = fairy.driver_connection
        try:
            ops.begin(dbc, write)
            try:
                tx = ops.txn(self, dbc, write, False)
                result = fn(tx)
                tx.finish()
            except BaseException:
                ops.rollback(dbc)
                raise
            ops.commit(self, tx, dbc)
            return result
        except BaseException as e:
            cause = e.cause if isinstance(e, _Transient) else e
            if ops.is_lost(cause, dbc) or isinstance(e, IndeterminateError):
                fairy.invalidate()  # never hand a broken connection to the next caller
            raise
        finally:
            fairy.close()

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
            except BaseException:
                self._ops.rollback(dbc)
                raise
            self._ops.commit(self, tx, dbc)
        finally:
            fairy.close()

    def _close(self) -> None:
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


# A collection's frontiers, recorded codec names, name and the stash's identity, in one
# statement (every write through a handle checks them; this way the check costs no query).
_SQLITE_FRONTIERS = (
    "SELECT s.since, u.upper, c.key_codec, c.value_codec, c.name, f.stash_id FROM sinces s"
    " JOIN uppers u ON u.collection_id = s.collection_id"
    " JOIN collections c ON c.collection_id = s.collection_id CROSS JOIN fence f"
    " WHERE s.collection_id = :c"
)
_SQLITE_PEEK = (
    "SELECT key, value, sum(diff) FROM data WHERE collection_id = :c AND time <= :ts"
    " GROUP BY key, value HAVING sum(diff) <> 0"
)
# The rows a peek of a whole collection consolidates (in Python: _consolidate_peek).
_SQLITE_PEEK_ROWS = "SELECT key, value, diff FROM data WHERE collection_id = :c AND time <= :ts"
# With a key, "+time" keeps SQLite (which has no statistics) off the (collection_id, time)
# index: the (collection_id, key) index finds a key's few rows instead of scanning the
# collection (and the per-key consolidation of every append stays O(rows of the key)).
_SQLITE_PEEK_KEY = (
    "SELECT key, value, sum(diff) FROM data WHERE collection_id = :c AND +time <= :ts"
    " AND key = :k GROUP BY key, value HAVING sum(diff) <> 0"
)
# Every row of a collection (of one key, of several keys) with its rowid, to consolidate.
_SQLITE_ROWS = "SELECT rowid, key, value, time, diff FROM data WHERE collection_id = :c"
_SQLITE_ROWS_KEY = (
    "SELECT rowid, key, value, time, diff FROM data WHERE collection_id = :c AND key = :k"
)
_SQLITE_ROWS_KEYS = (
    "SELECT rowid, key, value, time, diff FROM data WHERE collection_id = :c"
    " AND key IN (SELECT value FROM json_each(:ks))"
)

# The same rows taken out of the table as they are read (the rows of an append's keys are
# all rewritten by its consolidation), where SQLite has RETURNING (3.35 and later).
_HAS_RETURNING = sqlite3.sqlite_version_info >= (3, 35, 0)
_SQLITE_TAKE_KEY = (
    "DELETE FROM data WHERE collection_id = :c AND key = :k RETURNING key, value, time, diff"
)
_SQLITE_TAKE_KEYS = (
    "DELETE FROM data WHERE collection_id = :c"
    " AND key IN (SELECT value FROM json_each(:ks)) RETURNING key, value, time, diff"
)


# Compare-and-set logs (stash.logs): the entry goes in only if the log's head (its
# greatest seqno, read through the primary key) is the expected one (NULL: no entry).
_SQLITE_LOG_INSERT = (
    "INSERT INTO logs (name, seqno, rollup, data) SELECT ?, ?, ?, ?"
    " WHERE (SELECT max(seqno) FROM logs WHERE name = ?) IS ?"
)
# From the latest rollup on (every entry when there is none).
_SQLITE_LOG_HEAD = (
    "SELECT seqno, rollup, data FROM logs WHERE name = ?1 AND seqno >= coalesce("
    "(SELECT seqno FROM logs WHERE name = ?2 AND rollup ORDER BY seqno DESC LIMIT 1), 0)"
    " ORDER BY seqno"
)
_SQLITE_LOG_SCAN = (
    "SELECT seqno, rollup, data FROM logs WHERE name = ? AND seqno >= ? ORDER BY seqno"
)
# Never the head: a log keeps its latest entry, so its head seqno never goes back.
_SQLITE_LOG_TRUNCATE = (
    "DELETE FROM logs WHERE name = ? AND seqno < ?"
    " AND seqno < (SELECT max(seqno) FROM logs WHERE name = ?)"
)
_LOG_NAMES = "SELECT DISTINCT name FROM logs ORDER BY name"


def _consolidate_peek(rows: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    """``rows`` (``(key, value, diff)``) as ``_SQLITE_PEEK`` returns them: one row per
    ``(key, value)`` with the sum of its diffs, no zero sum, sorted by (key, value)
    (Python orders ``str`` by code point, as SQLite's BINARY collation orders UTF-8).

    Rows with pairwise distinct keys and no zero diff are consolidated already (the
    common case of a collection whose keys each hold one live row): they are only
    sorted.  Sums are exact Python integers (the rule on diff sums keeps them in i64)."""
    if rows:
        ks, _, ds = zip(*rows, strict=True)
        if 0 not in ds and len(set(ks)) == len(rows):
            rows.sort()  # keys distinct: only keys are compared
            return rows
    sums: dict[tuple[str, str], int] = {}
    get = sums.get
    for k, v, d in rows:
        sums[(k, v)] = get((k, v), 0) + d
    return [(k, v, d) for (k, v), d in sorted(sums.items()) if d != 0]


class SqlTxn:
    """The primitives of :class:`stash.txn.Txn` on one SQLite connection (``sqlite3``,
    named parameters).  :class:`stash.postgres.PgTxn` overrides them for Postgres.

    Frontiers read in the transaction are cached in it, so an ``append`` reads each
    collection's since and upper once; the statement that reads them also reads the
    recorded codec names (:meth:`codecs` costs no query of its own).

    Args:
        stash: the handle (for its epoch and nonce).
        dbc: the DBAPI connection, inside a transaction.
        write: whether this is a write transaction.
    """

    def __init__(self, stash: SqlStash, dbc: Any, write: bool) -> None:
        self.stash = stash
        self.dbc = dbc
        self.write = write
        # collection id -> [since, upper, key codec name, value codec name]
        self._front: dict[int, list[Any]] = {}
        # Rows inserted but not yet written, by collection: an append's rows are merged
        # with the stored rows of their keys in Python before anything is written, so a
        # retraction and the row it cancels are never written only to be deleted.
        self._buffered: dict[int, list[Row]] = {}
        self._sid: str | None = None  # fence.stash_id, once read

    def finish(self) -> None:
        """Called once ``fn`` is done and before COMMIT (buffered work goes out here)."""
        self._write_buffered()

    def _write_buffered(self, cid: int | None = None) -> None:
        """Write the buffered rows (of ``cid``, or of every collection)."""
        cids = list(self._buffered) if cid is None else [cid]
        for c in cids:
            rows = self._buffered.pop(c, None)
            if rows:
                self._write_rows(c, rows)

    def _one(self, sql: str, params: dict[str, Any]) -> Any:
        return self.dbc.execute(sql, params).fetchone()

    # ----------------------------------------------------------------- fence
    def check_fence(self) -> None:
        if self.stash._epoch is not None:  # the stash's identity comes with it: no query
            self._compare_fence(row := self._one("SELECT epoch, nonce, stash_id FROM fence", {}))
            self._sid = str(row[2])

    def _compare_fence(self, row: Any) -> None:
        mine = self.stash._epoch
        if mine is None:
            return
        epoch, nonce = (None, None) if row is None else (int(row[0]), bytes(row[1]))
        if (epoch, nonce) != (mine, self.stash._nonce):
            raise fence_error(mine, epoch)

    def bump_epoch(self, nonce: bytes) -> int:
        """Take the next leader epoch with ``nonce``; return it."""
        cur = self.dbc.execute("UPDATE fence SET epoch = epoch + 1, nonce = :n", {"n": nonce})
        if cur.rowcount != 1:
            raise StashError(
                f"the fence table holds {cur.rowcount} rows instead of 1; the stash schema is damaged"
            )
        return int(self._one("SELECT epoch FROM fence", {})[0])

    def stash_id(self) -> str:
        self._sid = self._sid or str(self._one("SELECT stash_id FROM fence", {})[0])
        return self._sid

    # ---------------------------------------------------------- commit times
    #: How a named parameter is written (psycopg: ``%(name)s``; see PgTxn).
    _param = ":{}"

    def _commit_times_sql(self, sql: str, params: dict[str, Any]) -> Any:
        """Run a statement of ``commit_times`` (names written ``{name}``)."""
        text = sql.format(**{k: self._param.format(k) for k in params})
        return self.dbc.execute(text, params)

    def record_commit_time(self, cid: int, time: int, at_ms: int, forget_before: int) -> None:
        self._commit_times_sql(
            "INSERT INTO commit_times (collection_id, time, committed_at)"
            " VALUES ({c}, {t}, {at}) ON CONFLICT (collection_id, time) DO NOTHING",
            {"c": cid, "t": time, "at": at_ms},
        )
        self._commit_times_sql(
            "DELETE FROM commit_times WHERE collection_id = {c} AND time < {before}",
            {"c": cid, "before": forget_before},
        )

    def newest_time_committed_by(self, cid: int, at_ms: int) -> int | None:
        row = self._commit_times_sql(
            "SELECT max(time) FROM commit_times WHERE collection_id = {c} AND committed_at <= {at}",
            {"c": cid, "at": at_ms},
        ).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    # ------------------------------------------------- compare-and-set logs
    # (stash.logs; the statements of SQLite, where a writer holds the write lock, so
    # the head read by the INSERT's condition cannot change before COMMIT)
    def log_insert(
        self, name: str, expected: int | None, seqno: int, rollup: bool, data: str
    ) -> bool:
        cur = self.dbc.execute(_SQLITE_LOG_INSERT, (name, seqno, rollup, data, name, expected))
        return bool(cur.rowcount == 1)

    def log_rows(self, name: str, from_seqno: int | None) -> list[LogRow]:
        if from_seqno is None:
            rows = self.dbc.execute(_SQLITE_LOG_HEAD, (name, name)).fetchall()
        else:
            rows = self.dbc.execute(_SQLITE_LOG_SCAN, (name, from_seqno)).fetchall()
        return [(int(n), bool(r), str(d)) for n, r, d in rows]

    def log_head_seqno(self, name: str) -> int | None:
        row = self._one("SELECT max(seqno) FROM logs WHERE name = :n", {"n": name})
        return None if row is None or row[0] is None else int(row[0])

    def log_truncate(self, name: str, before: int) -> int:
        return int(self.dbc.execute(_SQLITE_LOG_TRUNCATE, (name, before, name)).rowcount)

    def log_names(self) -> list[str]:
        return [str(r[0]) for r in self.dbc.execute(_LOG_NAMES).fetchall()]

    # ------------------------------------------------------------ collections
    def lookup_collection(self, name: str) -> tuple[int, str, str] | None:
        row = self._one(
            "SELECT collection_id, key_codec, value_codec FROM collections WHERE name = :name",
            {"name": name},
        )
        return None if row is None else (int(row[0]), str(row[1]), str(row[2]))

    def create_collection(self, name: str, key_codec: str, value_codec: str) -> int:
        cur = self.dbc.execute(
            "INSERT INTO collections (name, key_codec, value_codec) VALUES (:name, :k, :v)",
            {"name": name, "k": key_codec, "v": value_codec},
        )
        cid = int(cur.lastrowid)
        self.dbc.execute("INSERT INTO sinces (collection_id, since) VALUES (:c, 0)", {"c": cid})
        self.dbc.execute("INSERT INTO uppers (collection_id, upper) VALUES (:c, 0)", {"c": cid})
        self._front[cid] = [0, 0, key_codec, value_codec, name]
        return cid

    def set_collection_codecs(self, cid: int, key_codec: str, value_codec: str) -> None:
        self.dbc.execute(
            "UPDATE collections SET key_codec = :k, value_codec = :v WHERE collection_id = :c",
            {"k": key_codec, "v": value_codec, "c": cid},
        )
        f = self._front.get(cid)
        if f is not None:
            f[2], f[3] = key_codec, value_codec

    def list_collections(self) -> list[tuple[str, int, str, str]]:
        rows = self.dbc.execute(
            "SELECT name, collection_id, key_codec, value_codec FROM collections"
        ).fetchall()
        return [(str(n), int(i), str(k), str(v)) for n, i, k, v in rows]

    # ------------------------------------------------------------- frontiers
    def lock(self, ids: Sequence[int]) -> None:
        """SQLite writers hold the database's write lock already (``BEGIN IMMEDIATE``)."""

    def frontiers(self, cid: int) -> tuple[int | None, int | None]:
        f = self._front.get(cid)
        if f is None:
            row = self._one(_SQLITE_FRONTIERS, {"c": cid})
            if row is None:
                raise StashError(f"collection id {cid} does not exist")
            f = self._front[cid] = [row[0], row[1], str(row[2]), str(row[3]), str(row[4])]
            self._sid = str(row[5])
        return f[0], f[1]

    def codecs(self, cid: int) -> tuple[str, str]:
        self.frontiers(cid)  # read once, with the name: [since, upper, kc, vc, name]
        return self._front[cid][2], self._front[cid][3]

    def collection_name(self, cid: int) -> str:
        self.frontiers(cid)
        return str(self._front[cid][4])

    def set_upper(self, cid: int, upper: int | None) -> None:
        self.dbc.execute(
            "UPDATE uppers SET upper = :u WHERE collection_id = :c", {"u": upper, "c": cid}
        )
        self.frontiers(cid)
        self._front[cid][1] = upper

    def set_since(self, cid: int, since: int | None) -> None:
        self.dbc.execute(
            "UPDATE sinces SET since = :s WHERE collection_id = :c", {"s": since, "c": cid}
        )
        self.frontiers(cid)
        self._front[cid][0] = since

    # ------------------------------------------------------------------ rows
    def insert(self, cid: int, rows: Sequence[Row]) -> None:
        """Buffer ``rows`` of ``cid``: written by the next read or consolidation of the
        collection, or by :meth:`finish` (before COMMIT)."""
        if rows:
            self._buffered.setdefault(cid, []).extend(rows)

    def _write_rows(self, cid: int, rows: Sequence[Row]) -> None:
        self.dbc.executemany(
            "INSERT INTO data (collection_id, key, value, time, diff) VALUES (?, ?, ?, ?, ?)",
            [(cid, k, v, t, d) for k, v, t, d in rows],
        )

    def rows(self, cid: int, key: str | None = None) -> list[Row]:
        self._write_buffered(cid)
        if key is None:
            cur = self.dbc.execute(
                "SELECT key, value, time, diff FROM data WHERE collection_id = :c", {"c": cid}
            )
        else:
            cur = self.dbc.execute(
                "SELECT key, value, time, diff FROM data WHERE collection_id = :c AND key = :k",
                {"c": cid, "k": key},
            )
        return [(k, v, int(t), int(d)) for k, v, t, d in cur.fetchall()]

    def peek_rows(self, cid: int, ts: int, key: str | None = None) -> list[tuple[str, str, int]]:
        """The rows at times ``<= ts`` consolidated as ``_SQLITE_PEEK`` would: one row
        per ``(key, value)`` with its diff sum, no zero sum, ordered by (key, value).

        A whole collection is read with a plain indexed scan and consolidated in
        Python (:func:`_consolidate_peek`): SQLite's ``GROUP BY`` sorts every row in a
        temporary b-tree, which cost half the read of a 100,000-entry ``peek_one``.
        One key's few rows are grouped by SQLite."""
        self._write_buffered(cid)
        if key is not None:
            cur = self.dbc.execute(_SQLITE_PEEK_KEY, {"c": cid, "ts": ts, "k": key})
            keyed: list[tuple[str, str, int]] = cur.fetchall()
            return keyed
        return _consolidate_peek(
            self.dbc.execute(_SQLITE_PEEK_ROWS, {"c": cid, "ts": ts}).fetchall()
        )

    def consolidate(self, cid: int, since: int | None, keys: Collection[str] | None) -> None:
        if since is None:
            self._buffered.pop(cid, None)
            self.dbc.execute("DELETE FROM data WHERE collection_id = :c", {"c": cid})
            return
        pending = self._buffered.pop(cid, [])
        if keys is None:
            rows = self.dbc.execute(_SQLITE_ROWS, {"c": cid}).fetchall()
            todo = pending
        else:
            todo = [r for r in pending if r[0] in keys]
            if len(todo) != len(pending):
                self._buffered[cid] = [r for r in pending if r[0] not in keys]
            if not keys:
                rows = []
            elif _HAS_RETURNING:
                # Every stored row of a touched key is rewritten at max(time, since)
                # anyway (they are all older than the new since but for rows of this
                # very time): take them out in the statement that reads them.
                if len(keys) == 1:
                    cur = self.dbc.execute(_SQLITE_TAKE_KEY, {"c": cid, "k": next(iter(keys))})
                else:
                    cur = self.dbc.execute(
                        _SQLITE_TAKE_KEYS, {"c": cid, "ks": json.dumps(sorted(keys))}
                    )
                self._rewrite_rows(cid, since, [*cur.fetchall(), *todo])
                return
            elif len(keys) == 1:
                rows = self.dbc.execute(
                    _SQLITE_ROWS_KEY, {"c": cid, "k": next(iter(keys))}
                ).fetchall()
            else:
                rows = self.dbc.execute(
                    _SQLITE_ROWS_KEYS, {"c": cid, "ks": json.dumps(sorted(keys))}
                ).fetchall()
        if not rows and not todo:
            return
        self._consolidate_rows(cid, since, [*rows, *((None, k, v, t, d) for k, v, t, d in todo)])

    def _rewrite_rows(self, cid: int, since: int, rows: Sequence[Row]) -> None:
        """Write ``rows`` (``(key, value, time, diff)``: every row of the keys concerned,
        already deleted from the table, and the buffered rows) back consolidated, as
        :meth:`_consolidate_rows` leaves them: at ``max(time, since)``, one row per
        ``(key, value, time)``, no zero diff; sums exact and checked against the rule on
        diff sums before anything is written (a refusal rolls the transaction back, the
        deletion with it)."""
        acc: dict[tuple[str, str, int], int] = {}
        for k, v, t, d in rows:
            g = (k, v, t if t > since else since)
            acc[g] = acc.get(g, 0) + d
        if not diff_sums_fit(((k, v), d) for (k, v, _), d in acc.items()):
            raise DiffSumOverflow(cid)
        merged = [(k, v, t, d) for (k, v, t), d in acc.items() if d != 0]
        if merged:
            self._write_rows(cid, merged)

    def _consolidate_rows(self, cid: int, since: int, rows: Sequence[Any]) -> None:
        """Consolidate ``rows`` (``(rowid, key, value, time, diff)``, every row of the
        keys concerned; rowid ``None`` for a buffered row not yet written) as the memory
        backend holds them: every row at ``max(time, since)``, one row per ``(key, value,
        time)``, no zero diff.  Sums are exact (Python integers, whatever order SQLite
        would add them in) and checked against the rule on diff sums before anything is
        written; buffered rows are written only as their consolidated sums."""
        groups: dict[tuple[str, str, int], list[Any]] = {}
        for rowid, k, v, t, d in rows:
            g = groups.get((k, v, max(t, since)))
            if g is None:
                groups[(k, v, max(t, since))] = [int(d), [rowid], t < since or rowid is None]
            else:
                g[0] += d
                g[1].append(rowid)
                g[2] = g[2] or rowid is None
        if not diff_sums_fit(((k, v), g[0]) for (k, v, _), g in groups.items()):
            raise DiffSumOverflow(cid)
        dead: list[tuple[int]] = []
        merged: list[Row] = []
        for (k, v, t), (d, rowids, rewrite) in groups.items():
            if len(rowids) > 1 or rewrite or d == 0:
                dead.extend((r,) for r in rowids if r is not None)
                if d != 0:
                    merged.append((k, v, t, d))
        if dead:
            self.dbc.executemany("DELETE FROM data WHERE rowid = ?", dead)
        if merged:
            self._write_rows(cid, merged)
