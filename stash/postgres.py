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
* **Writes in one round trip.** ``insert``, ``set_upper``, ``set_since`` and the
  per-key ``consolidate`` of an append are buffered and sent at the end as one
  statement per collection (data-modifying CTEs, which all see the statement's
  snapshot), so a 1-entry fenced append is ``BEGIN``, the lock, the write, ``COMMIT``.
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

from stash.antichain import I64_MAX, I64_MIN
from stash.base import Mode
from stash.consolidation import DiffSumOverflow
from stash.errors import IndeterminateError, StashError
from stash.placement import install, placement
from stash.sql import (
    TABLE_COLUMNS,
    EngineOptions,
    SqlStash,
    SqlTxn,
    _driver_error,
    _Ops,
    _Transient,
    first_line,
)
from stash.txn import Row
from stash.url import redact

log = logging.getLogger(__name__)

#: SQLSTATEs after which the whole transaction is run again.
RETRY_STATES = frozenset({"40001", "40P01"})
#: SQLSTATEs that mean the server ended or refused the session (plus class 08).
LOST_STATES = frozenset({"57P01", "57P02", "57P03", "53300"})
_UNIQUE_VIOLATION = "23505"


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
        # psycopg sends BEGIN with these settings before the first statement.
        if write:
            dbc.isolation_level = None  # the server default, READ COMMITTED
            dbc.read_only = None
        else:
            dbc.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            dbc.read_only = True

    def rollback(self, dbc: Any) -> None:
        try:
            dbc.rollback()
        except psycopg.Error:
            pass

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
            " committed_at bigint NOT NULL, PRIMARY KEY (collection_id, time))"
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


# The lock statement: uppers and sinces rows of the collections, in id order, their
# names and recorded codec names (the collections rows FOR SHARE: a migration's update of them waits
# for this transaction, and a lock that waited for a migration re-reads them), the stash's
# identity, and (for a fenced handle) the fence row FOR SHARE and the transaction id, in
# one round trip.  The
# collections rows come after the uppers and sinces rows in the locking clauses, so that a
# writer waiting for a migration's uppers row should hold no lock the migration's update of
# the collections row waits for; were it otherwise, the deadlock (40P01) is retried.
_LOCK = (
    "SELECT u.collection_id, u.upper, s.since, c.key_codec, c.value_codec{fcols}, c.name,"
    " txid_current()"
    " FROM uppers u JOIN sinces s ON s.collection_id = u.collection_id"
    " JOIN collections c ON c.collection_id = u.collection_id{fjoin}"
    " WHERE u.collection_id = ANY(%(ids)s::int4[])"
    " ORDER BY u.collection_id FOR UPDATE OF u, s FOR SHARE OF c{flock}"
)
_LOCK_SQL = _LOCK.format(fcols=", f.stash_id", fjoin=" CROSS JOIN fence f", flock="")
_LOCK_FENCED_SQL = _LOCK.format(
    fcols=", f.stash_id, f.epoch, f.nonce", fjoin=" CROSS JOIN fence f", flock=", f"
)
# A reader's frontiers, codec names and name (and fence), in one statement of its snapshot.
_FRONTIERS = (
    "SELECT s.since, u.upper, c.key_codec, c.value_codec{fcols}, c.name FROM sinces s"
    " JOIN uppers u"
    " ON u.collection_id = s.collection_id"
    " JOIN collections c ON c.collection_id = s.collection_id{fjoin}"
    " WHERE s.collection_id = %(c)s"
)
_FRONTIERS_SQL = _FRONTIERS.format(fcols="", fjoin="")
_FRONTIERS_FENCED_SQL = _FRONTIERS.format(fcols=", f.epoch, f.nonce", fjoin=" CROSS JOIN fence f")


