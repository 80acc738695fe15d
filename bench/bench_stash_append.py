"""Stash append throughput against the raw driver doing the same transaction, and peek
latency on a large collection.

For each backend, in interleaved rounds (order rotated every round, the median of the
per-round ratios reported):

* **stash**: ``Stash.open(url, fenced=True)``; each append is one 1-entry
  :class:`~stash.AppendBatch` built from the upper the writer knows (a leader's loop:
  no read before the append) and passed to ``append``: one transaction that checks the
  fence, locks the collection, checks the lower, inserts the entry, advances upper and
  since and consolidates the key;
* **raw**: the driver alone doing the minimal equivalent transaction on the same schema:
  ``BEGIN`` (``BEGIN IMMEDIATE`` on SQLite), read the upper (``FOR UPDATE`` on Postgres),
  insert the entry, advance the upper, ``COMMIT``;
* informational: the stash with ``make_batch`` before each append (a second, read-only
  transaction per append), on Postgres the stash with ``pre_ping=True``, and a
  compare-and-set log write (``stash.logs.write`` of one entry on top of the head the
  writer knows: one conditional ``INSERT`` and the ``COMMIT``, through a fenced handle).

Goal: stash appends per second >= 0.9 x raw appends per second, on each backend.  The
client CPU per append (``time.process_time`` over each burst; on Postgres the server's
CPU is not in it) is reported beside the rates, absolute and as an informational ratio
(raw CPU / stash CPU per round): the rate ratio is bounded by fsync (SQLite) and round
trips (Postgres), the CPU is what the stash adds on top.
Bursts are short (0.3 s) and rounds many (15) so that each round's ratio compares the
contestants under nearly the same load: on a shared machine the fsync latency and the
CPU left to the server change from one second to the next.
SQLite runs in WAL mode with ``synchronous=FULL`` on both sides; Postgres is a throwaway
server started from the machine's binaries (``tests/support/pgserver.py``) with production
durability settings (``fsync``, ``synchronous_commit`` on).  Also measured: ``peek`` of a
collection of 100,000 entries (``{"name": ..., "n": ...}`` values), median of rounds.

Run: ``python -m bench.bench_stash_append [--backend sqlite|postgres|all]
[--seconds N] [--rounds N] [--quick] [--profile] [--json PATH]``.  Results go to
``--json PATH`` (default ``var/bench-results/stash.json``) in the format of
:mod:`bench.common`.  When a ratio misses its goal (or with ``--profile``) a pyinstrument
profile of the stash's appends is stored with the results.
"""

from __future__ import annotations

import shutil
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from bench.common import ROOT, BenchResults, Goal, burst, interleave, profile_text, ratio_record
from stash import Antichain, AppendBatch, Stash, StashCollection, logs

__all__ = ["main", "run"]

GOAL = Goal(">=", 0.9)
PEEK_ENTRIES = 100_000


class StashAppender:
    """Appends ``(i, i)`` one entry at a time through a fenced stash handle."""

    def __init__(self, url: str, *, make_batch: bool = False, **options: Any) -> None:
        self.stash = Stash.open(url, fenced=True, **options)
        self.coll: StashCollection[int, int] = self.stash.collection(
            f"bench-{'mb' if make_batch else 'ab'}-{options.get('pre_ping', False)}",
            key="int",
            value="int",
        )
        up = self.stash.upper(self.coll).as_option()
        assert up is not None
        self.upper = up
        self.make_batch = make_batch

    def append(self, _i: int) -> None:
        c, t = self.coll, self.upper
        if self.make_batch:
            b = c.make_batch(self.stash)
        else:
            b = AppendBatch(
                c, Antichain.from_elem(t), Antichain.from_elem(t + 1), Antichain.from_elem(t), t
            )
        c.append_to_batch(b, t, t, 1)
        self.stash.append([b])
        self.upper = t + 1

    def close(self) -> None:
        self.stash.close()


class LogWriter:
    """Writes one compare-and-set log entry at a time (:mod:`stash.logs`) through a
    fenced handle, on top of the head the writer knows (a leader's loop)."""

    def __init__(self, url: str) -> None:
        self.stash = Stash.open(url, fenced=True)
        self.head = logs.head_seqno(self.stash, "bench-log")

    def append(self, _i: int) -> None:
        h = self.head
        n = 0 if h is None else h + 1
        logs.write(self.stash, [logs.LogEntry("bench-log", h, n, str(n))])
        self.head = n

    def close(self) -> None:
        self.stash.close()


