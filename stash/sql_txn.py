"""The primitive transaction of the SQL stash in SQLite's SQL (:class:`SqlTxn`; Postgres
overrides it in :mod:`stash.postgres`), with the statements it runs: frontiers, peeks,
an append's buffered rows and their consolidation, commit-time records and the
compare-and-set logs' conditional INSERT.  :class:`stash.sql.SqlStash` runs each public
stash method as one of these on one DBAPI connection.

Invariants kept here: every value is a bound parameter; an append's rows are buffered and
merged with the stored rows of their keys before anything is written (a row that
consolidation would delete in the same transaction is never written), and every buffered
row is written before any read of its collection and before COMMIT (:meth:`SqlTxn.finish`);
consolidation sums exactly (Python integers) and is checked against the rule on diff
sums before anything is written; a fenced handle's epoch and nonce are compared in the
transaction before anything it writes.

Source of the idea: Materialize's ``Sqlite`` stash backend (``src/stash/src/lib.rs``).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Collection, Sequence
from typing import Any, Protocol

from stash.antichain import I64_MAX, I64_MIN
from stash.consolidation import DiffSumOverflow, diff_sums_fit
from stash.errors import FenceError, StashError
from stash.txn import KeyProbe, LogRow, Row


class FencedHandle(Protocol):
    """What a transaction reads of its stash handle (:class:`stash.sql.SqlStash`): the
    leader epoch and nonce it took at open (``_epoch`` ``None``: not fenced)."""

    _epoch: int | None
    _nonce: bytes


def fence_error(mine: int, found: int | None) -> FenceError:
    """The unrecoverable error of a handle whose epoch ``mine`` was superseded."""
    return FenceError(
        f"stash fenced: this handle's epoch {mine} was superseded by epoch {found}; "
        "another handle opened the stash with fenced=True"
    )


# A collection's frontiers, recorded codec names, name and the stash's identity, in one
# statement (every write through a handle checks them; this way the check costs no query).
_SQLITE_FRONTIERS = (
    "SELECT s.since, u.upper, c.key_codec, c.value_codec, c.name, f.stash_id FROM sinces s"
    " JOIN uppers u ON u.collection_id = s.collection_id"
    " JOIN collections c ON c.collection_id = s.collection_id CROSS JOIN fence f"
    " WHERE s.collection_id = ?"
)
# The same with the fence's epoch and nonce, for a write whose fence is not checked yet.
_SQLITE_FRONTIERS_FENCED = _SQLITE_FRONTIERS.replace(
    "f.stash_id FROM", "f.stash_id, f.epoch, f.nonce FROM"
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
# The same for one key's candidate texts (stash.codec.key_texts), as an IN list.
_SQLITE_PEEK_KEYS = _SQLITE_PEEK_KEY.replace(
    "key = :k", "key IN (SELECT value FROM json_each(:ks))"
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


_SQLITE_INSERT = "INSERT INTO data (collection_id, key, value, time, diff) VALUES (?, ?, ?, ?, ?)"
# One row of a key that has no stored row (an append's fresh key): consolidation would
# leave it as it is, so it goes in by one statement (SqlTxn._insert_fresh).
_SQLITE_INSERT_FRESH = (
    "INSERT INTO data (collection_id, key, value, time, diff) SELECT ?1, ?2, ?3, ?4, ?5"
    " WHERE NOT EXISTS (SELECT 1 FROM data WHERE collection_id = ?1 AND key = ?2)"
)


# Compare-and-set logs (stash.logs): the entry goes in only if the log's head (its
# greatest seqno, read through the primary key) is the expected one (NULL: no entry).
_SQLITE_LOG_INSERT = (
    "INSERT INTO logs (name, seqno, rollup, data) SELECT ?, ?, ?, ?"
    " WHERE (SELECT max(seqno) FROM logs WHERE name = ?) IS ?"
)
# The same for a write whose fence is not checked yet: the fence must also hold the
# handle's epoch and nonce (no row: check_fence then tells a fence error from a lost race).
_SQLITE_LOG_INSERT_FENCED = (
    "INSERT INTO logs (name, seqno, rollup, data) SELECT ?, ?, ?, ?"
    " WHERE (SELECT max(seqno) FROM logs WHERE name = ?) IS ?"
    " AND EXISTS (SELECT 1 FROM fence WHERE epoch = ? AND nonce = ?)"
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

    def __init__(self, stash: FencedHandle, dbc: Any, write: bool) -> None:
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
        # A fenced write (see SqliteOps.txn) checks its fence with its first read of a
        # collection's frontiers, or its log INSERT, or at the latest in finish(): the
        # writer holds the write lock from BEGIN IMMEDIATE on, so the fence cannot move
        # before COMMIT, and a fenced-out handle's failure is reported as the fence
        # error whatever else failed first (fence_before).
        self._fence_pending = False

    def finish(self) -> None:
        """Called once ``fn`` is done and before COMMIT (buffered work goes out here)."""
        if self._fence_pending:
            self.check_fence()
        self._write_buffered()

    def fence_before(self, e: BaseException) -> None:
        """Called when the transaction's work raised ``e`` (before the rollback): a
        fenced write whose fence is not checked yet checks it now and raises
        :class:`~stash.errors.FenceError` in place of ``e`` if the handle is fenced out,
        as if the fence had been checked first."""
        if self._fence_pending and isinstance(e, Exception):
            try:
                self.check_fence()
            except FenceError:
                raise
            except Exception:  # noqa: BLE001, S110 - the connection failed: e says more
                pass

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
        self._fence_pending = False
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
        if not self._fence_pending:
            cur = self.dbc.execute(_SQLITE_LOG_INSERT, (name, seqno, rollup, data, name, expected))
            return bool(cur.rowcount == 1)
        cur = self.dbc.execute(
            _SQLITE_LOG_INSERT_FENCED,
            (name, seqno, rollup, data, name, expected, self.stash._epoch, self.stash._nonce),
        )
        if cur.rowcount == 1:
            self._fence_pending = False  # the fence held this handle's epoch and nonce
            return True
        self.check_fence()  # FenceError if the fence moved, else a lost race
        return False

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
            fenced = self._fence_pending
            row = self.dbc.execute(
                _SQLITE_FRONTIERS_FENCED if fenced else _SQLITE_FRONTIERS, (cid,)
            ).fetchone()
            if row is None:
                if fenced:
                    self.check_fence()
                raise StashError(f"collection id {cid} does not exist")
            if fenced:
                self._fence_pending = False
                self._compare_fence((row[6], row[7]))
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
        self.dbc.execute("UPDATE uppers SET upper = ? WHERE collection_id = ?", (upper, cid))
        f = self._front.get(cid)  # not read yet: the next read reads the new one
        if f is not None:
            f[1] = upper

    def set_since(self, cid: int, since: int | None) -> None:
        self.dbc.execute("UPDATE sinces SET since = ? WHERE collection_id = ?", (since, cid))
        f = self._front.get(cid)
        if f is not None:
            f[0] = since

    # ------------------------------------------------------------------ rows
    def insert(self, cid: int, rows: Sequence[Row]) -> None:
        """Buffer ``rows`` of ``cid``: written by the next read or consolidation of the
        collection, or by :meth:`finish` (before COMMIT)."""
        if rows:
            self._buffered.setdefault(cid, []).extend(rows)

    def _write_rows(self, cid: int, rows: Sequence[Row]) -> None:
        if len(rows) == 1:  # executemany costs a few microseconds more for one row
            self.dbc.execute(_SQLITE_INSERT, (cid, *rows[0]))
        else:
            self.dbc.executemany(_SQLITE_INSERT, [(cid, k, v, t, d) for k, v, t, d in rows])

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

    def peek_rows(
        self, cid: int, ts: int, key: KeyProbe | None = None
    ) -> list[tuple[str, str, int]]:
        """The rows at times ``<= ts`` consolidated as ``_SQLITE_PEEK`` would: one row
        per ``(key, value)`` with its diff sum, no zero sum, ordered by (key, value).

        A whole collection is read with a plain indexed scan and consolidated in
        Python (:func:`_consolidate_peek`): SQLite's ``GROUP BY`` sorts every row in a
        temporary b-tree, which cost half the read of a 100,000-entry ``peek_one``.
        One key's few rows are grouped by SQLite."""
        self._write_buffered(cid)
        if isinstance(key, tuple):
            cur = self.dbc.execute(_SQLITE_PEEK_KEYS, {"c": cid, "ts": ts, "ks": json.dumps(key)})
            return list(cur.fetchall())
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
            elif len(todo) == 1 and len(keys) == 1 and self._insert_fresh(cid, since, todo[0]):
                return  # one row of a key with no stored row: consolidated as it is
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

    def _insert_fresh(self, cid: int, since: int, row: Row) -> bool:
        """Write the one buffered row of its key at ``max(time, since)`` if the key has
        no stored row, in one statement (``_SQLITE_INSERT_FRESH``); return whether it
        was written.  Alone in its key, a non-zero i64 diff is what consolidation would
        leave of it (one row, its time advanced to since, its sum within the rule), so
        nothing else is read or written; otherwise (a stored row, or a diff that
        consolidation would drop or refuse) nothing is written and the caller takes
        the general path."""
        k, v, t, d = row
        if d == 0 or not I64_MIN <= d <= I64_MAX:
            return False
        cur = self.dbc.execute(_SQLITE_INSERT_FRESH, (cid, k, v, t if t > since else since, d))
        return bool(cur.rowcount == 1)

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
