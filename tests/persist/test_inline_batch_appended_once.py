"""A batch whose parts are inline is appended once, as a batch of blob parts is: each
inline part draws a nonce when written (its identity, carried in the transmittable
bytes), so a copy of the batch (its bytes decoded again) is refused with
``BatchAppended``, in a later append, in the same append, or in a transaction; two
separately written batches with equal bytes are both appended (a checksum could not tell
them from copies)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persist import BatchAppended, FileBlob, InvalidUsage, PersistClient
from persist.gc import collect_garbage
from persist.txn import RAW_TIME
from stash import Antichain, Stash

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string())])


@pytest.fixture
def client(tmp_path: Path) -> Iterator[PersistClient]:
    s = Stash.open(f"sqlite:///{tmp_path / 's.db'}", fenced=False)
    c = PersistClient(s, FileBlob(tmp_path / "blob"), compaction="off")  # default inline
    yield c
    c.close()
    s.close()


def test_inline_batch_decoded_twice_is_refused(client: PersistClient) -> None:
    w, r = client.open("x", KS, VS)
    b = w.batch([(((1,), ("a",)), 0, 1)], 0, 1)
    assert all(p.key is None for p in b.hollow.parts)  # inline
    data = b.into_transmittable()
    w.compare_and_append_batch([w.batch_from_transmittable(data)], 0, 1)
    copy = w.batch_from_transmittable(data)
    copy.rewrite_ts(Antichain.from_elem(1), Antichain.from_elem(2))
    with pytest.raises(BatchAppended):
        w.compare_and_append_batch([copy], 1, 2)
    assert copy.consumed  # the shard's: never deleted by its holder
    assert r.snapshot(0).to_pylist() == [{"k": 1, "v": "a", "_time": 0, "_diff": 1}]
    assert client.inspect("x").upper == Antichain.from_elem(1)  # nothing committed


def test_inline_batch_decoded_twice_in_one_call_is_refused(client: PersistClient) -> None:
    w, r = client.open("x", KS, VS)
    data = w.batch([(((1,), ("a",)), 0, 1)], 0, 1).into_transmittable()
    copies = [w.batch_from_transmittable(data), w.batch_from_transmittable(data)]
    with pytest.raises(InvalidUsage, match="share parts"):
        w.compare_and_append_batch(copies, 0, 1)
    assert client.inspect("x").upper == Antichain.from_elem(0)  # nothing committed
    w.compare_and_append_batch(copies[:1], 0, 1)
    assert r.snapshot(0).column("_diff").to_pylist() == [1]


def test_equal_inline_batches_written_twice_are_both_appended(client: PersistClient) -> None:
    w, r = client.open("x", KS, VS)
    one = w.batch([(((1,), ("a",)), 0, 1)], 0, 1)
    two = w.batch([(((1,), ("a",)), 0, 1)], 0, 1)
    assert one.hollow.parts[0].checksum == two.hollow.parts[0].checksum  # equal bytes
    w.compare_and_append_batch([one, two], 0, 1)
    assert r.snapshot(0).column("_diff").to_pylist() == [2]


def test_txn_refuses_an_inline_batch_decoded_twice(client: PersistClient) -> None:
    w, r = client.open("x", KS, VS)
    raw = w.batch(
        pa.table({"k": [1], "v": ["a"], "_time": [RAW_TIME], "_diff": [1]}),
        RAW_TIME,
        RAW_TIME + 1,
    )
    assert all(p.key is None for p in raw.hollow.parts)  # inline
    data = raw.into_transmittable()
    t = client.begin()
    t.write_batches("x", [w.batch_from_transmittable(data)])
    with pytest.raises(InvalidUsage, match="already added"):
        t.write_batches("x", [w.batch_from_transmittable(data)])
    ts = t.commit()
    t2 = client.begin()
    t2.write_batches("x", [w.batch_from_transmittable(data)])
    with pytest.raises(BatchAppended):
        t2.commit()
    assert r.snapshot(ts).column("_diff").to_pylist() == [1]


def test_inline_copy_after_compaction_is_refused_until_gc_forgets(tmp_path: Path) -> None:
    s = Stash.open(f"sqlite:///{tmp_path / 's.db'}", fenced=False)
    c = PersistClient(s, FileBlob(tmp_path / "blob"), compaction="off")
    try:
        w, r = c.open("x", KS, VS)
        b = w.batch([(((1,), ("a",)), 0, 1)], 0, 1)
        (pid,) = b.part_ids()
        assert pid.startswith("inline:")
        data = b.into_transmittable()
        w.compare_and_append_batch([w.batch_from_transmittable(data)], 0, 1)
        for t in range(1, 8):
            w.compare_and_append([(((2,), ("b",)), t, 1)], t, t + 1)
        c.compactor.compact_once("x")
        held = {p.part_id for hb in c.inspect("x").batches() for p in hb.parts}
        assert pid not in held  # merged away
        assert pid in c.consensus.retired(w.shard_id)  # retired like a blob key
        copy = w.batch_from_transmittable(data)
        copy.rewrite_ts(Antichain.from_elem(8), Antichain.from_elem(9))
        with pytest.raises(BatchAppended):
            w.compare_and_append_batch([copy], 8, 9)
        assert r.snapshot(7).column("_diff").to_pylist() == [1, 7]
        r.expire()  # its seqno hold no longer keeps the retired entries
        report = collect_garbage(c, "x", grace_seconds=0)
        assert pid in report.forgot_inline  # the record stays bounded
        assert pid not in c.consensus.retired(w.shard_id)
    finally:
        c.close()
        s.close()


def test_a_merge_of_inline_parts_retires_their_ids_in_one_row(tmp_path: Path) -> None:
    """A compaction merging several inline batches away writes one row of the retired
    collection holding their ids (not a row each, each with its index entries: the
    database log a one-row append costs); each id still reads as retired, a copy of any
    of them is refused, and GC forgets the row.  Failed on the old code (a row per
    id)."""
    s = Stash.open(f"sqlite:///{tmp_path / 's.db'}", fenced=False)
    c = PersistClient(s, FileBlob(tmp_path / "blob"), compaction="off")
    try:
        w, r = c.open("x", KS, VS)
        datas, pids = [], []
        for t in range(8):
            b = w.batch([(((t,), ("a",)), t, 1)], t, t + 1)
            (pid,) = b.part_ids()
            pids.append(pid)
            datas.append(b.into_transmittable())
            w.compare_and_append_batch([w.batch_from_transmittable(datas[-1])], t, t + 1)
        c.compactor.compact_once("x")
        held = {p.part_id for hb in c.inspect("x").batches() for p in hb.parts}
        merged = [i for i, pid in enumerate(pids) if pid not in held]
        assert len(merged) >= 4, merged
        coll = c.consensus.retired_collection(w.shard_id)
        rows = [k for (k, _v), _t, d in s.iter(coll) if d > 0]
        assert len(rows) == 1, (rows, merged)  # one merge, one row
        assert set(c.consensus.retired(w.shard_id)) == {pids[i] for i in merged}
        for i in (merged[0], merged[-1]):
            copy = w.batch_from_transmittable(datas[i])
            copy.rewrite_ts(Antichain.from_elem(8), Antichain.from_elem(9))
            with pytest.raises(BatchAppended):
                w.compare_and_append_batch([copy], 8, 9)
        r.expire()
        report = collect_garbage(c, "x", grace_seconds=0)
        assert sorted(report.forgot_inline) == sorted(pids[i] for i in merged)
        assert c.consensus.retired(w.shard_id) == {}
        assert [k for (k, _v), _t, d in s.iter(coll) if d != 0] == []
    finally:
        c.close()
        s.close()


def test_retired_rows_of_one_id_each_still_read() -> None:
    """Rows written before ids shared rows (one inline id or blob key each, with or
    without a seqno) read as before; a shared row names each of its ids."""
    from persist.retired_keys import parse_retired, retired_ids, retired_rows

    old = [("inline:ab12@5", 10), ("inline:cd34", 11), ("s1/b/k.parquet@5", 12)]
    assert [retired_ids(parse_retired(k, ms)) for k, ms in old] == [
        ["inline:ab12"],
        ["inline:cd34"],
        ["s1/b/k.parquet"],
    ]
    rows = retired_rows(
        {"inline:bb": 1, "inline:aa": 1, "inline:cc": 2, "inline:d,e": 1, "s/k.parquet": 1}, 9
    )
    assert rows == {
        "inlines:aa,bb@9": 1,
        "inline:cc@9": 2,  # alone: a row of one id, as before
        "inline:d,e@9": 1,  # not a hex nonce: a row of its own, read as one id
        "s/k.parquet@9": 1,
    }
    assert [retired_ids(parse_retired(k, ms)) for k, ms in rows.items()] == [
        ["inline:d,e"],
        ["s/k.parquet"],
        ["inline:aa", "inline:bb"],
        ["inline:cc"],
    ]


def _ids() -> st.SearchStrategy[str]:
    """Ids a version may retire: inline ids (hex nonces, or anything a state may hold:
    separators, prefixes) and blob keys."""
    hexes = st.text("0123456789abcdef", min_size=1, max_size=8)
    odd = st.text(",@:sinle0a ", min_size=0, max_size=8)
    return st.one_of(
        hexes.map(lambda n: "inline:" + n),
        odd.map(lambda n: "inline:" + n),
        st.text("abc/._-", min_size=1, max_size=8).map(lambda k: f"s1/{k}.parquet"),
    )


@settings(max_examples=200, deadline=None)
@given(adds=st.dictionaries(_ids(), st.integers(0, 2), max_size=80), seqno=st.integers(0, 10**12))
def test_retired_rows_name_every_id_once_with_its_ms_and_seqno(
    adds: dict[str, int], seqno: int
) -> None:
    """Whatever the ids one version retires (more than a row holds, nonces holding
    ``,``, ``@``, ``:`` or looking like a row's prefix, blob keys), the rows written name
    each id exactly once, with its ms and the version's seqno, and no row holds more
    than ``INLINE_IDS_PER_ROW`` ids (a version retiring 67 hex ids writes 3 rows)."""
    from persist.retired_keys import INLINE_IDS_PER_ROW, parse_retired, retired_ids, retired_rows

    named: dict[str, tuple[int, int | None]] = {}
    for k, ms in retired_rows(adds, seqno).items():
        r = parse_retired(k, ms)
        ids = retired_ids(r)
        assert len(ids) <= INLINE_IDS_PER_ROW
        for i in ids:
            assert i not in named, (i, k)
            named[i] = (r.ms, r.seqno)
    assert named == {k: (ms, seqno) for k, ms in adds.items()}
    many = {f"inline:{i:032x}": 7 for i in range(2 * INLINE_IDS_PER_ROW + 3)}
    assert len(retired_rows(many, seqno)) == 3


@pytest.mark.parametrize("db", ["sqlite", "postgres"])
def test_more_inline_ids_than_a_row_holds_retired_by_one_version(
    tmp_path: Path, db: str, request: pytest.FixtureRequest
) -> None:
    """One version (a full compaction: ``optimize``) merges away more inline batches than
    a row of the retired collection holds: their ids take several rows (a full row's key,
    32 ids, fits the key indexes of Postgres), each id reads as retired, a copy of one
    from each row is refused, and GC forgets every row."""
    from persist.optimize import optimize
    from persist.retired_keys import INLINE_IDS_PER_ROW

    url = (
        f"sqlite:///{tmp_path / 's.db'}"
        if db == "sqlite"
        else str(request.getfixturevalue("postgres_url"))
    )
    if db == "postgres":
        from stash.migrate import migration_engine, upgrade

        engine = migration_engine(url)
        upgrade(engine)
        engine.dispose()
    s = Stash.open(url, fenced=False)
    c = PersistClient(s, FileBlob(tmp_path / "blob"), compaction="off")
    try:
        w, r = c.open("x", KS, VS)
        n = INLINE_IDS_PER_ROW + 8
        datas, pids = [], []
        for t in range(n):
            b = w.batch([(((t,), ("a",)), t, 1)], t, t + 1)
            pids.extend(b.part_ids())
            datas.append(b.into_transmittable())
            w.compare_and_append_batch([w.batch_from_transmittable(datas[-1])], t, t + 1)
        optimize(c.context, c.compactor, c.machine(w.shard_id))
        held = {p.part_id for hb in c.inspect("x").batches() for p in hb.parts}
        assert not held & set(pids)
        coll = c.consensus.retired_collection(w.shard_id)
        rows = [k for (k, _v), _t, d in s.iter(coll) if d > 0]
        assert len(rows) == 2, rows
        assert set(c.consensus.retired(w.shard_id)) == set(pids)
        for i in (0, n - 1):  # an id of each row
            copy = w.batch_from_transmittable(datas[i])
            copy.rewrite_ts(Antichain.from_elem(n), Antichain.from_elem(n + 1))
            with pytest.raises(BatchAppended):
                w.compare_and_append_batch([copy], n, n + 1)
        assert sorted(r.snapshot(n - 1).column("k").to_pylist()) == list(range(n))
        r.expire()
        report = collect_garbage(c, "x", grace_seconds=0)
        assert sorted(report.forgot_inline) == sorted(pids)
        assert c.consensus.retired(w.shard_id) == {}
        assert [k for (k, _v), _t, d in s.iter(coll) if d != 0] == []
    finally:
        c.close()
        s.close()
