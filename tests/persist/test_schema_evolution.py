"""Schema evolution of shards (``persist/updates.py``, ``persist/state_base.py``).

Versioned value schemas in the shard state, parts recording the version they were
written with, reads conformed to the reader's version, compaction under the newest
version, every incompatible change refused with nothing committed, and states written
before schemas were versioned still readable (schema 0).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

from persist import (
    InvalidUsage,
    MemoryBlob,
    PersistClient,
    PersistError,
    SchemaMismatch,
    ShardState,
)
from persist.types import PartRef
from persist.updates import SchemaHistory, check_schema_evolution
from stash import Stash

KS = pa.schema([pa.field("k", pa.int64(), nullable=False)])
V0 = pa.schema([pa.field("a", pa.int32(), nullable=False), pa.field("b", pa.string())])


@pytest.fixture
def client() -> Iterator[PersistClient]:
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off")
    try:
        yield c
    finally:
        c.close()
        s.close()


def rows(table: pa.Table) -> Counter[tuple[Any, ...]]:
    names = [n for n in table.column_names if n not in ("_time", "_diff")]
    out: Counter[tuple[Any, ...]] = Counter()
    for r in table.to_pylist():
        out[tuple(r[n] for n in names)] += r["_diff"]
    return out


# ------------------------------------------------------------------ the rules

COMPATIBLE = {
    "add nullable column": pa.schema([*V0, pa.field("c", pa.float64())]),
    "add nullable column in the middle": pa.schema(
        [V0.field("a"), ("c", pa.int8()), V0.field("b")]
    ),
    "drop column": pa.schema([V0.field("a")]),
    "widen int32 to int64": pa.schema([pa.field("a", pa.int64(), nullable=False), V0.field("b")]),
    "string to large_string": pa.schema([V0.field("a"), pa.field("b", pa.large_string())]),
    "make nullable": pa.schema([pa.field("a", pa.int32()), V0.field("b")]),
}

INCOMPATIBLE = {
    "narrowing": (KS, pa.schema([pa.field("a", pa.int16(), nullable=False), V0.field("b")]), "a"),
    "type change": (
        KS,
        pa.schema([pa.field("a", pa.string(), nullable=False), V0.field("b")]),
        "a",
    ),
    "int to float": (
        KS,
        pa.schema([pa.field("a", pa.float64(), nullable=False), V0.field("b")]),
        "a",
    ),
    "non-nullable added column": (
        KS,
        pa.schema([*V0, pa.field("c", pa.int64(), nullable=False)]),
        "c",
    ),
    "nullable made not null": (
        KS,
        pa.schema([V0.field("a"), pa.field("b", pa.string(), nullable=False)]),
        "b",
    ),
    "reordered kept columns": (KS, pa.schema([V0.field("b"), V0.field("a")]), "b"),
    "key type change": (pa.schema([pa.field("k", pa.int32(), nullable=False)]), V0, "k"),
    "key column added": (
        pa.schema([*KS, pa.field("k2", pa.int64(), nullable=False)]),
        V0,
        "k2",
    ),
    "key made nullable": (pa.schema([pa.field("k", pa.int64())]), V0, "k"),
}


@pytest.mark.parametrize("case", sorted(COMPATIBLE))
def test_compatible_change_registers_a_version(client: PersistClient, case: str) -> None:
    w0, r0 = client.open("s", KS, V0)
    w0.append([(((1,), (5, "x")), 0, 1)], 0, 1)
    before = client.inspect("s")
    new = COMPATIBLE[case]
    w1, r1 = client.open("s", KS, new, drop=[n for n in V0.names if n not in new.names])
    st = client.inspect("s")
    assert st.seqno > before.seqno
    assert len(st.schema_history) == 2 and st.schema_history[0].equals(V0)
    assert st.value_schema.equals(new) and w1.schema_id == 1 and r1.schema_id == 1
    # Re-opening with the same schema registers nothing.
    client.open("s", KS, new)
    assert len(client.inspect("s").schema_history) == 2
    # The part written before reads under the new version.
    snap = r1.snapshot(0)
    assert snap.schema.names == [*KS.names, *new.names, "_time", "_diff"]
    expect = {"a": 5, "b": "x", "c": None}
    assert rows(snap) == Counter({(1, *(expect[n] for n in new.names)): 1})
    # And the old reader keeps its view, including of rows the new writer wrote.
    vals = {"a": 7, "b": "y", "c": None}
    w1.append([(((2,), tuple(vals[n] for n in new.names)), 1, 1)], 1, 2)
    old = r0.snapshot(1)
    assert old.schema.names == ["k", "a", "b", "_time", "_diff"]
    # Dropped columns are gone for every reader, the old one included.
    a_of = (lambda v: v) if "a" in new.names else (lambda v: None)
    b_of = (lambda v: v) if "b" in new.names else (lambda v: None)
    assert rows(old) == Counter({(1, a_of(5), b_of("x")): 1, (2, a_of(7), b_of("y")): 1})


@pytest.mark.parametrize("case", sorted(INCOMPATIBLE))
def test_incompatible_change_is_refused_and_commits_nothing(
    client: PersistClient, case: str
) -> None:
    w, r = client.open("s", KS, V0)
    w.append([(((1,), (5, "x")), 0, 1)], 0, 1)
    before = client.inspect("s")
    entries = before.to_entries()
    ks, vs, column = INCOMPATIBLE[case]
    with pytest.raises(SchemaMismatch) as e:
        client.open("s", ks, vs)
    assert isinstance(e.value, PersistError) and isinstance(e.value, InvalidUsage)
    assert e.value.column == column and e.value.rule
    assert repr(column) in str(e.value) and "nothing was changed" in str(e.value)
    after = client.inspect("s")
    assert after.seqno == before.seqno and after.to_entries() == entries


def test_check_names_the_rule() -> None:
    with pytest.raises(SchemaMismatch, match="must be nullable"):
        check_schema_evolution("s", KS, V0, KS, pa.schema([*V0, pa.field("c", pa.int8(), False)]))
    with pytest.raises(SchemaMismatch, match="not a widening"):
        check_schema_evolution("s", KS, V0, KS, pa.schema([pa.field("a", pa.int8(), False)]))
    with pytest.raises(SchemaMismatch, match="key schema never changes"):
        check_schema_evolution("s", KS, V0, pa.schema([("k", pa.string())]), V0)
    # Chains of widenings are each one step or several at once.
    check_schema_evolution(
        "s",
        KS,
        pa.schema([("x", pa.int8()), ("f", pa.float32()), ("s", pa.large_string())]),
        KS,
        pa.schema([("x", pa.int64()), ("f", pa.float64()), ("s", pa.string())]),
    )


# ------------------------------------------------------------ reads and compaction


def test_dropped_column_does_not_keep_rows_apart(client: PersistClient) -> None:
    """Conform before consolidating: rows differing only in a dropped column are one
    row, in a snapshot (several batches, and a single run) and after compaction."""
    w0, _ = client.open("s", KS, V0)
    # One run (one append) holding two rows that differ only in b.
    w0.append([(((1,), (5, "x")), 0, 1), (((1,), (5, "y")), 0, 1)], 0, 1)
    v1 = pa.schema([V0.field("a")])
    w1, r1 = client.open("s", KS, v1, drop=["b"])
    assert rows(r1.snapshot(0)) == Counter({(1, 5): 2})
    snap = r1.snapshot(0)
    assert snap.num_rows == 1
    w1.append([(((1,), (5,)), 1, -1)], 1, 2)
    assert rows(r1.snapshot(1)) == Counter({(1, 5): 1}) and r1.snapshot(1).num_rows == 1
    for t in range(2, 6):  # enough batches for the Spine to ask for merges
        w1.append([], t, t + 1)
        client.compactor.compact_once("s")
    assert rows(r1.snapshot(1)) == Counter({(1, 5): 1}) and r1.snapshot(1).num_rows == 1


def test_compaction_rewrites_under_the_newest_schema(client: PersistClient) -> None:
    w0, _ = client.open("s", KS, V0)
    for t in range(4):
        w0.append([(((t,), (t, "x")), t, 1)], t, t + 1)
    v1 = pa.schema([pa.field("a", pa.int64()), pa.field("c", pa.string())])
    w1, r1 = client.open("s", KS, v1, drop=["b"])
    for t in range(4, 8):
        w1.append([(((t,), (t, "z")), t, 1)], t, t + 1)
    r1.downgrade_since(7)
    before = rows(r1.snapshot(7))
    for _ in range(4):
        client.compactor.compact_once("s")
    st = client.inspect("s")
    parts = [p for b in st.batches() for p in b.parts]
    assert parts and all(p.schema_id == 1 for p in parts), [p.schema_id for p in parts]
    assert rows(r1.snapshot(7)) == before
    assert before == Counter(
        {**{(t, t, None): 1 for t in range(4)}, **{(t, t, "z"): 1 for t in range(4, 8)}}
    )


def test_dropped_and_re_added_column_is_another_column(client: PersistClient) -> None:
    w0, _ = client.open("s", KS, V0)
    w0.append([(((1,), (5, "old")), 0, 1)], 0, 1)
    client.open("s", KS, pa.schema([V0.field("a")]), drop=["b"])
    v2 = pa.schema([V0.field("a"), pa.field("b", pa.int64())])
    w2, r2 = client.open("s", KS, v2)
    assert w2.schema_id == 2
    w2.append([(((2,), (6, 9)), 1, 1)], 1, 2)
    assert rows(r2.snapshot(1)) == Counter({(1, 5, None): 1, (2, 6, 9): 1})


def test_older_writer_keeps_writing_its_version(client: PersistClient) -> None:
    """A writer opened with an older registered version writes parts recording that
    version (persist-client's behaviour); readers of any version conform them.  (Once a
    later version dropped one of its columns, such a writer is refused: see
    ``test_writer_of_a_version_that_lost_a_column_is_refused``.)"""
    w0, r0 = client.open("s", KS, V0)
    w0.append([(((1,), (5, "x")), 0, 1)], 0, 1)
    v1 = pa.schema([pa.field("a", pa.int64(), nullable=False), pa.field("c", pa.float64())])
    w1, r1 = client.open("s", KS, v1, drop=["b"])
    w1.append([(((2,), (6, 0.5)), 1, 1)], 1, 2)
    st = client.inspect("s")
    assert [p.schema_id for b in st.batches() for p in b.parts] == [0, 1]
    assert rows(r1.snapshot(1)) == Counter({(1, 5, None): 1, (2, 6, 0.5): 1})
    # The old reader's view is its schema; b, which a later version dropped, is gone
    # (null) for it too, so its view does not change when compaction rewrites parts
    # under the newest version.
    before = r0.snapshot(1)
    assert rows(before) == Counter({(1, 5, None): 1, (2, 6, None): 1})
    assert before.schema.field("a").type == pa.int32()
    for t in range(2, 6):
        w1.append([], t, t + 1)
        client.compactor.compact_once("s")
    assert {p.schema_id for b in client.inspect("s").batches() for p in b.parts} == {1}
    assert rows(r0.snapshot(5)) == rows(before)


def test_older_reader_refuses_a_value_it_cannot_hold(client: PersistClient) -> None:
    _, r0 = client.open("s", KS, V0)
    w1, _ = client.open(
        "s", KS, pa.schema([pa.field("a", pa.int64(), nullable=False), V0.field("b")])
    )
    w1.append([(((1,), (2**40, "x")), 0, 1)], 0, 1)
    with pytest.raises(SchemaMismatch, match="'a'.*older type int32"):
        r0.snapshot(0)


def test_listen_conforms_to_its_readers_version(client: PersistClient) -> None:
    w0, r0 = client.open("s", KS, V0)
    listen = r0.listen(0)
    w0.append([(((0,), (1, "x")), 0, 1)], 0, 1)  # not emitted: at as_of
    w1, _ = client.open("s", KS, pa.schema([pa.field("a", pa.int64(), nullable=False)]), drop=["b"])
    w1.append([(((1,), (7,)), 1, 1)], 1, 2)
    got = [e for e in listen.poll() if e.kind == "updates"]
    listen.close()
    assert len(got) == 1 and got[0].updates is not None
    assert got[0].updates.to_pylist() == [{"k": 1, "a": 7, "b": None, "_time": 1, "_diff": 1}]


def test_batches_mixing_versions_append_together(client: PersistClient) -> None:
    """Batches of writers of two versions, one truncated (rewritten physically), in one
    compare_and_append_batch."""
    w0, _ = client.open("s", KS, V0)
    v1 = pa.schema([pa.field("a", pa.int64(), nullable=False)])
    w1, r1 = client.open("s", KS, v1, drop=["b"])
    b0 = w0.batch([(((1,), (5, "x")), 0, 1), (((9,), (9, "late")), 3, 1)], 0, 4)
    b1 = w1.batch([(((2,), (6,)), 0, 1)], 0, 1)
    w1.compare_and_append_batch([b0, b1], 0, 1)
    assert rows(r1.snapshot(0)) == Counter({(1, 5): 1, (2, 6): 1})


# ------------------------------------------------------------------- state JSON


def test_state_round_trips_and_old_states_read_as_schema_zero(client: PersistClient) -> None:
    w0, r0 = client.open("s", KS, V0)
    w0.append([(((1,), (5, "x")), 0, 1)], 0, 1)
    st = client.inspect("s")
    entries = st.to_entries()
    # One version: the state has no "schemas" entry and its parts no "schema" field,
    # exactly as states written before schemas were versioned.
    assert "schemas" not in entries
    assert all(
        "schema" not in p
        for k, v in entries.items()
        if k.startswith("trace/hollow")
        for p in v.get("parts", [])
    )
    assert ShardState.from_entries(entries).schema_history == (V0,)
    assert PartRef.from_json({"key": "x", "rows": 1, "bytes": 2, "sha256": "0"}).schema_id == 0
    w1, _ = client.open("s", KS, pa.schema([*V0, ("c", pa.int8())]))
    w1.append([(((2,), (6, "y", 3)), 1, 1)], 1, 2)
    st = client.inspect("s")
    entries = st.to_entries()
    assert [d["id"] for d in entries["schemas"]] == [0, 1]
    back = ShardState.from_entries(entries)
    assert back.to_entries() == entries and back.schemas() == st.schemas()
    assert ShardState.from_json(st.to_json()).to_entries() == entries
    assert [p.schema_id for b in back.batches() for p in b.parts] == [0, 1]


def test_part_naming_an_unknown_schema_is_an_error() -> None:
    h = SchemaHistory(KS, [V0])
    with pytest.raises(PersistError, match="schema id 3"):
        h.check_id(3)


def test_persist_inspect_shows_the_schema_history(tmp_path: Any) -> None:
    from click.testing import CliRunner

    from persist.cli import main

    url, blob = f"sqlite:///{tmp_path}/stash.db", f"file://{tmp_path}/blob"
    s = Stash.open(url, fenced=False)
    c = PersistClient(s, blob, compaction="off")
    try:
        w0, _ = c.open("evolving", KS, V0)
        w0.append([(((1,), (5, "x")), 0, 1)], 0, 1)
        w1, _ = c.open(
            "evolving", KS, pa.schema([pa.field("a", pa.int64(), nullable=False)]), drop=["b"]
        )
        w1.append([(((2,), (6,)), 1, 1)], 1, 2)
        w1.append([(((3,), (7,)), 2, 1)], 2, 3)
    finally:
        c.close()
        s.close()
    runner = CliRunner()
    base = ["--stash", url, "--blob", blob]
    res = runner.invoke(main, [*base, "inspect", "evolving", "--json"])
    assert res.exit_code == 0, res.output
    import json

    doc = json.loads(res.output)
    assert doc["schemas"] == [
        {"id": 0, "value_schema": ["a: int32 not null", "b: string"], "parts": 1},
        {"id": 1, "value_schema": ["a: int64 not null"], "parts": 2},
    ]
    res = runner.invoke(main, [*base, "inspect", "evolving"])
    assert res.exit_code == 0, res.output
    assert "schema history" in res.output and "a: int64 not null" in res.output


def test_snapshot_stream_conforms_like_snapshot(client: PersistClient) -> None:
    """The bounded-memory stream (key-range k-way merge) conforms each part to the
    reader's view before merging, as ``snapshot`` does: a dropped column merges rows, an
    added one reads null, a widened one is cast, in the same rows and order."""
    w0, _ = client.open("s", KS, V0)
    # Several runs, each holding rows that differ only in b (dropped below).
    for t in range(3):
        ups = [(((k,), (k % 7, s)), t, 1) for k in range(200) for s in ("x", "y")]
        w0.append(ups, t, t + 1)
    v1 = pa.schema([pa.field("a", pa.int64(), nullable=False), pa.field("c", pa.string())])
    w1, r1 = client.open("s", KS, v1, drop=["b"])
    w1.append([(((k,), (k % 7, "z")), 3, 1) for k in range(0, 200, 3)], 3, 4)
    snap = r1.snapshot(3)
    streamed = pa.Table.from_batches(list(r1.snapshot_stream(3, max_chunk_rows=50)))
    assert streamed.schema.equals(snap.schema)
    assert streamed.to_pylist() == snap.to_pylist()
    assert snap.num_rows == len(rows(snap)) == 200 + len(range(0, 200, 3))


def test_filtered_snapshot_prunes_only_by_columns_a_part_holds() -> None:
    """A part written before a column was dropped and added again still has statistics
    for the old column; under the newest view that column reads null, so ``b IS NULL``
    must keep the part (and a filter on its old values must not find them)."""
    import pyarrow.compute as pc

    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off", inline_max_bytes=0)
    try:
        w0, _ = c.open("s", KS, V0)
        w0.append([(((k,), (k, f"old{k}")), 0, 1) for k in range(50)], 0, 1)
        parts = [p for b in c.inspect("s").batches() for p in b.parts]
        assert parts and all(p.stats is not None and p.inline is None for p in parts)
        c.open("s", KS, pa.schema([V0.field("a")]), drop=["b"])
        v2 = pa.schema([V0.field("a"), pa.field("b", pa.string())])
        w2, r2 = c.open("s", KS, v2)
        w2.append([(((100,), (1, "new")), 1, 1)], 1, 2)
        full = r2.snapshot(1)
        for f in (pc.field("b").is_null(), pc.field("b") == "old3", pc.field("b") == "new"):
            got = r2.snapshot(1, filter=f, columns=["k", "b"])
            assert got.to_pylist() == full.filter(f).select(["k", "b"]).to_pylist(), f
        assert r2.snapshot(1, filter=pc.field("b").is_null()).num_rows == 50
    finally:
        c.close()
        s.close()


def test_writer_of_a_version_that_lost_a_column_is_refused(client: PersistClient) -> None:
    """Values a writer of version 0 puts in ``b`` after a later version dropped ``b``
    would read as null for every reader: such an append is refused and commits nothing,
    and opening with version 0's schema again registers ``b`` as a new column instead of
    reusing version 0."""
    w0, _ = client.open("s", KS, V0)
    w0.append([(((1,), (5, "x")), 0, 1)], 0, 1)
    client.open("s", KS, pa.schema([V0.field("a")]), drop=["b"])  # drops b
    with pytest.raises(SchemaMismatch, match="'b'"):
        w0.append([(((2,), (6, "lost")), 1, 1)], 1, 2)
    assert client.inspect("s").upper.as_option() == 1
    w2, r2 = client.open("s", KS, V0)
    assert w2.schema_id == 2
    w2.append([(((2,), (6, "kept")), 1, 1)], 1, 2)
    assert rows(r2.snapshot(1)) == Counter({(1, 5, None): 1, (2, 6, "kept"): 1})


def test_older_reader_view_does_not_depend_on_compaction(client: PersistClient) -> None:
    """An old reader (a: int8) reads as of 0, before a newer writer (a: int16) wrote
    a = 300 at time 1 (retracted at 2).  Before compaction the read works; once
    compaction merged the batches into one part, the same read at the same time raises
    SchemaMismatch ("300 not in range") for a value that is not in the snapshot: the
    part is conformed (cast) before times beyond ``as_of`` are dropped and before
    consolidation.  ``persist/updates.py`` promises "a reader's view is the same before
    and after compaction rewrites a part"."""
    k = pa.schema([("k", pa.string())])
    v0, v1 = pa.schema([("a", pa.int8())]), pa.schema([("a", pa.int16())])
    w0, r0 = client.open("s", k, v0)
    w0.compare_and_append([((("x",), (1,)), 0, 1)], 0, 1)
    w1, _ = client.open("s", k, v1)
    w1.compare_and_append([((("y",), (300,)), 1, 1)], 1, 2)
    w1.compare_and_append([((("y",), (300,)), 2, -1)], 2, 3)
    before = r0.snapshot(0).to_pylist()
    assert [(r["k"], r["a"]) for r in before] == [("x", 1)]
    client.compactor.compact_once("s")
    after = r0.snapshot(0).to_pylist()
    assert after == before


