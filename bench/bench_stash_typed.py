"""Typed stash reads and one-key upserts against SQLAlchemy Core doing the same work on
the same database.

For each backend (SQLite file in WAL mode with ``synchronous=FULL``; a throwaway
Postgres server, ``tests/support/pgserver.py``), in interleaved rounds (order rotated
every round, the median of the per-round ratios reported):

* **typed peek_one**: ``TypedCollection("items", key=int, value=Item).peek_one(stash)``
  of 10,000 entries, ``Item`` a dataclass of three fields, against SQLAlchemy Core
  selecting the same 10,000 rows from a table with one column per field and building
  ``{id: Item(name, n, done)}`` (the least a user of Core writes for the same dict).
  Goal: the stash takes at most 2 times as long.
* **upsert_key**: ``TypedCollection.upsert_key`` of one key (a new value each time) in
  that collection, against a Core ``INSERT ... ON CONFLICT (id) DO UPDATE`` of one row
  in its own transaction (``engine.begin()``).  Goal: at most 1.5 times as long.

Both sides use a fresh engine or stash handle opened once, as an application does; the
stash handle is ``fenced=False`` (an application's writer; a fenced leader's handle adds
no round trip).

Run: ``python -m bench.bench_stash_typed [--backend sqlite|postgres|all] [--rounds N]
[--quick] [--json PATH]``; results go to ``--json PATH`` (default
``var/bench-results/typed.json``) in the format of :mod:`bench.common`.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from bench.common import ROOT, BenchResults, Goal, burst, interleave, profile_text, ratio_record
from stash import Stash, TypedCollection

__all__ = ["Item", "main", "run"]

ENTRIES = 10_000
PEEK_GOAL = Goal("<=", 2.0)
UPSERT_GOAL = Goal("<=", 1.5)


@dataclass
class Item:
    """The value type of both sides."""

    name: str
    n: int
    done: bool = False


META = sa.MetaData()
ITEMS = sa.Table(
    "core_items",
    META,
    sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("n", sa.BigInteger, nullable=False),
    sa.Column("done", sa.Boolean, nullable=False),
)


class Core:
    """SQLAlchemy Core on the stash's database, in a table of its own."""

    def __init__(self, url: str) -> None:
        self.engine = sa.create_engine(url)
        if self.engine.dialect.name == "sqlite":

            @sa.event.listens_for(self.engine, "connect")
            def _pragmas(dbapi_conn: Any, _rec: Any) -> None:
                dbapi_conn.execute("PRAGMA journal_mode=WAL")
                dbapi_conn.execute("PRAGMA synchronous=FULL")

            self.insert: Any = sqlite.insert
        else:
            self.insert = postgresql.insert
        META.create_all(self.engine)
        with self.engine.begin() as conn:
            conn.execute(
                ITEMS.insert(),
                [{"id": i, "name": f"item {i}", "n": i, "done": False} for i in range(ENTRIES)],
            )
        self.select = sa.select(ITEMS.c.id, ITEMS.c.name, ITEMS.c.n, ITEMS.c.done)

    def peek(self) -> dict[int, Item]:
        with self.engine.connect() as conn:
            return {r[0]: Item(r[1], r[2], r[3]) for r in conn.execute(self.select)}

    def upsert(self, i: int) -> None:
        stmt = self.insert(ITEMS).values(id=i % ENTRIES, name=f"new {i}", n=i, done=True)
        stmt = stmt.on_conflict_do_update(
            index_elements=[ITEMS.c.id],
            set_={"name": stmt.excluded.name, "n": stmt.excluded.n, "done": stmt.excluded.done},
        )
        with self.engine.begin() as conn:
            conn.execute(stmt)

    def close(self) -> None:
        self.engine.dispose()


class Typed:
    """The stash side: a ``TypedCollection`` of ``Item`` values."""

    def __init__(self, url: str) -> None:
        self.stash = Stash.open(url, fenced=False)
        self.items: TypedCollection[int, Item] = TypedCollection("items", int, Item)
        self.items.upsert(self.stash, ((i, Item(f"item {i}", i)) for i in range(ENTRIES)))

    def peek(self) -> dict[int, Item]:
        return self.items.peek_one(self.stash)

    def upsert(self, i: int) -> None:
        self.items.upsert_key(self.stash, i % ENTRIES, Item(f"new {i}", i, True))

    def close(self) -> None:
        self.stash.close()


def _timed(fn: Callable[[], Any]) -> Callable[[int], float]:
    def run(_round: int) -> float:
        t = time.perf_counter()
        got = fn()
        elapsed = time.perf_counter() - t
        assert len(got) == ENTRIES
        return elapsed

    return run


