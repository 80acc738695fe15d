"""Protects: ``PersistTable.history`` shows, by default, only the state versions that
change data, a frontier or the schema (writes, compaction, since downgrades, schema
registrations), classified from the committed versions themselves; ``leases=True`` shows
every retained version (heartbeats, registrations, expiries and GC's bookkeeping too);
``limit`` keeps the newest.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

from persist import PersistClient, collect_garbage
from spark.persist_common import PersistSourceError
from stash import Stash

pytestmark = pytest.mark.spark

KEYS = pa.schema([("k", pa.int64())])
V0 = pa.schema([("v", pa.string())])
V1 = pa.schema([("v", pa.string()), ("x", pa.int64())])


def _rows(keys: list[int], schema: pa.Schema) -> pa.Table:
    cols: dict[str, Any] = {"k": keys, "v": [f"v{k}" for k in keys]}
    if "x" in schema.names:
        cols["x"] = keys
    return pa.table(cols, schema=pa.schema(list(KEYS) + list(schema)))


def build(store: Any) -> dict[str, int]:
    """Three writes, a reader heartbeat, a since downgrade, a compaction, a schema
    evolution (a column added), a write with it and GC; returns the seqno of each named
    step's version."""
    seqnos: dict[str, int] = {}
    with Stash.open(store.stash_url, fenced=False) as s:
        c = PersistClient(s, store.blob_uri, compaction="off")
        try:
            w, r = c.open("t", KEYS, V0)
            for i in range(3):
                w.upsert(_rows([i, i + 10], V0))
            seqnos["write"] = c.inspect("t").seqno
            r.heartbeat()
            seqnos["heartbeat"] = c.inspect("t").seqno
            r.downgrade_since(2)
            seqnos["since"] = c.inspect("t").seqno
            c.compactor.compact_once("t")
            seqnos["compaction"] = c.inspect("t").seqno
            w1, r1 = c.open("t", KEYS, V1)
            st = c.inspect("t")
            assert len(st.schema_history) == 2
            w1.upsert(_rows([5], V1))
            seqnos["evolved write"] = c.inspect("t").seqno
            for h in (w, r, w1, r1):
                h.expire()
            collect_garbage(c, "t", grace_seconds=0)  # forgets the compacted inline parts
            seqnos["last"] = c.inspect("t").seqno
        finally:
            c.close()
    return seqnos


@pytest.fixture
def history_table(spark: Any, spark_store: Any) -> tuple[Any, dict[str, int]]:
    from spark import PersistTable

    seqnos = build(spark_store)
    t = PersistTable.for_name(spark, "t", stash=spark_store.stash_url, blob=spark_store.blob_uri)
    return t, seqnos


def test_history_hides_lease_only_versions_by_default(history_table: Any) -> None:
    table, seqnos = history_table
    everything = [r.asDict() for r in table.versions(leases=True).collect()]
    shown = [r.asDict() for r in table.versions().collect()]
    # leases=True: every retained version, newest first, as before.
    assert everything[0]["seqno"] >= seqnos["last"]
    assert [r["seqno"] for r in everything] == list(range(everything[0]["seqno"], -1, -1))
    op = {r["seqno"]: r["operation"] for r in everything}
    assert op[seqnos["heartbeat"]] == "lease"
    assert op[seqnos["since"]] == "since"
    assert op[seqnos["compaction"]] == "compaction"
    assert op[seqnos["evolved write"]] == "append"
    assert op[0] == "create"
    assert "schema" in op.values() and "lease" in op.values() and "gc" in op.values()
    # The schema registration is its own version, between the compaction and the write.
    (schema_seqno,) = [s for s, o in op.items() if o == "schema"]
    assert seqnos["compaction"] < schema_seqno < seqnos["evolved write"]
    # Default: exactly the versions that are not lease-only or GC bookkeeping, same rows.
    assert shown == [r for r in everything if r["operation"] not in ("lease", "gc")]
    assert {r["operation"] for r in shown} == {"create", "append", "since", "compaction", "schema"}
    assert sum(r["operation"] == "append" for r in shown) == 4
    # The writes' figures are unchanged by the filter.
    appends = [r for r in shown if r["operation"] == "append"]
    assert all(r["rows_added"] > 0 and r["bytes_added"] > 0 for r in appends)
    assert all(r["upper"] == r["lower"] + 1 for r in appends)
    compaction = next(r for r in shown if r["operation"] == "compaction")
    assert compaction["rows_added"] > 0 and compaction["since"] == 2


