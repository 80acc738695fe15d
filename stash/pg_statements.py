"""The SQL statements of the Postgres backend (:mod:`stash.postgres`), built once at
import: the lock, a reader's frontiers, the one-statement flush of a collection's
buffered writes, peeks, the statements a one-key write sends ahead in one pipeline
(:meth:`stash.postgres.PgTxn.prefetch_key`) and those of the compare-and-set logs.

Invariants kept here: every value is a bound parameter; identifiers are constants;
statements are built from constant fragments with :mod:`psycopg.sql`.
"""

from __future__ import annotations

from typing import Any

from psycopg import sql

from stash.antichain import I64_MAX, I64_MIN
from stash.txn import KeyProbe

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
# The same for one collection, its id %(id)s a scalar (no array to dump).
_LOCK_ONE = _LOCK.replace("= ANY(%(ids)s::int4[])", "= %(id)s::int4")
_LOCK_ONE_SQL = _LOCK_ONE.format(fcols=", f.stash_id", fjoin=" CROSS JOIN fence f", flock="")
_LOCK_ONE_FENCED_SQL = _LOCK_ONE.format(
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


def _flush_sql(has_rows: bool, consolidate: str | None, one: bool = False) -> str:
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
    literal, about 20% of a one-row persist append's client CPU.  ``one``: the rows are
    one row (``%(k1)s``, ``%(v1)s``, ``%(t1)s``, ``%(d1)s``) and the keys to consolidate,
    if any, that row's key: sent as scalars, not arrays (psycopg's array dumper, run on
    every execute, cost a third of a one-entry append's client CPU).
    """
    q = sql.SQL
    ctes: list[sql.Composable] = []
    if has_rows and one:
        ctes.append(
            q(
                "c_new AS (SELECT %(k1)s::jsonb AS key, %(v1)s::jsonb AS value,"
                " %(t1)s::int8 AS time, %(d1)s::int8 AS diff)"
            )
        )
    elif has_rows:
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
                    "c_keys AS (SELECT %(k1)s::jsonb AS key,"
                    " jsonb_hash_extended(%(k1)s::jsonb, 0) AS h)"
                )
                if one
                else q(
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
#: One row, and (``"keys"``) its key consolidated: scalars in place of arrays.
_FLUSH_ONE_SQL = {cons: _flush_sql(True, cons, one=True) for cons in (None, "keys", "all")}


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


# The same for one key's candidate texts (stash.codec.key_texts), in one statement: the
# index is probed text by text (a LATERAL probe per text; OFFSET 0 keeps the planner from
# flattening it into a join, which a generic plan made on a tiny table ran as a scan of
# the collection).
_PEEK_KEYS_SQL = (
    "SELECT d.key::text, d.value::text, sum(d.diff)::int8"
    " FROM (SELECT DISTINCT k::jsonb AS key FROM unnest(%(k)s::text[]) AS k) w"
    " CROSS JOIN LATERAL (SELECT key, value, diff FROM data WHERE collection_id = %(c)s"
    " AND (time <= %(ts)s) IS TRUE AND jsonb_hash_extended(key, 0) ="
    " jsonb_hash_extended(w.key, 0) AND key = w.key OFFSET 0) d"
    " GROUP BY d.key, d.value HAVING sum(d.diff) <> 0"
)


def peek_statement(cid: int, ts: int, key: KeyProbe | None) -> tuple[str, dict[str, Any]]:
    """``(statement, parameters)`` of ``PgTxn.peek_rows``: a whole collection, one key
    text, or one key's candidate texts (a tuple)."""
    if isinstance(key, tuple):
        return _PEEK_KEYS_SQL, {"c": cid, "ts": ts, "k": list(key)}
    return _PEEK_SQL if key is None else _PEEK_KEY_SQL, {"c": cid, "ts": ts, "k": key}


# --- A one-key write's reads, sent ahead in one pipeline (PgTxn.prefetch_key) --------
# 1. The lock of the collection named %(n)s (as _LOCK, by name): its id and recorded
#    codec names answer the write's lookup, and the lock its lock.
_LOCK_BY_NAME = _LOCK.replace(
    "WHERE u.collection_id = ANY(%(ids)s::int4[])", "WHERE c.name = %(n)s"
)
_LOCK_BY_NAME_SQL = _LOCK_BY_NAME.format(
    fcols=", f.stash_id", fjoin=" CROSS JOIN fence f", flock=""
)
_LOCK_BY_NAME_FENCED_SQL = _LOCK_BY_NAME.format(
    fcols=", f.stash_id, f.epoch, f.nonce", fjoin=" CROSS JOIN fence f", flock=", f"
)
# 2. The sealed values of key %(k)s in that collection (as _PEEK_KEY_SQL at upper - 1).
#    A statement of its own, after the lock: under READ COMMITTED it reads a snapshot
#    taken once the lock is held, so it sees every commit of the writers before.
_PEEK_KEY_BY_NAME_SQL = (
    "SELECT d.key::text, d.value::text, sum(d.diff)::int8 FROM collections c"
    " JOIN uppers u ON u.collection_id = c.collection_id"
    " JOIN data d ON d.collection_id = c.collection_id AND (d.time < u.upper) IS TRUE"
    " AND jsonb_hash_extended(d.key, 0) = jsonb_hash_extended(%(k)s::jsonb, 0)"
    " AND d.key = %(k)s::jsonb"
    " WHERE c.name = %(n)s GROUP BY d.key, d.value HAVING sum(d.diff) <> 0"
)
# The same for one key's candidate texts, probed text by text (as _PEEK_KEYS_SQL).
_PEEK_KEYS_BY_NAME_SQL = (
    "SELECT d.key::text, d.value::text, sum(d.diff)::int8 FROM collections c"
    " JOIN uppers u ON u.collection_id = c.collection_id"
    " CROSS JOIN (SELECT DISTINCT k::jsonb AS key FROM unnest(%(k)s::text[]) AS k) w"
    " CROSS JOIN LATERAL (SELECT key, value, diff FROM data"
    " WHERE collection_id = c.collection_id AND (time < u.upper) IS TRUE"
    " AND jsonb_hash_extended(key, 0) = jsonb_hash_extended(w.key, 0) AND key = w.key"
    " OFFSET 0) d"
    " WHERE c.name = %(n)s GROUP BY d.key, d.value HAVING sum(d.diff) <> 0"
)


def peek_by_name_statement(name: str, key: KeyProbe) -> tuple[str, dict[str, Any]]:
    """``(statement, parameters)`` of ``PgTxn.prefetch_key``'s peek of one key text or
    of one key's candidate texts (a tuple)."""
    if isinstance(key, tuple):
        return _PEEK_KEYS_BY_NAME_SQL, {"n": name, "k": list(key)}
    return _PEEK_KEY_BY_NAME_SQL, {"n": name, "k": key}


# 3. The collection named %(rn)s (the retention settings) and its rows of key %(rk)s
#    (the collection's setting): one row with NULL row columns if it has none, no row if
#    the collection does not exist.
_ROWS_BY_NAME_SQL = (
    "SELECT c.collection_id, c.key_codec, c.value_codec, d.key::text, d.value::text,"
    " d.time, d.diff FROM collections c LEFT JOIN data d"
    " ON d.collection_id = c.collection_id"
    " AND jsonb_hash_extended(d.key, 0) = jsonb_hash_extended(%(rk)s::jsonb, 0)"
    " AND d.key = %(rk)s::jsonb"
    " WHERE c.name = %(rn)s"
)


# Compare-and-set logs (stash.logs): see stash.sql_txn for the SQLite spelling.  The head is
# read through the primary key.  A write of N entries (at most one per log) is ONE
# statement (pg_log_insert_sql), one data-modifying CTE per entry: entry i goes in only if
# its log's head is %(ei)s (its seqno is %(si)s), and the statement answers one row with
# one column per entry, the transaction's id if the entry went in, NULL if not (the
# first NULL names the log that lost).  Under READ COMMITTED a concurrent writer may also
# have seen the expected head: the INSERT of the same seqno waits for it and fails on the
# primary key once it commits (a lost race, named by PgTxn._lost_on_key).  No ON CONFLICT
# clause: its speculative insertion writes ~160 bytes more WAL per entry.
def pg_log_insert_sql(count: int, fenced: bool) -> str:
    """The conditional INSERT of ``count`` log entries (parameters ``n0, s0, r0, d0, e0,
    n1, ...``: name, seqno, rollup, data, expected head).  ``fenced``: a fenced handle
    whose fence is not checked yet in the transaction; the fence row is read FOR SHARE
    (as by ``PgTxn.check_fence``) in the same statement, with parameters ``ep`` and
    ``no``, and no entry goes in unless it holds this handle's epoch and nonce (every
    column NULL: the fence or the heads differ; ``check_fence`` then tells which, a
    FenceError first, as when checked on its own before the INSERT)."""
    cached = _LOG_INSERT_CACHE.get((count, fenced))
    if cached is not None:
        return cached
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"a log write inserts at least one entry, got {count!r}")
    ctes = [_LOG_FENCE_CTE] if fenced else []
    where = _LOG_FENCE_WHERE if fenced else " WHERE"
    for i in range(count):  # only the entry's index (an int) goes into the text
        ctes.append(_LOG_ENTRY_CTE.replace("{where}", where).replace("#", str(i)))
    cols = ", ".join(_LOG_ENTRY_COL.replace("#", str(i)) for i in range(count))
    statement = _LOG_INSERT_CACHE[(count, fenced)] = "WITH " + ", ".join(ctes) + " SELECT " + cols
    return statement


