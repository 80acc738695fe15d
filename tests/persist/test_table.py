"""``persist.Table`` (:mod:`persist.table`): create and open by name, append anything
Arrow takes, row changes, reads as of a time, on memory, SQLite and PostgreSQL stashes."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from persist import (
    InvalidUsage,
    MemoryBlob,
    PersistClient,
    RowChanges,
    SchemaMismatch,
    SinceViolation,
    Table,
    UnknownShard,
)
from stash import Stash
from tests.support.dbutil import backend_url

SCHEMA = pa.schema([pa.field("id", pa.int64(), False), ("name", pa.string()), ("v", pa.float64())])


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def stash_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return backend_url(request, str(request.param), tmp_path)


@pytest.fixture
def client(stash_url: str) -> Iterator[PersistClient]:
    s = Stash.open(stash_url, fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="inline")
    try:
        yield c
    finally:
        c.close()
        s.close()


def rows(t: pa.Table) -> list[tuple[Any, ...]]:
    return [tuple(r.values()) for r in t.to_pylist()]


class ArrowStream:
    """Any object with ``__arrow_c_stream__`` (the PyCapsule stream interface)."""

    def __init__(self, table: pa.Table) -> None:
        self.table = table

    def __arrow_c_stream__(self, requested_schema: Any = None) -> Any:
        return self.table.__arrow_c_stream__(requested_schema)


def test_create_open_append_read(client: PersistClient) -> None:
    t = client.create_table("orders", SCHEMA, key=["id"])
    assert isinstance(t, Table)
    assert t.name == "orders" and t.key == ["id"] and t.schema.equals(SCHEMA)
    assert t.to_arrow().num_rows == 0 and t.to_arrow().schema.equals(SCHEMA)
    t0 = t.append(pa.table({"id": [1, 2], "name": ["a", "b"], "v": [1.0, 2.0]}))
    t1 = t.append(pd.DataFrame({"id": [3], "name": ["c"], "v": [3.5]}))
    t2 = t.append(pa.record_batch({"id": [4], "name": ["d"], "v": [4.0]}, schema=SCHEMA))
    t3 = t.append(ArrowStream(pa.table({"v": [5.0], "id": [5], "name": ["e"]})))
    reader = pa.RecordBatchReader.from_batches(
        SCHEMA, pa.table({"id": [6], "name": ["f"], "v": [6.0]}, schema=SCHEMA).to_batches()
    )
    t4 = t.append(reader)
    assert [t0, t1, t2, t3, t4] == [0, 1, 2, 3, 4]
    assert rows(t.to_arrow()) == [
        (1, "a", 1.0),
        (2, "b", 2.0),
        (3, "c", 3.5),
        (4, "d", 4.0),
        (5, "e", 5.0),
        (6, "f", 6.0),
    ]
    assert rows(t.to_arrow(as_of=1)) == [(1, "a", 1.0), (2, "b", 2.0), (3, "c", 3.5)]
    assert rows(t.to_arrow(columns=["v", "id"], filter=pc.field("id") >= 5)) == [
        (5.0, 5),
        (6.0, 6),
    ]
    assert t.to_pandas(as_of=0).to_dict("list") == {
        "id": [1, 2],
        "name": ["a", "b"],
        "v": [1.0, 2.0],
    }
    assert t.to_reader(as_of=2).read_all().equals(t.to_arrow(as_of=2))
    # a fresh client opens it by name with its schema
    other = PersistClient(client.stash, client.raw_blob, compaction="off")
    try:
        again = other.table("orders")
        assert again.schema.equals(SCHEMA) and again.key == ["id"]
        assert again.to_arrow().equals(t.to_arrow())
    finally:
        other.close()


def test_multiplicities_and_row_changes(client: PersistClient) -> None:
    t = client.create_table("m", SCHEMA, key=["id"])
    t.append(pa.table({"id": [1, 1], "name": ["a", "a"], "v": [1.0, 1.0]}, schema=SCHEMA))
    assert rows(t.to_arrow()) == [(1, "a", 1.0), (1, "a", 1.0)]  # repeated by multiplicity
    up = t.upsert(pd.DataFrame({"id": [1, 2], "name": ["x", "y"], "v": [9.0, 8.0]}))
    assert up == RowChanges(1, 2, 2)
    assert rows(t.to_arrow()) == [(1, "x", 9.0), (2, "y", 8.0)]
    assert t.update(pc.field("id") == 2, {"v": pc.field("v") + 1}) == RowChanges(2, 1, 1)
    assert t.delete(pc.field("id") == 1) == RowChanges(3, 0, 1)
    assert rows(t.to_arrow()) == [(2, "y", 9.0)]
    assert rows(t.to_arrow(as_of=0)) == [(1, "a", 1.0), (1, "a", 1.0)]


def test_create_same_schema_returns_table_other_schema_refused(client: PersistClient) -> None:
    t = client.create_table("o", SCHEMA, key=["id"])
    t.append(pa.table({"id": [1], "name": ["a"], "v": [1.0]}))
    again = client.create_table("o", SCHEMA, key=["id"])
    assert again.shard_id == t.shard_id and again.to_arrow().num_rows == 1
    other = pa.schema([pa.field("id", pa.int64(), False), ("name", pa.string())])
    with pytest.raises(SchemaMismatch, match="exists with key"):
        client.create_table("o", other, key=["id"])
    with pytest.raises(SchemaMismatch):
        client.create_table("o", SCHEMA, key=["id", "name"])
    # the refusal changed nothing
    assert client.table("o").schema.equals(SCHEMA)


def test_key_order_and_bad_keys(client: PersistClient) -> None:
    schema = pa.schema([("a", pa.string()), ("b", pa.int64()), ("c", pa.int64())])
    t = client.create_table("k", schema, key=["c", "b"])
    assert t.key == ["c", "b"] and t.schema.names == ["c", "b", "a"]
    t.append(pa.table({"a": ["x"], "b": [1], "c": [2]}))
    assert rows(t.to_arrow()) == [(2, 1, "x")]
    with pytest.raises(InvalidUsage, match="not in the schema"):
        client.create_table("k2", schema, key=["z"])
    with pytest.raises(InvalidUsage, match="non-empty list"):
        client.create_table("k2", schema, key=[])
    with pytest.raises(InvalidUsage, match="non-empty list"):
        client.create_table("k2", schema, key="a")
    with pytest.raises(InvalidUsage, match="twice"):
        client.create_table("k2", schema, key=["a", "a"])


def test_unknown_table_did_you_mean(client: PersistClient) -> None:
    client.create_table("orders", SCHEMA, key=["id"])
    with pytest.raises(UnknownShard, match="did you mean 'orders'"):
        client.table("ordrs")


def test_bad_input_commits_nothing(client: PersistClient) -> None:
    t = client.create_table("b", SCHEMA, key=["id"])
    with pytest.raises(InvalidUsage, match="not list"):
        t.append([1, 2])  # type: ignore[arg-type]
    with pytest.raises(InvalidUsage, match="missing"):
        t.append(pa.table({"id": [1]}))
    with pytest.raises(InvalidUsage, match="unknown"):
        t.append(pa.table({"id": [1], "name": ["a"], "v": [1.0], "_diff": [1]}))
    with pytest.raises(InvalidUsage, match="do not fit"):
        t.append(pa.table({"id": [None], "name": ["a"], "v": [1.0]}))
    assert client.inspect("b").upper.as_option() == 0


def test_as_of_errors_name_since_and_upper(client: PersistClient) -> None:
    t = client.create_table("s", SCHEMA, key=["id"])
    for i in range(3):
        t.append(pa.table({"id": [i], "name": ["a"], "v": [1.0]}))
    with pytest.raises(InvalidUsage, match="not before its upper"):
        t.to_arrow(as_of=3)
    with pytest.raises(InvalidUsage, match="as_of must be"):
        t.to_arrow(as_of="1")
    # move the since: a reader downgrades it; reads before it name it
    w, r = client.open(
        "s", pa.schema([SCHEMA.field("id")]), pa.schema([SCHEMA.field("name"), SCHEMA.field("v")])
    )
    for h in list(client.context.handles):
        if h is not r and hasattr(h, "downgrade_since"):
            h.expire()
    r.downgrade_since(2)
    with pytest.raises(SinceViolation, match=r"since \{2\}"):
        t.to_arrow(as_of=1)
    assert rows(t.to_arrow(as_of=2)) == [(0, "a", 1.0), (1, "a", 1.0), (2, "a", 1.0)]


def test_reads_write_nothing(client: PersistClient) -> None:
    t = client.create_table("r", SCHEMA, key=["id"])
    t.append(pa.table({"id": [1], "name": ["a"], "v": [1.0]}))
    seqno = client.inspect("r").seqno
    for _ in range(3):
        client.table("r").to_arrow()
        t.to_arrow(as_of=0)
    assert client.inspect("r").seqno == seqno


# ------------------------------------------------------------------- history
class Clock:
    """A settable wall clock (seconds)."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clocked(stash_url: str) -> Iterator[tuple[PersistClient, Clock]]:
    s = Stash.open(stash_url, fenced=False)
    clock = Clock(1_700_000_000.0)
    c = PersistClient(s, MemoryBlob(), compaction="off", clock=clock)
    try:
        yield c, clock
    finally:
        c.close()
        s.close()


