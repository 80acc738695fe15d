"""The SQL backends of the stash (SQLite, the embedded default, and Postgres) through
SQLAlchemy Core.

Invariants kept here:

* every public stash method runs as one database transaction; writers on SQLite take the
  write lock up front (``BEGIN IMMEDIATE``), so a transaction never fails half-way on a
  lock upgrade; transient failures ("database is locked", serialization failures, a lost
  connection before COMMIT) are retried with jittered exponential backoff (tenacity)
  until the retry budget is spent, so they never reach the caller while it lasts;
* a COMMIT whose outcome cannot be known (the connection dropped during it) raises an
  :class:`~stash.errors.IndeterminateError`, never success or plain failure;
* a fenced writable handle bumps ``fence.epoch`` at open and checks epoch and nonce in
  every transaction (holding the fence row ``FOR SHARE`` on Postgres so a concurrent
  fencing waits for it); an older handle then fails with a :class:`FenceError`;
* SQL is built with SQLAlchemy Core: every value is a bound parameter;
* the schema is only created by alembic; a database behind the head fails to open with
  the revision found and the command to run, except that a writable SQLite stash
  upgrades itself;
* SQLite runs in WAL mode with ``synchronous=FULL`` by default; the database file is
  created readable by its owner only.

Source of the idea: the seed's ``Sqlite`` and ``Postgres`` stash backends (``003``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
import tenacity
from alembic import command
from sqlalchemy import event
from sqlalchemy.engine import URL

from stash import schema
from stash.base import Mode, Stash
from stash.codec import canonical_json
from stash.errors import FenceError, IndeterminateError, MigrationRequired, StashError
from stash.migrate import alembic_config, current_revision
from stash.schema import collections, data, fence, sinces, uppers
from stash.txn import Row, Txn
from stash.url import safe_url

log = logging.getLogger(__name__)
R = TypeVar("R")

SYNCHRONOUS_MODES = ("OFF", "NORMAL", "FULL", "EXTRA")
IN_CHUNK = 500

# Postgres SQLSTATEs that mean "run the transaction again".
_PG_RETRY_STATES = {"40001", "40P01"}


class _Transient(Exception):
    """Internal: a transaction failed in a way that is safe to retry."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


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
            (default 60).
        pool_size: connections kept per handle (default 5).
        auto_migrate: upgrade a database behind the alembic head at open (default: true
            for writable SQLite, false otherwise).

    Raises:
        StashError: unreachable database, bad option, schema behind head.
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
    ) -> None:
        super().__init__(mode, fenced)
        self._url = url
        self.backend = url.get_backend_name()
        self.retry_budget = float(retry_budget)
        self._epoch: int | None = None
        self._nonce = b""
        self._sp_conn: sa.Connection | None = None
        self._sp_trans: sa.RootTransaction | None = None
        self._sp_lock = threading.RLock()
        self._opening = True  # a server that is down at open fails fast, without retries
        if self.backend == "sqlite":
            sync = str(synchronous).upper()
            if sync not in SYNCHRONOUS_MODES:
                raise StashError(
                    f"sqlite synchronous must be one of {list(SYNCHRONOUS_MODES)}, got {synchronous!r}"
                )
            self.engine = _sqlite_engine(url, sync, float(busy_timeout), pool_size, mode)
        else:
            self.engine = sa.create_engine(
                url,
                pool_size=pool_size,
                pool_pre_ping=True,
                json_serializer=lambda v: v,
                connect_args={"connect_timeout": 10},
            )
        try:
            if auto_migrate is None:
                auto_migrate = self.backend == "sqlite" and mode == "writable"
            self._check_schema(auto_migrate)
            if mode == "savepoint":
                self._sp_conn = self.engine.connect()
                self._sp_trans = self._sp_conn.begin()
            if fenced and mode == "writable":
                self._take_epoch()
            self._opening = False
        except BaseException:
            self.engine.dispose()
            raise

    def __repr__(self) -> str:
        return f"SqlStash({safe_url(self._url)!r}, mode={self.mode!r}, fenced={self.fenced})"

    # ------------------------------------------------------------ open helpers
    def _check_schema(self, auto_migrate: bool) -> None:
        def check(conn: sa.Connection) -> None:
            found = current_revision(conn)
            if found == schema.SCHEMA_HEAD:
                return
            if not auto_migrate or found not in (None, *_older_revisions()):
                raise MigrationRequired(
                    f"database {safe_url(self._url)} is at schema revision "
                    f"{found or 'none (empty database)'} but this code needs "
                    f"{schema.SCHEMA_HEAD}; run: stash migrate '{safe_url(self._url)}'"
                )
            log.info("upgrading stash schema of %s from %s to %s", safe_url(self._url),
                     found, schema.SCHEMA_HEAD)
            command.upgrade(alembic_config(conn), "head")

        self._with_conn(True, check)

    def _take_epoch(self) -> None:
        nonce = secrets.token_bytes(16)

        def bump(conn: sa.Connection) -> int:
            conn.execute(sa.update(fence).values(epoch=fence.c.epoch + 1, nonce=nonce))
            return int(conn.execute(sa.select(fence.c.epoch)).scalar_one())

        self._epoch = self._with_conn(True, bump)
        self._nonce = nonce
        log.info("stash %s: took leader epoch %d", safe_url(self._url), self._epoch)

    def _with_conn(self, write: bool, fn: Callable[[sa.Connection], R]) -> R:
        """Run ``fn`` on a plain connection in one transaction, with the retry policy."""

        def attempt() -> R:
            with self.engine.connect() as conn:
                conn.execution_options(stash_write=write)
                with conn.begin():
                    return fn(conn)

        return self._retrying(attempt)

    # --------------------------------------------------------- transactions
    def _classify(self, e: BaseException, during_commit: bool) -> BaseException:
        """Map a driver error to a retry (``_Transient``) or a StashError."""
        if isinstance(e, StashError):
            return e
        if not isinstance(e, sa.exc.DBAPIError):
            return e
        orig = e.orig if e.orig is not None else e
        msg = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
        if self.backend == "sqlite":
            low = msg.lower()
            if "locked" in low or "busy" in low:
                return _Transient(e)
            return StashError(f"sqlite: {msg}")
        state = getattr(orig, "sqlstate", None)
        lost = e.connection_invalidated or isinstance(e, sa.exc.OperationalError) and state is None
        if during_commit and lost:
            return IndeterminateError(
                f"postgres: connection lost during COMMIT; the outcome is unknown: {msg}"
            )
        if state in _PG_RETRY_STATES or (lost and not during_commit and not self._opening):
            return _Transient(e)
        return StashError(f"postgres: {msg}")

    def _retrying(self, attempt: Callable[[], R]) -> R:
        retryer = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(_Transient),
            wait=tenacity.wait_random_exponential(multiplier=0.002, max=0.5),
            stop=tenacity.stop_after_delay(self.retry_budget),
            reraise=True,
        )
        try:
            for at in retryer:
                with at:
                    try:
                        return attempt()
                    except _Transient:
                        raise
                    except BaseException as e:
                        raise self._classify(e, getattr(e, "_stash_commit", False)) from None
        except _Transient as t:
            raise StashError(
                f"{self.backend}: {t.cause.orig if isinstance(t.cause, sa.exc.DBAPIError) else t.cause}"
                f" (gave up after retrying for {self.retry_budget:g} s)"
            ) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _run(self, write: bool, fn: Callable[[Txn], R]) -> R:
        if self._sp_conn is not None:
            return self._run_savepoint(fn)

        def attempt() -> R:
            with self.engine.connect() as conn:
                conn.execution_options(stash_write=write)
                trans = conn.begin()
                try:
                    tx = SqlTxn(self, conn)
                    if self._epoch is not None:
                        tx.check_fence()
                    result = fn(tx)
                except BaseException:
                    if trans.is_active:
                        try:
                            trans.rollback()
                        except sa.exc.DBAPIError:
                            pass
                    raise
                try:
                    trans.commit()
                except sa.exc.DBAPIError as e:
                    e._stash_commit = True  # type: ignore[attr-defined]
                    raise
                return result

        return self._retrying(attempt)

    def _run_savepoint(self, fn: Callable[[Txn], R]) -> R:
        assert self._sp_conn is not None
        with self._sp_lock:
            nested = self._sp_conn.begin_nested()
            try:
                result = fn(SqlTxn(self, self._sp_conn))
            except BaseException as e:
                nested.rollback()
                raise self._classify(e, False) from None
            nested.commit()
            return result

    @contextmanager
    def _txn(self, write: bool) -> Iterator[Txn]:  # pragma: no cover - _run is used
        with self.engine.connect() as conn:
            conn.execution_options(stash_write=write)
            with conn.begin():
                yield SqlTxn(self, conn)

    def _close(self) -> None:
        if self._sp_conn is not None:
            if self._sp_trans is not None and self._sp_trans.is_active:
                self._sp_trans.rollback()
            self._sp_conn.close()
            self._sp_conn = None
        self.engine.dispose()


