"""The SQLite dialect of the SQL stash (:class:`stash.sql.SqlStash` on ``sqlite:///path``):
its URL rule, its engine and how its transactions begin, commit and fail.

Invariants kept here:

* a SQLite stash URL names a file (``sqlite:///path/to/stash.db``); ``:memory:`` is
  refused (``memory://`` is the in-memory stash);
* the database file is created readable by its owner only, by a writable open only;
  a readonly open of a missing file fails instead of creating it;
* every connection runs in WAL mode (switched only by a handle that may write: the
  switch needs the write lock) with the ``synchronous`` level asked for (``FULL`` by
  default), ``busy_timeout`` and foreign keys on; writers take the write lock up front
  (``BEGIN IMMEDIATE``), so a transaction never fails half-way on a lock upgrade;
* "database is locked" / busy means "run the whole transaction again"; an I/O error at
  COMMIT (the WAL frame may or may not be on disk) is an
  :class:`~stash.errors.IndeterminateError`, never success or plain failure;
* a savepoint handle works on session-private (``TEMP``) copies of the stash tables,
  inside one transaction that is never committed;
* a readonly handle in a directory it cannot write reads a cleanly closed file as
  ``immutable`` (SQLite cannot create the -wal and -shm it needs), but never trusts
  that it stays so: a connection whose file changed since it was made (a writer
  opened it elsewhere) is replaced at checkout, and a read it was serving when the
  file changed is run again (one committed state per read, never two).

This module imports :mod:`stash.sql`, never the reverse: :mod:`stash.sql` finds
:class:`SqliteOps` by name (``stash.sql.SQL_DIALECTS``).  Source of the idea:
Materialize's ``Sqlite`` stash backend (``src/stash/src/lib.rs``).
"""

from __future__ import annotations

import os
import sqlite3
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import quote

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL

from stash.base import Mode
from stash.errors import IndeterminateError, StashError
from stash.migrate import create_sqlite_file
from stash.placement import placement
from stash.sql import (
    TABLE_COLUMNS,
    EngineOptions,
    SqlStash,
    _driver_error,
    _Ops,
    _Transient,
    first_line,
)
from stash.sql_txn import SqlTxn

SYNCHRONOUS_MODES = ("OFF", "NORMAL", "FULL", "EXTRA")