def _utc(seconds: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, dt.UTC)


def test_history_operations_parameters_metrics(clocked: tuple[PersistClient, Clock]) -> None:
    client, clock = clocked
    t = client.create_table("h", SCHEMA, key=["id"])
    clock.t += 10
    t.append(pa.table({"id": [1, 2], "name": ["a", "b"], "v": [1.0, 2.0]}))
    clock.t += 10
    t.upsert(pa.table({"id": [2, 3], "name": ["B", "c"], "v": [2.0, 3.0]}))
    clock.t -= 100  # a clock going backwards never makes a timestamp go backwards
    t.update(pc.field("id") == 1, {"v": 7.5})
    clock.t += 200
    t.delete(pc.field("id") == 3)
    # lease-only versions are hidden: a reader registers, heartbeats and expires
    _w, r = client.open("h", pa.schema([SCHEMA.field("id")]), pa.schema(list(SCHEMA)[1:]))
    r.heartbeat()
    r.expire()
    h = t.history()
    assert h.schema.names == ["version", "time", "timestamp", "operation", "parameters", "metrics"]
    ops = h.column("operation").to_pylist()
    assert ops == ["delete", "update", "upsert", "append", "create"]
    assert h.column("time").to_pylist() == [3, 2, 1, 0, None]
    versions = h.column("version").to_pylist()
    assert versions == sorted(versions, reverse=True)
    stamps = h.column("timestamp").to_pylist()
    assert stamps == sorted(stamps, reverse=True)  # never decreasing over versions
    assert all(s.tzinfo is not None for s in stamps)
    assert stamps[-1] == _utc(1_700_000_000.0) and stamps[-2] == _utc(1_700_000_010.0)
    assert stamps[1] == stamps[2] == _utc(1_700_000_020.0)  # the update's clock was behind
    params = [json.loads(p) for p in h.column("parameters").to_pylist()]
    metrics = [json.loads(m) for m in h.column("metrics").to_pylist()]
    assert "3" in params[0]["predicate"] and params[1]["set"] == {"v": "7.5"}
    assert (metrics[3]["rows_inserted"], metrics[3]["rows_retracted"]) == (2, 0)
    assert (metrics[2]["rows_inserted"], metrics[2]["rows_retracted"]) == (2, 1)
    assert (metrics[1]["rows_inserted"], metrics[1]["rows_retracted"]) == (1, 1)
    assert (metrics[0]["rows_inserted"], metrics[0]["rows_retracted"]) == (0, 1)
    assert metrics[3]["parts_added"] == 1 and metrics[3]["bytes_added"] > 0
    assert t.history(limit=2).column("operation").to_pylist() == ["delete", "update"]