def _flush_sql(has_rows: bool, consolidate: str | None) -> str:
    """One statement writing one collection's buffered work: new rows, their
    consolidation (``consolidate``: ``None``, ``"keys"`` for the keys in ``%(ck)s`` or
    ``"all"``) at the since ``%(cs)s``, and the new upper and since (each only if its flag
    is set).

    Consolidation sums the rows of each ``(key, value, greatest(time, since))`` group
    (exactly: numeric) of the keys concerned into one row: for ``"keys"`` (an append or
    update) only groups of several rows are rewritten and new zero diffs are not written,
    so a lone stored row stays where it is (no rewrite, and no cached generic plan ever
    gets to delete on a key that has no group); ``"all"`` leaves the rows as the memory
    backend holds them (every row at ``greatest(time, since)``, no zero diff).  The
    statement returns whether the rule on diff sums is broken afterwards.  All parts see the
    snapshot of the statement, so the consolidation merges the new rows (from the ``c_new`` CTE)
    with the stored ones (from the table) itself.  Built from constant fragments with
    :mod:`psycopg.sql`; every value is a bound parameter.  The arrays are sent in
    binary (``%(name)b``): as text, psycopg escaped every JSON text for the array
    literal, about 20% of a one-row persist append's client CPU.
    """
    q = sql.SQL
    ctes: list[sql.Composable] = []
    if has_rows:
        ctes.append(
            q(
                "c_new AS (SELECT k::jsonb AS key, v::jsonb AS value, t AS time, d AS diff"
                " FROM unnest(%(ks)b::text[], %(vs)b::text[], %(ts)b::int8[], %(ds)b::int8[])"
                " AS x(k, v, t, d))"
            )
        )
    inserts: list[sql.Composable] = []
    check: sql.Composable = q("")
    if consolidate is not None:
        if consolidate == "keys":
            # A set joined (hashed or index-probed), never "= ANY(array)": under a generic
            # plan that is a linear scan of the array for every row, O(rows x keys).
            ctes.append(
                q(
                    "c_keys AS (SELECT DISTINCT k::jsonb AS key, jsonb_hash_extended(k::jsonb, 0)"
                    " AS h FROM unnest(%(ck)b::text[]) AS k)"
                )
            )
            # Stored rows are fetched key by key through the (collection_id, key hash) index
            # (a LATERAL probe per key; OFFSET 0 keeps the planner from flattening it
            # into a join): otherwise each append may scan the collection, O(collection).
            sources: list[sql.Composable] = [q(_KEY_ROWS_SQL)]
            if has_rows:
                sources.append(
                    q(
                        "SELECT key, value, time, diff FROM c_new"
                        " WHERE key IN (SELECT key FROM c_keys)"
                    )
                )
        else:
            sources = [q("SELECT key, value, time, diff FROM data WHERE collection_id = %(c)s")]
            if has_rows:
                sources.append(q("SELECT key, value, time, diff FROM c_new"))
        # The rows concerned are read once (a CTE referenced twice is materialized) and
        # summed once per (key, value, greatest(time, since)): the groups to rewrite
        # and the check of the rule on diff sums both come from those sums.  Sums are
        # numeric (exact).  A sum beyond i64 becomes NULL in c_grp instead of failing
        # the statement (its row is not written): the statement's result then reports
        # the broken rule, and the caller rolls the transaction back.
        ctes.append(q("c_src AS ({})").format(q(" UNION ALL ").join(sources)))
        ctes.append(
            q(
                "c_sum AS (SELECT key, value, greatest(time, %(cs)s::int8) AS time,"
                " sum(diff) AS s, count(*) AS n{whole} FROM c_src"
                " GROUP BY key, value, greatest(time, %(cs)s::int8))"
            ).format(
                whole=q(", min(time) AS t0, bool_or(diff = 0) AS z")
                if consolidate == "all"
                else q("")
            )
        )
        ctes.append(
            q(
                "c_grp AS (SELECT key, value, time,"
                " CASE WHEN s BETWEEN {lo} AND {hi} THEN s::int8 END AS diff"
                " FROM c_sum WHERE n > 1{whole})"
            ).format(
                lo=q(str(I64_MIN)),
                hi=q(str(I64_MAX)),
                whole=q(" OR t0 < %(cs)s::int8 OR z") if consolidate == "all" else q(""),
            )
        )
        ctes.append(
            q(
                # Gated by "EXISTS (c_grp)" (a one-time filter): an append of new keys,
                # or of new values of stored keys, has no group and never runs the scan,
                # whatever plan was cached for it.
                "c_del AS (DELETE FROM data d USING c_grp g WHERE EXISTS (SELECT 1 FROM c_grp)"
                " AND d.collection_id = %(c)s AND jsonb_hash_extended(d.key, 0) ="
                " jsonb_hash_extended(g.key, 0) AND d.key = g.key AND d.value = g.value"
                " AND greatest(d.time, %(cs)s::int8) = g.time)"
            )
        )
        inserts.append(q("SELECT %(c)s, key, value, time, diff FROM c_grp WHERE diff <> 0"))
        # The statement's result: whether a (key, value) concerned breaks the rule on
        # diff sums afterwards (its rows are the nonzero sums grouped above).
        check = q(
            "SELECT EXISTS (SELECT 1 FROM c_sum GROUP BY key, value"
            " HAVING coalesce(sum(s) FILTER (WHERE s > 0), 0) > {hi}"
            " OR coalesce(sum(s) FILTER (WHERE s < 0), 0) < {lo})"
        ).format(lo=q(str(I64_MIN)), hi=q(str(I64_MAX)))
    if has_rows:
        keep = q("")
        if consolidate is not None:
            keep = q(
                " WHERE n.diff <> 0 AND NOT EXISTS (SELECT 1 FROM c_grp g WHERE g.key = n.key"
                " AND g.value = n.value AND g.time = greatest(n.time, %(cs)s::int8))"
            )
        inserts.insert(0, q("SELECT %(c)s, key, value, time, diff FROM c_new n{}").format(keep))
    if inserts:
        ctes.append(
            q("c_ins AS (INSERT INTO data (collection_id, key, value, time, diff) {})").format(
                q(" UNION ALL ").join(inserts)
            )
        )
    ctes.append(
        q(
            "c_up AS (UPDATE uppers SET upper = %(u)s::int8"
            " WHERE collection_id = %(c)s AND %(su)s::bool)"
        )
    )
    set_since = q(
        "UPDATE sinces SET since = %(s)s::int8 WHERE collection_id = %(c)s AND %(ss)s::bool"
    )
    if consolidate is None:
        statement = q("WITH {} {}").format(q(", ").join(ctes), set_since)
    else:
        ctes.append(q("c_since AS ({})").format(set_since))
        statement = q("WITH {} {}").format(q(", ").join(ctes), check)
    return statement.as_string()


