"""MERGE INTO a shard (:mod:`persist.merge_into`, ``WriteHandle.merge``): Delta Lake's
clause semantics checked against a Python model of them (hypothesis, on memory, SQLite
and Postgres), the recipes users write (update if newer, delete on a flag, sync to a
source), bad input refused with nothing committed, and processes merging at once."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist import InvalidUsage, MemoryBlob, MergeResult, PersistClient
from stash import Antichain, Stash
from tests.reliability.campaign import runs
from tests.support.procs import process_context

KEY = pa.schema([pa.field("id", pa.int64(), False)])
VAL = pa.schema([("v", pa.string()), ("n", pa.int64()), ("flag", pa.bool_())])
SCHEMA = pa.schema([*KEY, *VAL])
SOURCE = pa.schema(
    [("id", pa.int64()), ("v", pa.string()), ("n", pa.int64()), ("flag", pa.bool_())]
)

Row = tuple[str | None, int | None, bool | None]  # (v, n, flag)


@pytest.fixture()
def client() -> Iterator[PersistClient]:
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="inline")
    try:
        yield c
    finally:
        c.close()
        s.close()


def rows(t: dict[int, Row]) -> pa.Table:
    ids = sorted(t)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "v": [t[i][0] for i in ids],
            "n": pa.array([t[i][1] for i in ids], pa.int64()),
            "flag": pa.array([t[i][2] for i in ids], pa.bool_()),
        },
        schema=SCHEMA,
    )


def live(r: Any, time: int) -> dict[int, tuple[Row, int]]:
    t = r.snapshot(time)
    return {d["id"]: ((d["v"], d["n"], d["flag"]), d["_diff"]) for d in t.to_pylist()}


# ------------------------------------------------------------------ recipes
def test_update_if_newer_insert_new_and_delete_on_a_flag(client: PersistClient) -> None:
    w, r = client.open("s", KEY, VAL)
    w.upsert(rows({1: ("a", 10, False), 2: ("b", 20, False), 3: ("c", 30, False)}))
    src = rows({2: ("B", 25, False), 3: ("C", 5, False), 4: ("D", 40, False), 1: ("x", 0, True)})
    m = (
        w.merge(src)
        .when_matched_delete(condition="source.flag")
        .when_matched_update_all(condition="source.n > target.n")
        .when_not_matched_insert_all()
        .execute()
    )
    assert m == MergeResult(
        time=1,
        num_source_rows=4,
        num_target_rows_inserted=1,
        num_target_rows_updated=1,
        num_target_rows_deleted=1,
    )
    assert live(r, 1) == {
        2: (("B", 25, False), 1),
        3: (("c", 30, False), 1),
        4: (("D", 40, False), 1),
    }


def test_sync_to_a_source_deletes_what_the_source_no_longer_has(client: PersistClient) -> None:
    w, r = client.open("s", KEY, VAL)
    w.upsert(rows({1: ("a", 1, None), 2: ("b", 2, None), 3: ("c", 3, None)}))
    src = rows({2: ("b", 2, None), 3: ("C", 3, None), 5: ("e", 5, None)})
    m = (
        w.merge(src)
        .when_matched_update_all()
        .when_not_matched_insert_all()
        .when_not_matched_by_source_delete()
        .execute()
    )
    # row 2 is equal to its live value: neither retracted nor inserted, not counted
    assert (m.num_target_rows_updated, m.num_target_rows_unchanged) == (1, 1)
    assert (m.num_target_rows_inserted, m.num_target_rows_deleted) == (1, 1)
    assert live(r, m.time) == {
        k: (v, 1) for k, v in {2: ("b", 2, None), 3: ("C", 3, None), 5: ("e", 5, None)}.items()
    }


def test_a_merge_that_changes_nothing_writes_no_part(client: PersistClient) -> None:
    w, r = client.open("s", KEY, VAL)
    w.upsert(rows({1: ("a", 1, None), 2: ("b", 2, None)}))
    before = sum(b.len for b in client.inspect("s").batches())
    m = w.merge(rows({1: ("a", 1, None)})).when_matched_update_all().execute()
    assert (m.num_target_rows_updated, m.num_target_rows_unchanged) == (0, 1)
    assert sum(b.len for b in client.inspect("s").batches()) == before


def test_values_are_exact_and_the_stored_key_is_kept() -> None:
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="inline")
    key = pa.schema([pa.field("k", pa.float64(), False)])
    val = pa.schema([("t", pa.time64("ns"))])
    w, r = c.open("f", key, val)
    w.upsert(pa.table({"k": [0.0, float("nan")], "t": pa.array([500, 700], pa.time64("ns"))}))
    # -0.0 matches 0.0 and NaN matches NaN; a plain column reference is taken from Arrow
    src = pa.table({"k": [-0.0, float("nan")], "t": pa.array([501, 700], pa.time64("ns"))})
    m = w.merge(src).when_matched_update(set={"t": "source.t"}).execute()
    assert (m.num_target_rows_updated, m.num_target_rows_unchanged) == (1, 1)
    got = r.snapshot(m.time).to_pylist()
    assert len(got) == 2
    assert sorted(r.snapshot(m.time).column("t").cast(pa.int64()).to_pylist()) == [501, 700]
    zero = [d for d in got if d["k"] == 0.0]
    assert len(zero) == 1 and str(zero[0]["k"]) == "0.0"  # the stored key, not -0.0
    c.close()
    s.close()


# ------------------------------------------------------------------ bad input
BAD: list[tuple[str, Callable[[Any], Any], str]] = [
    ("parse", lambda b: b.when_matched_update(set={"n": "target.n +"}), "cannot be evaluated"),
    ("unknown column", lambda b: b.when_matched_update(set={"n": "target.nope"}), "nope"),
    (
        "by-source names source",
        lambda b: b.when_not_matched_by_source_delete(condition="source.n > 1"),
        "target columns only",
    ),
    ("type", lambda b: b.when_matched_update(set={"n": "'abc'"}), "within its kind"),
    ("truncation", lambda b: b.when_matched_update(set={"n": "1.5"}), "does not fit"),
    ("key change", lambda b: b.when_matched_update(set={"id": "source.id + 1"}), "change"),
    ("unknown set column", lambda b: b.when_matched_update(set={"zz": "1"}), "zz"),
    ("non-nullable key null", lambda b: b.when_not_matched_insert(values={"v": "'x'"}), "null"),
    (
        "insert onto a live key",
        lambda b: b.when_not_matched_insert(values={"id": "1", "v": "'x'"}),
        "live row",
    ),
    ("no clause", lambda b: b, "at least one"),
]


@pytest.mark.parametrize("make", [b[1] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_merges_are_refused_and_commit_nothing(
    client: PersistClient, make: Callable[[Any], Any]
) -> None:
    w, r = client.open("s", KEY, VAL)
    w.upsert(rows({1: ("a", 1, None), 2: ("b", 2, None)}))
    before = w.fetch_recent_upper()
    src = rows({2: ("x", 5, None), 7: ("y", 7, None)})
    expected = dict(b[1:] for b in BAD)[make]
    with pytest.raises(InvalidUsage, match=expected):
        make(w.merge(src)).execute()
    assert w.fetch_recent_upper() == before


def test_a_target_row_matched_twice_is_refused_naming_its_key(client: PersistClient) -> None:
    w, _ = client.open("s", KEY, VAL)
    w.upsert(rows({1: ("a", 1, None)}))
    src = pa.table({"id": [1, 1], "v": ["x", "y"]})
    with pytest.raises(InvalidUsage, match=r"\['id'\] = \[1\] is matched by 2 source rows"):
        w.merge(src).when_matched_update(set={"v": "source.v"}).execute()
    assert w.fetch_recent_upper() == Antichain([1])


def test_a_refused_key_python_cannot_hold_is_named_exactly(client: PersistClient) -> None:
    """An error naming a key prints temporal values as Arrow does: a duration beyond
    ``datetime.timedelta``'s range once raised ``OverflowError`` from the message."""
    ks = pa.schema([pa.field("d", pa.duration("ms"), False)])
    w, _ = client.open("far", ks, pa.schema([pa.field("v", pa.int64())]))
    far = -(1 << 62)
    src = pa.table({"d": pa.array([far, far], pa.duration("ms")), "v": [1, 2]})
    with pytest.raises(InvalidUsage, match=str(far)):
        w.merge(src).when_not_matched_insert_all().execute()
    assert w.fetch_recent_upper() == Antichain([0])