def test_time_travel_by_timestamp(clocked: tuple[PersistClient, Clock]) -> None:
    client, clock = clocked
    t = client.create_table("tt", SCHEMA, key=["id"])
    start = clock.t
    with pytest.raises(InvalidUsage, match="before the table's first commit.*since"):
        t.to_arrow(as_of=_utc(start + 5))
    clock.t = start + 10
    t.append(pa.table({"id": [1], "name": ["a"], "v": [1.0]}))
    clock.t = start + 20
    t.upsert(pa.table({"id": [1], "name": ["b"], "v": [1.0]}))
    assert rows(t.to_arrow(as_of=_utc(start + 10))) == [(1, "a", 1.0)]
    assert rows(t.to_arrow(as_of=_utc(start + 19.999))) == [(1, "a", 1.0)]
    assert rows(t.to_arrow(as_of=_utc(start + 20))) == [(1, "b", 1.0)]
    assert rows(t.to_arrow(as_of=_utc(start + 10_000))) == [(1, "b", 1.0)]
    with pytest.raises(InvalidUsage, match="before the table's first commit.*since"):
        t.to_arrow(as_of=_utc(start + 9))
    with pytest.raises(InvalidUsage, match="naive"):
        t.to_arrow(as_of=dt.datetime(2030, 1, 1))
    # a time the since passed is refused naming the since
    _w, r = client.open("tt", pa.schema([SCHEMA.field("id")]), pa.schema(list(SCHEMA)[1:]))
    r.downgrade_since(1)
    with pytest.raises(SinceViolation, match=r"since \{1\}"):
        t.to_arrow(as_of=_utc(start + 15))