def _rate(op: Callable[[int], None], seconds: float) -> Callable[[int], float]:
    counter = [0]

    def run(_round: int) -> float:
        def step(_i: int) -> None:
            counter[0] += 1
            op(counter[0])

        n, elapsed = burst(step, seconds=seconds, min_ops=10)
        return elapsed / n

    return run


def measure(res: BenchResults, backend: str, url: str, rounds: int, seconds: float) -> None:
    """Both comparisons on the database at ``url`` (at the stash schema head)."""
    core, typed = Core(url), Typed(url)
    try:
        assert typed.peek() == core.peek()
        samples = interleave(
            {"stash typed peek_one": _timed(typed.peek), "SA Core select": _timed(core.peek)},
            rounds,
            warmup=1,
            log=res.log,
        )
        rec = res.add(
            ratio_record(
                backend,
                f"{backend}: typed peek_one of {ENTRIES:,} dataclass entries vs SA Core",
                subject="stash typed peek_one",
                subject_samples=samples["stash typed peek_one"],
                reference="SA Core select",
                reference_samples=samples["SA Core select"],
                measure="slowdown",
                goal=PEEK_GOAL,
                note="Core builds the same dataclasses from a table of one column per field",
            )
        )
        if rec.goal_met is False:
            res.profiles[f"{backend} typed peek_one"] = profile_text(typed.peek)
        samples = interleave(
            {
                "stash upsert_key": _rate(typed.upsert, seconds),
                "SA Core upsert": _rate(core.upsert, seconds),
            },
            rounds,
            warmup=1,
            log=res.log,
        )
        rec = res.add(
            ratio_record(
                backend,
                f"{backend}: one-key upsert_key vs SA Core INSERT ON CONFLICT",
                subject="stash upsert_key",
                subject_samples=samples["stash upsert_key"],
                reference="SA Core upsert",
                reference_samples=samples["SA Core upsert"],
                measure="slowdown",
                goal=UPSERT_GOAL,
                note="each a transaction of its own, committed durably",
            )
        )
        if rec.goal_met is False:
            res.profiles[f"{backend} upsert_key"] = profile_text(
                lambda: burst(typed.upsert, seconds=1.0)
            )
    finally:
        typed.close()
        core.close()


def _sqlite(res: BenchResults, rounds: int, seconds: float) -> None:
    root = Path(tempfile.mkdtemp(prefix="stash-typed-", dir=ROOT / "var"))
    try:
        measure(res, "sqlite", f"sqlite:///{root}/typed.db", rounds, seconds)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _postgres(res: BenchResults, rounds: int, seconds: float) -> None:
    sys.path.insert(0, str(ROOT))
    from stash.migrate import upgrade
    from tests.support.pgserver import PostgresServer  # the tests' throwaway server

    server = PostgresServer()
    try:
        url = server.create_database("typed")
        engine = sa.create_engine(url)
        try:
            upgrade(engine)
        finally:
            engine.dispose()
        res.notes.append(f"postgres: throwaway server {server.safe_url('typed')}")
        measure(res, "postgres", url, rounds, seconds)
    finally:
        server.cleanup()


def run(backend: str, rounds: int, seconds: float, quick: bool, json_path: str | None) -> Path:
    """Run the bench; return the path of the results JSON."""
    if quick:
        rounds, seconds = min(rounds, 3), min(seconds, 0.2)
    res = BenchResults(
        "typed",
        "Stash: typed peek_one and upsert_key against SQLAlchemy Core",
        quick=quick,
        params={"backend": backend, "rounds": rounds, "entries": ENTRIES},
    )
    (ROOT / "var").mkdir(exist_ok=True)
    if backend in ("sqlite", "all"):
        with res.section("sqlite"):
            _sqlite(res, rounds, seconds)
    if backend in ("postgres", "all"):
        with res.section("postgres"):
            _postgres(res, rounds, seconds)
    for r in res.records:
        verdict = "" if r.goal is None else f"  goal {r.goal}: {r.verdict}"
        click.echo(f"{r.name}: {r.value:.2f}x{verdict}")
    return res.save(json_path)


@click.command()
@click.option(
    "--backend", type=click.Choice(["sqlite", "postgres", "all"]), default="all", show_default=True
)
@click.option("--rounds", type=int, default=9, show_default=True, help="Measured rounds.")
@click.option("--seconds", type=float, default=0.5, show_default=True, help="Seconds per burst.")
@click.option("--quick", is_flag=True, help="Fewer rounds, shorter bursts.")
@click.option(
    "--json", "json_path", default=None, help="Results file (default var/bench-results/typed.json)."
)
def main(backend: str, rounds: int, seconds: float, quick: bool, json_path: str | None) -> None:
    """Typed peek_one (goal <= 2x) and upsert_key (goal <= 1.5x) against SQLAlchemy Core."""
    path = run(backend, rounds, seconds, quick, json_path)
    click.echo(f"typed bench results: {path}")


if __name__ == "__main__":
    main()