_LOG_INSERT_CACHE: dict[tuple[int, bool], str] = {}
_LOG_FENCE_CTE = "f AS (SELECT epoch, nonce FROM fence FOR SHARE)"
_LOG_FENCE_WHERE = " FROM f WHERE f.epoch = %(ep)s AND f.nonce = %(no)s AND"
_LOG_ENTRY_CTE = (
    "i# AS (INSERT INTO logs (name, seqno, rollup, data)"
    " SELECT %(n#)s, %(s#)s, %(r#)s, %(d#)s{where}"
    " (SELECT max(seqno) FROM logs WHERE name = %(n#)s) IS NOT DISTINCT FROM %(e#)s::bigint"
    " RETURNING txid_current() AS x)"
)
_LOG_ENTRY_COL = "(SELECT x FROM i#)"
_PG_LOG_HEAD = (
    "SELECT seqno, rollup, data FROM logs WHERE name = %(n)s AND seqno >= coalesce("
    "(SELECT seqno FROM logs WHERE name = %(n)s AND rollup ORDER BY seqno DESC LIMIT 1), 0)"
    " ORDER BY seqno"
)
_PG_LOG_SCAN = (
    "SELECT seqno, rollup, data FROM logs WHERE name = %(n)s AND seqno >= %(s)s ORDER BY seqno"
)
_PG_LOG_TRUNCATE = (
    "DELETE FROM logs WHERE name = %(n)s AND seqno < %(b)s"
    " AND seqno < (SELECT max(seqno) FROM logs WHERE name = %(n)s)"
)
