"""Transactions (``persist/txn.py``), property test: random sequences of multi-shard
transactions, single-shard appends and plain stash appends on 3 shards and 2 stash
collections, checked after every step against a reference model (contents of every shard as
of every definite time, every upper, the collections' contents), on the memory, SQLite and
Postgres stashes.

A transaction committed at a time below some shard's upper must raise TxnUpperMismatch
naming exactly those shards, and change nothing anywhere."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist import InvalidUsage, MemoryBlob, PersistClient, TxnUpperMismatch
from stash import Antichain, Stash
from tests.support.dbutil import migrate_to_head

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])
SHARDS = ("s0", "s1", "s2")
COLLS = ("c0", "c1")

keys = st.sampled_from(["a", "b", "c"])
row = st.tuples(keys, st.integers(0, 2), st.sampled_from([1, 1, 2, -1]))
rows = st.lists(row, max_size=4)

txn_op = st.tuples(
    st.just("txn"),
    st.dictionaries(st.sampled_from(SHARDS), rows, min_size=0, max_size=3),
    st.dictionaries(st.sampled_from(COLLS), st.tuples(keys, st.integers(0, 9)), max_size=2),
    st.one_of(st.none(), st.integers(-2, 3)),  # None: commit(); k: commit_at(max upper + k)
    st.sets(st.sampled_from(SHARDS)),  # shards written with their own times (time_column)
)
append_op = st.tuples(st.just("append"), st.sampled_from(SHARDS), rows, st.integers(1, 3))
stash_op = st.tuples(st.just("stash"), st.sampled_from(COLLS), keys, st.integers(0, 9))
ops = st.lists(st.one_of(txn_op, append_op, stash_op), min_size=1, max_size=10)


@dataclass
class Model:
    updates: dict[str, list[tuple[str, int, int, int]]] = field(
        default_factory=lambda: {s: [] for s in SHARDS}
    )
    uppers: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SHARDS, 0))
    colls: dict[str, dict[str, int]] = field(default_factory=lambda: {c: {} for c in COLLS})

    def at(self, shard: str, t: int) -> Counter[tuple[str, int]]:
        out: Counter[tuple[str, int]] = Counter()
        for k, v, time, d in self.updates[shard]:
            if time <= t:
                out[(k, v)] += d
        return Counter({kv: n for kv, n in out.items() if n != 0})


def contents(table: pa.Table) -> Counter[tuple[str, int]]:
    out: Counter[tuple[str, int]] = Counter()
    for r in table.to_pylist():
        out[(r["k"], r["v"])] += r["_diff"]
    return out


def table_of(rs: list[tuple[str, int, int]]) -> pa.Table:
    return pa.table(
        {
            "k": pa.array([r[0] for r in rs], pa.string()),
            "v": pa.array([r[1] for r in rs], pa.int64()),
            "_diff": pa.array([r[2] for r in rs], pa.int64()),
        }
    )


def run_ops(open_stash: Callable[[], Stash], sequence: list[Any]) -> None:
    stash = open_stash()
    pre = "p" + uuid.uuid4().hex[:8]
    client = PersistClient(stash, MemoryBlob(), compaction="inline", inline_max_bytes=0)
    try:
        names = {s: f"{pre}.{s}" for s in SHARDS}
        writers = {s: client.open(names[s], KS, VS)[0] for s in SHARDS}
        colls = {c: stash.collection(f"{pre}.{c}", key="str", value="int") for c in COLLS}
        model = Model()
        for op in sequence:
            if op[0] == "txn":
                _, writes, cat, mode, timed = op
                txn = client.begin()
                times: dict[str, list[int]] = {}
                for s, rs in writes.items():
                    if s in timed:
                        # Row i at the shard's upper + i % 3: times the txn keeps.
                        times[s] = [model.uppers[s] + i % 3 for i in range(len(rs))]
                        t = table_of(rs).append_column("t", pa.array(times[s], pa.int64()))
                        txn.write(names[s], t, time_column="t")
                    else:
                        txn.write(names[s], table_of(rs))
                batches = []
                for c, (k, v) in cat.items():
                    b = colls[c].make_batch(stash)
                    colls[c].append_to_batch(b, k, v, 1)
                    if k in model.colls[c]:
                        colls[c].append_to_batch(b, k, model.colls[c][k], -1)
                    batches.append(b)
                txn.stash_append(batches)
                top = max(
                    [model.uppers[s] for s in writes] + [max(v) for v in times.values() if v] or [0]
                )
                if mode is None or not writes:
                    ts = txn.commit()
                    if writes:
                        assert ts == top
                else:
                    ts = top + mode
                    if any(v and max(v) > ts for v in times.values()):
                        with pytest.raises(InvalidUsage, match="after the commit time"):
                            txn.commit_at(ts)
                        check(client, stash, names, colls, model)
                        txn.abort()
                        continue
                    beyond = {names[s]: model.uppers[s] for s in writes if model.uppers[s] > ts}
                    if beyond:
                        with pytest.raises(TxnUpperMismatch) as e:
                            txn.commit_at(ts)
                        assert {n: u.as_option() for n, u in e.value.shards.items()} == beyond
                        check(client, stash, names, colls, model)
                        txn.abort()
                        continue
                    assert txn.commit_at(ts) == ts
                for s, rs in writes.items():
                    at = times.get(s, [ts] * len(rs))
                    model.updates[s].extend(
                        (k, v, t, d) for (k, v, d), t in zip(rs, at, strict=True)
                    )
                    model.uppers[s] = ts + 1
                for c, (k, v) in cat.items():
                    model.colls[c][k] = v
            elif op[0] == "append":
                _, s, rs, width = op
                lo = model.uppers[s]
                upd = [(((k,), (v,)), lo + i % width, d) for i, (k, v, d) in enumerate(rs)]
                writers[s].compare_and_append(upd, lo, lo + width)
                model.updates[s].extend((k, v, lo + i % width, d) for i, (k, v, d) in enumerate(rs))
                model.uppers[s] = lo + width
            else:
                _, c, k, v = op
                b = colls[c].make_batch(stash)
                colls[c].append_to_batch(b, k, v, 1)
                if k in model.colls[c]:
                    colls[c].append_to_batch(b, k, model.colls[c][k], -1)
                stash.append([b])
                model.colls[c][k] = v
            check(client, stash, names, colls, model)
    finally:
        client.close()
        stash.close()


def check(
    client: PersistClient,
    stash: Stash,
    names: dict[str, str],
    colls: dict[str, Any],
    model: Model,
) -> None:
    for s in SHARDS:
        assert client.inspect(names[s]).upper == Antichain.from_elem(model.uppers[s])
    written = [s for s in SHARDS if model.uppers[s] > 0]
    if written:
        # One consistent read at the latest time definite in all written shards, and
        # each shard at its own latest time.
        common = min(model.uppers[s] for s in written) - 1
        snap = client.snapshot_many([names[s] for s in written])
        for s in written:
            assert contents(snap[names[s]]) == model.at(s, common), s
        own = client.snapshot_many({names[s]: model.uppers[s] - 1 for s in written})
        for s in written:
            assert contents(own[names[s]]) == model.at(s, model.uppers[s] - 1), s
    for c in COLLS:
        got: dict[str, int] = {}
        for (k, v), _t, d in stash.iter(colls[c]):
            assert d == 1
            got[k] = v
        assert got == model.colls[c]


PROPERTY = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@PROPERTY
@given(sequence=ops)
def test_txn_model_memory(sequence: list[Any]) -> None:
    run_ops(lambda: Stash.open("memory://", fenced=False), sequence)


@pytest.fixture
def sqlite_url(tmp_path: Any) -> Iterator[str]:
    yield f"sqlite:///{tmp_path}/stash.db"


@settings(PROPERTY, max_examples=8)
@given(sequence=ops)
def test_txn_model_sqlite(sqlite_url: str, sequence: list[Any]) -> None:
    run_ops(lambda: Stash.open(sqlite_url, fenced=False), sequence)


@settings(PROPERTY, max_examples=6)
@given(sequence=ops)
def test_txn_model_postgres(postgres_url: str, sequence: list[Any]) -> None:
    migrate_to_head(postgres_url)
    run_ops(lambda: Stash.open(postgres_url, fenced=False), sequence)
