"""Exactly-once streaming writes to a persist shard (``df.writeStream.format("persist")``).

Streams from a directory of JSON files (one file per micro-batch), run with
``trigger(availableNow=True)``; replays are provoked by deleting the newest entries of
Spark's commit log (``checkpointLocation/commits/``) and by a SIGKILL of a driver process
after the persist commit and before Spark's.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.spark

SCHEMA = "id long, v string"


def _opts(store: Any) -> dict[str, str]:
    return {"stash": store.stash_url, "blob": store.blob_uri}


def _files(src: Path, batches: list[list[tuple[int, str]]], start: int = 0) -> None:
    """One JSON file per micro-batch (``maxFilesPerTrigger`` 1), in order."""
    import os
    import time

    src.mkdir(exist_ok=True)
    now = int(time.time())
    for i, rows in enumerate(batches, start):
        body = "".join(json.dumps({"id": k, "v": v}) + "\n" for k, v in rows)
        path = src / f"part-{i:04d}.json"
        path.write_text(body)
        # Spark's file source orders files by modification time (in milliseconds):
        # distinct times make the micro-batches' order the files' order.
        os.utime(path, (now + i - 100, now + i - 100))


def _stream(spark: Any, src: Path, store: Any, shard: str, ckpt: Path, **options: Any) -> None:
    """Run the stream from ``src`` into ``shard`` until it has no more input."""
    w = (
        spark.readStream.schema(SCHEMA)
        .option("maxFilesPerTrigger", 1)
        .json(str(src))
        .writeStream.format("persist")
        .options(**_opts(store))
        .option("key_columns", "id")
        .option("checkpointLocation", str(ckpt))
    )
    for k, v in options.items():
        w = w.option(k, v)
    q = w.trigger(availableNow=True).start(shard)
    q.awaitTermination()
    if q.exception() is not None:
        raise AssertionError(f"stream failed: {q.exception()}")


def _rows(spark: Any, store: Any, shard: str) -> Counter[tuple[Any, ...]]:
    """The shard's consolidated rows with their diffs."""
    df = spark.read.format("persist").options(**_opts(store)).load(shard)
    return Counter(tuple(r) for r in df.collect())


def _newest_commits(ckpt: Path, n: int = 1) -> list[Path]:
    entries = sorted(
        (p for p in (ckpt / "commits").iterdir() if p.name.isdigit()), key=lambda p: int(p.name)
    )
    return entries[-n:]


BATCHES = [[(1, "a"), (2, "b")], [(3, "c"), (4, "d")]]


def _expected(batches: list[list[tuple[int, str]]]) -> Counter[tuple[Any, ...]]:
    return Counter((k, v, 1) for rows in batches for k, v in rows)


def test_replayed_micro_batch_adds_nothing(spark: Any, spark_store: Any) -> None:
    src, ckpt = spark_store.root / "src", spark_store.root / "ckpt"
    _files(src, BATCHES)
    _stream(spark, src, spark_store, "events", ckpt)
    assert _rows(spark, spark_store, "events") == _expected(BATCHES)
    # Spark's commit log loses the newest entry: the last micro-batch runs again.
    for p in _newest_commits(ckpt):
        p.unlink()
        (p.parent / f".{p.name}.crc").unlink(missing_ok=True)
    _stream(spark, src, spark_store, "events", ckpt)
    assert _rows(spark, spark_store, "events") == _expected(BATCHES)
    # New input after the replay is written once.
    more = [[(6, "f")]]
    _files(src, more, start=len(BATCHES))
    _stream(spark, src, spark_store, "events", ckpt)
    assert _rows(spark, spark_store, "events") == _expected(BATCHES + more)


DRIVER = """
import sys
from pathlib import Path
from spark.session import build_session
spark = build_session("local[1]", "stream-kill", shuffle_partitions=1, driver_memory="1g")
src, stash, blob, ckpt = sys.argv[1:5]
q = (
    spark.readStream.schema("id long, v string").option("maxFilesPerTrigger", 1).json(src)
    .writeStream.format("persist").option("stash", stash).option("blob", blob)
    .option("key_columns", "id").option("checkpointLocation", ckpt)
    .trigger(availableNow=True).start("events")
)
q.awaitTermination()
"""


