"""Read-then-write paths decide on the version they read: a commit that lands between
the read and the write fails the write's lower check instead of writing changes
computed against a version that is no longer the collection's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stash import Antichain, Stash


@pytest.fixture(params=["sqlite", "postgres"])
def stash_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A new stash: a SQLite file, or a migrated database on the test Postgres server."""
    from tests.support.dbutil import backend_url

    return backend_url(request, request.param, tmp_path)


def _peek_then(monkeypatch: pytest.MonkeyPatch, race: Any) -> list[bool]:
    """Wrap ``Stash.peek_one`` so ``race()`` runs once, right after the first peek."""
    real = Stash.peek_one
    raced: list[bool] = []

    def peek_then_race(self: Any, coll: Any) -> Any:
        out = real(self, coll)
        if not raced:
            raced.append(True)
            race()
        return out

    monkeypatch.setattr(Stash, "peek_one", peek_then_race)
    return raced


def test_persist_txn_upsert_entries_loses_a_race_committed_after_its_peek(
    stash_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``PersistTxn.upsert_entries`` computes its retractions against the version its
    peek read.  Another driver sets the key right after that peek: the transaction's
    catalog batch must fail its lower check (nothing committed), not retract a value
    the collection no longer holds (which left the key with three values, two of them
    at multiplicity +1, and every later ``peek_one`` failing)."""
    from persist.txn import TxnUpperMismatch
    from spark.persist_txn import PersistTxn

    url = stash_url
    with PersistTxn(None, url, "memory://") as t:
        t.upsert_entries("planes", {"N1": {"seats": 1}})

    def other_driver() -> None:
        with PersistTxn(None, url, "memory://") as other:
            other.upsert_entries("planes", {"N1": {"seats": 2}})

    t = PersistTxn(None, url, "memory://")
    try:
        raced = _peek_then(monkeypatch, other_driver)
        t.upsert_entries("planes", {"N1": {"seats": 3}})
        monkeypatch.undo()
        assert raced
        with pytest.raises(TxnUpperMismatch, match="planes"):
            t.commit()
    finally:
        t.close()
    with Stash.open(url, mode="readonly") as s:
        coll = s.collection("planes", key="str", value="json")
        assert s.peek_one(coll) == {"N1": {"seats": 2}}


def _catalog_frames(airline: str, seats: int) -> dict[str, Any]:
    import pandas as pd

    return {
        "airlines": pd.DataFrame({"carrier": ["AA", "UA"], "name": [airline, "United"]}),
        "airports": pd.DataFrame({"faa": ["JFK"], "lat": [40.6], "lon": [-73.8]}),
        "planes": pd.DataFrame({"tailnum": ["N1"], "seats": [seats]}),
    }


def test_flights_load_catalog_retries_a_race_committed_after_its_peek(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The flights job's ``load_catalog`` diffs each catalog collection against its
    peek.  Another run of the job commits right after the first peek: the first run's
    batch must fail its lower check and the run retry on the new version (ending with
    its own catalog), not append retractions of values the other run replaced (which
    left ``AA`` with three values and ``peek_one`` failing)."""
    from spark.jobs.flights import load_catalog

    url = f"sqlite:///{tmp_path}/s.db"
    load_catalog(url, _catalog_frames("American", 100))
    raced = _peek_then(monkeypatch, lambda: load_catalog(url, _catalog_frames("American 2", 200)))
    load_catalog(url, _catalog_frames("American Airlines", 300))
    assert raced
    with Stash.open(url, mode="readonly") as s:
        got = {
            name: s.peek_one(s.collection(name, key="str", value="json"))
            for name in ("airlines", "airports", "planes")
        }
    assert got == {
        "airlines": {"AA": {"name": "American Airlines"}, "UA": {"name": "United"}},
        "airports": {"JFK": {"lat": 40.6, "lon": -73.8}},
        "planes": {"N1": {"seats": 300}},
    }


def test_stash_source_snapshot_time_is_the_time_its_entries_were_read_at(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``stash`` source's snapshot labels its entries with the peek time (the
    ``time_column``).  Another handle appends right after the snapshot's first read:
    the snapshot must hold the entries of the time it reports (before: the time and the
    entries were two reads, and the new entry came back labelled with the earlier time,
    at which it did not exist)."""
    from spark.stash_source import read_collection

    url = f"sqlite:///{tmp_path}/s.db"
    with Stash.open(url) as s:
        c = s.collection("catalog", key="str", value="json")
        s.update(c, ("a", 1), 0, 1)
        s.seal(c, Antichain.from_elem(1))

    def other_handle() -> None:
        with Stash.open(url) as o:
            oc = o.collection("catalog", key="str", value="json")
            o.update(oc, ("b", 2), 1, 1)
            o.seal(oc, Antichain.from_elem(2))

    # Another handle commits right after the snapshot's first read transaction of the
    # collection (the first after it looked the collection up): a time and entries
    # read in two transactions straddle that commit.
    real_read, real_collections = Stash._read, Stash.collections
    armed: list[bool] = []
    raced: list[bool] = []

    def collections_then_arm(self: Any) -> Any:
        out = real_collections(self)
        armed.append(True)
        return out

    def read_then_race(self: Any, fn: Any, *, codecs: Any) -> Any:
        out = real_read(self, fn, codecs=codecs)
        if armed and not raced:
            raced.append(True)
            other_handle()
        return out

    monkeypatch.setattr(Stash, "collections", collections_then_arm)
    monkeypatch.setattr(Stash, "_read", read_then_race)
    snap = read_collection(url, "catalog")
    assert raced
    assert (snap.time, snap.entries) in [
        (0, [("a", 1, 1)]),
        (1, [("a", 1, 1), ("b", 2, 1)]),
    ]


def test_compact_job_keeps_the_retired_parts_of_a_merge_output_that_did_not_apply(
    tmp_path: Path,
) -> None:
    """The compact job deletes the parts of a merge output that did not apply, except
    those the shard references or retired as of one state version (an output whose
    apply lost its acknowledgement may since have been compacted away and its parts
    retired: readers can still hold them).  Before: ``_delete`` read a ``retired``
    attribute shard states do not have, so a lost race crashed the job with
    ``AttributeError`` and leaked the output's parts."""
    import dataclasses

    import pyarrow as pa

    from persist import Description, HollowBatch, PersistClient
    from spark.jobs.compact import _apply

    with Stash.open(f"sqlite:///{tmp_path}/s.db", fenced=False) as s:
        c = PersistClient(s, f"file://{tmp_path}/blob", compaction="off")
        try:
            w = c.open_writer("t", pa.schema([("k", pa.int64())]), pa.schema([("v", pa.string())]))
            for i in range(4):
                n = 1000
                w.compare_and_append(
                    pa.table(
                        {
                            "k": pa.array(range(i * n, (i + 1) * n), pa.int64()),
                            "v": ["x" * 50] * n,
                            "_time": pa.array([i] * n, pa.int64()),
                            "_diff": pa.array([1] * n, pa.int64()),
                        }
                    ),
                    i,
                    i + 1,
                )
            m = c.machine(c.shard_id("t"))
            (req,) = m.fetch().trace.all_fueled_merge_reqs()
            inputs = [p for b in req.inputs for p in b.batch.parts]
            assert c.compactor.merge(m, req).applied  # the inputs are retired now
            retired = inputs[0]
            assert retired.key is not None
            fresh = dataclasses.replace(retired, key=retired.key.replace(".parquet", "-b.parquet"))
            c.blob.set(fresh.key, c.blob.get(retired.key))
            # An output for inputs no longer in the spine (they were merged): a lost race.
            stale = Description(Antichain.from_elem(1), Antichain.from_elem(3), req.desc.since)
            out = HollowBatch(stale, (retired, fresh), 2 * retired.rows, ())
            assert _apply(c, m, out) is False
            keys = {k for k, _ in c.blob.list_keys()}
            assert retired.key in keys  # retired: a reader may still hold it
            assert fresh.key not in keys  # never referenced: deleted
        finally:
            c.close()


def test_writer_abort_keeps_the_parts_of_a_commit_landing_between_its_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The persist writer's ``abort`` deletes a task batch's parts only when the shard
    neither references nor retired them.  The driver's commit, whose acknowledgement
    was lost, lands while ``abort`` reads: between its read of the state and its read
    of the retired keys.  Both must be of one version (re-read when the head moved);
    before, the parts were referenced by the head yet deleted, and the shard lost
    the rows."""
    import pyarrow as pa

    from persist import PersistClient
    from persist.consensus import Consensus
    from spark.persist_common import ShardTarget
    from spark.persist_writer import PersistCommitMessage, PersistWriter, WriteSettings

    ks, vs = pa.schema([("k", pa.int64())]), pa.schema([("v", pa.string())])
    target = ShardTarget(f"sqlite:///{tmp_path}/stash.db", f"file://{tmp_path}/blob", "t")
    with Stash.open(target.stash_url, fenced=False) as s:
        c = PersistClient(s, target.blob_uri, compaction="off", inline_max_bytes=0)
        try:
            w, r = c.open(target.shard, ks, vs)
            w.compare_and_append([(((0,), ("v0",)), 0, 1)], 0, 1)
            b = w.batch([(((9,), ("v9",)), 1, 1)], 1, 2)
            msg = PersistCommitMessage(b.into_transmittable(), 1, 2, 1, 1, 1)
            landed = w.batch_from_transmittable(msg.batch)
            keys = set(landed.blob_keys())
            real = Consensus.retired_entries
            raced: list[bool] = []

            def land_then_read(self: Any, shard_id: str) -> Any:
                if not raced:
                    raced.append(True)
                    w.compare_and_append_batch([landed], 1, 2)  # the late commit
                return real(self, shard_id)

            monkeypatch.setattr(Consensus, "retired_entries", land_then_read)
            settings = WriteSettings(
                target=target,
                key_columns=["k"],
                value_columns=["v"],
                key_schema=ks,
                value_schema=vs,
                time_mode="auto",
            )
            PersistWriter(settings).abort([msg])
            monkeypatch.undo()
            assert raced
            assert keys <= c.inspect(target.shard).referenced_blob_keys()
            present = {k for k, _ in c.raw_blob.list_keys(c.shard_id(target.shard) + "/")}
            assert keys <= present, "abort deleted parts the shard references"
            assert sorted(r.snapshot(1).column("k").to_pylist()) == [0, 9]
        finally:
            c.close()


@pytest.mark.spark
def test_stash_source_rows_read_after_an_inferred_schema_changed_are_an_error(
    spark: Any, tmp_path: Path
) -> None:
    """The ``stash`` source infers a DataFrame's schema from one peek and reads its rows
    from a later one.  A value appended in between that the inferred schema cannot
    tell apart (the number ``5`` in a column inferred from the string ``"5"`` as plain
    strings, not JSON text) must not read as the same ``"5"``: rows are given only when
    their own peek infers the same schema, else a named error (reading again infers
    again)."""
    url = f"sqlite:///{tmp_path}/s.db"
    with Stash.open(url) as s:
        c = s.collection("things", key="str", value="json")
        s.update(c, ("a", {"x": "5"}), 0, 1)
        s.seal(c, Antichain.from_elem(1))
    df = spark.read.format("stash").option("url", url).load("things")
    assert df.schema["x"].metadata == {}  # plain strings
    with Stash.open(url) as s:
        c = s.collection("things", key="str", value="json")
        s.update(c, ("b", {"x": 5}), 1, 1)
        s.seal(c, Antichain.from_elem(2))
    with pytest.raises(Exception, match="changed since its schema was inferred") as e:
        df.collect()
    assert "things" in str(e.value)
    again = spark.read.format("stash").option("url", url).load("things")
    assert sorted((r["key"], r["x"]) for r in again.collect()) == [("a", '"5"'), ("b", "5")]
    with Stash.open(url) as s:  # a change the schema still reads exactly
        c = s.collection("things", key="str", value="json")
        s.update(c, ("c", {"x": 7}), 2, 1)
        s.seal(c, Antichain.from_elem(3))
    assert sorted((r["key"], r["x"]) for r in again.collect()) == [
        ("a", '"5"'),
        ("b", "5"),
        ("c", "7"),
    ]