def test_bad_on_and_aliases(client: PersistClient) -> None:
    w, _ = client.open("s", KEY, VAL)
    with pytest.raises(InvalidUsage, match="not key columns"):
        w.merge(rows({}), on=["v"])
    with pytest.raises(InvalidUsage, match="identifier"):
        w.merge(rows({}), source_alias="s; drop")
    with pytest.raises(InvalidUsage, match="both"):
        w.merge(rows({}), source_alias="a", target_alias="A")
    with pytest.raises(InvalidUsage, match="merge source: takes a pyarrow Table"):
        w.merge(object())
    with pytest.raises(InvalidUsage, match="no column 'id'"):
        w.merge(pa.table({"x": [1]})).when_matched_delete().execute()


def test_aliases_and_quoted_names(client: PersistClient) -> None:
    w, r = client.open("s", KEY, VAL)
    w.upsert(rows({1: ("a", 1, None)}))
    m = (
        w.merge(rows({1: ("b", 2, None)}), source_alias="s", target_alias="t")
        .when_matched_update(set={"n": '"t"."n" + s.n', "v": "s.v"})
        .execute()
    )
    assert live(r, m.time) == {1: (("b", 3, None), 1)}


def test_pandas_source(client: PersistClient) -> None:
    import pandas as pd

    w, r = client.open("s", KEY, VAL)
    df = pd.DataFrame({"id": [1, 2], "v": ["a", "b"], "n": [1, 2], "flag": [True, False]})
    m = w.merge(df).when_not_matched_insert_all().execute()
    assert m.num_target_rows_inserted == 2
    assert live(r, m.time)[1] == (("a", 1, True), 1)