# A key is found through the index (collection_id, jsonb_hash_extended(key, 0)) (a btree
# entry holding a long key itself would exceed Postgres' 2704 bytes): by its hash, then by
# the key itself (the hash is consistent with jsonb equality; equal hashes may differ).

#: Every stored row of the keys in ``c_keys``, probed key by key.
_KEY_ROWS_SQL = (
    "SELECT d.key, d.value, d.time, d.diff FROM c_keys k CROSS JOIN LATERAL"
    " (SELECT key, value, time, diff FROM data WHERE collection_id = %(c)s"
    " AND jsonb_hash_extended(key, 0) = k.h AND key = k.key OFFSET 0) d"
)


_FLUSH_SQL = {
    (rows, cons): _flush_sql(rows, cons) for rows in (False, True) for cons in (None, "keys", "all")
}


# A whole collection's rows, consolidated in Python (_consolidate_rendered): a server-side
# GROUP BY of jsonb (key, value) cost more than the rest of a 10,000-entry peek.
_PEEK_SQL = (
    "SELECT key::text, value::text, diff FROM data WHERE collection_id = %(c)s AND time <= %(ts)s"
)
# "(time <= ..) IS TRUE": not an index condition, so even a generic plan cached while the
# table was tiny finds the key through the (collection_id, key hash) index, never by scanning
# the collection's rows in time order.
_PEEK_KEY_SQL = (
    "SELECT key::text, value::text, sum(diff)::int8 FROM data"
    " WHERE collection_id = %(c)s AND (time <= %(ts)s) IS TRUE"
    " AND jsonb_hash_extended(key, 0) = jsonb_hash_extended(%(k)s::jsonb, 0)"
    " AND key = %(k)s::jsonb GROUP BY key, value HAVING sum(diff) <> 0"
)


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

    # ------------------------------------------------------------ collections
    def lookup_collection(self, name: str) -> tuple[int, str, str] | None:
        self._ensure_fence()
        row = self._exec(
            "SELECT collection_id, key_codec, value_codec FROM collections WHERE name = %(n)s",
            {"n": name},
        ).fetchone()
        return None if row is None else (int(row[0]), str(row[1]), str(row[2]))

    def create_collection(self, name: str, key_codec: str, value_codec: str) -> int:
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
        rows = self._exec(_LOCK_FENCED_SQL if fenced else _LOCK_SQL, {"ids": todo}).fetchall()
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

    def _pend(self, cid: int) -> _Pending:
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
        if p.rows:
            params["ks"] = [r[0] for r in p.rows]
            params["vs"] = [r[1] for r in p.rows]
            params["ts"] = [r[2] for r in p.rows]
            params["ds"] = [r[3] for r in p.rows]
        if cons == "keys":
            params["ck"] = p.cons
        self._wrote = True
        # A batch with retractions (an update of stored keys) consolidates groups and
        # deletes rows: it is planned afresh each time (never a cached generic plan, which
        # may have been made while the table was tiny and then scan the whole
        # collection).  Appends of new keys keep the prepared plan; for them the
        # deletion is gated off (see _flush_sql).
        fresh = cons is not None and any(r[3] < 0 for r in p.rows)
        statement, prepare = _FLUSH_SQL[(bool(p.rows), cons)], False if fresh else None
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

    def peek_rows(self, cid: int, ts: int, key: str | None = None) -> list[tuple[str, str, int]]:
        self._ensure_fence()
        self._flush()
        out = self._exec(
            _PEEK_SQL if key is None else _PEEK_KEY_SQL, {"c": cid, "ts": ts, "k": key}
        ).fetchall()
        c = canonical_text
        if key is None:
            return _consolidate_rendered([(c(k), v, int(d)) for k, v, d in out])
        return [(c(k), c(v), int(d)) for k, v, d in out]

    def consolidate(self, cid: int, since: int | None, keys: Collection[str] | None) -> None:
        if since is None:
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