@pytest.mark.slow  # a second JVM: over 30 s on a loaded machine
def test_sigkill_after_persist_commit_then_restart(
    spark: Any, spark_store: Any, tmp_path: Path
) -> None:
    """A driver killed after micro-batch 0 committed to persist and before Spark wrote
    ``commits/0``: the restarted stream replays micro-batch 0 and adds nothing for it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from spark.persist_stream_writer import HOLD_AFTER_COMMIT_ENV, committed_batch
    from tests.support.spark_fixtures import TEST_JVM_FLAGS

    src, ckpt = spark_store.root / "src", spark_store.root / "ckpt"
    _files(src, BATCHES)
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    marker = tmp_path / "committed"
    env = {**os.environ, HOLD_AFTER_COMMIT_ENV: str(marker), "JAVA_TOOL_OPTIONS": TEST_JVM_FLAGS}
    args = [str(src), spark_store.stash_url, spark_store.blob_uri, str(ckpt)]
    proc = subprocess.Popen(
        [sys.executable, str(script), *args],
        env=env,
        start_new_session=True,  # its own process group: the JVM and its Python workers
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            if proc.poll() is not None:
                raise AssertionError(f"driver exited early: {proc.stderr.read().decode()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError("micro-batch 0 never committed")
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()
    # Persist has micro-batch 0; Spark's commit log does not.
    assert committed_batch(spark_store.stash_url, spark_store.blob_uri, "events", str(ckpt)) == 0
    assert not (ckpt / "commits" / "0").exists()
    assert _rows(spark, spark_store, "events") == _expected(BATCHES[:1])
    _stream(spark, src, spark_store, "events", ckpt)
    assert _rows(spark, spark_store, "events") == _expected(BATCHES)


def test_stream_reader_and_writer_chained(spark: Any, spark_store: Any) -> None:
    """Shard to shard: the stream reader's updates (retractions included, through
    ``_diff``) written by the stream writer leave the target equal to the source."""
    from persist import PersistClient
    from stash import Stash

    ks, vs = _schemas()
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        client = PersistClient(s, spark_store.blob_uri, compaction="off")
        try:
            w = client.open_writer("source", ks, vs)
            w.compare_and_append([(((1,), ("a",)), 0, 1), (((2,), ("b",)), 0, 2)], 0, 1)
            q = (
                spark.readStream.format("persist")
                .options(**_opts(spark_store))
                .load("source")
                .writeStream.format("persist")
                .options(**_opts(spark_store))
                .option("checkpointLocation", str(spark_store.root / "ckpt"))
                .start("target")
            )
            try:
                q.processAllAvailable()
                assert _rows(spark, spark_store, "target") == _rows(spark, spark_store, "source")
                w.compare_and_append([(((2,), ("b",)), 1, -1), (((3,), ("c",)), 1, 1)], 1, 2)
                q.processAllAvailable()
                want = Counter({(1, "a", 1): 1, (2, "b", 1): 1, (3, "c", 1): 1})
                assert _rows(spark, spark_store, "source") == want
                assert _rows(spark, spark_store, "target") == want
            finally:
                q.stop()
            w.expire()
        finally:
            client.close()


def _schemas() -> tuple[Any, Any]:
    import pyarrow as pa

    return pa.schema([("id", pa.int64())]), pa.schema([("v", pa.string())])


UPSERTS = [[(1, "a"), (2, "b")], [(1, "c")], [(2, "d"), (3, "e"), (1, "c")]]


def test_upsert_mode_matches_write_handle_upsert(spark: Any, spark_store: Any) -> None:
    """Each micro-batch applied as an upsert: the shard equals one where the same rows
    went through ``WriteHandle.upsert`` batch by batch; a replayed micro-batch adds
    nothing; two rows with one key in a micro-batch fail it, committing nothing."""
    import pyarrow as pa

    from persist import PersistClient
    from stash import Stash

    src, ckpt = spark_store.root / "src", spark_store.root / "ckpt"
    _files(src, UPSERTS)
    _stream(spark, src, spark_store, "upserted", ckpt, mode="upsert")
    ks, vs = _schemas()
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        client = PersistClient(s, spark_store.blob_uri, compaction="off")
        try:
            w = client.open_writer("model", ks, vs)
            for rows in UPSERTS:
                w.upsert(pa.table({"id": [k for k, _ in rows], "v": [v for _, v in rows]}))
            w.expire()
        finally:
            client.close()
    want = Counter({(1, "c", 1): 1, (2, "d", 1): 1, (3, "e", 1): 1})
    assert _rows(spark, spark_store, "model") == want
    assert _rows(spark, spark_store, "upserted") == want
    for p in _newest_commits(ckpt, 2):
        p.unlink()
        (p.parent / f".{p.name}.crc").unlink(missing_ok=True)
    _stream(spark, src, spark_store, "upserted", ckpt, mode="upsert")
    assert _rows(spark, spark_store, "upserted") == want
    _files(src, [[(4, "x"), (4, "y")]], start=len(UPSERTS))
    with pytest.raises(Exception, match="two rows have one key"):
        _stream(spark, src, spark_store, "upserted", ckpt, mode="upsert")
    assert _rows(spark, spark_store, "upserted") == want


def test_bad_options_name_the_rule(spark: Any, spark_store: Any) -> None:
    src = spark_store.root / "src"
    _files(src, BATCHES[:1])
    cases = [
        ({}, "checkpointLocation"),
        ({"checkpointLocation": str(src / "c1"), "time": "3"}, "one new time"),
        ({"checkpointLocation": str(src / "c2"), "mode": "merge"}, "mode must"),
    ]
    for options, message in cases:
        # A fresh writer each time: DataStreamWriter.option changes the writer itself.
        writer = (
            spark.readStream.schema(SCHEMA)
            .json(str(src))
            .writeStream.format("persist")
            .options(**_opts(spark_store), **options)
        )
        with pytest.raises(Exception, match=message):
            q = writer.trigger(availableNow=True).start("bad")
            q.awaitTermination()


# ---------------------------------------------------- the commit protocol, without a JVM
def _writer(store: Any, ckpt: Path, mode: str = "append") -> Any:
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    from spark.persist_common import ShardTarget, registered_schemas
    from spark.persist_stream_writer import PersistStreamWriter, StreamWriteSettings

    schema = StructType([StructField("id", LongType()), StructField("v", StringType())])
    options = {
        **_opts(store),
        "path": "events",
        "key_columns": "id",
        "checkpointLocation": str(ckpt),
        "mode": mode,
    }
    target = ShardTarget(store.stash_url, store.blob_uri, "events")
    settings = StreamWriteSettings.from_options(options, schema, registered_schemas(target))
    return PersistStreamWriter(settings)


def _task(writer: Any, rows: list[tuple[int, str]]) -> Any:
    import pyarrow as pa

    rb = pa.RecordBatch.from_pydict(
        {"id": pa.array([k for k, _ in rows], pa.int64()), "v": [v for _, v in rows]}
    )
    return writer.write(iter([rb]))


def _snapshot(store: Any) -> Counter[tuple[Any, ...]]:
    from spark.persist_common import ShardTarget, persist_client

    with persist_client(ShardTarget(store.stash_url, store.blob_uri, "events")) as client:
        read = client.open_reader("events", *_schemas())
        try:
            upper = read.fetch_recent_upper().as_option()
            t = read.snapshot(upper - 1)
        finally:
            read.expire()
    return Counter((r["id"], r["v"], r["_diff"]) for r in t.to_pylist())


def test_racing_commits_of_one_micro_batch_land_once(spark_store: Any) -> None:
    """Drivers of one query (a zombie run and its restarts) commit micro-batch 0 at
    once, each with its own parts: the rows land once, the losers' parts are deleted."""
    import threading

    ckpt = spark_store.root / "ckpt"
    writers = [_writer(spark_store, ckpt) for _ in range(4)]
    rows = [(k, "x" * 100) for k in range(3000)]  # big enough for blob parts
    msgs = [_task(w, rows) for w in writers]
    barrier = threading.Barrier(len(writers))
    errors: list[BaseException] = []

    def run(w: Any, m: Any) -> None:
        try:
            barrier.wait()
            w.commit([m], 0)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=wm) for wm in zip(writers, msgs, strict=True)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert _snapshot(spark_store) == Counter((k, v, 1) for k, v in rows)
    assert _stray_parts(spark_store) == set()
    assert _referenced(spark_store)  # the parts were blobs, not inline