def test_field_metadata_survives_an_equal_schema_seen_before(client: PersistClient) -> None:
    """A shard's key field metadata is kept (it is, when the process has not seen the
    same schema without it), whatever other shard the process opened first."""
    plain = pa.schema([pa.field("k", pa.int64(), nullable=False)])
    meta = pa.schema([pa.field("k", pa.int64(), nullable=False, metadata={b"unit": b"m"})])
    client.open("plain_first", plain, V0)
    w, r = client.open("with_metadata", meta, V0)
    w.compare_and_append([(((1,), (1, "x")), 0, 1)], 0, 1)
    again = PersistClient(client.stash, client.raw_blob, compaction="off")
    try:
        assert again.inspect("with_metadata").key_schema.field("k").metadata == {b"unit": b"m"}
    finally:
        again.close()


def test_a_snapshot_keeps_field_metadata_after_an_equal_schema_seen_before(
    client: PersistClient,
) -> None:
    plain = pa.schema([pa.field("k", pa.int64(), nullable=False)])
    meta = pa.schema([pa.field("k", pa.int64(), nullable=False, metadata={b"unit": b"m"})])
    client.open("plain_first", plain, V0)
    w, r = client.open("with_metadata", meta, V0)
    w.compare_and_append([(((1,), (1, "x")), 0, 1)], 0, 1)
    assert w.schema.field("k").metadata == {b"unit": b"m"}
    assert r.snapshot(0).schema.field("k").metadata == {b"unit": b"m"}