# ------------------------------------------------------------------ the model
@dataclass(frozen=True)
class Clause:
    kind: str
    action: str
    cond: str | None
    values: dict[str, str] | None


# (SQL, Python) pairs: each Python function gets (source row, target row) dicts.
MATCHED_CONDS = [
    (None, lambda s, t: True),
    ("source.n > target.n", lambda s, t: _gt(s["n"], t["n"])),
    ("source.flag", lambda s, t: s["flag"] is True),
    ("target.n < 5", lambda s, t: _gt(5, t["n"])),
]
NOT_MATCHED_CONDS = [
    (None, lambda s, t: True),
    ("source.flag", lambda s, t: s["flag"] is True),
    ("source.n >= 3", lambda s, t: s["n"] is not None and s["n"] >= 3),
]
BY_SOURCE_CONDS = [
    (None, lambda s, t: True),
    ("target.n < 4", lambda s, t: _gt(4, t["n"])),
    ("target.v IS NULL", lambda s, t: t["v"] is None),
    # a key range: the read is pruned to it (and the source's keys)
    ("target.id >= 3 AND target.id < 6", lambda s, t: 3 <= t["id"] < 6),
    ("5 > target.id AND target.n IS NOT NULL", lambda s, t: t["id"] < 5 and t["n"] is not None),
]
MATCHED_SETS: list[tuple[dict[str, str] | None, Callable[[Any, Any], dict[str, Any]]]] = [
    ({"n": "target.n + source.n"}, lambda s, t: {"n": _add(t["n"], s["n"])}),
    ({"v": "source.v"}, lambda s, t: {"v": s["v"]}),
    (None, lambda s, t: {"v": s["v"], "n": s["n"], "flag": s["flag"]}),
]
INSERTS: list[tuple[dict[str, str] | None, Callable[[Any], dict[str, Any]]]] = [
    (None, lambda s: dict(s)),
    (
        {"id": "source.id", "v": "'new'"},
        lambda s: {"id": s["id"], "v": "new", "n": None, "flag": None},
    ),
]
BY_SOURCE_SETS: list[tuple[dict[str, str], Callable[[Any], dict[str, Any]]]] = [
    ({"v": "'gone'"}, lambda t: {"v": "gone"}),
    ({"n": "target.n * 2"}, lambda t: {"n": None if t["n"] is None else t["n"] * 2}),
]