def test_a_predicate_holding_a_nul_is_recorded(client: PersistClient) -> None:
    """A NUL character in a delete's or update's predicate (a string key may hold one)
    is kept in history as JSON escapes it; the stash refuses NULs in a value, and the
    change once failed on its history record."""
    t = client.create_table("nul", SCHEMA, key=["id"])
    t.append(pa.table({"id": [1], "name": ["a\x00b"], "v": [1.0]}))
    t.update(pc.field("name") == "a\x00b", {"v": 2.0})
    t.delete(pc.field("name") == "a\x00b")
    assert t.to_arrow().num_rows == 0
    params = [json.loads(p) for p in t.history().column("parameters").to_pylist()]
    assert "a\\u0000b" in params[0]["predicate"] and "a\\u0000b" in params[1]["predicate"]


def test_an_update_set_beyond_python_datetimes_is_recorded(client: PersistClient) -> None:
    """An update's ``set`` value is recorded as Arrow prints it: a nanosecond timestamp
    that Python's ``datetime`` cannot hold once failed the update on ``str(value)``."""
    ts = pa.timestamp("ns", tz="America/New_York")
    t = client.create_table(
        "far", pa.schema([pa.field("id", pa.int64(), False), ("at", ts)]), key=["id"]
    )
    t.append(pa.table({"id": [1], "at": pa.array([0], ts)}))
    far = pa.scalar(-(2**63) + 1, ts)
    t.update(pc.field("id") == 1, {"at": far})
    assert t.to_arrow().column("at").cast(pa.int64()).to_pylist() == [-(2**63) + 1]
    params = json.loads(t.history().column("parameters")[0].as_py())
    assert params["set"]["at"] == far.cast(pa.string()).as_py()


def test_a_maintenance_version_that_changes_nothing_has_no_record() -> None:
    """An ``optimize`` or ``since`` version whose since and batches are those of the
    version before (it only expired leases) is hidden from history; comparing the two
    traces' batch generators once made every such version a record."""
    from persist import ShardState
    from persist.history_record import make_record

    st = ShardState("s" + "0" * 32, "x", pa.schema([("k", pa.int64())]), pa.schema([]))
    for command in ("optimize", "since"):
        assert make_record(st, st.clone(), command, 1_700_000_000_000) is None


def test_old_states_without_history_decode() -> None:
    """A state written before history and table entries existed decodes (no history,
    no retention), and one with them round-trips."""
    from persist import ShardState

    st = ShardState("s" + "0" * 32, "x", pa.schema([("k", pa.int64())]), pa.schema([]))
    entries = st.to_entries()
    assert "history" not in entries and "table" not in entries
    back = ShardState.from_entries(entries)
    assert (back.history_upper, back.retention_ms, back.store_id) == (0, None, None)
    st.history_upper, st.history_ms, st.retention_ms, st.store_id = 3, 5, 7, "b1"
    assert ShardState.from_entries(st.to_entries()) == st
    assert ShardState.from_json(st.to_json()) == st


# ------------------------------------------------------- optimize, restore, details
def test_optimize_consolidates_at_the_since_and_keeps_every_read(client: PersistClient) -> None:
    client.compaction = "off"
    t = client.create_table("opt", SCHEMA, key=["id"])
    for i in range(6):
        t.upsert(pa.table({"id": [1, 2], "name": [f"n{i}", "x"], "v": [float(i), 2.0]}))
    before = client.inspect("opt")
    assert len(before.batches()) > 1
    reads = {a: t.to_arrow(as_of=a) for a in range(6)}
    _w, r = client.open("opt", pa.schema([SCHEMA.field("id")]), pa.schema(list(SCHEMA)[1:]))
    r.downgrade_since(4)
    rep = t.optimize()
    assert rep.applied and rep.since == 4 and rep.batches_after == 1
    assert rep.updates_after < rep.updates_before
    st = client.inspect("opt")
    assert len(st.batches()) == 1 and not st.batches()[0].runs
    for a in (4, 5):
        assert t.to_arrow(as_of=a).equals(reads[a])
    # consolidated at the since: one update per live row
    assert st.batches()[0].len == t.to_arrow(as_of=5).num_rows + 2  # 5's change stays a diff
    assert t.history(limit=1).column("operation").to_pylist() == ["optimize"]
    assert json.loads(t.history(limit=1).column("parameters")[0].as_py()) == {"full": True}
    seqno = st.seqno
    again = t.optimize()  # already one run at the since: nothing is written
    assert not again.applied and client.inspect("opt").seqno == seqno
    # later appends stay after the merged batch
    t.append(pa.table({"id": [3], "name": ["z"], "v": [0.0]}))
    assert rows(t.to_arrow(as_of=6)) == [(1, "n5", 5.0), (2, "x", 2.0), (3, "z", 0.0)]


