"""Shards written when consensus kept each shard's versions in a stash collection
(``persist.shard.<id>``: a rollup of entries and one ``diff/<seqno>`` entry per later
version) read back unchanged once ``migrations/versions/0008_persist_shard_logs.py`` moved
them to compare-and-set logs, on SQLite and Postgres; their history records (collections
``persist.history.<id>``) likewise once ``0009_persist_history_logs.py`` moved them.

The stash is rebuilt from ``data/consensus_collections_0006.json``: the rows of a stash at
revision 0006 that the code before the logs wrote (``data/make_consensus_collections_0006.py``,
run on that code), with four shards (a few diffs on a rollup; past a rollup; every
version a rollup; no data), and what reading each gave then (state JSON, snapshot)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import sqlalchemy as sa

from persist import PersistClient
from persist.consensus import Consensus
from stash import Stash, logs
from stash.migrate import current_revision, downgrade, upgrade
from stash.schema import SCHEMA_HEAD

FIXTURE = Path(__file__).parent / "data" / "consensus_collections_0006.json"
KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string()), ("x", pa.float64())])


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/m.db"
    return str(request.getfixturevalue("postgres_url"))


def _load(engine: sa.Engine, fx: dict[str, Any]) -> None:
    """The fixture's rows into a stash at the fixture's revision."""
    upgrade(engine, fx["revision"])
    pg = engine.dialect.name == "postgresql"
    with engine.begin() as conn:
        for table in ("collections", "sinces", "uppers", "data"):
            cols = fx["tables"][table]["columns"]
            marks = [
                f"CAST(:{c} AS jsonb)"
                if pg and table == "data" and c in ("key", "value")
                else f":{c}"
                for c in cols
            ]
            rows = [dict(zip(cols, r, strict=True)) for r in fx["tables"][table]["rows"]]
            conn.execute(
                sa.text(f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join(marks)})"),  # noqa: S608
                rows,
            )
        if pg:
            conn.execute(
                sa.text(
                    "SELECT setval(pg_get_serial_sequence('collections', 'collection_id'),"
                    " (SELECT max(collection_id) FROM collections))"
                )
            )


def _blob(fx: dict[str, Any], root: Path) -> str:
    """The fixture's blob store (its identity marker: every part is inline)."""
    for rel, b64 in fx["blob_files"].items():
        path = root / "blob" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(b64))
    return f"file://{root}/blob"


def _read(url: str, blob: str, fx: dict[str, Any]) -> dict[str, Any]:
    got: dict[str, Any] = {}
    with Stash.open(url, fenced=False) as s:
        client = PersistClient(s, blob, compaction="off")
        try:
            for name in fx["expected"]:
                st = client.inspect(name)
                sj = st.to_json()
                got[name] = {
                    "shard_id": client.shard_id(name),
                    "upper": st.upper.as_option(),
                    "state": sj if isinstance(sj, str) else json.dumps(sj, sort_keys=True),
                }
            for name, want in fx["expected"].items():
                rows: list[str] = []
                up = want["upper"]
                if up:
                    w, r = client.open(name, KS, VS)
                    rows = sorted(map(json.dumps, r.snapshot(up - 1).to_pylist()))
                    r.expire()
                    w.expire()
                got[name]["rows"] = rows
        finally:
            client.close()
    return got


def test_shards_kept_in_collections_read_back_unchanged_from_logs(
    db_url: str, tmp_path: Path
) -> None:
    fx = json.loads(FIXTURE.read_text())
    blob = _blob(fx, tmp_path)
    engine = sa.create_engine(db_url)
    try:
        _load(engine, fx)
        upgrade(engine, "0008")
        old_history = _history_rows(engine)
        upgrade(engine)
        with engine.connect() as conn:
            assert current_revision(conn) == SCHEMA_HEAD
            names = [r[0] for r in conn.execute(sa.text("SELECT name FROM collections"))]
        assert not [n for n in names if n.startswith(("persist.shard.", "persist.history."))]
    finally:
        engine.dispose()
    want = fx["expected"]
    assert _read(db_url, blob, fx) == want
    assert len(old_history) == 4
    with Stash.open(db_url, mode="readonly") as s:
        # The records, in order, as the history collections held them.
        consensus = Consensus(s)
        assert {
            sid: consensus.history(sid.removeprefix("persist.history.")) for sid in old_history
        } == old_history
    with Stash.open(db_url, fenced=False) as s:
        layout = {
            n: [(r.seqno, r.rollup) for r in logs.scan(s, f"persist.shard.{v['shard_id']}")]
            for n, v in want.items()
        }
        # A rollup row, then one diff row per later version, contiguous.
        for rows in layout.values():
            first = rows[0][0]
            assert rows == [(first + i, i == 0) for i in range(len(rows))]
        assert layout["past_a_rollup"][0] == (33, True)
        # The shards go on.
        client = PersistClient(s, blob, compaction="off")
        try:
            w, r = client.open("past_a_rollup", KS, VS)
            w.compare_and_append([(((99,), ("more", 1.5)), 38, 1)], 38, 39)
            assert len(r.snapshot(38)) == 39
            w.expire()
            r.expire()
        finally:
            client.close()


def _history_rows(engine: sa.Engine) -> dict[str, list[dict[str, Any]]]:
    """The live records of every history collection by name, ordered by key (as the
    code before the history logs read them)."""
    pg = engine.dialect.name == "postgresql"
    text = "::text" if pg else ""
    out: dict[str, list[dict[str, Any]]] = {}
    with engine.connect() as conn:
        for cid, name in conn.execute(sa.text("SELECT collection_id, name FROM collections")):
            if not name.startswith("persist.history."):
                continue
            rows = conn.execute(
                sa.text(
                    f"SELECT key{text}, value{text} FROM data WHERE collection_id = :c"  # noqa: S608
                    " GROUP BY key, value HAVING sum(diff) = 1"
                ),
                {"c": cid},
            ).all()
            out[name] = [json.loads(v) for k, v in sorted(rows, key=lambda r: json.loads(r[0]))]
            assert out[name]
    return out


def test_downgrade_turns_the_logs_back_into_collections(db_url: str, tmp_path: Path) -> None:
    fx = json.loads(FIXTURE.read_text())
    blob = _blob(fx, tmp_path)
    engine = sa.create_engine(db_url)
    try:
        _load(engine, fx)
        upgrade(engine)
        with Stash.open(db_url, mode="readonly") as s:
            before = {n: logs.head(s, n) for n in logs.names(s)}
        downgrade(engine, "0008")
        with engine.connect() as conn:
            q = "SELECT count(*) FROM logs WHERE name LIKE 'persist.history.%'"
            assert conn.execute(sa.text(q)).scalar_one() == 0
        history = _history_rows(engine)
        downgrade(engine, "0007")
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM logs")).scalar_one() == 0
            names = {r[0] for r in conn.execute(sa.text("SELECT name FROM collections"))}
        assert set(before) <= names
        upgrade(engine, "0008")
        assert _history_rows(engine) == history
        upgrade(engine)
        with Stash.open(db_url, mode="readonly") as s:
            assert {n: logs.head(s, n) for n in logs.names(s)} == before
    finally:
        engine.dispose()
    assert _read(db_url, blob, fx) == fx["expected"]