class RawSqlite:
    """The minimal append transaction with ``sqlite3`` (WAL, ``synchronous=FULL``)."""

    def __init__(self, path: Path) -> None:
        url = f"sqlite:///{path}"
        with Stash.open(url, fenced=False) as s:  # the same schema, created by alembic
            self.cid = s.collection("raw", key="int", value="int").id
        self.conn = sqlite3.connect(path, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.execute("PRAGMA busy_timeout=5000")

    def append(self, _i: int) -> None:
        conn, cid = self.conn, self.cid
        conn.execute("BEGIN IMMEDIATE")
        (upper,) = conn.execute(
            "SELECT upper FROM uppers WHERE collection_id = ?", (cid,)
        ).fetchone()
        text = str(upper)
        conn.execute(
            "INSERT INTO data (collection_id, key, value, time, diff) VALUES (?, ?, ?, ?, 1)",
            (cid, text, text, upper),
        )
        conn.execute("UPDATE uppers SET upper = ? WHERE collection_id = ?", (upper + 1, cid))
        conn.execute("COMMIT")

    def close(self) -> None:
        self.conn.close()


class RawPostgres:
    """The minimal append transaction with psycopg 3 (one connection, as the stash's
    single writer uses one pooled connection)."""

    def __init__(self, url: str, conninfo: str) -> None:
        import psycopg

        with Stash.open(url, fenced=False) as s:
            self.cid = s.collection("raw", key="int", value="int").id
        self.conn = psycopg.connect(conninfo)

    def append(self, _i: int) -> None:
        conn, cid = self.conn, self.cid
        cur = conn.cursor()
        row = cur.execute(
            "SELECT upper FROM uppers WHERE collection_id = %s FOR UPDATE", (cid,)
        ).fetchone()
        assert row is not None
        upper = int(row[0])
        text = str(upper)
        cur.execute(
            "INSERT INTO data (collection_id, key, value, time, diff)"
            " VALUES (%s, %s::jsonb, %s::jsonb, %s, 1)",
            (cid, text, text, upper),
        )
        cur.execute("UPDATE uppers SET upper = %s WHERE collection_id = %s", (upper + 1, cid))
        conn.commit()

    def close(self) -> None:
        self.conn.close()


def _contestant(appender: Any, seconds: float, cpu: list[float]) -> Callable[[int], float]:
    """A contestant for :func:`bench.common.interleave`: appends for ``seconds`` and
    returns the seconds per append of that burst (its CPU seconds per append go to
    ``cpu``)."""

    def run(_round: int) -> float:
        t0 = time.process_time()
        n, elapsed = burst(appender.append, seconds=seconds, min_ops=20)
        cpu.append((time.process_time() - t0) / n)
        return elapsed / n

    return run


def _measure_appends(
    res: BenchResults,
    backend: str,
    appenders: dict[str, Any],
    informational: list[str],
    seconds: float,
    rounds: int,
    profile: bool,
) -> None:
    cpus: dict[str, list[float]] = {name: [] for name in appenders}
    contestants = {name: _contestant(a, seconds, cpus[name]) for name, a in appenders.items()}
    samples = interleave(contestants, rounds, warmup=1, log=res.log)
    rates = {name: [1.0 / x for x in xs] for name, xs in samples.items()}
    raw = f"raw {backend}"
    missed = False
    for name in appenders:
        if name == raw:
            continue
        rec = res.add(
            ratio_record(
                backend,
                f"{backend}: {name} appends/s vs {raw}",
                subject=name,
                subject_samples=rates[name],
                reference=raw,
                reference_samples=rates[raw],
                measure="rate",
                goal=None if name in informational else GOAL,
                unit="appends/s",
                note="1-entry appends, fenced handle"
                + (" (informational: not the same transaction)" if name in informational else ""),
            )
        )
        missed = missed or rec.goal_met is False
        n = len(rates[name])  # the CPU of the measured rounds (warm-up excluded)
        res.add(
            ratio_record(
                backend,
                f"{backend}: {name} client CPU per append vs {raw}",
                subject=name,
                subject_samples=cpus[name][-n:],
                reference=raw,
                reference_samples=cpus[raw][-n:],
                measure="speed",
                note="1-entry appends, fenced handle; client CPU (time.process_time) per"
                " append, informational (on Postgres the server's CPU is not in it)",
            )
        )
    for name, xs in rates.items():
        res.absolute(
            backend,
            f"{backend}: {name} appends per second",
            subject=name,
            samples=xs,
            unit="appends/s",
            definition="1-entry appends per second, median of rounds",
        )
        res.absolute(
            backend,
            f"{backend}: {name} client CPU per append",
            subject=name,
            samples=[x * 1e6 for x in cpus[name][-len(xs) :]],
            unit="us",
            definition="client CPU (time.process_time) per 1-entry append, median of rounds",
        )
    if profile or missed:
        stash_appender = appenders[f"stash {backend}"]
        res.profiles[f"{backend} stash append"] = profile_text(
            lambda: burst(stash_appender.append, seconds=max(1.0, seconds))
        )


def _measure_peek(res: BenchResults, backend: str, url: str, rounds: int) -> None:
    with Stash.open(url, fenced=False) as s:
        c = s.collection("peek", key="int")
        done = s.upper(c).as_option()
        assert done is not None
        step = 10_000
        t0 = time.perf_counter()
        for start in range(0, PEEK_ENTRIES, step):
            b = c.make_batch(s)
            for i in range(start, start + step):
                c.append_to_batch(b, i, {"name": f"item {i}", "n": i}, 1)
            s.append([b])
        res.log(f"  loaded {PEEK_ENTRIES:,} entries in {time.perf_counter() - t0:.1f} s")
        times: list[float] = []
        for r in range(min(rounds, 5) + 1):
            t = time.perf_counter()
            got = s.peek(c)
            elapsed = time.perf_counter() - t
            assert len(got) == PEEK_ENTRIES
            if r:
                times.append(elapsed)
        res.absolute(
            backend,
            f"{backend}: peek of {PEEK_ENTRIES:,} entries",
            subject=f"stash {backend}",
            samples=times,
            unit="s",
            definition="seconds for one peek (consolidated, decoded, sorted), median of rounds",
        )
        if backend == "sqlite":
            _measure_peek_one(res, s, c, url, rounds)
        key_times: list[float] = []
        for r in range(201):
            t = time.perf_counter()
            assert s.peek_key_one(c, r * 997 % PEEK_ENTRIES) is not None
            if r:
                key_times.append(time.perf_counter() - t)
        res.absolute(
            backend,
            f"{backend}: peek_key_one in {PEEK_ENTRIES:,} entries",
            subject=f"stash {backend}",
            samples=key_times,
            unit="s",
            definition="seconds for one peek_key_one, median",
        )


PEEK_ONE_GOAL = Goal(">=", 0.8)


def _measure_peek_one(
    res: BenchResults, s: Stash, c: StashCollection[Any, Any], url: str, rounds: int
) -> None:
    """``peek_one`` of the loaded collection against raw ``sqlite3``: one SELECT of the
    collection's keys and values and ``json.loads`` of each (the least a dict of the
    contents needs), in interleaved rounds after the same warm-up."""
    import json

    path = url.removeprefix("sqlite:///")
    conn = sqlite3.connect(path)
    cid = c.id

    def raw(_r: int) -> float:
        t = time.perf_counter()
        loads = json.loads
        got = {
            loads(k): loads(v)
            for k, v in conn.execute(
                "SELECT key, value FROM data WHERE collection_id = ?", (cid,)
            ).fetchall()
        }
        elapsed = time.perf_counter() - t
        assert len(got) == PEEK_ENTRIES
        return elapsed

    def stash(_r: int) -> float:
        t = time.perf_counter()
        got = s.peek_one(c)
        elapsed = time.perf_counter() - t
        assert len(got) == PEEK_ENTRIES
        return elapsed

    try:
        samples = interleave(
            {"stash peek_one": stash, "raw sqlite3 select + json.loads": raw},
            max(3, min(rounds, 7)),
            warmup=1,
            log=res.log,
        )
    finally:
        conn.close()
    rec = res.add(
        ratio_record(
            "sqlite",
            f"sqlite: peek_one of {PEEK_ENTRIES:,} entries vs raw sqlite3 select + json.loads",
            subject="stash peek_one",
            subject_samples=samples["stash peek_one"],
            reference="raw sqlite3 select + json.loads",
            reference_samples=samples["raw sqlite3 select + json.loads"],
            measure="speed",
            goal=PEEK_ONE_GOAL,
        )
    )
    if rec.goal_met is False:
        res.profiles[f"sqlite stash peek_one of {PEEK_ENTRIES:,} entries"] = profile_text(
            lambda: s.peek_one(c)
        )


def _sqlite(res: BenchResults, seconds: float, rounds: int, profile: bool) -> None:
    root = Path(tempfile.mkdtemp(prefix="stash-bench-", dir=ROOT / "var"))
    try:
        appenders: dict[str, Any] = {
            "raw sqlite": RawSqlite(root / "raw.db"),
            "stash sqlite": StashAppender(f"sqlite:///{root}/stash.db"),
            "stash sqlite with make_batch": StashAppender(
                f"sqlite:///{root}/stash-mb.db", make_batch=True
            ),
            "stash sqlite log write": LogWriter(f"sqlite:///{root}/stash-log.db"),
        }
        informational = ["stash sqlite with make_batch", "stash sqlite log write"]
        try:
            _measure_appends(res, "sqlite", appenders, informational, seconds, rounds, profile)
        finally:
            for a in appenders.values():
                a.close()
        _measure_peek(res, "sqlite", f"sqlite:///{root}/peek.db", rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _postgres(res: BenchResults, seconds: float, rounds: int, profile: bool) -> None:
    sys.path.insert(0, str(ROOT))
    from stash.migrate import upgrade
    from tests.support.pgserver import PostgresServer  # the tests' throwaway server

    server = PostgresServer()
    try:
        import sqlalchemy as sa

        def database(name: str) -> str:
            """A new database at the schema head: each fenced stash gets its own (two
            fenced handles on one stash fence each other)."""
            url = server.create_database(name)
            engine = sa.create_engine(url)
            try:
                upgrade(engine)
            finally:
                engine.dispose()
            return url

        url = database("bench")
        res.notes.append(f"postgres: throwaway server {server.safe_url('bench')}")
        with server.connect() as conn:
            row = conn.execute("SHOW server_version").fetchone()
            res.params["postgres_version"] = row[0] if row else None
        appenders: dict[str, Any] = {
            "raw postgres": RawPostgres(url, server.conninfo("bench")),
            "stash postgres": StashAppender(url),
            "stash postgres with make_batch": StashAppender(database("bench_mb"), make_batch=True),
            "stash postgres with pre_ping": StashAppender(database("bench_pp"), pre_ping=True),
            "stash postgres log write": LogWriter(database("bench_log")),
        }
        try:
            _measure_appends(
                res,
                "postgres",
                appenders,
                [
                    "stash postgres with make_batch",
                    "stash postgres with pre_ping",
                    "stash postgres log write",
                ],
                seconds,
                rounds,
                profile,
            )
        finally:
            for a in appenders.values():
                a.close()
        _measure_peek(res, "postgres", database("bench_peek"), rounds)
    finally:
        server.cleanup()


def run(
    backend: str, seconds: float, rounds: int, quick: bool, profile: bool, json_path: str | None
) -> Path:
    """Run the bench; return the path of the results JSON."""
    if quick:
        seconds, rounds = min(seconds, 0.2), min(rounds, 5)
    res = BenchResults(
        "stash",
        "Stash: 1-entry appends against the raw driver, and peek latency",
        quick=quick,
        params={
            "backend": backend,
            "seconds_per_burst": seconds,
            "rounds": rounds,
            "peek_entries": PEEK_ENTRIES,
            "goal": str(GOAL),
        },
    )
    (ROOT / "var").mkdir(exist_ok=True)
    if backend in ("sqlite", "all"):
        with res.section("sqlite"):
            _sqlite(res, seconds, rounds, profile)
    if backend in ("postgres", "all"):
        with res.section("postgres"):
            _postgres(res, seconds, rounds, profile)
    for r in res.records:
        if r.kind == "ratio":
            verdict = "" if r.goal is None else f"  goal {r.goal}: {r.verdict}"
            click.echo(f"{r.name}: {r.value:.2f}x{verdict}")
        else:
            click.echo(f"{r.name}: {r.value:.6g} {r.unit}")
    return res.save(json_path)


@click.command()
@click.option(
    "--backend", type=click.Choice(["sqlite", "postgres", "all"]), default="all", show_default=True
)
@click.option(
    "--seconds",
    type=float,
    default=0.3,
    show_default=True,
    help="Seconds per burst (short bursts, many rounds: paired under the same load).",
)
@click.option("--rounds", type=int, default=15, show_default=True, help="Measured rounds.")
@click.option("--quick", is_flag=True, help="Shorter bursts and fewer rounds.")
@click.option("--profile", is_flag=True, help="Store a profile of the stash's appends.")
@click.option(
    "--json", "json_path", default=None, help="Results file (default var/bench-results/stash.json)."
)
def main(
    backend: str, seconds: float, rounds: int, quick: bool, profile: bool, json_path: str | None
) -> None:
    """Stash appends per second against the raw driver, as a ratio (goal >= 0.9)."""
    path = run(backend, seconds, rounds, quick, profile, json_path)
    click.echo(f"stash bench results: {path}")


if __name__ == "__main__":
    main()