def test_restore(client: PersistClient) -> None:
    t = client.create_table("res", SCHEMA, key=["id"])
    t.append(pa.table({"id": [1, 1, 2], "name": ["a", "a", "b"], "v": [1.0, 1.0, 2.0]}))
    t.upsert(pa.table({"id": [1, 3], "name": ["A", "c"], "v": [9.0, 3.0]}))
    t.delete(pc.field("id") == 2)
    then = t.to_arrow(as_of=0)
    ch = t.restore(0)
    assert ch == RowChanges(3, 3, 2)  # a x2 and b back, A and c gone
    assert t.to_arrow().equals(then)
    assert t.history(limit=1).column("operation").to_pylist() == ["restore"]
    # restoring the present changes no row, so it writes nothing (time: upper - 1)
    assert t.restore(3) == RowChanges(3, 0, 0)
    assert t.history(limit=1).column("time").to_pylist() == [3]


def test_details(client: PersistClient) -> None:
    t = client.create_table("det", SCHEMA, key=["id"])
    t.append(pa.table({"id": [1], "name": ["a"], "v": [1.0]}))
    d = t.details()
    assert d["name"] == "det" and d["shard_id"] == t.shard_id and d["key"] == ["id"]
    assert d["schema"] == ["id: int64 not null", "name: string", "v: double"]
    assert (d["since"], d["upper"], d["batches"], d["parts"], d["updates"]) == (0, 1, 1, 1, 1)
    assert d["runs"] == 1 and d["inline_bytes"] > 0 and d["bytes"] == 0
    retention = d["retention_seconds"]
    assert d["schema_versions"] == 1 and retention is None
    assert d["blob_store"].startswith("MemoryBlob")
    json.dumps(d)


# ------------------------------------------------------------------ retention
def _commit_every_10s(t: Table, clock: Clock, n: int) -> list[float]:
    at = []
    for i in range(n):
        clock.t += 10
        at.append(clock.t)
        t.upsert(pa.table({"id": [1], "name": [f"n{i}"], "v": [float(i)]}))
    return at


def test_retention_moves_the_since_at_every_commit(clocked: tuple[PersistClient, Clock]) -> None:
    client, clock = clocked
    t = client.create_table("ret", SCHEMA, key=["id"])
    _commit_every_10s(t, clock, 3)  # times 0, 1, 2 at +10, +20, +30 s
    assert t.details()["since"] == 0
    fifteen = dt.timedelta(seconds=15)  # a setting, not a measured time
    t.set_retention(fifteen)  # now +30: newest commit at or before +15 is time 0
    stored = t.details()["retention_seconds"]
    assert t.retention == fifteen and stored == 15
    assert t.details()["since"] == 0
    assert t.history(limit=1).column("operation").to_pylist() == ["retention"]
    _commit_every_10s(t, clock, 2)  # times 3, 4 at +40, +50: cutoff +35: time 2
    assert t.details()["since"] == 2
    with pytest.raises(SinceViolation, match=r"since \{2\}"):
        t.to_arrow(as_of=1)
    assert rows(t.to_arrow(as_of=2)) == [(1, "n2", 2.0)]
    # another client sees the retention (it is in the state)
    other = PersistClient(client.stash, client.raw_blob, compaction="off")
    try:
        assert other.table("ret").retention == fifteen
    finally:
        other.close()
    # clearing it leaves the since where it is
    t.set_retention(None)
    _commit_every_10s(t, clock, 2)
    assert t.retention is None and t.details()["since"] == 2