def test_a_record_committed_between_the_peek_and_a_second_read_is_a_lost_race(
    spark_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first commit of a stream peeks an empty record collection; another driver's
    record lands right after that peek.  The decision stays on the version the peek
    read (nothing committed yet), so the commit loses the race on its record batch's
    lower, retries, sees the other record and adds nothing.  (Deciding on a second
    read of the upper raised ``PeekSinceUpperError`` to Spark instead.)"""
    from stash import Stash

    ckpt = spark_store.root / "ckpt"
    first, second = _writer(spark_store, ckpt), _writer(spark_store, ckpt)
    rows = [(k, "x" * 100) for k in range(3000)]
    m_first, m_second = _task(first, rows), _task(second, rows)
    real = Stash.peek_key_one
    raced: list[bool] = []

    def peek_then_race(self: Any, coll: Any, key: Any) -> Any:
        # A never-written collection peeks as None (or, before, raised
        # PeekSinceUpperError): either way the other record lands right after.
        try:
            return real(self, coll, key)
        finally:
            if not raced:
                raced.append(True)
                second.commit([m_second], 0)  # lands between the peek and the decision

    monkeypatch.setattr(Stash, "peek_key_one", peek_then_race)
    first.commit([m_first], 0)
    assert raced
    assert _snapshot(spark_store) == Counter((k, v, 1) for k, v in rows)
    assert _stray_parts(spark_store) == set()


def _stray_parts(store: Any) -> set[str]:
    """Blob keys of parts the shard does not reference (the store's identity marker is
    no part)."""
    from persist.store_identity import MARKER_KEY
    from spark.persist_common import ShardTarget, persist_client

    with persist_client(ShardTarget(store.stash_url, store.blob_uri, "events")) as client:
        referenced = set(client.inspect("events").referenced_blob_keys())
        keys = {k for k, _ in client.blob.list_keys() if not k.startswith(MARKER_KEY + "/")}
    return keys - referenced


def _referenced(store: Any) -> set[str]:
    from spark.persist_common import ShardTarget, persist_client

    with persist_client(ShardTarget(store.stash_url, store.blob_uri, "events")) as client:
        return set(client.inspect("events").referenced_blob_keys())


def test_new_query_on_a_recreated_checkpoint_is_not_a_replay(spark_store: Any) -> None:
    """A checkpoint location deleted and made again holds a new query id: its batch 0 is
    new data, not a replay of the old query's batch 0."""
    ckpt = spark_store.root / "ckpt"
    ckpt.mkdir()
    (ckpt / "metadata").write_text('{"id":"query-one"}\n')
    w = _writer(spark_store, ckpt)
    w.commit([_task(w, [(1, "a")])], 0)
    w.commit([_task(w, [(1, "a")])], 0)  # a replay: nothing
    (ckpt / "metadata").write_text('{"id":"query-two"}\n')
    w.commit([_task(w, [(2, "b")])], 0)
    assert _snapshot(spark_store) == Counter({(1, "a", 1): 1, (2, "b", 1): 1})


def test_abort_deletes_the_parts(spark_store: Any) -> None:
    w = _writer(spark_store, spark_store.root / "ckpt")
    w.commit([_task(w, [(k, "y" * 100) for k in range(3000)])], 0)
    m = _task(w, [(k, "x" * 100) for k in range(3000)])
    assert _stray_parts(spark_store)
    w.abort([m, None], 1)
    assert _stray_parts(spark_store) == set()


def test_upsert_mode_replans_after_a_lost_race(spark_store: Any, monkeypatch: Any) -> None:
    """A write landing between an upsert micro-batch's plan and its commit makes the
    commit re-read and re-plan: the row it added under the upserted key is retracted
    too, and the executors' parts are committed (not uploaded again)."""
    import pyarrow as pa

    from spark.persist_common import ShardTarget, persist_client
    from spark.persist_stream_writer import PersistStreamWriter

    w = _writer(spark_store, spark_store.root / "ckpt", mode="upsert")
    w.commit([_task(w, [(1, "a"), (2, "b")])], 0)
    real = PersistStreamWriter._retractions
    raced: list[int] = []

    def racing(self: Any, write: Any, incoming: Any) -> Any:
        out = real(self, write, incoming)
        if not raced:
            target = ShardTarget(spark_store.stash_url, spark_store.blob_uri, "events")
            with persist_client(target) as client:
                other = client.open_writer("events", *_schemas())
                upper = other.fetch_recent_upper().as_option()
                late = pa.table(
                    {
                        "id": pa.array([1], pa.int64()),
                        "v": ["late"],
                        "_time": pa.array([upper], pa.int64()),
                        "_diff": pa.array([1], pa.int64()),
                    }
                )
                other.compare_and_append(late, upper, upper + 1)
                other.expire()
            raced.append(upper)
        return out

    monkeypatch.setattr(PersistStreamWriter, "_retractions", racing)
    w.commit([_task(w, [(1, "c")])], 1)
    assert raced
    assert _snapshot(spark_store) == Counter({(1, "c", 1): 1, (2, "b", 1): 1})
    assert _stray_parts(spark_store) == set()


def test_upsert_micro_batch_repeating_a_row_fails_and_commits_nothing(spark_store: Any) -> None:
    """The same row twice in one task of an upsert micro-batch: the task's builder
    consolidates the two into one update with ``_diff`` 2, so the check must read the
    diffs, not only the keys. The micro-batch fails and commits nothing (before the fix
    it committed the row with ``_diff`` 2)."""
    from spark.persist_common import PersistSourceError

    w = _writer(spark_store, spark_store.root / "ckpt", mode="upsert")
    w.commit([_task(w, [(1, "a")])], 0)
    with pytest.raises(PersistSourceError, match="two rows have one key"):
        w.commit([_task(w, [(2, "b"), (2, "b")])], 1)
    assert _snapshot(spark_store) == Counter({(1, "a", 1): 1})
    assert _stray_parts(spark_store) == set()


@pytest.mark.parametrize("char", [" ", "%", "[", "#", "?", "%41"])
def test_checkpoint_path_characters_are_data(spark_store: Any, char: str) -> None:
    """A checkpoint directory whose name holds a space, ``%``, ``[``, ``#`` or ``?`` (or
    an escape-like ``%41``): the query id is read from that directory's own
    ``metadata``, so a recreated checkpoint (a new query id) is a new stream, not a
    replay. Before the fix the location was ``"file://" + path`` unescaped: the id read
    as ``None`` (or another file's), and micro-batch 0 of the new query was dropped."""
    ckpt = spark_store.root / f"ck{char}pt"
    ckpt.mkdir()
    # A decoy beside it: "#" or "?" cut the unescaped URI's path at "ck".
    (spark_store.root / "ck").mkdir()
    (spark_store.root / "ck" / "metadata").write_text('{"id":"decoy"}\n')
    (ckpt / "metadata").write_text('{"id":"query-one"}\n')
    w = _writer(spark_store, ckpt)
    w.commit([_task(w, [(1, "a")])], 0)
    w.commit([_task(w, [(1, "a")])], 0)  # a replay: nothing
    (ckpt / "metadata").write_text('{"id":"query-two"}\n')
    w.commit([_task(w, [(2, "b")])], 0)
    assert _snapshot(spark_store) == Counter({(1, "a", 1): 1, (2, "b", 1): 1})
