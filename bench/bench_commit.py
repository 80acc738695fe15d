"""Persist's one-row ``compare_and_append`` against the commit it must do.

Each figure is a ratio measured in the same run, in interleaved rounds (order rotated
every round, every contender after the same warm-up round; the median of the per-round
ratios reported with its spread):

* **SQLite**: persist's ``WriteHandle.compare_and_append`` of one flights row on a SQLite
  stash (WAL, ``synchronous=FULL``, file blob, compactor in the background) against a raw
  ``sqlite3`` transaction with the same settings doing the least a commit of one row
  needs: ``BEGIN IMMEDIATE``, read the upper, insert the row (as JSON text), advance the
  upper, ``COMMIT``.  Both sides' inputs are built before the timed bursts (the raw
  side's JSON texts, persist's one-row Arrow tables in the writer's updates schema:
  zero-copy slices of a prepared table, see ``_Prepared``), so neither pays for making up its rows.  Goal: >= 0.5x,
  measured at several shard lengths (1 to 100,000 appends; 20,000 with ``--quick``) so
  that flatness shows: a cost growing with the shard would show as a falling ratio.
  Beside it, persist's CPU per append (``time.process_time`` over each burst: the whole
  process, background compaction included; goal <= 0.45 ms), with raw sqlite3's, and
  the CPU of the commit persist makes done with ``sqlite3`` alone (``RawSqliteLogs``:
  its two log rows in the stash's ``logs`` table; the floor of its ``COMMIT``, no goal);
* **Postgres**: the same on a Postgres stash (a throwaway server, production durability:
  ``fsync`` and ``synchronous_commit`` on) against a raw psycopg transaction (``SELECT ...
  FOR UPDATE``, ``INSERT``, ``UPDATE``, ``COMMIT``).  Goal: >= 0.3x.  Beside it, the
  costs of one append (client CPU, the server backends' CPU, WAL bytes) against a
  one-entry ``Stash.append`` (goals: server CPU and WAL within 2x), and the WAL by source
  (``pg_walinspect``, each record by the relation it writes: the log rows, their TOAST
  (rollups, the longest diffs), the log's primary key, truncation's DELETEs, stash collection rows (the
  retired collection), frontiers, commit records; full-page images, which follow
  checkpoints, a server setting, counted apart too);
* **8 processes**: 8 processes, each appending one-row batches to its own shard of one
  Postgres stash, against 1 process doing the same: the aggregate rate, as a ratio (goal
  >= 3x: independent shards must not serialise on each other; Postgres groups their WAL
  flushes).  The same ratio for raw psycopg is reported beside it: the machine's limit.
  Beside each run, the machine's busy cores during it (``/proc/stat``): when one process
  with its server backend already keeps ``b`` of the ``c`` cores busy, no number of
  processes reaches more than ``c / b`` times its rate (on a quiet machine).

When a ratio misses its goal (or with ``--profile``) a pyinstrument profile of persist's
appends is stored with the results.

Run: ``python -m bench.bench_commit [--backend sqlite|postgres|all] [--quick]
[--profile] [--json PATH]`` (default results ``var/bench-results/commit.json``).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import pyarrow as pa

from bench.common import (
    ROOT,
    BenchResults,
    Curve,
    Goal,
    Table,
    burst,
    fmt_num,
    interleave,
    median,
    profile_text,
    ratio_record,
)

__all__ = ["PersistOneRow", "RawPgOneRow", "RawSqliteLogs", "RawSqliteOneRow", "main", "run"]

GOAL_ONE_ROW = Goal(">=", 0.3)
#: The SQLite goals: appends per second against raw sqlite3's, and persist's CPU per
#: append (the whole process's, background compaction included).
GOAL_SQLITE_ONE_ROW = Goal(">=", 0.5)
GOAL_SQLITE_CPU_MS = Goal("<=", 0.45)
GOAL_PROCESSES = Goal(">=", 3.0)
#: Server CPU and WAL of a one-row persist append, as a multiple of a one-entry
#: ``Stash.append``'s.
GOAL_PG_COSTS = Goal("<=", 2.0)
PROCESSES = 8


def _rows(n: int = 1000) -> pa.Table:
    from bench.data import flights

    return flights().slice(0, n)


def _one(rows: pa.Table, i: int, t: int) -> pa.Table:
    """Row ``i`` (mod the table) with ``_time`` = ``t`` and ``_diff`` = 1."""
    row = rows.slice(i % rows.num_rows, 1)
    return row.append_column("_time", pa.array([t], pa.int64())).append_column(
        "_diff", pa.array([1], pa.int64())
    )


#: Rows of persist's input prepared at a time (outside the timed bursts, see
#: :class:`PersistOneRow`).
PREPARED_ROWS = 1 << 16


class _Prepared:
    """One-row update tables for times ``start, start + 1, ...``, prepared ahead: a table
    of :data:`PREPARED_ROWS` rows (``rows`` repeated, ``_time`` counting up, ``_diff``
    1), sliced zero-copy per append, so that building the input costs persist's side of
    the comparison what the raw side's precomputed JSON texts cost it (nothing)."""

    def __init__(
        self, rows: pa.Table, start: int, count: int, schema: pa.Schema | None = None
    ) -> None:
        import pyarrow.compute as pc

        reps = -(-count // rows.num_rows)
        base = pa.concat_tables([rows] * reps).slice(0, count).combine_chunks()
        times = pc.add(pa.array(range(count), pa.int64()), pa.scalar(start, pa.int64()))
        self.start = start
        table = base.append_column("_time", times).append_column(
            "_diff", pa.array([1] * count, pa.int64())
        )
        # In the writer's updates schema (``_time``, ``_diff`` not null), as a caller
        # that builds its rows for the shard would.
        self.table = table if schema is None else table.cast(schema)

    def get(self, t: int) -> pa.Table | None:
        """The one-row table at time ``t``, or ``None`` if ``t`` is not prepared."""
        i = t - self.start
        return self.table.slice(i, 1) if 0 <= i < self.table.num_rows else None


class PersistOneRow:
    """Persist's one-row appends to one shard (``compare_and_append(row, u, u + 1)``)."""

    def __init__(self, stash_url: str, blob_url: str, rows: pa.Table, tag: str = "onerow") -> None:
        from persist import PersistClient
        from stash import Stash

        self.stash = Stash.open(stash_url, mode="writable", fenced=False)
        self.client = PersistClient(self.stash, blob_url, compaction="background")
        self.write, self.read = self.client.open(tag, rows.schema, pa.schema([]))
        self.rows = rows
        self.upper = self.write.upper.as_option() or 0
        self.count = 0
        self.prepared = _Prepared(rows, self.upper, PREPARED_ROWS, self.write.schema)

    def prepare(self) -> None:
        """Prepare the input rows of the next :data:`PREPARED_ROWS` appends if fewer than
        half are left (called between timed bursts; :meth:`append` prepares too if it
        runs out, which a burst of more than ~32,000 appends would make it do once)."""
        p = self.prepared
        if self.upper - p.start > PREPARED_ROWS // 2:
            self.prepared = _Prepared(self.rows, self.upper, PREPARED_ROWS, self.write.schema)

    def append(self, _i: int) -> None:
        u = self.upper
        row = self.prepared.get(u)
        if row is None:
            self.prepared = _Prepared(self.rows, u, PREPARED_ROWS, self.write.schema)
            row = self.prepared.get(u)
        self.write.compare_and_append(row, u, u + 1)
        self.upper = u + 1
        self.count += 1

    def close(self) -> None:
        self.write.expire()
        self.read.expire()
        self.client.close()
        self.stash.close()


class RawSqliteOneRow:
    """The least one-row commit with ``sqlite3`` (WAL, ``synchronous=FULL``)."""

    def __init__(self, path: Path, rows: pa.Table) -> None:
        self.texts = [json.dumps(r, default=str) for r in rows.to_pylist()]
        self.conn = sqlite3.connect(path, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.execute("CREATE TABLE uppers (shard INTEGER PRIMARY KEY, upper INTEGER)")
        self.conn.execute("CREATE TABLE data (shard INTEGER, row TEXT, time INTEGER, diff INTEGER)")
        self.conn.execute("INSERT INTO uppers VALUES (1, 0)")
        self.count = 0

    def append(self, _i: int) -> None:
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        (upper,) = conn.execute("SELECT upper FROM uppers WHERE shard = 1").fetchone()
        conn.execute(
            "INSERT INTO data VALUES (1, ?, ?, 1)",
            (self.texts[self.count % len(self.texts)], upper),
        )
        conn.execute("UPDATE uppers SET upper = ? WHERE shard = 1", (upper + 1,))
        conn.execute("COMMIT")
        self.count += 1

    def close(self) -> None:
        self.conn.close()


class RawSqliteLogs:
    """The commit a persist append makes, done with ``sqlite3`` alone: a stash's own
    ``logs`` table (made by the stash's migrations, its primary key included), WAL,
    ``synchronous=FULL``, and per commit the same two conditional ``INSERT`` s of texts
    the size of persist's (a shard diff entry and a history entry, ``texts``), each on
    top of its log's head, then ``COMMIT``.  Not a goal: the floor of persist's
    ``COMMIT`` (the rows it writes touch about 5 WAL frames, the raw one-row commit's
    about 2), shown beside its CPU per append."""

    INSERT = (
        "INSERT INTO logs (name, seqno, rollup, data) SELECT ?, ?, 0, ?"
        " WHERE (SELECT max(seqno) FROM logs WHERE name = ?) IS ?"
    )

    def __init__(self, path: Path, texts: tuple[str, str]) -> None:
        from stash import Stash

        Stash.open(f"sqlite:///{path}", mode="writable", fenced=False).close()  # the schema
        self.conn = sqlite3.connect(path, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.logs = list(zip(("bench.shard", "bench.history"), texts, strict=True))
        self.head: dict[str, int | None] = {name: None for name, _ in self.logs}
        self.count = 0

    def append(self, _i: int) -> None:
        conn, head = self.conn, self.head
        conn.execute("BEGIN IMMEDIATE")
        for name, text in self.logs:
            h = head[name]
            seqno = 0 if h is None else h + 1
            cur = conn.execute(self.INSERT, (name, seqno, text, name, h))
            if cur.rowcount != 1:  # pragma: no cover - one writer
                raise AssertionError(f"log {name}: head moved")
            head[name] = seqno
        conn.execute("COMMIT")
        self.count += 1

    def close(self) -> None:
        self.conn.close()


def _persist_log_texts(stash_path: Path) -> tuple[str, str]:
    """The newest shard diff entry and history entry persist wrote in the stash file at
    ``stash_path`` (read with ``sqlite3``, after the appends)."""
    conn = sqlite3.connect(stash_path)
    try:
        out = []
        for prefix in ("persist.shard.", "persist.history."):
            row = conn.execute(
                "SELECT data FROM logs WHERE substr(name, 1, ?) = ? AND NOT rollup"
                " ORDER BY rowid DESC LIMIT 1",
                (len(prefix), prefix),
            ).fetchone()
            out.append(str(row[0]))
        return out[0], out[1]
    finally:
        conn.close()


class RawPgOneRow:
    """The least one-row commit with psycopg 3 on its own table."""

    def __init__(self, conninfo: str, rows: pa.Table, shard: int = 1) -> None:
        import psycopg

        self.texts = [json.dumps(r, default=str) for r in rows.to_pylist()]
        self.conn = psycopg.connect(conninfo)
        self.shard = shard
        with self.conn.cursor() as cur:
            cur.execute(
                "CREATE TABLE IF NOT EXISTS raw_uppers (shard int PRIMARY KEY, upper bigint)"
            )
            cur.execute(
                "CREATE TABLE IF NOT EXISTS raw_data (shard int, row jsonb, time bigint, diff int)"
            )
            cur.execute("INSERT INTO raw_uppers VALUES (%s, 0) ON CONFLICT DO NOTHING", (shard,))
        self.conn.commit()
        self.count = 0

    def append(self, _i: int) -> None:
        cur = self.conn.cursor()
        row = cur.execute(
            "SELECT upper FROM raw_uppers WHERE shard = %s FOR UPDATE", (self.shard,)
        ).fetchone()
        assert row is not None
        upper = int(row[0])
        cur.execute(
            "INSERT INTO raw_data VALUES (%s, %s::jsonb, %s, 1)",
            (self.shard, self.texts[self.count % len(self.texts)], upper),
        )
        cur.execute("UPDATE raw_uppers SET upper = %s WHERE shard = %s", (upper + 1, self.shard))
        self.conn.commit()
        self.count += 1

    def close(self) -> None:
        self.conn.close()


class StashOneEntry:
    """One-entry ``Stash.append`` of a leader that knows its upper (the reference of the
    Postgres costs: what the stash itself spends on one commit), on a handle opened as
    persist opens its own (``fenced=False``)."""

    def __init__(self, stash_url: str) -> None:
        from stash import Antichain, AppendBatch, Stash

        self._ac, self._batch = Antichain.from_elem, AppendBatch
        self.stash = Stash.open(stash_url, mode="writable", fenced=False)
        self.coll = self.stash.collection("one-entry", key="int", value="int")
        self.upper = self.stash.upper(self.coll).as_option() or 0
        self.count = 0

    def append(self, _i: int) -> None:
        t, ac = self.upper, self._ac
        b = self._batch(self.coll, ac(t), ac(t + 1), ac(t), t)
        self.coll.append_to_batch(b, t, t, 1)
        self.stash.append([b])
        self.upper = t + 1
        self.count += 1

    def close(self) -> None:
        self.stash.close()


def _backend_ticks(conn: Any, dbname: str) -> int:
    """CPU clock ticks (user + system, ``/proc/<pid>/stat``) used so far by the server
    backends connected to ``dbname`` (``conn``'s own included: it only runs these
    queries), or ``-1`` when ``/proc`` cannot be read."""
    pids = [
        int(r[0])
        for r in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s", (dbname,)
        ).fetchall()
    ]
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return -1
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total


#: The sources of :func:`_wal_by_source`'s table, in its order.
WAL_SOURCES = (
    "logs: rows inserted (diffs, history records, small rollups)",
    "logs: TOAST (entries past ~2 KB out of line: rollups, the longest diffs)",
    "logs: primary key",
    "logs: DELETEs (truncation below a rollup, heap and TOAST)",
    "stash collections: data rows and their indexes",
    "stash frontiers and locks (uppers, sinces, collections)",
    "commit records",
    "other (raw psycopg's own table, anything else)",
)


def _wal_relations(mon: Any) -> dict[str, str]:
    """The relation file nodes of the stash's tables, indexes and TOAST by source (see
    :data:`WAL_SOURCES`): ``{filenode: "logs" | "logs_pkey" | "logs_toast" | "data" |
    "frontier"}``."""
    rels: dict[str, str] = {}
    rows = mon.execute(
        "SELECT c.relname, pg_relation_filenode(c.oid), pg_relation_filenode(t.oid), "
        "pg_relation_filenode(ti.indexrelid) FROM pg_class c "
        "LEFT JOIN pg_class t ON t.oid = c.reltoastrelid "
        "LEFT JOIN pg_index ti ON ti.indrelid = t.oid "
        "WHERE c.relkind = 'r' AND c.relname IN "
        "('logs', 'data', 'uppers', 'sinces', 'collections', 'commit_times', 'fence')"
    ).fetchall()
    for name, node, toast, toast_index in rows:
        kind = name if name in ("logs", "data") else "frontier"
        for n in (node, toast, toast_index):
            if n is not None:
                rels[str(n)] = kind if n == node or kind != "logs" else "logs_toast"
    for node, table in mon.execute(
        "SELECT pg_relation_filenode(x.indexrelid), t.relname FROM pg_index x "
        "JOIN pg_class t ON t.oid = x.indrelid WHERE t.relname IN "
        "('logs', 'data', 'uppers', 'sinces', 'collections', 'commit_times', 'fence')"
    ).fetchall():
        rels[str(node)] = {"logs": "logs_pkey", "data": "data"}.get(table, "frontier")
    return rels


def _wal_by_source(mon: Any, rels: dict[str, str], lsn0: str, lsn1: str) -> dict[str, float]:
    """The WAL between ``lsn0`` and ``lsn1`` in bytes by source (:data:`WAL_SOURCES`),
    plus ``"of which full-page images"``, read with ``pg_walinspect`` (PostgreSQL 15's
    ``pg_get_wal_records_info``: each record's total length, its full-page images' part,
    and the relation of its first block)."""
    out = dict.fromkeys((*WAL_SOURCES, "of which full-page images"), 0.0)
    rows = mon.execute(
        "SELECT resource_manager, record_type, substring(block_ref from 'rel [0-9]+/[0-9]+/"
        "([0-9]+)'), sum(record_length), sum(fpi_length) "
        "FROM pg_get_wal_records_info(%s, %s) GROUP BY 1, 2, 3",
        (lsn0, lsn1),
    ).fetchall()
    for rmgr, rtype, node, length, fpi in rows:
        kind = rels.get(node or "", "")
        if rmgr == "Transaction":
            src = "commit records"
        elif kind in ("logs", "logs_toast") and rmgr == "Heap" and "DELETE" in rtype:
            src = WAL_SOURCES[3]
        elif kind == "logs":
            src = WAL_SOURCES[0]
        elif kind == "logs_toast":
            src = WAL_SOURCES[1]
        elif kind == "logs_pkey":
            src = WAL_SOURCES[2]
        elif kind == "data":
            src = WAL_SOURCES[4]
        elif kind == "frontier":
            src = WAL_SOURCES[5]
        else:
            src = WAL_SOURCES[7]
        out[src] += float(length)
        out["of which full-page images"] += float(fpi or 0)
    return out


def _pg_costs(
    res: BenchResults,
    section: str,
    conninfo: str,
    dbname: str,
    contenders: dict[str, Any],
    appends: int,
    rounds: int,
) -> None:
    """Per append of each contender, in interleaved rounds of ``appends`` appends: the
    client's CPU (``time.process_time``, its background threads included), the server
    backends' CPU (``/proc`` of the backends of ``dbname``: ticks of 10 ms, so summed
    over a whole round) and the WAL written (``pg_current_wal_lsn`` before and after:
    server-wide, so anything else writing to the server counts: nothing else runs
    against this throwaway server).  A table, and two ratios against the one-entry
    ``Stash.append``."""
    import psycopg

    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    costs: dict[str, dict[str, list[float]]] = {
        k: {"client": [], "server": [], "wal": []} for k in contenders
    }
    by_source: dict[str, dict[str, list[float]]] = {k: {} for k in contenders}
    with psycopg.connect(conninfo, autocommit=True) as mon:
        try:
            mon.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            rels: dict[str, str] | None = _wal_relations(mon)
        except psycopg.Error as e:  # no contrib package: no breakdown, the rest stands
            res.notes.append(f"postgres: no WAL breakdown by source (pg_walinspect: {e})")
            rels = None
        for c in contenders.values():  # warm-up
            for i in range(min(appends, 100)):
                c.append(i)
        for r in range(rounds):
            names = list(contenders)
            names = names[r % len(names) :] + names[: r % len(names)]
            for name in names:
                c = contenders[name]
                prep = getattr(c, "prepare", None)
                if prep is not None:
                    prep()
                lsn0 = mon.execute("SELECT pg_current_wal_lsn()").fetchone()[0]  # type: ignore[index]
                ticks0 = _backend_ticks(mon, dbname)
                t0 = time.process_time()
                for i in range(appends):
                    c.append(i)
                cpu = time.process_time() - t0
                ticks1 = _backend_ticks(mon, dbname)
                lsn1, wal = mon.execute(
                    "SELECT l, pg_wal_lsn_diff(l, %s) FROM pg_current_wal_lsn() AS l", (lsn0,)
                ).fetchone()  # type: ignore[misc]
                costs[name]["client"].append(cpu / appends * 1000)
                if ticks0 >= 0 and ticks1 >= 0:
                    costs[name]["server"].append((ticks1 - ticks0) / tick / appends * 1000)
                costs[name]["wal"].append(float(wal) / appends)
                if rels is not None:
                    for src, b in _wal_by_source(mon, rels, lsn0, lsn1).items():
                        by_source[name].setdefault(src, []).append(b / appends)
    med = {k: {m: (median(v) if v else None) for m, v in d.items()} for k, d in costs.items()}
    res.tables.append(
        Table(
            section=section,
            name="postgres costs",
            title=f"Postgres: costs per append (medians of {rounds} rounds of {appends} appends; "
            "client CPU includes persist's background compaction; server CPU from /proc of "
            "the database's backends, 10 ms ticks)",
            columns=["contender", "client CPU ms", "server CPU ms", "WAL bytes"],
            rows=[
                [
                    name,
                    fmt_num(m["client"]),
                    fmt_num(m["server"]),
                    fmt_num(m["wal"]),
                ]
                for name, m in med.items()
            ],
        )
    )
    if rels is not None:
        res.tables.append(
            Table(
                section=section,
                name="postgres WAL by source",
                title=f"Postgres: WAL bytes per append by source (medians of {rounds} rounds; "
                "pg_walinspect: each record by the relation of its first block; full-page "
                "images, which follow checkpoints (a server setting), are counted in their "
                "source and again on the last line)",
                columns=["source", *contenders],
                rows=[
                    [src, *(fmt_num(median(by_source[k].get(src) or [0.0])) for k in contenders)]
                    for src in (*WAL_SOURCES, "of which full-page images")
                ],
            )
        )
    for name, m in med.items():
        res.log(
            f"  {name}: client CPU {fmt_num(m['client'])} ms "
            f"[{fmt_num(min(costs[name]['client']))}-{fmt_num(max(costs[name]['client']))}], "
            f"server CPU {fmt_num(m['server'])} ms, WAL {fmt_num(m['wal'])} bytes per append"
        )
    ref = "one-entry Stash.append"
    for measure, unit in (("server", "server CPU ms/append"), ("wal", "WAL bytes/append")):
        subj, refs = costs["persist"][measure], costs[ref][measure]
        if subj and len(subj) == len(refs) and min(subj) > 0 and min(refs) > 0:
            res.add(
                ratio_record(
                    section,
                    f"postgres: persist one-row append {unit} vs a one-entry Stash.append",
                    subject="persist compare_and_append (1 row)",
                    subject_samples=costs["persist"][measure],
                    reference=ref,
                    reference_samples=costs[ref][measure],
                    measure="slowdown",
                    unit=unit,
                    goal=GOAL_PG_COSTS,
                    note="cost ratio: lower is better (goal: within 2x)",
                )
            )


def _rate(
    appender: Any, seconds: float, cpu_ms: list[float] | None = None
) -> Callable[[int], float]:
    """A round of ``interleave``: the appender's rate over a burst; with ``cpu_ms``, the
    process's CPU milliseconds per append during the burst are appended to it (all
    threads: persist's background compaction counts)."""
    prepare = getattr(appender, "prepare", None)

    def fn(_r: int) -> float:
        if prepare is not None:
            prepare()  # input rows built outside the timed burst
        cpu = time.process_time()
        n, secs = burst(appender.append, seconds=seconds, min_ops=10)
        if cpu_ms is not None:
            cpu_ms.append((time.process_time() - cpu) * 1000 / n)
        return n / secs

    return fn


def _compare(
    res: BenchResults,
    section: str,
    name: str,
    persist: Any,
    raw: Any,
    raw_name: str,
    seconds: float,
    rounds: int,
    goal: Goal | None,
    cpu_ms: dict[str, list[float]] | None = None,
) -> tuple[float, float, float, bool]:
    """Interleaved rounds of persist against raw; adds the ratio record; returns
    (ratio, persist rate, raw rate, missed).  ``cpu_ms``: gets each side's CPU
    milliseconds per append of each round (keys ``"persist"`` and ``"raw"``)."""
    cpu: dict[str, list[float]] = cpu_ms if cpu_ms is not None else {}
    samples = interleave(
        {
            "persist": _rate(persist, seconds, cpu.setdefault("persist", [])),
            raw_name: _rate(raw, seconds, cpu.setdefault("raw", [])),
        },
        rounds,
        warmup=1,
        log=res.log,
    )
    rec = res.add(
        ratio_record(
            section,
            name,
            subject="persist compare_and_append (1 row)",
            subject_samples=samples["persist"],
            reference=raw_name,
            reference_samples=samples[raw_name],
            measure="rate",
            unit="appends/s",
            goal=goal,
        )
    )
    return (
        rec.value,
        rec.subject_value or 0.0,
        rec.reference_value or 0.0,
        rec.goal_met is False,
    )


def _fill(appender: Any, upto: int, log: Callable[[str], None]) -> None:
    """Append until ``appender.count`` reaches ``upto`` (untimed)."""
    t0 = time.perf_counter()
    start = appender.count
    while appender.count < upto:
        appender.append(0)
    if upto > start:
        log(f"  filled to {upto:,} appends in {time.perf_counter() - t0:.1f} s")


def _sqlite(
    res: BenchResults, counts: list[int], seconds: float, rounds: int, profile: bool
) -> None:
    section = "one-row commits on SQLite"
    root = Path(tempfile.mkdtemp(prefix="commit-bench-", dir=ROOT / "var"))
    rows = _rows()
    persist = PersistOneRow(f"sqlite:///{root}/stash.db", f"file://{root}/blob", rows)
    raw = RawSqliteOneRow(root / "raw.db", rows)
    logs: RawSqliteLogs | None = None
    table_rows: list[list[Any]] = []
    series: dict[str, list[tuple[float, float]]] = {
        "persist appends/s": [],
        "raw sqlite3 appends/s": [],
    }
    missed_any = False
    try:
        for n in counts:
            _fill(persist, n, res.log)
            _fill(raw, n, res.log)
            at = max(persist.count, 1)
            cpu: dict[str, list[float]] = {}
            ratio, p, r, missed = _compare(
                res,
                section,
                f"sqlite: one-row compare_and_append vs raw sqlite3 at {at:,} appends",
                persist,
                raw,
                "raw sqlite3 transaction",
                seconds,
                rounds,
                GOAL_SQLITE_ONE_ROW,
                cpu_ms=cpu,
            )
            raw_cpu = median(cpu["raw"][1:] or cpu["raw"])
            cpu_rec = res.absolute(
                section,
                f"sqlite: CPU per one-row compare_and_append at {at:,} appends",
                subject="persist compare_and_append (1 row)",
                samples=cpu["persist"][1:] or cpu["persist"],  # after the warm-up round
                unit="ms",
                definition="process CPU time (all threads) per append over a burst",
                goal=GOAL_SQLITE_CPU_MS,
                note=f"raw sqlite3 transaction: {fmt_num(raw_cpu)} ms per commit",
            )
            missed = missed or cpu_rec.goal_met is False
            missed_any = missed_any or missed
            if logs is None:
                logs = RawSqliteLogs(root / "raw-logs.db", _persist_log_texts(root / "stash.db"))
                _fill(logs, 500, res.log)
            logs_cpu: list[float] = []
            logs_rate = _rate(logs, seconds, logs_cpu)
            for _ in range(max(2, rounds)):
                logs_rate(0)
            res.absolute(
                section,
                f"sqlite: CPU per raw sqlite3 commit of persist's two log rows, beside {at:,} appends",
                subject="raw sqlite3: persist's log INSERTs and COMMIT",
                samples=logs_cpu[1:],
                unit="ms",
                definition=(
                    "process CPU time per commit of RawSqliteLogs (the stash's logs table, "
                    "a shard diff and a history entry of persist's sizes, synchronous=FULL): "
                    "the floor of persist's COMMIT, not a goal"
                ),
            )
            series["persist appends/s"].append((float(at), p))
            series["raw sqlite3 appends/s"].append((float(at), r))
            table_rows.append([f"{at:,}", fmt_num(p), fmt_num(r), f"{fmt_num(ratio)}x"])
        res.tables.append(
            Table(
                section=section,
                name="sqlite-one-row-flatness",
                title="One-row appends per second by shard length (medians), SQLite",
                columns=["appends so far", "persist /s", "raw sqlite3 /s", "ratio"],
                rows=table_rows,
            )
        )
        res.curves.append(
            Curve(
                section=section,
                name="sqlite-one-row",
                title="One-row commits per second against shard length, SQLite",
                x_label="appends so far",
                y_label="appends/s",
                series=series,
                log_x=True,
            )
        )
        if profile or missed_any:
            res.profiles["sqlite: persist one-row compare_and_append"] = profile_text(
                lambda: burst(persist.append, seconds=2.0), max_lines=90
            )
    finally:
        persist.close()
        raw.close()
        if logs is not None:
            logs.close()
        shutil.rmtree(root, ignore_errors=True)


def _machine_jiffies() -> tuple[int, int] | None:
    """``(busy, total)`` CPU clock ticks of the whole machine since boot, summed over its
    cores (Linux ``/proc/stat``: busy is all but idle and iowait), or ``None``."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 5:
        return None
    total = sum(fields[:8])
    return total - fields[3] - fields[4], total


def _pg_worker(
    args: tuple[str, str, str, int, str, float, Any, Any],
) -> tuple[int, float, float, float | None]:
    """One process of the multi-process section: open, wait at the barrier, append for
    ``seconds``; return (appends, seconds, CPU seconds of this process meanwhile, and
    for the first process the machine's busy cores meanwhile: clients, server and
    anything else, in cores, or ``None`` elsewhere or off Linux)."""
    stash_url, conninfo, blob_url, shard, kind, seconds, barrier, _ = args
    sys.path.insert(0, str(ROOT))
    rows = _rows(200)
    a: Any
    if kind == "persist":
        a = PersistOneRow(stash_url, blob_url, rows, tag=f"proc{shard}")
    else:
        a = RawPgOneRow(conninfo, rows, shard=shard)
    try:
        for i in range(5):
            a.append(i)
        barrier.wait()
        cpu = time.process_time()
        before = _machine_jiffies() if shard == 100 else None
        n, secs = burst(a.append, seconds=seconds, min_ops=5)
        used = time.process_time() - cpu
        after = _machine_jiffies() if before is not None else None
        busy = None
        if before is not None and after is not None and after[1] > before[1]:
            cores = os.cpu_count() or 1
            busy = cores * (after[0] - before[0]) / (after[1] - before[1])
        return n, secs, used, busy
    finally:
        a.close()


def _processes(
    res: BenchResults,
    stash_url: str,
    conninfo: str,
    blob_url: str,
    kind: str,
    n: int,
    seconds: float,
) -> tuple[float, float, float | None]:
    """Aggregate appends per second of ``n`` processes on their own shards, the client
    CPU milliseconds per append (all processes, background threads included) and the
    machine's busy cores during the first process's burst (``None`` off Linux)."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as mgr:
        barrier = mgr.Barrier(n)
        with ctx.Pool(n) as pool:
            out = pool.map(
                _pg_worker,
                [
                    (stash_url, conninfo, blob_url, 100 + i, kind, seconds, barrier, None)
                    for i in range(n)
                ],
            )
    appends = sum(o[0] for o in out)
    busy = next((o[3] for o in out if o[3] is not None), None)
    return appends / max(o[1] for o in out), 1000 * sum(o[2] for o in out) / appends, busy


def _postgres(res: BenchResults, seconds: float, rounds: int, quick: bool, profile: bool) -> None:
    sys.path.insert(0, str(ROOT))
    import sqlalchemy as sa

    from stash.migrate import upgrade
    from tests.support.pgserver import PostgresServer  # the tests' throwaway server

    server = PostgresServer()
    root = Path(tempfile.mkdtemp(prefix="commit-bench-pg-", dir=ROOT / "var"))
    try:
        url = server.create_database("commit")
        engine = sa.create_engine(url)
        try:
            upgrade(engine)
        finally:
            engine.dispose()
        conninfo = server.conninfo("commit")
        res.notes.append(f"postgres: throwaway server {server.safe_url('commit')}")
        rows = _rows()
        section = "one-row commits on Postgres"
        persist = PersistOneRow(url, f"file://{root}/blob", rows)
        raw = RawPgOneRow(conninfo, rows)
        try:
            _, _, _, missed = _compare(
                res,
                section,
                "postgres: one-row compare_and_append vs raw psycopg",
                persist,
                raw,
                "raw psycopg transaction",
                seconds,
                rounds,
                GOAL_ONE_ROW,
            )
            if profile or missed:
                res.profiles["postgres: persist one-row compare_and_append"] = profile_text(
                    lambda: burst(persist.append, seconds=2.0), max_lines=90
                )
            one = StashOneEntry(url)
            try:
                _pg_costs(
                    res,
                    section,
                    conninfo,
                    "commit",
                    {"persist": persist, "one-entry Stash.append": one, "raw psycopg": raw},
                    300 if quick else 1000,
                    3 if quick else 5,
                )
            finally:
                one.close()
        finally:
            persist.close()
            raw.close()
        section = f"{PROCESSES} processes on {PROCESSES} shards, Postgres"
        psecs = 2.0 if quick else 4.0
        prounds = 1 if quick else 3
        samples: dict[str, list[float]] = {k: [] for k in ("p1", "pn", "r1", "rn")}
        cpu: dict[str, list[float]] = {k: [] for k in samples}
        busy: dict[str, list[float]] = {k: [] for k in samples}
        for r in range(prounds):
            for key, kind, n in (
                ("p1", "persist", 1),
                ("pn", "persist", PROCESSES),
                ("r1", "raw", 1),
                ("rn", "raw", PROCESSES),
            ):
                rate, ms, cores = _processes(
                    res, url, conninfo, f"file://{root}/blob", kind, n, psecs
                )
                samples[key].append(rate)
                cpu[key].append(ms)
                if cores is not None:
                    busy[key].append(cores)
                res.log(
                    f"  round {r + 1}/{prounds} {kind} x{n}: {rate:.0f} appends/s, "
                    f"{ms:.2f} client CPU ms per append"
                    + ("" if cores is None else f", machine {cores:.2f} cores busy")
                )
        res.add(
            ratio_record(
                section,
                f"postgres: {PROCESSES} processes vs 1, persist one-row appends (aggregate)",
                subject=f"persist, {PROCESSES} processes",
                subject_samples=samples["pn"],
                reference="persist, 1 process",
                reference_samples=samples["p1"],
                measure="rate",
                unit="appends/s",
                goal=GOAL_PROCESSES,
            )
        )
        res.tables.append(
            Table(
                section=section,
                name="processes",
                title=f"{PROCESSES} processes against 1 on Postgres: aggregate appends/s and "
                "client CPU per append (medians over rounds; the machine has 2 cores, so "
                "the clients' CPU alone caps the aggregate at 2000 / (CPU ms per append))",
                columns=[
                    "contender",
                    "appends/s",
                    "client CPU ms/append",
                    "CPU cap appends/s",
                    "machine cores busy",
                ],
                rows=[
                    [
                        label,
                        fmt_num(median(samples[k])),
                        fmt_num(median(cpu[k])),
                        fmt_num(2000 / max(median(cpu[k]), 1e-9)),
                        fmt_num(median(busy[k])) if busy[k] else "n/a",
                    ]
                    for k, label in (
                        ("p1", "persist, 1 process"),
                        ("pn", f"persist, {PROCESSES} processes"),
                        ("r1", "raw psycopg, 1 process"),
                        ("rn", f"raw psycopg, {PROCESSES} processes"),
                    )
                ],
            )
        )
        cores = os.cpu_count() or 1
        for k, who in (("p1", "persist"), ("r1", "raw psycopg")):
            if busy[k]:
                b = median(busy[k])
                # N processes cannot keep more than every core busy: if one process
                # (with its server backend) already keeps b cores busy, N of them
                # reach at most cores / b times its rate, whatever N is (when nothing
                # else runs: other load counts in b but yields its cores to N clients).
                many = busy["pn" if k == "p1" else "rn"]
                n_busy = median(many) if many else None
                res.notes.append(
                    f"{who}, 1 process: the machine was {b:.2f} of {cores} cores busy "
                    f"(client, server and anything else running), so on a quiet machine "
                    f"no number of processes can reach more than {cores / b:.2f}x its "
                    f"rate; with {PROCESSES} processes it was "
                    + ("n/a" if n_busy is None else f"{n_busy:.2f}")
                    + " cores busy"
                )
        res.add(
            ratio_record(
                section,
                f"postgres: {PROCESSES} processes vs 1, raw psycopg one-row commits (the limit)",
                subject=f"raw psycopg, {PROCESSES} processes",
                subject_samples=samples["rn"],
                reference="raw psycopg, 1 process",
                reference_samples=samples["r1"],
                measure="rate",
                unit="appends/s",
            )
        )
    finally:
        server.cleanup()
        shutil.rmtree(root, ignore_errors=True)


def run(
    backend: str,
    quick: bool,
    profile: bool,
    json_path: str | None,
    counts: list[int] | None = None,
) -> Path:
    """Run the bench; return the path of the results JSON.  ``counts``: the shard
    lengths (appends so far) at which the SQLite ratio is measured."""
    if not counts:
        counts = [1, 1_000, 5_000, 20_000] if quick else [1, 1_000, 10_000, 100_000]
    seconds, rounds = (0.3, 3) if quick else (0.5, 5)
    res = BenchResults(
        "commit",
        "Persist one-row compare_and_append against the commit it must do",
        quick=quick,
        params={
            "backend": backend,
            "counts": counts,
            "seconds_per_burst": seconds,
            "rounds": rounds,
            "processes": PROCESSES,
        },
    )
    (ROOT / "var").mkdir(exist_ok=True)
    if backend in ("sqlite", "all"):
        with res.section("one-row commits on SQLite"):
            _sqlite(res, counts, seconds, rounds, profile)
    if backend in ("postgres", "all"):
        with res.section("one-row commits on Postgres"):
            _postgres(res, seconds, rounds, quick, profile)
    for r in res.records:
        verdict = "" if r.goal is None else f"  goal {r.goal}: {r.verdict}"
        sp = r.spread
        spread = "" if sp is None else f" ({fmt_num(sp[0])} to {fmt_num(sp[1])})"
        click.echo(f"{r.name}: {fmt_num(r.value)}{r.unit}{spread}{verdict}")
    return res.save(json_path)


@click.command()
@click.option(
    "--backend", type=click.Choice(["sqlite", "postgres", "all"]), default="all", show_default=True
)
@click.option("--quick", is_flag=True, help="Fewer appends and rounds.")
@click.option("--profile", is_flag=True, help="Store profiles of persist's appends.")
@click.option(
    "--json",
    "json_path",
    default=None,
    help="Results file (default var/bench-results/commit.json).",
)
@click.option(
    "--counts",
    default="",
    help="Comma-separated shard lengths for the SQLite ratio (default 1,1000,10000,100000; "
    "filling a shard to 100,000 one-row appends takes minutes on a loaded machine).",
)
def main(backend: str, quick: bool, profile: bool, json_path: str | None, counts: str) -> None:
    """Persist's one-row commits against raw drivers, and 8 processes against 1."""
    try:
        parsed = [int(x) for x in counts.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(
            f"--counts must be integers separated by commas, got {counts!r}"
        ) from None
    if any(n < 1 for n in parsed) or parsed != sorted(parsed):
        raise click.BadParameter(f"--counts must be increasing and at least 1, got {counts!r}")
    path = run(backend, quick, profile, json_path, parsed)
    click.echo(f"commit bench results: {path}")


if __name__ == "__main__":
    main()