def test_reader_leases_hold_the_since_back_table_reads_do_not(
    clocked: tuple[PersistClient, Clock],
) -> None:
    client, clock = clocked
    t = client.create_table("ret2", SCHEMA, key=["id"])
    _w, r = client.open("ret2", pa.schema([SCHEMA.field("id")]), pa.schema(list(SCHEMA)[1:]))
    _commit_every_10s(t, clock, 4)
    t.set_retention(dt.timedelta(seconds=5))
    t.to_arrow()
    assert t.details()["since"] == 0  # the reader holds it
    r.expire()
    _commit_every_10s(t, clock, 1)  # time 4 at +50: cutoff +45: time 3
    assert t.details()["since"] == 3


def test_vacuum_moves_the_since_exactly_then_collects(clocked: tuple[PersistClient, Clock]) -> None:
    client, clock = clocked
    t = client.create_table("vac", SCHEMA, key=["id"])
    _commit_every_10s(t, clock, 4)  # times 0..3 at +10..+40
    t.set_retention(dt.timedelta(seconds=100))
    assert t.details()["since"] == 0
    clock.t += 75  # now +115: cutoff +15: time 0; then +125: time 1
    rep = t.vacuum(grace_seconds=0)
    assert rep.since == 0
    clock.t += 10
    rep = t.vacuum(grace_seconds=0)
    assert rep.since == 1 and t.details()["since"] == 1
    h = t.history(limit=1)
    assert h.column("operation").to_pylist() == ["retention"]
    assert json.loads(h.column("parameters")[0].as_py()) == {"vacuum": True}


def test_bad_retention(client: PersistClient) -> None:
    t = client.create_table("badret", SCHEMA, key=["id"])
    with pytest.raises(InvalidUsage, match="timedelta"):
        t.set_retention(7)  # type: ignore[arg-type]
    with pytest.raises(InvalidUsage, match="timedelta"):
        t.set_retention(dt.timedelta(seconds=-1))


# ------------------------------------------------------------------- progress
def test_progress_logged_for_long_operations_only(
    client: PersistClient, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off a terminal, an operation still running after ``after`` seconds logs its
    phase and size in rows and bytes (``persist.progress``), and its end; a short one
    logs nothing."""
    import logging
    import time

    from persist import progress as progress_mod

    caplog.set_level(logging.INFO, logger="persist.progress")
    t = client.create_table("prog", SCHEMA, key=["id"])
    t.append(pa.table({"id": [1], "name": ["a"], "v": [1.0]}))
    assert not [r for r in caplog.records if r.name == "persist.progress"]
    real = progress_mod.Progress.__init__

    def quick(self: Any, *a: Any, **k: Any) -> None:
        real(self, *a, **{**k, "after": 0.0, "interval": 0.01, "tty": False})

    monkeypatch.setattr(progress_mod.Progress, "__init__", quick)
    w = t._write_handle()
    real_upsert = w.upsert

    def slow(rows: Any) -> Any:  # an upsert that takes a while
        time.sleep(0.1)
        return real_upsert(rows)

    monkeypatch.setattr(w, "upsert", slow)
    t.upsert(pa.table({"id": [2, 3], "name": ["b", "c"], "v": [2.0, 3.0]}))
    msgs = [r.getMessage() for r in caplog.records if r.name == "persist.progress"]
    assert any("upsert: reading live rows" in m and "(2 rows, 42 bytes)" in m for m in msgs), msgs
    assert msgs[-1].startswith("table 'prog': upsert: done in")


def test_optimize_that_loses_the_race_to_a_merge_starts_again(
    client: PersistClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A merge applied between the full compaction's read and its commit changes the
    batches it read: its output is not applied (replace_batches refuses a prefix that
    is no longer the trace's), it is released, and the compaction starts again on the
    newer version; every read is unchanged."""
    from persist import optimize as optimize_mod

    client.compaction = "off"
    t = client.create_table("race", SCHEMA, key=["id"])
    for i in range(8):
        t.upsert(pa.table({"id": [i % 3], "name": [f"n{i}"], "v": [float(i)]}))
    want = {a: t.to_arrow(as_of=a) for a in range(8)}
    real = optimize_mod.write_parts
    calls: list[int] = []

    def racing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:  # a background merge lands meanwhile
            assert client.compactor.compact_once("race").applied > 0
        return real(*args, **kwargs)

    monkeypatch.setattr(optimize_mod, "write_parts", racing)
    rep = t.optimize()
    assert rep.applied and len(calls) == 2
    assert len(client.inspect("race").batches()) == 1
    for a, rows_a in want.items():
        assert t.to_arrow(as_of=a).equals(rows_a)
