"""``bench/bench_commit.py``'s Postgres WAL by source: every byte between two LSNs is
counted in exactly one source, and a stash append's rows and frontiers land in theirs
(the table that tells what a persist append writes, so it must add up)."""

from __future__ import annotations

import psycopg
import sqlalchemy as sa

from bench.bench_commit import WAL_SOURCES, StashOneEntry, _wal_by_source, _wal_relations
from stash.migrate import upgrade
from tests.support.pg_fixtures import _unavailable


def test_wal_by_source_adds_up_and_names_the_stash_tables(postgres_url: str) -> None:
    engine = sa.create_engine(postgres_url)
    upgrade(engine)
    engine.dispose()
    one = StashOneEntry(postgres_url)
    conninfo = sa.make_url(postgres_url).set(drivername="postgresql")
    try:
        with psycopg.connect(
            conninfo.render_as_string(hide_password=False), autocommit=True
        ) as mon:
            try:
                mon.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            except psycopg.Error as e:  # pragma: no cover - contrib not installed
                _unavailable(f"its extension pg_walinspect (contrib) is missing: {e}")
            rels = _wal_relations(mon)
            lsn0 = mon.execute("SELECT pg_current_wal_lsn()").fetchone()[0]  # type: ignore[index]
            for i in range(20):
                one.append(i)
            lsn1, wal = mon.execute(
                "SELECT l, pg_wal_lsn_diff(l, %s) FROM pg_current_wal_lsn() AS l", (lsn0,)
            ).fetchone()  # type: ignore[misc]
            got = _wal_by_source(mon, rels, lsn0, lsn1)
    finally:
        one.close()
    assert set(got) == {*WAL_SOURCES, "of which full-page images"}
    counted = sum(v for k, v in got.items() if k != "of which full-page images")
    # Records are counted whole; the LSN difference also holds alignment padding.
    assert 0.9 * float(wal) <= counted <= float(wal)
    assert got["stash collections: data rows and their indexes"] > 0
    assert got["stash frontiers and locks (uppers, sinces, collections)"] > 0
    assert got["commit records"] >= 20 * 30
    assert got["logs: rows inserted (diffs, history records, small rollups)"] == 0