def test_history_lease_only_versions_change_only_lease_entries(
    history_table: Any, spark_store: Any
) -> None:
    """Every hidden version's consensus entries differ from its predecessor's in reader
    and writer entries (and the seqno) only, checked on the raw committed entries."""
    table, _ = history_table
    hidden = {
        r["seqno"] for r in table.versions(leases=True).collect() if r["operation"] == "lease"
    }
    with table.client(readonly=True) as c:
        versions = c.consensus.versions(c.shard_id("t"))
    for before, after in zip(versions, versions[1:], strict=False):
        seqno = after.data["meta"]["seqno"]
        keys = {
            k for k in set(before.data) | set(after.data) if before.data.get(k) != after.data.get(k)
        }
        meta = {
            k
            for k in set(before.data["meta"]) | set(after.data["meta"])
            if before.data["meta"].get(k) != after.data["meta"].get(k)
        }
        lease_only = meta == {"seqno"} and all(
            k == "meta" or k.startswith(("reader/", "writer/")) for k in keys
        )
        assert lease_only == (seqno in hidden), (seqno, sorted(keys), sorted(meta))


def test_history_limit_keeps_the_newest(history_table: Any) -> None:
    table, _ = history_table
    shown = table.versions().collect()
    assert table.versions(limit=2).collect() == shown[:2]
    assert table.versions(limit=1000).collect() == shown
    assert table.versions(3, leases=True).collect() == table.versions(leases=True).collect()[:3]


def test_history_bad_input_raises_naming_the_rule(history_table: Any) -> None:
    table, _ = history_table
    for bad in (0, -1, "2", 1.5, True):
        with pytest.raises(PersistSourceError, match="history limit must be an int >= 1"):
            table.versions(limit=bad)
    with pytest.raises(PersistSourceError, match="history leases must be a bool"):
        table.versions(leases="yes")


def test_history_is_the_tables(spark: Any, spark_store: Any) -> None:
    """``PersistTable.history`` gives ``persist.Table.history``'s rows (what ``persist
    history`` prints), and Spark's row changes are named in it."""
    from spark import PersistTable

    with Stash.open(spark_store.stash_url, fenced=False) as s:
        c = PersistClient(s, spark_store.blob_uri)
        try:
            t = c.create_table("h", pa.schema([("id", pa.int64()), ("v", pa.string())]), ["id"])
            t.append(pa.table({"id": [1, 2], "v": ["a", "b"]}))
        finally:
            c.close()
    table = PersistTable.for_name(
        spark, "h", stash=spark_store.stash_url, blob=spark_store.blob_uri
    )
    table.upsert(spark.createDataFrame([(2, "B"), (3, "c")], "id long, v string"))
    table.delete("id = 1")
    table.update("id = 3", {"v": "upper(v)"})
    got = [r.asDict() for r in table.history().collect()]
    assert [r["operation"] for r in got] == ["update", "delete", "upsert", "append", "create"]
    assert got[1]["parameters"] == '{"predicate":"id = 1"}'
    with Stash.open(spark_store.stash_url, mode="readonly") as s:
        c = PersistClient(s, spark_store.blob_uri)
        try:
            want = c.table("h").history().to_pylist()
        finally:
            c.close()
    assert [{k: r[k] for k in ("version", "time", "operation")} for r in got] == [
        {k: r[k] for k in ("version", "time", "operation")} for r in want
    ]
    assert table.history(limit=2).count() == 2
    table.close()