def _sqlite_engine(
    url: URL, sync: str, busy_timeout: float, pool_size: int, mode: Mode
) -> sa.Engine:
    assert url.database is not None
    path = Path(url.database).expanduser()
    if mode == "writable":
        try:  # created owner-only if missing; a warning if others can read it
            create_sqlite_file(str(path))
        except OSError as e:
            raise StashError(f"sqlite: cannot create {path}: {e.strerror}") from None
    elif not path.exists():
        raise StashError(f"sqlite stash file {path} does not exist")
    kwargs: dict[str, Any] = {"connect_args": {"check_same_thread": False, "timeout": busy_timeout}}
    read_only_place = mode == "readonly" and not os.access(path.parent, os.W_OK)
    if read_only_place:
        # SQLite opens a WAL-mode file only where it can create its -wal and -shm files,
        # where a writer has them open, or when told the file is immutable: in a
        # directory this process cannot write (a read-only mount, an archived copy), a
        # cleanly closed file (no -wal) is read as such (SQLite's "immutable" URI
        # parameter, https://www.sqlite.org/uri.html), each connection deciding when it
        # is made (_connect_read_only), checked at each checkout below and at the end of
        # each read (_ReadOnlyCursor: a read a writer's checkpoint overlapped runs again).
        kwargs = {"creator": partial(_connect_read_only, path, busy_timeout)}
    engine = sa.create_engine(url.set(database=str(path)), pool_size=pool_size, **kwargs)
    ms = int(busy_timeout * 1000)

    if read_only_place:

        @event.listens_for(engine, "checkout")
        def _on_checkout(dbapi_conn: Any, _rec: Any, _proxy: Any) -> None:
            # An immutable connection trusts that the file never changes (it ignores a
            # -wal and keeps its cache); a writer elsewhere (another user, a writable
            # mount of the same directory) may have opened it since: then the pool
            # makes a new connection, which reads what is committed now.
            if getattr(dbapi_conn, "signature", None) != _signature(path):
                raise sa.exc.DisconnectionError(
                    f"sqlite stash file {path} changed since this connection opened it"
                )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _rec: Any) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout={ms:d}")
        if mode != "readonly":  # switching the journal mode needs the write lock
            cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA synchronous={sync}")  # validated against SYNCHRONOUS_MODES
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        write = conn.get_execution_options().get("stash_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


class _ReadOnlyConnection(sqlite3.Connection):
    """A connection of a readonly stash in a directory it cannot write, with the
    :func:`_signature` of its file ``path`` when it was made (``None``: read through a
    writer's -wal).  Its ``execute`` runs on a :class:`_ReadOnlyCursor`."""

    signature: tuple[int, int, int] | None = None
    path: Path | None = None

    def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
        return self.cursor(_ReadOnlyCursor).execute(sql, parameters)

    def changed(self) -> bool:
        """Whether this connection is immutable and its file changed since it was made
        (a writer opened it: its -wal appeared, or a checkpoint rewrote pages)."""
        return (
            self.signature is not None
            and self.path is not None
            and _signature(self.path) != self.signature
        )


#: The error an immutable connection's statement raises when the file changed under
#: it: SQLite's "busy", which the stash answers by running the transaction again (on a
#: new connection: the pool's checkout check replaces this one).
_CHANGED = (
    "database is busy: the stash file changed while this read-only connection read it "
    "as immutable (a writer opened it)"
)


class _ReadOnlyCursor(sqlite3.Cursor):
    """A cursor of a :class:`_ReadOnlyConnection`: on an immutable connection whose
    file changed, an error while reading (pages of two states read as one B-tree:
    "database disk image is malformed") and the COMMIT ending a read (its rows may mix
    two states) raise SQLite's "busy" instead (:data:`_CHANGED`), so the read is run
    again and sees one committed state."""

    def _changed(self) -> bool:
        conn = self.connection
        return isinstance(conn, _ReadOnlyConnection) and conn.changed()

    def execute(self, sql: str, parameters: Any = (), /) -> _ReadOnlyCursor:
        if sql == "COMMIT" and self._changed():
            raise sqlite3.OperationalError(_CHANGED)
        try:
            super().execute(sql, parameters)
            return self
        except sqlite3.DatabaseError as e:
            if self._changed():
                raise sqlite3.OperationalError(_CHANGED) from e
            raise

    def fetchone(self) -> Any:
        try:
            return super().fetchone()
        except sqlite3.DatabaseError as e:
            if self._changed():
                raise sqlite3.OperationalError(_CHANGED) from e
            raise

    def fetchmany(self, size: int | None = None) -> list[Any]:
        try:
            return super().fetchmany(self.arraysize if size is None else size)
        except sqlite3.DatabaseError as e:
            if self._changed():
                raise sqlite3.OperationalError(_CHANGED) from e
            raise

    def fetchall(self) -> list[Any]:
        try:
            return super().fetchall()
        except sqlite3.DatabaseError as e:
            if self._changed():
                raise sqlite3.OperationalError(_CHANGED) from e
            raise

    def __next__(self) -> Any:
        try:
            return super().__next__()
        except sqlite3.DatabaseError as e:
            if self._changed():
                raise sqlite3.OperationalError(_CHANGED) from e
            raise


def _signature(path: Path) -> tuple[int, int, int] | None:
    """``(inode, size, mtime in ns)`` of a cleanly closed stash file (no ``-wal``
    beside it), or ``None`` while a writer has it open (a ``-wal`` beside it) or the
    file cannot be read (then SQLite's open says why)."""
    try:
        if path.with_name(path.name + "-wal").exists():
            return None
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _connect_read_only(path: Path, timeout: float) -> sqlite3.Connection:
    """A read-only connection to ``path`` in a directory this process cannot write:
    ``immutable`` when the file is cleanly closed (SQLite cannot create the -wal and
    -shm it needs otherwise), else through the -wal and -shm its writer keeps."""
    sig = _signature(path)
    uri = f"file:{quote(str(path.resolve()))}?mode=ro" + ("" if sig is None else "&immutable=1")
    conn = sqlite3.connect(
        uri, uri=True, check_same_thread=False, timeout=timeout, factory=_ReadOnlyConnection
    )
    assert isinstance(conn, _ReadOnlyConnection)
    conn.signature, conn.path = sig, path
    return conn


_SQLITE_IOERR = 10  # SQLITE_IOERR: the primary result code of every I/O failure


class SqliteOps(_Ops):
    """SQLite: ``BEGIN IMMEDIATE`` writers, busy means "run again"."""

    name = "sqlite"

    def stash_url(self, url: URL) -> URL:
        placement(url)  # refuses the Postgres-only schema parameters
        if not url.database or url.database == ":memory:":
            raise StashError(
                "sqlite stash URL needs a file path (sqlite:///path/to/stash.db); "
                "use memory:// for an in-memory stash"
            )
        return url

    def engine(self, url: URL, mode: Mode, options: EngineOptions) -> sa.Engine:
        sync = str(options.synchronous).upper()
        if sync not in SYNCHRONOUS_MODES:
            raise StashError(
                f"sqlite synchronous must be one of {list(SYNCHRONOUS_MODES)}, "
                f"got {options.synchronous!r}"
            )
        return _sqlite_engine(url, sync, float(options.busy_timeout), options.pool_size, mode)

    def txn(self, stash: SqlStash, dbc: Any, write: bool, savepoint: bool) -> SqlTxn:
        tx = SqlTxn(stash, dbc, write)
        if stash._epoch is not None and not savepoint:
            if write:  # checked by the first statement that can (see SqlTxn)
                tx._fence_pending = True
            else:
                tx.check_fence()
        return tx

    def begin(self, dbc: Any, write: bool) -> None:
        dbc.execute("BEGIN IMMEDIATE" if write else "BEGIN")

    def commit(self, stash: SqlStash, tx: SqlTxn, dbc: Any) -> None:
        try:
            dbc.execute("COMMIT")
        except sqlite3.Error as e:
            self.rollback(dbc)
            low = str(e).lower()
            if "locked" in low or "busy" in low:
                raise _Transient(e) from None
            if getattr(e, "sqlite_errorcode", 0) & 0xFF == _SQLITE_IOERR:
                # An I/O error while writing or syncing the WAL: the commit frame may or
                # may not have reached the disk.
                raise IndeterminateError(
                    f"sqlite: COMMIT failed with an I/O error; the outcome is unknown: "
                    f"{first_line(e)}"
                ) from None
            raise StashError(f"sqlite: COMMIT failed: {first_line(e)}") from None

    def rollback(self, dbc: Any) -> None:
        try:
            if dbc.in_transaction:
                dbc.execute("ROLLBACK")
        except sqlite3.Error:
            pass

    def is_idle(self, dbc: Any) -> bool:
        try:
            return not dbc.in_transaction
        except sqlite3.Error:  # closed
            return False

    def classify(self, e: BaseException, opening: bool) -> BaseException:
        if isinstance(e, StashError):
            return e
        orig = _driver_error(e)
        if isinstance(orig, UnicodeError):
            return StashError(f"sqlite: a value is not valid Unicode text: {first_line(orig)}")
        if not isinstance(orig, sqlite3.Error):
            return e
        low = first_line(orig).lower()
        if "locked" in low or "busy" in low:
            return _Transient(orig)
        return StashError(f"sqlite: {first_line(orig)}")

    def savepoint_open(self, dbc: Any, stash_id: str) -> str:
        dbc.execute("BEGIN")
        for statement in _SQLITE_SAVEPOINT_DDL:
            dbc.execute(statement)
        dbc.execute("UPDATE temp.fence SET stash_id = ?", (stash_id,))
        return str(dbc.execute("SELECT stash_id FROM main.fence").fetchone()[0])


# Session-private copies of the stash tables for a savepoint handle (the temp schema is
# searched before main, so the unqualified names of SqlTxn's statements resolve to them).
_SQLITE_SAVEPOINT_DDL = (
    "CREATE TEMP TABLE fence (epoch INTEGER NOT NULL, nonce BLOB NOT NULL, stash_id TEXT NOT NULL)",
    "CREATE TEMP TABLE collections (collection_id INTEGER PRIMARY KEY,"
    " name TEXT NOT NULL UNIQUE, key_codec TEXT NOT NULL, value_codec TEXT NOT NULL)",
    "CREATE TEMP TABLE data (collection_id INTEGER NOT NULL, key TEXT NOT NULL,"
    " value TEXT NOT NULL, time INTEGER NOT NULL, diff INTEGER NOT NULL)",
    "CREATE TEMP TABLE sinces (collection_id INTEGER PRIMARY KEY, since INTEGER)",
    "CREATE TEMP TABLE uppers (collection_id INTEGER PRIMARY KEY, upper INTEGER)",
    "CREATE TEMP TABLE commit_times (collection_id INTEGER NOT NULL, time INTEGER NOT NULL,"
    " committed_at INTEGER NOT NULL, PRIMARY KEY (collection_id, time))",
    "CREATE TEMP TABLE logs (name TEXT NOT NULL, seqno INTEGER NOT NULL,"
    " rollup BOOLEAN NOT NULL, data TEXT NOT NULL, PRIMARY KEY (name, seqno))",
    *(
        f"INSERT INTO temp.{t} ({', '.join(c)}) SELECT {', '.join(c)} FROM main.{t}"  # noqa: S608 - constant names
        for t, c in TABLE_COLUMNS.items()
    ),
    "CREATE INDEX temp.data_collection_key ON data (collection_id, key)",
    "CREATE INDEX temp.data_collection_time ON data (collection_id, time)",
)