def _gt(a: int | None, b: int | None) -> bool:
    return a is not None and b is not None and a > b


def _add(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a + b


values_st = st.tuples(
    st.sampled_from(["a", "b", None]),
    st.one_of(st.none(), st.integers(0, 6)),
    st.sampled_from([True, False, None]),
)
table_st = st.dictionaries(st.integers(0, 7), values_st, max_size=6)


@st.composite
def clauses_st(draw: st.DrawFn) -> list[tuple[str, int, int]]:
    """(kind, condition index, action index); action -1 is delete."""
    out = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["matched", "not_matched", "not_matched_by_source"]))
        if kind == "matched":
            out.append(
                (
                    kind,
                    draw(st.integers(0, len(MATCHED_CONDS) - 1)),
                    draw(st.integers(-1, len(MATCHED_SETS) - 1)),
                )
            )
        elif kind == "not_matched":
            out.append(
                (
                    kind,
                    draw(st.integers(0, len(NOT_MATCHED_CONDS) - 1)),
                    draw(st.integers(0, len(INSERTS) - 1)),
                )
            )
        else:
            out.append(
                (
                    kind,
                    draw(st.integers(0, len(BY_SOURCE_CONDS) - 1)),
                    draw(st.integers(-1, len(BY_SOURCE_SETS) - 1)),
                )
            )
    return out


def build(b: Any, clauses: list[tuple[str, int, int]]) -> Any:
    for kind, ci, ai in clauses:
        if kind == "matched":
            cond = MATCHED_CONDS[ci][0]
            if ai < 0:
                b = b.when_matched_delete(condition=cond)
            elif MATCHED_SETS[ai][0] is None:
                b = b.when_matched_update_all(condition=cond)
            else:
                b = b.when_matched_update(set=MATCHED_SETS[ai][0], condition=cond)
        elif kind == "not_matched":
            cond = NOT_MATCHED_CONDS[ci][0]
            vals = INSERTS[ai][0]
            b = (
                b.when_not_matched_insert_all(condition=cond)
                if vals is None
                else b.when_not_matched_insert(values=vals, condition=cond)
            )
        else:
            cond = BY_SOURCE_CONDS[ci][0]
            b = (
                b.when_not_matched_by_source_delete(condition=cond)
                if ai < 0
                else b.when_not_matched_by_source_update(set=BY_SOURCE_SETS[ai][0], condition=cond)
            )
    return b


