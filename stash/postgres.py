"""The Postgres backend of the stash (psycopg 3 on a SQLAlchemy pool): transactions,
locking, fencing, fault handling and ``jsonb`` text.

Invariants kept here:

* **Isolation.** Read transactions run ``REPEATABLE READ READ ONLY``: one snapshot for the
  frontiers and the rows they select (a concurrent append's consolidation can never be
  half-seen), and a readonly handle cannot write even by mistake.  Write transactions run
  ``READ COMMITTED`` and lock before they read: the first statement locks the
  ``uppers`` and ``sinces`` rows of every collection involved, ``FOR UPDATE``, in
  ascending collection id (one statement, ``ORDER BY`` under ``LockRows``), so each later
  statement of the transaction sees the latest committed state of those collections and
  appends to overlapping sets of collections queue instead of deadlocking.  Every writer
  of a collection (append, seal, compact, consolidate, update) takes that lock first.
  Lock ordering was chosen over ``SERIALIZABLE`` with retries: contended appends (the
  leader and optimistic writers on a shared collection) wait their turn instead of doing
  the work and then failing, and the outcome is the same.  Serialization failures and
  deadlocks (40001, 40P01) are still retried, as a safety net.
* **Fencing.** A fenced handle's write transactions hold the fence row ``FOR SHARE``
  (taken in the same statement as the collection locks), so the ``UPDATE`` of a new
  leader waits for them and every later one sees the new epoch and fails with
  :class:`~stash.errors.FenceError`; nothing a deposed handle writes after the fence
  commits.  Its read transactions check the epoch in their snapshot without locking
  (a lock would make every read write WAL and wait for an fsync at COMMIT).
* **Writes in one round trip.** An append's ``insert``, ``set_upper``, ``set_since`` and
  per-key ``consolidate`` are buffered and sent at the end as one statement per
  collection (data-modifying CTEs: one snapshot), so a 1-entry fenced append is
  ``BEGIN``, the lock, the write, ``COMMIT``.  A one-key typed write (``upsert_key``)
  sends its reads ahead with the ``BEGIN`` in one pipeline (:meth:`PgTxn.prefetch_key`:
  the lock by name, then the key's values and the retention setting, which see what the
  lock waited for): three waits, as a SQLAlchemy Core upsert.  The statements live in
  :mod:`stash.pg_statements`.
* **Faults.** A connection lost before COMMIT makes the whole transaction run again on a
  new connection.  A connection lost *during* COMMIT is resolved by asking the server
  (``txid_status`` of the transaction's id, learnt in the transaction): committed is
  success, aborted is run again, and only when the server cannot tell within the retry
  budget does the caller get :class:`~stash.errors.IndeterminateError`.  A server that is
  down at open fails at once with ``stash error: postgres: ...``.
* **jsonb.** Keys and values are sent as canonical JSON text cast to ``jsonb`` and read
  back as ``jsonb::text`` turned canonical again (:func:`canonical_text`), so text
  equality is value equality on both sides.
* Every value is a bound parameter; identifiers are constants or ``psycopg.sql``
  identifiers.  Passwords never appear in messages (libpq does not echo them; URLs go
  through :func:`stash.url.redact`).

This module imports :mod:`stash.sql`, never the reverse: :mod:`stash.sql` finds
:class:`PgOps` by name (``stash.sql.SQL_DIALECTS``).

Source of the idea: Materialize's ``Postgres`` stash (``src/stash/src/lib.rs``): a fence row
with epoch and nonce checked in every transaction, savepoint and readonly modes.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Collection, Sequence
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg import sql
from sqlalchemy.engine import URL

from stash.base import Mode
from stash.consolidation import DiffSumOverflow
from stash.errors import IndeterminateError, StashError
from stash.pg_statements import (
    _FLUSH_ONE_SQL,
    _FLUSH_SQL,
    _FRONTIERS_FENCED_SQL,
    _FRONTIERS_SQL,
    _LOCK_BY_NAME_FENCED_SQL,
    _LOCK_BY_NAME_SQL,
    _LOCK_FENCED_SQL,
    _LOCK_ONE_FENCED_SQL,
    _LOCK_ONE_SQL,
    _LOCK_SQL,
    _PG_LOG_HEAD,
    _PG_LOG_SCAN,
    _PG_LOG_TRUNCATE,
    _ROWS_BY_NAME_SQL,
    peek_by_name_statement,
    peek_statement,
    pg_log_insert_sql,
)
from stash.placement import install, placement
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
from stash.txn import KeyProbe, LogRow, Row
from stash.url import redact

log = logging.getLogger(__name__)

#: SQLSTATEs after which the whole transaction is run again.
RETRY_STATES = frozenset({"40001", "40P01"})
#: SQLSTATEs that mean the server ended or refused the session (plus class 08).
LOST_STATES = frozenset({"57P01", "57P02", "57P03", "53300"})
_UNIQUE_VIOLATION = "23505"
#: Log entries per INSERT statement (a statement binds at most 65,535 parameters).
LOG_INSERT_CHUNK = 64


def pg_engine(url: URL, *, pool_size: int, connect_timeout: float, pre_ping: bool) -> sa.Engine:
    """The SQLAlchemy engine (pool) of a Postgres stash.

    Connection options given in the URL's query win over these defaults:
    ``connect_timeout`` (seconds), ``application_name=stash``, TCP keepalives that notice
    a dead peer within about a minute instead of the kernel's two hours, and
    ``options=-c plan_cache_mode=force_generic_plan``: every stash statement is a keyed
    index lookup whose generic plan is the right one (checked with EXPLAIN on 100,000
    rows), and psycopg prepares repeated statements, so the server stops re-planning the
    append statement on every call (0.73 -> 0.30 ms measured; left to "auto", Postgres
    keeps choosing custom plans for it).
    """
    try:
        timeout = max(2, int(connect_timeout))
    except (TypeError, ValueError):
        raise StashError(
            f"connect_timeout must be a number of seconds, got {connect_timeout!r}"
        ) from None
    defaults: dict[str, Any] = {
        "connect_timeout": timeout,
        "application_name": "stash",
        "keepalives": 1,
        "keepalives_idle": 30,
        "keepalives_interval": 10,
        "keepalives_count": 3,
        "options": "-c plan_cache_mode=force_generic_plan",
    }
    connect_args = {k: v for k, v in defaults.items() if k not in url.query}
    engine = sa.create_engine(
        url,
        pool_size=pool_size,
        max_overflow=2 * pool_size,
        pool_pre_ping=bool(pre_ping),
        connect_args=connect_args,
    )
    install(engine)  # the stash's schema (stash_schema=...) on every connection
    return engine


def _parse_float(text: str) -> float | int:
    # The codec's number rule (stash.codec._normalize): whole floats below 2**53 are ints.
    f = float(text)
    return int(f) if f.is_integer() and abs(f) < 2**53 else f


_decode = json.JSONDecoder(parse_float=_parse_float).decode
_encode = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
).encode


def canonical_text(text: str) -> str:
    """Canonical JSON text (as :func:`stash.codec.canonical_json` writes it) of a
    ``jsonb::text``.

    Postgres renders strings, integers, ``true``, ``false`` and ``null`` exactly as the
    canonical encoder does (the same escapes, UTF-8 kept), so those are returned as they
    are; objects (key order, ``": "``), arrays (``", "``) and decimals are parsed and
    re-encoded (C-accelerated ``json``; the value was validated when it was written).
    """
    c = text[0]
    if c == '"' or text in ("true", "false", "null"):
        return text
    if (c == "-" or c.isdigit()) and text.lstrip("-").isdigit():
        return text
    return _encode(_decode(text))


def _consolidate_rendered(rows: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    """A whole collection's rows ``(canonical key, jsonb-rendered value, diff)`` as
    ``peek_rows`` returns them: one per ``(key, value)`` with its diff sum, no zero sum.

    The collection is read to be decoded, so a value stays as ``jsonb`` renders it (it
    decodes to the value written; making every object canonical cost half of a
    10,000-entry typed ``peek_one``).  Only the values of a key held by several rows
    are made canonical before they are summed (``2.50`` and ``2.5`` are one value).
    """
    keys = [k for k, _, _ in rows]
    if len(set(keys)) == len(rows):
        return [r for r in rows if r[2] != 0]
    seen: dict[str, int] = {}
    for k in keys:
        seen[k] = seen.get(k, 0) + 1
    sums: dict[tuple[str, str], int] = {}
    for k, v, d in rows:
        kv = (k, canonical_text(v) if seen[k] > 1 else v)
        sums[kv] = sums.get(kv, 0) + d
    return [(k, v, d) for (k, v), d in sums.items() if d != 0]


def _sqlstate(e: BaseException) -> str | None:
    return getattr(e, "sqlstate", None)


class PgOps(_Ops):
    """Postgres: isolation per transaction kind, commit resolution, error mapping."""

    name = "postgres"

    def stash_url(self, url: URL) -> URL:
        """``url`` on the psycopg 3 driver (``postgresql``, ``+psycopg`` and ``+psycopg2``
        URLs are accepted; any other driver is refused)."""
        if (
            url.get_driver_name() not in ("psycopg", "psycopg2", "")
            and url.drivername != "postgresql"
        ):
            raise StashError(
                f"unsupported postgres driver in {redact(url)!r}; use postgresql+psycopg"
            )
        placement(url)  # the stash's schema parameters are identifiers
        return url.set(drivername="postgresql+psycopg")

    def engine(self, url: URL, mode: Mode, options: EngineOptions) -> sa.Engine:
        return pg_engine(
            url,
            pool_size=options.pool_size,
            connect_timeout=options.connect_timeout,
            pre_ping=options.pre_ping,
        )

    def txn(self, stash: SqlStash, dbc: Any, write: bool, savepoint: bool) -> SqlTxn:
        return PgTxn(stash, dbc, write, savepoint)

    def begin(self, dbc: Any, write: bool) -> None:
        # psycopg sends BEGIN with these (None: the server's, READ COMMITTED) before the first
        # statement; a set takes a lock and a wait and drops its cached BEGIN: only on change.
        level, read_only = (None, None) if write else (psycopg.IsolationLevel.REPEATABLE_READ, True)
        if dbc.isolation_level != level:
            dbc.isolation_level = level
        if dbc.read_only != read_only:
            dbc.read_only = read_only

    def rollback(self, dbc: Any) -> None:
        try:
            dbc.rollback()
        except psycopg.Error:
            pass

    def is_idle(self, dbc: Any) -> bool:
        return bool(
            not dbc.broken and dbc.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        )

    def is_lost(self, e: BaseException, dbc: Any) -> bool:
        if isinstance(e, sa.exc.DBAPIError) and e.connection_invalidated:
            return True
        orig = _driver_error(e)
        if not isinstance(orig, psycopg.Error):
            return False
        if dbc is not None and getattr(dbc, "broken", False):
            return True
        state = _sqlstate(orig)
        if state is None:
            return isinstance(orig, psycopg.OperationalError | psycopg.InterfaceError)
        return state.startswith("08") or state in LOST_STATES

    def classify(self, e: BaseException, opening: bool) -> BaseException:
        if isinstance(e, StashError):
            return e
        orig = _driver_error(e)
        if isinstance(orig, UnicodeError):
            return StashError(f"postgres: a value is not valid Unicode text: {first_line(orig)}")
        if not isinstance(orig, psycopg.Error):
            return e
        state = _sqlstate(orig)
        if state in RETRY_STATES:
            return _Transient(orig)
        if self.is_lost(e, None):
            if opening:
                return StashError(f"postgres: {first_line(orig)}")
            return _Transient(orig)
        if state == _UNIQUE_VIOLATION and "collections" in first_line(orig):
            return _Transient(orig)  # a collection created concurrently: look it up again
        return StashError(f"postgres: {first_line(orig)}")

    def commit(self, stash: SqlStash, tx: SqlTxn, dbc: Any) -> None:
        try:
            dbc.commit()
        except psycopg.Error as e:
            self.rollback(dbc)
            assert isinstance(tx, PgTxn)
            if not self.is_lost(e, dbc):
                # The server answered: the transaction did not commit.
                c = self.classify(e, False)
                raise c from None
            if not tx.write or tx.xid is None:
                raise _Transient(e) from None  # nothing was written: run it again
            committed = resolve_commit(stash, tx.xid)
            if committed is True:
                log.warning(
                    "stash %s: connection lost during COMMIT; the server reports "
                    "transaction %d committed",
                    redact(stash._url),
                    tx.xid,
                )
                return
            if committed is False:
                log.warning(
                    "stash %s: connection lost during COMMIT; the server reports "
                    "transaction %d aborted, running it again",
                    redact(stash._url),
                    tx.xid,
                )
                raise _Transient(e) from None
            raise IndeterminateError(
                f"postgres: connection lost during COMMIT of transaction {tx.xid} and the "
                f"server could not say within {stash.retry_budget:g} s whether it committed; "
                f"the outcome is unknown: {first_line(e)}"
            ) from None

    def savepoint_open(self, dbc: Any, stash_id: str) -> str:
        # Statements prepared before the temporary tables existed must not be reused.
        dbc.prepare_threshold = None
        # One snapshot for the whole copy: under READ COMMITTED each INSERT ... SELECT
        # would see the appends committed before it, and the copy's uppers could claim
        # rows its data table does not hold.
        dbc.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        dbc.read_only = None
        cur = dbc.cursor()
        row = cur.execute(
            "SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE c.oid = 'data'::regclass"
        ).fetchone()
        home = sql.Identifier(row[0])
        cur.execute(
            "CREATE TEMP TABLE fence (epoch bigint NOT NULL, nonce bytea NOT NULL,"
            " stash_id text NOT NULL);"
            "CREATE TEMP TABLE collections (collection_id serial PRIMARY KEY,"
            " name text NOT NULL UNIQUE, key_codec text NOT NULL, value_codec text NOT NULL);"
            "CREATE TEMP TABLE data (collection_id integer NOT NULL, key jsonb NOT NULL,"
            " value jsonb NOT NULL, time bigint NOT NULL, diff bigint NOT NULL);"
            "CREATE INDEX ON pg_temp.data (collection_id, jsonb_hash_extended(key, 0));"
            "CREATE INDEX ON pg_temp.data (collection_id, time);"
            "CREATE TEMP TABLE sinces (collection_id integer PRIMARY KEY, since bigint);"
            "CREATE TEMP TABLE uppers (collection_id integer PRIMARY KEY, upper bigint);"
            "CREATE TEMP TABLE commit_times (collection_id integer, time bigint,"
            " committed_at bigint NOT NULL, PRIMARY KEY (collection_id, time));"
            "CREATE TEMP TABLE logs (name text, seqno bigint, rollup boolean NOT NULL,"
            " data text NOT NULL, PRIMARY KEY (name, seqno))"
        )
        for table, cols in TABLE_COLUMNS.items():
            names = sql.SQL(", ").join(sql.Identifier(c) for c in cols)
            cur.execute(
                sql.SQL("INSERT INTO pg_temp.{t} ({c}) SELECT {c} FROM {h}.{t}").format(
                    t=sql.Identifier(table), c=names, h=home
                )
            )
        cur.execute(
            "SELECT setval(pg_get_serial_sequence('pg_temp.collections', 'collection_id'),"
            " coalesce(max(collection_id), 0) + 1, false) FROM pg_temp.collections"
        )
        cur.execute("UPDATE pg_temp.fence SET stash_id = %s", (stash_id,))
        row = cur.execute(sql.SQL("SELECT stash_id FROM {h}.fence").format(h=home)).fetchone()
        return str(row[0])


def resolve_commit(stash: SqlStash, xid: int) -> bool | None:
    """Ask the server whether transaction ``xid`` committed, after its connection was
    lost during COMMIT: ``True`` committed, ``False`` aborted (it never will commit),
    ``None`` unknown (the server stayed unreachable for the retry budget, or no longer
    knows the transaction).  Waits while the old session is still finishing."""
    deadline = time.monotonic() + stash.retry_budget
    delay = 0.02
    while True:
        status = _txid_status(stash, xid)
        if status == "committed":
            return True
        if status == "aborted":
            return False
        if status is None:
            return None
        # "in progress": the lost session has not finished yet; "": unreachable.
        if time.monotonic() + delay > deadline:
            return None
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def _txid_status(stash: SqlStash, xid: int) -> str | None:
    """``txid_status(xid)`` on a fresh pooled connection; ``""`` if the server cannot be
    reached."""
    try:
        fairy = stash.engine.raw_connection()
    except psycopg.Error:
        return ""
    dbc = fairy.driver_connection
    assert dbc is not None
    try:
        dbc.isolation_level = None
        dbc.read_only = None
        row = dbc.execute("SELECT txid_status(%s)", (xid,)).fetchone()
        dbc.rollback()
        return None if row is None or row[0] is None else str(row[0])
    except psycopg.Error:
        fairy.invalidate()
        return ""
    finally:
        fairy.close()


class _Pending:
    """Buffered writes of one collection in a write transaction."""

    __slots__ = ("rows", "upper", "set_upper", "since", "set_since", "cons", "cons_since")

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.upper: int | None = None
        self.set_upper = False
        self.since: int | None = None
        self.set_since = False
        self.cons: list[str] | None | bool = False  # False: none; None: all keys
        self.cons_since: int = 0


class PgTxn(SqlTxn):
    """The primitives of :class:`stash.txn.Txn` on one psycopg connection.

    Args:
        stash: the handle (epoch, nonce).
        dbc: the psycopg connection (a transaction starts with the first statement).
        write: whether this is a write transaction (locks, buffered writes, xid).
        savepoint: whether it runs inside a savepoint handle's transaction (no fence).

    Attributes:
        xid: the transaction's id (``txid_current()``) once a write statement learnt it,
            used to resolve a COMMIT whose answer was lost.
    """

    def __init__(self, stash: SqlStash, dbc: Any, write: bool, savepoint: bool) -> None:
        super().__init__(stash, dbc, write)
        self.cur = dbc.cursor()
        self.xid: int | None = None
        self._fence_pending = stash._epoch is not None and not savepoint
        self._locked: set[int] = set()
        self._pending: dict[int, _Pending] = {}
        self._wrote = False
        # Answers read ahead by prefetch_key, each used once, all dropped by any write.
        self._ahead: dict[tuple[Any, ...], Any] = {}

    # ------------------------------------------------------------- plumbing
    _param = "%({})s"  # commit_times statements (SqlTxn)

    def _exec(self, statement: str, params: Any = None, prepare: bool | None = None) -> Any:
        return self.cur.execute(statement, params, prepare=prepare)

    def _ensure_fence(self) -> None:
        if self._fence_pending:
            self.check_fence()

    def stash_id(self) -> str:
        if self._sid is None:
            self._ensure_fence()
            self._sid = str(self._exec("SELECT stash_id FROM fence").fetchone()[0])
        return self._sid

    def check_fence(self) -> None:
        if self.stash._epoch is None:
            return
        self._fence_pending = False
        if self.write:
            row = self._exec("SELECT epoch, nonce, txid_current() FROM fence FOR SHARE").fetchone()
            if row is not None:
                self.xid = int(row[2])
        else:
            row = self._exec("SELECT epoch, nonce FROM fence").fetchone()
        self._compare_fence(row)

    def fence_before(self, e: BaseException) -> None:
        """Nothing: a failed statement aborted the transaction, and every statement
        of a fenced transaction checks the fence first (_ensure_fence)."""

    def finish(self) -> None:
        self._flush()
        if self._fence_pending:
            self.check_fence()
        if self.write and self.xid is None and self._wrote:
            row = self._exec("SELECT txid_current_if_assigned()").fetchone()
            self.xid = None if row is None or row[0] is None else int(row[0])

    def bump_epoch(self, nonce: bytes) -> int:
        rows = self._exec(
            "UPDATE fence SET epoch = epoch + 1, nonce = %(n)s RETURNING epoch, txid_current()",
            {"n": nonce},
        ).fetchall()
        if len(rows) != 1:
            raise StashError(
                f"the fence table holds {len(rows)} rows instead of 1; the stash schema is damaged"
            )
        self.xid = int(rows[0][1])
        return int(rows[0][0])

    # ------------------------------------------------- compare-and-set logs
    def log_insert(
        self, name: str, expected: int | None, seqno: int, rollup: bool, data: str
    ) -> bool:
        """One conditional INSERT (:meth:`log_insert_many` of one entry): ``False`` when
        the log's head is not ``expected`` (a lost race; the caller ends the
        transaction)."""
        return self._log_insert([(name, seqno, rollup, data, expected)]) is None

    def log_insert_many(self, entries: Sequence[Any]) -> int | None:
        """:meth:`log_insert` of each ``LogEntry`` of ``entries`` (at most one per log)
        in ONE statement (``stash.pg_statements.pg_log_insert_sql``; one per
        :data:`LOG_INSERT_CHUNK` entries): the index of the first entry not written (a
        lost race; the caller rolls back), ``None`` when all were.  Raises FenceError if
        the fence moved.  Two waits: ``BEGIN`` and this statement, ``COMMIT``."""
        return self._log_insert([(e.name, e.seqno, e.rollup, e.data, e.expected) for e in entries])

    def _log_insert(self, entries: list[tuple[str, int, bool, str, int | None]]) -> int | None:
        # A statement answers, per entry, the transaction's id (for a COMMIT whose answer
        # is lost) or NULL (the log's head had moved).
        self._ahead.clear()
        for start in range(0, len(entries), LOG_INSERT_CHUNK):
            chunk = entries[start : start + LOG_INSERT_CHUNK]
            fenced = self._fence_pending and self.write
            params: dict[str, Any] = {}
            if fenced:  # the fence check rides on the INSERT: one round trip less
                params["ep"], params["no"] = self.stash._epoch, self.stash._nonce
            else:
                self._ensure_fence()
            for i, entry in enumerate(chunk):  # name, seqno, rollup, data, expected head
                params.update({f"{k}{i}": v for k, v in zip("nsrde", entry, strict=True)})
            try:
                row = self._fetch_first(pg_log_insert_sql(len(chunk), fenced), params)
            except psycopg.errors.UniqueViolation:
                return self._lost_on_key(entries)
            for i, xid in enumerate(row):
                if xid is None:
                    if fenced:
                        self.check_fence()  # raises FenceError if the fence moved
                    return start + i
                self.xid = int(xid)
            self._fence_pending = False
            self._wrote = True
        return None

    def _fetch_first(self, statement: str, params: dict[str, Any]) -> Any:
        """The first row of ``statement``; sent first in a transaction, in one pipeline with
        its ``BEGIN``: one wait, not two (for ~35 us of client CPU)."""
        if self.dbc.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            return self._exec(statement, params).fetchone()
        failed: psycopg.Error | None = None
        with self.dbc.pipeline() as pipeline:
            try:  # caught in the block: leaving it with the error, psycopg warns
                self._exec(statement, params)
                pipeline.sync()
            except psycopg.errors.UniqueViolation as e:
                failed = e
        if failed:
            raise failed
        return self.cur.fetchone()

    def _lost_on_key(self, entries: list[tuple[str, int, bool, str, int | None]]) -> int:
        """The entry that lost its race when a log INSERT failed on the primary key (a
        concurrent writer of its seqno, which saw the same head, committed first): the
        first whose log's head moved, read after rolling the aborted transaction back."""
        if len(entries) == 1:
            return 0
        self.dbc.rollback()
        for i, (name, _, _, _, expected) in enumerate(entries):
            if self.log_head_seqno(name) != expected:
                return i
        return 0  # pragma: no cover - the failed entry's head has moved

    def log_rows(self, name: str, from_seqno: int | None) -> list[LogRow]:
        self._ensure_fence()
        if from_seqno is None:
            rows = self._exec(_PG_LOG_HEAD, {"n": name}).fetchall()
        else:
            rows = self._exec(_PG_LOG_SCAN, {"n": name, "s": from_seqno}).fetchall()
        return [(int(n), bool(r), str(d)) for n, r, d in rows]

    def log_head_seqno(self, name: str) -> int | None:
        self._ensure_fence()
        row = self._exec("SELECT max(seqno) FROM logs WHERE name = %(n)s", {"n": name}).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def log_truncate(self, name: str, before: int) -> int:
        self._ensure_fence()
        self._ahead.clear()
        cur = self._exec(_PG_LOG_TRUNCATE, {"n": name, "b": before})
        self._wrote = self._wrote or cur.rowcount > 0
        return int(cur.rowcount)

    def log_names(self) -> list[str]:
        self._ensure_fence()
        return [str(r[0]) for r in self._exec("SELECT DISTINCT name FROM logs ORDER BY name")]

    # ------------------------------------------------------------ collections
    def lookup_collection(self, name: str) -> tuple[int, str, str] | None:
        if ("lookup", name) in self._ahead:
            found: tuple[int, str, str] | None = self._ahead.pop(("lookup", name))
            return found
        self._ensure_fence()
        row = self._exec(
            "SELECT collection_id, key_codec, value_codec FROM collections WHERE name = %(n)s",
            {"n": name},
        ).fetchone()
        return None if row is None else (int(row[0]), str(row[1]), str(row[2]))

    def create_collection(self, name: str, key_codec: str, value_codec: str) -> int:
        self._ahead.clear()
        self._ensure_fence()
        row = self._exec(
            "WITH c AS (INSERT INTO collections (name, key_codec, value_codec)"
            " VALUES (%(n)s, %(k)s, %(v)s) ON CONFLICT (name) DO NOTHING RETURNING collection_id),"
            " s AS (INSERT INTO sinces (collection_id, since) SELECT collection_id, 0 FROM c),"
            " u AS (INSERT INTO uppers (collection_id, upper) SELECT collection_id, 0 FROM c)"
            " SELECT collection_id, txid_current() FROM c",
            {"n": name, "k": key_codec, "v": value_codec},
        ).fetchone()
        if row is None:
            # Another transaction created it since our lookup: run ours again to find it
            # with the codecs it was created with.
            raise _Transient(StashError(f"collection {name} was created concurrently"))
        cid = int(row[0])
        self.xid = int(row[1])
        self._front[cid] = [0, 0, key_codec, value_codec, name]
        self._locked.add(cid)
        return cid

    def set_collection_codecs(self, cid: int, key_codec: str, value_codec: str) -> None:
        self._ahead.clear()
        self._ensure_fence()
        self._exec(
            "UPDATE collections SET key_codec = %(k)s, value_codec = %(v)s"
            " WHERE collection_id = %(c)s",
            {"k": key_codec, "v": value_codec, "c": cid},
        )
        f = self._front.get(cid)
        if f is not None:
            f[2], f[3] = key_codec, value_codec

    def list_collections(self) -> list[tuple[str, int, str, str]]:
        self._ensure_fence()
        rows = self._exec(
            "SELECT name, collection_id, key_codec, value_codec FROM collections"
        ).fetchall()
        return [(str(n), int(i), str(k), str(v)) for n, i, k, v in rows]

    # ------------------------------------------------------------- frontiers
    def lock(self, ids: Sequence[int]) -> None:
        todo = sorted({int(i) for i in ids} - self._locked)
        if not self.write or not todo:
            return
        fenced = self._fence_pending
        params: dict[str, Any]
        if len(todo) == 1:
            statement, params = _LOCK_ONE_FENCED_SQL if fenced else _LOCK_ONE_SQL, {"id": todo[0]}
        else:
            statement, params = _LOCK_FENCED_SQL if fenced else _LOCK_SQL, {"ids": todo}
        rows = self._exec(statement, params).fetchall()
        self._took_locks(rows, fenced)

    def _took_locks(self, rows: list[Any], fenced: bool) -> None:
        """Record the rows of a lock statement (frontiers, codecs, identity, fence)."""
        if rows:
            self._sid = str(rows[0][5])
        if fenced:
            if not rows:
                self.check_fence()
            else:
                self._fence_pending = False
                self._compare_fence((rows[0][6], rows[0][7]))
        for row in rows:
            cid = int(row[0])
            self._front[cid] = [row[2], row[1], str(row[3]), str(row[4]), str(row[-2])]
            self._locked.add(cid)
            self.xid = int(row[-1])

    def frontiers(self, cid: int) -> tuple[int | None, int | None]:
        f = self._front.get(cid)
        if f is None:
            if self.write:
                # A writer locks before it reads (so e.g. update_many and a concurrent
                # seal cannot interleave).
                self.lock([cid])
                f = self._front.get(cid)
            else:
                fenced = self._fence_pending
                row = self._exec(
                    _FRONTIERS_FENCED_SQL if fenced else _FRONTIERS_SQL, {"c": cid}
                ).fetchone()
                if fenced and row is not None:
                    self._fence_pending = False
                    self._compare_fence((row[4], row[5]))
                if row is not None:
                    f = self._front[cid] = [row[0], row[1], str(row[2]), str(row[3]), row[-1]]
            if f is None:
                self._ensure_fence()
                raise StashError(f"collection id {cid} does not exist")
        return f[0], f[1]

    def prefetch_key(self, name: str, key: KeyProbe, side: str, side_key: str) -> None:
        """Read ahead, in one pipeline (one round trip, its ``BEGIN`` included), what a
        one-key write of collection ``name`` reads next: its lookup and lock, the sealed
        values of ``key`` at its upper - 1, and the collection ``side`` with its rows of
        ``side_key`` (the retention setting).  Later calls of :meth:`lookup_collection`,
        :meth:`lock`, :meth:`peek_rows` and :meth:`rows` asking exactly that are answered
        from these reads (once each; any write first drops them).  The peek and the side
        read are statements after the lock, so under READ COMMITTED they see every commit
        before the lock was granted, as separate calls would."""
        if not self.write or self._pending:
            return
        fenced = self._fence_pending
        lock = _LOCK_BY_NAME_FENCED_SQL if fenced else _LOCK_BY_NAME_SQL
        with self.dbc.pipeline():
            c_lock, c_peek, c_side = self.dbc.cursor(), self.dbc.cursor(), self.dbc.cursor()
            c_lock.execute(lock, {"n": name})
            c_peek.execute(*peek_by_name_statement(name, key))
            c_side.execute(_ROWS_BY_NAME_SQL, {"rn": side, "rk": side_key})
        rows = c_lock.fetchall()
        self._took_locks(rows, fenced)
        if not rows:
            self._ahead[("lookup", name)] = None
            return
        cid, upper = int(rows[0][0]), rows[0][1]
        self._ahead[("lookup", name)] = (cid, str(rows[0][3]), str(rows[0][4]))
        c = canonical_text
        if upper is not None:
            peek = [(c(k), c(v), int(d)) for k, v, d in c_peek.fetchall()]
            self._ahead[("peek", cid, int(upper) - 1, key)] = peek
        found = c_side.fetchall()
        if found:
            sid = int(found[0][0])
            self._ahead[("lookup", side)] = (sid, str(found[0][1]), str(found[0][2]))
            self._ahead[("rows", sid, side_key)] = [
                (c(k), c(v), int(t), int(d)) for _, _, _, k, v, t, d in found if k is not None
            ]
        else:
            self._ahead[("lookup", side)] = None

    def _pend(self, cid: int) -> _Pending:
        self._ahead.clear()
        p = self._pending.get(cid)
        if p is None:
            self.frontiers(cid)  # locks it (writers only get here)
            p = self._pending[cid] = _Pending()
        return p

    def set_upper(self, cid: int, upper: int | None) -> None:
        p = self._pend(cid)
        p.upper, p.set_upper = upper, True
        self._front[cid][1] = upper

    def set_since(self, cid: int, since: int | None) -> None:
        p = self._pend(cid)
        p.since, p.set_since = since, True
        self._front[cid][0] = since

    # ------------------------------------------------------------------ rows
    def insert(self, cid: int, rows: Sequence[Row]) -> None:
        if not rows:
            return
        p = self._pend(cid)
        if p.cons is not False:
            self._flush_one(cid)
            p = self._pend(cid)
        p.rows.extend(rows)

    def _flush(self) -> None:
        if not self._pending:
            return
        cids = sorted(self._pending)
        if len(cids) == 1:
            self._flush_one(cids[0])
            return
        checks: list[tuple[int, Any]] = []
        with self.dbc.pipeline():
            for cid in cids:
                cur = self._flush_one(cid, defer=True)
                if cur is not None:
                    checks.append((cid, cur))
        for cid, cur in checks:
            self._check_sums(cid, cur)

    @staticmethod
    def _check_sums(cid: int, cur: Any) -> None:
        row = cur.fetchone()
        if row is not None and row[0]:
            raise DiffSumOverflow(cid)

    def _flush_one(self, cid: int, defer: bool = False) -> Any:
        """Send one collection's buffered work.  A consolidating flush answers whether
        the rule on diff sums holds: checked here, or (``defer``, inside a pipeline) by
        the caller through the returned cursor."""
        p = self._pending.pop(cid, None)
        if p is None:
            return None
        cons = None if p.cons is False else ("all" if p.cons is None else "keys")
        if not p.rows and cons is None and not p.set_upper and not p.set_since:
            return None
        params: dict[str, Any] = {
            "c": cid,
            "u": p.upper,
            "su": p.set_upper,
            "s": p.since,
            "ss": p.set_since,
            "cs": p.cons_since,
        }
        # One row whose key is the one consolidated (a one-entry append): scalars.
        one = len(p.rows) == 1 and (
            cons != "keys" or (isinstance(p.cons, list) and p.cons == [p.rows[0][0]])
        )
        if one:
            params["k1"], params["v1"], params["t1"], params["d1"] = p.rows[0]
        elif p.rows:
            params["ks"] = [r[0] for r in p.rows]
            params["vs"] = [r[1] for r in p.rows]
            params["ts"] = [r[2] for r in p.rows]
            params["ds"] = [r[3] for r in p.rows]
        if cons == "keys" and not one:
            params["ck"] = p.cons
        self._wrote = True
        # A batch with retractions (an update of stored keys) consolidates groups and
        # deletes rows: it is planned afresh each time (never a cached generic plan, which
        # may have been made while the table was tiny and then scan the whole
        # collection).  Appends of new keys keep the prepared plan; for them the
        # deletion is gated off (see stash.pg_statements._flush_sql).
        fresh = cons is not None and any(r[3] < 0 for r in p.rows)
        statement = _FLUSH_ONE_SQL[cons] if one else _FLUSH_SQL[(bool(p.rows), cons)]
        prepare = False if fresh else None
        if defer:  # inside a pipeline: a cursor of its own, read after the sync
            cur = self.dbc.cursor()
            cur.execute(statement, params, prepare=prepare)
        else:
            cur = self._exec(statement, params, prepare=prepare)
        if cons is None:
            return None
        if defer:
            return cur
        self._check_sums(cid, cur)
        return None

    def rows(self, cid: int, key: str | None = None) -> list[Row]:
        if ("rows", cid, key) in self._ahead:
            ahead: list[Row] = self._ahead.pop(("rows", cid, key))
            return ahead
        self._ensure_fence()
        self._flush()
        if key is None:
            out = self._exec(
                "SELECT key::text, value::text, time, diff FROM data WHERE collection_id = %(c)s",
                {"c": cid},
            ).fetchall()
        else:
            out = self._exec(
                "SELECT key::text, value::text, time, diff FROM data"
                " WHERE collection_id = %(c)s"
                " AND jsonb_hash_extended(key, 0) = jsonb_hash_extended(%(k)s::jsonb, 0)"
                " AND key = %(k)s::jsonb",
                {"c": cid, "k": key},
            ).fetchall()
        c = canonical_text
        return [(c(k), c(v), int(t), int(d)) for k, v, t, d in out]

    def peek_rows(
        self, cid: int, ts: int, key: KeyProbe | None = None
    ) -> list[tuple[str, str, int]]:
        if ("peek", cid, ts, key) in self._ahead:
            peeked: list[tuple[str, str, int]] = self._ahead.pop(("peek", cid, ts, key))
            return peeked
        self._ensure_fence()
        self._flush()
        out = self._exec(*peek_statement(cid, ts, key)).fetchall()
        c = canonical_text
        if key is None:
            return _consolidate_rendered([(c(k), v, int(d)) for k, v, d in out])
        return [(c(k), c(v), int(d)) for k, v, d in out]

    def consolidate(self, cid: int, since: int | None, keys: Collection[str] | None) -> None:
        if since is None:
            self._ahead.clear()
            self._flush_one(cid)
            self.frontiers(cid)
            self._wrote = True
            self._exec("DELETE FROM data WHERE collection_id = %(c)s", {"c": cid})
            return
        p = self._pend(cid)
        if p.cons is not False:
            self._flush_one(cid)
            p = self._pend(cid)
        p.cons = None if keys is None else sorted(keys)
        p.cons_since = since
        if keys is not None and not keys:
            p.cons = False