def _older_revisions() -> tuple[str, ...]:
    return ()


def _sqlite_engine(url: URL, sync: str, busy_timeout: float, pool_size: int, mode: Mode) -> sa.Engine:
    assert url.database is not None
    path = Path(url.database).expanduser()
    if not path.exists():
        if mode != "writable":
            raise StashError(f"sqlite stash file {path} does not exist")
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
        except OSError as e:
            raise StashError(f"sqlite: cannot create {path}: {e.strerror}") from None
        os.close(fd)
    engine = sa.create_engine(
        url.set(database=str(path)),
        pool_size=pool_size,
        connect_args={"check_same_thread": False, "timeout": busy_timeout},
    )
    ms = int(busy_timeout * 1000)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _rec: Any) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout={ms:d}")
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA synchronous={sync}")  # validated against SYNCHRONOUS_MODES
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        write = conn.get_execution_options().get("stash_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def _chunks(items: Sequence[Any], n: int = IN_CHUNK) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


class SqlTxn:
    """The primitives of :class:`stash.txn.Txn` on one SQLAlchemy connection.

    Frontiers read in the transaction are cached in it, so an ``append`` reads each
    collection's since and upper once.
    """

    def __init__(self, stash: SqlStash, conn: sa.Connection) -> None:
        self.stash = stash
        self.conn = conn
        self.pg = stash.backend == "postgresql"
        self._front: dict[int, list[int | None]] = {}
        if self.pg:
            self._key: Any = sa.cast(data.c.key, sa.Text)
            self._value: Any = sa.cast(data.c.value, sa.Text)
        else:
            self._key, self._value = data.c.key, data.c.value

    def _canon(self, text: str) -> str:
        return canonical_json(json.loads(text)) if self.pg else text

    def lookup_collection(self, name: str) -> tuple[int, str, str] | None:
        row = self.conn.execute(
            sa.select(collections.c.collection_id, collections.c.key_codec,
                      collections.c.value_codec).where(collections.c.name == name)
        ).first()
        return None if row is None else (int(row[0]), str(row[1]), str(row[2]))

    def create_collection(self, name: str, key_codec: str, value_codec: str) -> int:
        res = self.conn.execute(
            sa.insert(collections).values(name=name, key_codec=key_codec, value_codec=value_codec)
        )
        cid = int(res.inserted_primary_key[0])  # type: ignore[index]
        self.conn.execute(sa.insert(sinces).values(collection_id=cid, since=0))
        self.conn.execute(sa.insert(uppers).values(collection_id=cid, upper=0))
        self._front[cid] = [0, 0]
        return cid

    def list_collections(self) -> list[tuple[str, int, str, str]]:
        rows = self.conn.execute(
            sa.select(collections.c.name, collections.c.collection_id, collections.c.key_codec,
                      collections.c.value_codec)
        )
        return [(str(n), int(i), str(k), str(v)) for n, i, k, v in rows]

    def lock(self, ids: Sequence[int]) -> None:
        if self.pg and ids:
            rows = self.conn.execute(
                sa.select(uppers.c.collection_id, uppers.c.upper, sinces.c.since)
                .join(sinces, sinces.c.collection_id == uppers.c.collection_id)
                .where(uppers.c.collection_id.in_(list(ids)))
                .order_by(uppers.c.collection_id)
                .with_for_update(of=uppers)
            )
            for cid, upper, since in rows:
                self._front[int(cid)] = [since, upper]

    def frontiers(self, cid: int) -> tuple[int | None, int | None]:
        f = self._front.get(cid)
        if f is None:
            row = self.conn.execute(
                sa.select(sinces.c.since, uppers.c.upper)
                .join(uppers, uppers.c.collection_id == sinces.c.collection_id)
                .where(sinces.c.collection_id == cid)
            ).first()
            if row is None:
                raise StashError(f"collection id {cid} does not exist")
            f = self._front[cid] = [row[0], row[1]]
        return f[0], f[1]

    def set_upper(self, cid: int, upper: int | None) -> None:
        self.conn.execute(sa.update(uppers).where(uppers.c.collection_id == cid).values(upper=upper))
        self.frontiers(cid)
        self._front[cid][1] = upper

    def set_since(self, cid: int, since: int | None) -> None:
        self.conn.execute(sa.update(sinces).where(sinces.c.collection_id == cid).values(since=since))
        self.frontiers(cid)
        self._front[cid][0] = since

    def insert(self, cid: int, rows: Sequence[Row]) -> None:
        if rows:
            self.conn.execute(
                sa.insert(data),
                [{"collection_id": cid, "key": k, "value": v, "time": t, "diff": d}
                 for k, v, t, d in rows],
            )

    def rows(self, cid: int, key: str | None = None) -> list[Row]:
        q = sa.select(self._key, self._value, data.c.time, data.c.diff).where(
            data.c.collection_id == cid
        )
        if key is not None:
            q = q.where(data.c.key == key)
        c = self._canon
        return [(c(k), c(v), int(t), int(d)) for k, v, t, d in self.conn.execute(q)]

    def peek_rows(self, cid: int, ts: int, key: str | None = None) -> list[tuple[str, str, int]]:
        total = sa.func.sum(data.c.diff)
        q = (
            sa.select(self._key, self._value, total)
            .where(data.c.collection_id == cid, data.c.time <= ts)
            .group_by(data.c.key, data.c.value)
            .having(total != 0)
        )
        if key is not None:
            q = q.where(data.c.key == key)
        c = self._canon
        return [(c(k), c(v), int(d)) for k, v, d in self.conn.execute(q)]

    def consolidate(self, cid: int, since: int | None, keys: Collection[str] | None) -> None:
        if since is None:
            self.conn.execute(sa.delete(data).where(data.c.collection_id == cid))
            return
        groups: list[tuple[str, str, int]] = []
        base = (
            sa.select(self._key, self._value, sa.func.sum(data.c.diff))
            .where(data.c.collection_id == cid, data.c.time <= since)
            .group_by(data.c.key, data.c.value)
            .having(sa.func.count() > 1)
        )
        c = self._canon
        if keys is None:
            groups = [(c(k), c(v), int(d)) for k, v, d in self.conn.execute(base)]
        else:
            for chunk in _chunks(sorted(keys)):
                q = base.where(data.c.key.in_(list(chunk)))
                groups.extend((c(k), c(v), int(d)) for k, v, d in self.conn.execute(q))
        if not groups:
            return
        self.conn.execute(
            sa.delete(data).where(
                data.c.collection_id == cid,
                data.c.key == sa.bindparam("k", type_=schema.JsonText),
                data.c.value == sa.bindparam("v", type_=schema.JsonText),
                data.c.time <= since,
            ),
            [{"k": k, "v": v} for k, v, _ in groups],
        )
        self.insert(cid, [(k, v, since, d) for k, v, d in groups if d != 0])

    def check_fence(self) -> None:
        q = sa.select(fence.c.epoch, fence.c.nonce)
        if self.pg:
            q = q.with_for_update(read=True)
        row = self.conn.execute(q).first()
        epoch, nonce = (None, None) if row is None else (int(row[0]), bytes(row[1]))
        mine = self.stash._epoch
        if mine is None:
            return
        if (epoch, nonce) != (mine, self.stash._nonce):
            raise FenceError(
                f"stash fenced: this handle's epoch {mine} was superseded by epoch {epoch}"
            )