def model(
    target: dict[int, Row], source: dict[int, Row], clauses: list[tuple[str, int, int]]
) -> tuple[dict[int, Row], tuple[int, int, int, int]]:
    """Delta's semantics in plain Python: (the new rows, (inserted, updated, deleted,
    unchanged))."""

    def d(i: int, r: Row) -> dict[str, Any]:
        return {"id": i, "v": r[0], "n": r[1], "flag": r[2]}

    out = dict(target)
    ins = upd = dele = same = 0
    for i, trow in target.items():
        t = d(i, trow)
        s = d(i, source[i]) if i in source else None
        kind = "matched" if s is not None else "not_matched_by_source"
        for k, ci, ai in clauses:
            if k != kind:
                continue
            conds = MATCHED_CONDS if kind == "matched" else BY_SOURCE_CONDS
            if not conds[ci][1](s, t):
                continue
            if ai < 0:
                del out[i]
                dele += 1
            else:
                new = dict(t)
                new.update(
                    MATCHED_SETS[ai][1](s, t) if kind == "matched" else BY_SOURCE_SETS[ai][1](t)
                )
                row = (new["v"], new["n"], new["flag"])
                if row == trow:
                    same += 1
                else:
                    out[i] = row
                    upd += 1
            break
    for i, srow in source.items():
        if i in target:
            continue
        s = d(i, srow)
        for k, ci, ai in clauses:
            if k == "not_matched" and NOT_MATCHED_CONDS[ci][1](s, None):
                new = INSERTS[ai][1](s)
                out[i] = (new["v"], new["n"], new["flag"])
                ins += 1
                break
    return out, (ins, upd, dele, same)


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def merge_client(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[PersistClient]:
    if request.param == "memory":
        url = "memory://"
    elif request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'stash.db'}"
    else:
        from tests.support.dbutil import migrate_to_head

        url = str(request.getfixturevalue("postgres_url"))
        migrate_to_head(url)
    s = Stash.open(url, fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="inline")
    try:
        yield c
    finally:
        c.close()
        s.close()


@pytest.mark.sized
@given(target=table_st, source=table_st, clauses=clauses_st())
@settings(
    max_examples=runs(25, 200),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_merge_equals_the_model(
    merge_client: PersistClient,
    target: dict[int, Row],
    source: dict[int, Row],
    clauses: list[tuple[str, int, int]],
) -> None:
    w, r = merge_client.open(f"s{uuid.uuid4().hex}", KEY, VAL)
    w.upsert(rows(target))
    expected, (ins, upd, dele, same) = model(target, source, clauses)
    m = build(w.merge(rows(source)), clauses).execute()
    assert (m.num_target_rows_inserted, m.num_target_rows_updated) == (ins, upd)
    assert (m.num_target_rows_deleted, m.num_target_rows_unchanged) == (dele, same)
    assert m.num_source_rows == len(source)
    upper = w.fetch_recent_upper().as_option()
    assert upper is not None
    # a merge that changes nothing commits nothing: its time is the upper before it - 1
    assert m.time == upper - 1
    got = live(r, m.time) if upper > 0 else {}
    assert got == {k: (v, 1) for k, v in expected.items()}


# ------------------------------------------------------------------ processes
def _merge_worker(url: str, blob: str, rounds: int) -> None:
    s = Stash.open(url, fenced=False)
    c = PersistClient(s, blob)
    w, _ = c.open("counter", KEY, VAL)
    src = rows({i: (None, 1, None) for i in range(4)})
    for _ in range(rounds):
        (
            w.merge(src)
            .when_matched_update(set={"n": "target.n + source.n"})
            .when_not_matched_insert_all()
            .execute()
        )
    c.close()
    s.close()


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def test_four_processes_merging_lose_no_update(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'stash.db'}"
        Stash.open(url).close()
    else:
        from tests.support.dbutil import migrate_to_head

        url = str(request.getfixturevalue("postgres_url"))
        migrate_to_head(url)
    blob = f"file://{tmp_path / 'blob'}"
    rounds = 3
    ctx = process_context()
    procs = [ctx.Process(target=_merge_worker, args=(url, blob, rounds)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    s = Stash.open(url, fenced=False)
    c = PersistClient(s, blob)
    w, r = c.open("counter", KEY, VAL)
    got = live(r, w.fetch_recent_upper().as_option() - 1)
    # the first merge to land inserts n=1; every later one adds 1: 20 merges in all
    assert got == {i: ((None, 4 * rounds, None), 1) for i in range(4)}
    c.close()
    s.close()


# ------------------------------------------------------------------ transactions
def test_txn_merge_commits_with_the_transaction(client: PersistClient) -> None:
    from persist import RowChanges

    wa, ra = client.open("a", KEY, VAL)
    wb, rb = client.open("b", KEY, VAL)
    wa.upsert(rows({1: ("a", 1, None), 2: ("b", 2, None)}))
    stash = client.stash
    cat = stash.collection("catalog", key="str", value="json")
    with client.begin() as txn:
        txn.merge(
            "a", rows({2: ("B", 2, None), 3: ("c", 3, None)})
        ).when_matched_update_all().when_not_matched_insert_all().execute()
        txn.upsert("b", rows({9: ("z", 9, None)}))
        # two changes to one shard apply in order: the merge sees the upsert
        txn.upsert("a", rows({4: ("d", 4, None)}))
        txn.merge("a", rows({4: ("D", 4, None)})).when_matched_update(
            set={"v": "source.v"}
        ).execute()
        cb = cat.make_batch(stash)
        cat.append_to_batch(cb, "a", {"merged": True}, 1)
        txn.stash_append([cb])
    ts = txn.committed_ts
    assert ts is not None
    assert live(ra, ts) == {
        1: (("a", 1, None), 1),
        2: (("B", 2, None), 1),
        3: (("c", 3, None), 1),
        4: (("D", 4, None), 1),
    }
    assert live(rb, ts) == {9: (("z", 9, None), 1)}
    assert stash.peek_one(cat) == {"a": {"merged": True}}
    first, second = txn.merge_results()
    assert (first.num_target_rows_updated, first.num_target_rows_inserted) == (1, 1)
    assert (second.time, second.num_target_rows_updated) == (ts, 1)
    assert txn.row_changes()[0] == RowChanges(ts, 2, 1)


def test_txn_merge_refused_at_commit_commits_nothing(client: PersistClient) -> None:
    wa, _ = client.open("a", KEY, VAL)
    wb, _ = client.open("b", KEY, VAL)
    wa.upsert(rows({1: ("a", 1, None)}))
    before = (wa.fetch_recent_upper(), wb.fetch_recent_upper())
    txn = client.begin()
    txn.upsert("b", rows({9: ("z", 9, None)}))
    txn.merge("a", rows({1: ("x", 1, None)})).when_matched_update(set={"n": "'text'"}).execute()
    with pytest.raises(InvalidUsage, match="within its kind"):
        txn.commit()
    txn.abort()
    assert (wa.fetch_recent_upper(), wb.fetch_recent_upper()) == before
    with pytest.raises(InvalidUsage, match="no column 'id'"):
        client.begin().merge("a", pa.table({"x": [1]})).when_matched_delete().execute()


# ------------------------------------------------------------------ the table
def test_table_merge_and_its_history(client: PersistClient) -> None:
    import json

    t = client.create_table("orders", SCHEMA, key=["id"])
    t.append(rows({1: ("a", 1, None), 2: ("b", 2, None)}))
    m = (
        t.merge(rows({2: ("B", 2, None), 3: ("c", 3, None)}), source_alias="s", target_alias="t")
        .when_matched_update_all(condition="s.v <> t.v")
        .when_not_matched_insert_all()
        .execute()
    )
    assert (m.num_target_rows_updated, m.num_target_rows_inserted) == (1, 1)
    got = t.to_arrow().sort_by("id").select(["id", "v"]).to_pylist()
    assert got == [{"id": 1, "v": "a"}, {"id": 2, "v": "B"}, {"id": 3, "v": "c"}]
    (h,) = t.history(limit=1).to_pylist()
    assert (h["operation"], h["time"]) == ("merge", m.time)
    params = json.loads(h["parameters"])
    assert params["predicate"] == "s.id = t.id"
    assert params["clauses"][0] == {
        "clause": "when_matched_update",
        "condition": "s.v <> t.v",
        "all": True,
    }
    metrics = json.loads(h["metrics"])
    assert metrics["num_target_rows_updated"] == 1
    assert metrics["num_target_rows_inserted"] == 1
    assert (metrics["rows_inserted"], metrics["rows_retracted"]) == (2, 1)
