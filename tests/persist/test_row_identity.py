"""Row changes compare keys as consolidation does, on every key type and path, convert
``set`` values exactly, and leave rows equal to their live row alone.

Each test runs through both paths of :mod:`tests.persist.row_paths` (the write handle
and a transaction): key ``-0.0`` is key ``0.0``; ``duration`` keys work; a key swap
that would give one key two live rows is refused, row by row; ``time64[ns]`` keys are
exact to the nanosecond; ``set`` scalars are converted exactly or refused before
anything is staged; a transaction's change through an older handle is a
``SchemaMismatch``; an upsert or update that changes nothing writes nothing and counts
nothing.
"""

from __future__ import annotations

import datetime as dt
import math
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persist import InvalidUsage, MemoryBlob, PersistClient, RowChanges, SchemaMismatch
from persist import rows as rows_mod
from persist.write import WriteHandle
from stash import Stash
from tests.persist.arrow_strategies import COLUMN_TYPES, canonical_rows
from tests.persist.row_paths import PATHS, Path

NAN = float("nan")
INT = pa.int64()


@pytest.fixture()
def client() -> Iterator[PersistClient]:
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off", inline_max_bytes=0)
    try:
        yield c
    finally:
        c.close()
        s.close()


@pytest.fixture(params=PATHS, ids=[name for name, _ in PATHS])
def path(request: pytest.FixtureRequest) -> Path:
    return request.param[1]  # type: ignore[no-any-return]


def _plain(v: Any) -> Any:
    if isinstance(v, float):
        return "NaN" if math.isnan(v) else v + 0.0
    return v


def live(w: WriteHandle) -> Counter[tuple[Any, ...]]:
    """The live rows, temporal values as their stored integers (exact), floats with
    ``-0.0`` made ``0.0`` and NaN a token: ``{row: count}``."""
    t = w.read_live(w.change_state(), None)
    cols = []
    for n in [*w.key_schema.names, *w.value_schema.names]:
        c = t.column(n)
        if pa.types.is_temporal(c.type):
            c = pa.chunked_array([x.view(pa.int64()) for x in c.chunks], pa.int64())
        cols.append([_plain(v) for v in c.to_pylist()])
    diffs = t.column("_diff").to_pylist()
    return Counter(dict(zip(zip(*cols, strict=True), diffs, strict=True)))


def parts(c: PersistClient, name: str) -> int:
    return sum(len(b.parts) for b in c.inspect(name).batches())


def shard(c: PersistClient, key: pa.DataType, value: pa.DataType = INT) -> WriteHandle:
    w, _ = c.open("s", pa.schema([pa.field("k", key)]), pa.schema([pa.field("v", value)]))
    return w


def rows(keys: list[Any], values: list[Any], key: pa.DataType, value: pa.DataType) -> pa.Table:
    return pa.table({"k": pa.array(keys, key), "v": pa.array(values, value)})


# ------------------------------------------------------------------ -0.0 is 0.0
def test_negative_zero_key_replaces_and_collides_with_zero(
    client: PersistClient, path: Path
) -> None:
    f = pa.float64()
    w = shard(client, f)
    path(client, w, ("upsert", rows([0.0, 1.0, NAN], [1, 2, 3], f, pa.int64())))
    ch = path(client, w, ("upsert", rows([-0.0, NAN], [5, 6], f, pa.int64())))
    assert (ch.inserted, ch.retracted) == (2, 2)
    assert live(w) == Counter({(0.0, 5): 1, (1.0, 2): 1, ("NaN", 6): 1})
    with pytest.raises(InvalidUsage, match="of a live row it does not change"):
        path(client, w, ("update", pc.field("k") == 1.0, {"k": -0.0}))
    with pytest.raises(InvalidUsage, match="two rows have one key"):
        path(client, w, ("upsert", rows([0.0, -0.0], [1, 1], f, pa.int64())))
    assert live(w) == Counter({(0.0, 5): 1, (1.0, 2): 1, ("NaN", 6): 1})


# ------------------------------------------------------------------ duration keys
@pytest.mark.parametrize("unit", ["s", "ns"])
def test_duration_keys(client: PersistClient, path: Path, unit: str) -> None:
    d = pa.duration(unit)
    w = shard(client, d)
    path(client, w, ("upsert", rows([1, 2, None], [1, 2, 3], d, pa.int64())))
    ch = path(client, w, ("upsert", rows([2, 3, None], [20, 30, 40], d, pa.int64())))
    assert (ch.inserted, ch.retracted) == (3, 2)
    ch = path(client, w, ("update", pc.field("k") == pa.scalar(3, d), {"k": pa.scalar(4, d)}))
    assert (ch.inserted, ch.retracted) == (1, 1)
    with pytest.raises(InvalidUsage, match="of a live row it does not change"):
        path(client, w, ("update", pc.field("k") == pa.scalar(4, d), {"k": pa.scalar(1, d)}))
    assert live(w) == Counter({(1, 1): 1, (2, 20): 1, (4, 30): 1, (None, 40): 1})


# ------------------------------------------------------------------ key swaps
def test_a_key_swap_giving_a_key_two_live_rows_is_refused(
    client: PersistClient, path: Path
) -> None:
    """(1,a), (1,b), (2,x) from plain appends; swapping the keys of (1,a) and (2,x)
    would leave key 1 with (1,b) and (1,x): refused, per kept row.  Swapping the keys
    of (1,a) and (1,b) with (2,x)'s as a whole is a plain swap and commits."""
    s = pa.string()
    w = shard(client, pa.int64(), s)
    w.compare_and_append(
        [(((1,), ("a",)), 0, 1), (((1,), ("b",)), 0, 1), (((2,), ("x",)), 0, 1)], 0, 1
    )
    before = live(w)
    swap = {"k": pc.if_else(pc.field("k") == 1, 2, 1)}
    chosen = ((pc.field("k") == 1) & (pc.field("v") == "a")) | (pc.field("k") == 2)
    with pytest.raises(InvalidUsage, match=r"of a live row it does not change"):
        path(client, w, ("update", chosen, swap))
    assert live(w) == before
    ch = path(client, w, ("update", pc.field("k").isin([1, 2]), swap))
    assert (ch.inserted, ch.retracted) == (3, 3)
    assert live(w) == Counter({(2, "a"): 1, (2, "b"): 1, (1, "x"): 1})


def test_two_keys_merged_by_an_update_are_refused(client: PersistClient, path: Path) -> None:
    w = shard(client, pa.int64())
    path(client, w, ("upsert", rows([1, 2], [1, 2], pa.int64(), pa.int64())))
    with pytest.raises(InvalidUsage, match=r"two updated rows would get one key \['k'\] = \[7\]"):
        path(client, w, ("update", pc.field("k").isin([1, 2]), {"k": 7}))
    assert live(w) == Counter({(1, 1): 1, (2, 2): 1})


# ------------------------------------------------------------------ time64[ns]
def test_time64_ns_keys_are_exact(client: PersistClient, path: Path) -> None:
    t = pa.time64("ns")
    w = shard(client, t)
    ch = path(client, w, ("upsert", rows([500, 700, None], [1, 2, 3], t, pa.int64())))
    assert (ch.inserted, ch.retracted) == (3, 0)
    path(client, w, ("upsert", rows([700], [7], t, pa.int64())))
    assert live(w) == Counter({(500, 1): 1, (700, 7): 1, (None, 3): 1})
    with pytest.raises(InvalidUsage, match="of a live row it does not change"):
        path(client, w, ("update", pc.field("k") == pa.scalar(700, t), {"k": pa.scalar(500, t)}))
    with pytest.raises(InvalidUsage, match="two rows have one key"):
        path(client, w, ("upsert", rows([900, 900], [1, 2], t, pa.int64())))


# ------------------------------------------------------------------ set scalars
@pytest.mark.parametrize(
    ("value", "column", "why"),
    [
        (1.9, pa.int64(), "truncated"),
        (2**70, pa.int64(), "does not fit"),
        ("x", pa.int64(), "convert"),
        (True, pa.int64(), "integer"),
        (1e300, pa.float32(), "overflows"),
        (dt.timedelta(microseconds=1), pa.duration("s"), "lose data"),
        (pa.scalar("5"), pa.int64(), "does not fit"),
        (pa.scalar(1.5), pa.int32(), "truncated"),
    ],
)
def test_set_scalars_are_converted_exactly_or_refused(
    client: PersistClient, path: Path, value: Any, column: pa.DataType, why: str
) -> None:
    w = shard(client, pa.int64(), column)
    refused = f"column 'v'.*{why}|{why}.*column 'v'"
    with pytest.raises(InvalidUsage, match=refused):  # even when no row matches
        path(client, w, ("update", pc.field("k") == 1, {"v": value}))
    w.compare_and_append([(((1,), (None,)), 0, 1)], 0, 1)
    with pytest.raises(InvalidUsage, match=refused):
        path(client, w, ("update", pc.field("k") == 1, {"v": value}))
    assert live(w) == Counter({(1, None): 1})


def test_exact_set_scalars_are_taken(client: PersistClient, path: Path) -> None:
    w, _ = client.open(
        "s",
        pa.schema([pa.field("k", pa.int64())]),
        pa.schema(
            [
                pa.field("i", pa.int8()),
                pa.field("f", pa.float32()),
                pa.field("d", pa.decimal128(5, 2)),
                pa.field("u", pa.uint64()),
            ]
        ),
    )
    w.compare_and_append([(((1,), (None, None, None, None)), 0, 1)], 0, 1)
    ch = path(
        client, w, ("update", pc.field("k") == 1, {"i": 3.0, "f": 0.5, "d": 5, "u": 2**64 - 1})
    )
    assert (ch.inserted, ch.retracted) == (1, 1)
    t = w.read_live(w.change_state(), None)
    assert t.select(["i", "f", "d", "u"]).to_pylist() == [
        {"i": 3, "f": 0.5, "d": pa.scalar(5, pa.decimal128(5, 2)).as_py(), "u": 2**64 - 1}
    ]


def test_a_bad_set_scalar_in_a_txn_is_refused_before_anything_is_staged(
    client: PersistClient,
) -> None:
    """``2**70`` for an int64 column: ``InvalidUsage`` from ``Txn.update`` itself (not an
    ``OverflowError`` at commit, which left the transaction "may have landed"); the
    transaction's other changes then commit."""
    w = shard(client, pa.int64())
    w.upsert(rows([1], [1], pa.int64(), pa.int64()))
    with client.begin() as txn:
        txn.update(w, pc.field("k") == 1, {"v": 2})
        with pytest.raises(InvalidUsage, match="column 'v'"):
            txn.update(w, pc.field("k") == 1, {"v": 2**70})
        assert not txn._maybe_landed
    assert live(w) == Counter({(1, 2): 1})


# ------------------------------------------------------------------ older handle in a Txn
def test_an_older_handle_in_a_txn_is_a_schema_mismatch(client: PersistClient) -> None:
    key = pa.schema([pa.field("k", pa.int64())])
    old, _ = client.open("s", key, pa.schema([pa.field("v", pa.int64())]))
    old.upsert(rows([1], [1], pa.int64(), pa.int64()))
    new, _ = client.open(
        "s", key, pa.schema([pa.field("v", pa.int64()), pa.field("n", pa.string())])
    )
    txn = client.begin()
    txn.update("s", pc.field("k") == 1, {"v": 2})  # by name: the newest version
    with pytest.raises(SchemaMismatch, match=r"'s'.*newest schema version 1.*version 0"):
        txn.upsert(old, rows([2], [2], pa.int64(), pa.int64()))
    txn.commit()  # the change by name is kept and commits
    assert live(new) == Counter({(1, 2, None): 1})


# ------------------------------------------------------------------ changes that change nothing
def test_an_upsert_or_update_that_changes_nothing_writes_nothing(
    client: PersistClient, path: Path
) -> None:
    """Rows equal to their live row (NaN equal to NaN, ``-0.0`` to ``0.0``, nulls equal)
    are left alone: no retraction, no insertion, no part; the counts are the real
    changes only."""
    f = pa.float64()
    w = shard(client, pa.int64(), f)
    path(client, w, ("upsert", rows([1, 2, 3, 4], [NAN, 0.0, None, 1.5], pa.int64(), f)))
    before, n = live(w), parts(client, "s")
    same = rows([1, 2, 3, 4], [NAN, -0.0, None, 1.5], pa.int64(), f)
    assert path(client, w, ("upsert", same)).inserted == 0
    ch = path(client, w, ("upsert", same))
    assert (ch.inserted, ch.retracted) == (0, 0)
    ch = path(client, w, ("update", pc.field("k") == 4, {"v": 1.5}))
    assert (ch.inserted, ch.retracted) == (0, 0)
    ch = path(client, w, ("update", pc.field("k") > 0, {"v": pc.field("v")}))
    assert (ch.inserted, ch.retracted) == (0, 0)
    assert parts(client, "s") == n and live(w) == before
    # one real change among equal rows counts one row each way, and writes one part
    ch = path(client, w, ("upsert", rows([1, 2, 3, 4], [NAN, 0.0, 9.0, 1.5], pa.int64(), f)))
    assert (ch.inserted, ch.retracted) == (1, 1)
    assert parts(client, "s") == n + 1


def test_a_handle_change_that_changes_nothing_commits_nothing(client: PersistClient) -> None:
    """Not even a new state version: the upper stays; the time returned is ``upper -
    1``, as of which the shard already shows the result."""
    w = shard(client, pa.int64())
    first = w.upsert(rows([1, 2], [1, 2], pa.int64(), pa.int64()))
    seqno = client.inspect("s").seqno
    again = w.upsert(rows([1, 2], [1, 2], pa.int64(), pa.int64()))
    assert again == RowChanges(first.time, 0, 0)
    assert client.inspect("s").seqno == seqno
    assert w.update(pc.field("k") == 1, {"v": 1}) == RowChanges(first.time, 0, 0)


def test_a_duplicated_live_row_is_brought_to_one(client: PersistClient, path: Path) -> None:
    """A live row with count 2 (raw appends) upserted as is: one copy retracted, none
    inserted."""
    w = shard(client, pa.int64())
    w.compare_and_append([(((1,), (1,)), 0, 2)], 0, 1)
    ch = path(client, w, ("upsert", rows([1], [1], pa.int64(), pa.int64())))
    assert (ch.inserted, ch.retracted) == (0, 1)
    assert live(w) == Counter({(1, 1): 1})


def test_a_rerun_of_a_txn_upsert_writes_nothing(client: PersistClient) -> None:
    """The main job's catalog step (``spark/jobs/flights.py``): one transaction upserts
    the whole planes table into its shard, with the catalog's stash batches (none on a
    re-run).  Run again on the same rows it writes nothing: no part, no state version,
    no upper moved; the transaction commits at the time asked for and counts nothing."""
    f = pa.float64()
    planes = pa.table(
        {
            "tailnum": pa.array(["N1", "N2", "N3"], pa.string()),
            "year": pa.array([2001, None, 1999], pa.int64()),
            "speed": pa.array([NAN, 1.5, None], f),
        }
    )
    key = pa.schema([pa.field("tailnum", pa.string(), False)])
    client.open("planes", key, pa.schema([planes.schema.field(n) for n in ("year", "speed")]))
    client.open("other", pa.schema([pa.field("k", INT)]), pa.schema([pa.field("v", INT)]))

    def run() -> int:
        with client.begin() as txn:
            txn.stash_append([])
            txn.upsert("planes", planes)
        assert txn.committed_ts is not None
        return txn.committed_ts

    run()
    state = client.inspect("planes")
    n = parts(client, "planes")
    ts = run()
    assert ts == state.upper.as_option()
    assert client.inspect("planes").seqno == state.seqno and parts(client, "planes") == n
    # two shards, both unchanged: nothing either; one changed: both commit
    with client.begin() as txn:
        txn.upsert("planes", planes)
        txn.delete("other", pc.field("k") == 1)
    assert txn.row_changes() == [RowChanges(ts, 0, 0), RowChanges(ts, 0, 0)]
    assert client.inspect("planes").seqno == state.seqno
    with client.begin() as txn:
        txn.upsert("planes", planes)
        txn.upsert("other", rows([1], [1], INT, INT))
    assert client.inspect("planes").upper.as_option() == txn.committed_ts + 1
    assert parts(client, "planes") == n


@settings(max_examples=150, deadline=None)
@given(
    updates=st.lists(
        st.tuples(
            st.sampled_from([0.0, -0.0, NAN, 1.0, None]),
            st.sampled_from([1, 2, None]),
            st.sampled_from([NAN, 0.0, -0.0, None]),
            st.sampled_from([-2, -1, 1, 2]),
        ),
        max_size=12,
    ),
    split=st.integers(0, 12),
)
def test_net_changes_compares_only_what_may_cancel_and_counts_as_consolidation(
    updates: list[tuple[Any, Any, Any, int]], split: int
) -> None:
    """:func:`persist.rows.net_changes` consolidates only the same-key retraction and
    insertion pairs that are equal; the result sums to the full consolidation's rows,
    every row that can cancel is cancelled, and the counts are the same."""
    t = pa.table(
        {
            "k": pa.array([u[0] for u in updates], pa.float64()),
            "j": pa.array([u[1] for u in updates], pa.int64()),
            "v": pa.array([u[2] for u in updates], pa.float64()),
            "_diff": pa.array([u[3] for u in updates], pa.int64()),
        }
    )
    parts = [t.slice(0, split), t.slice(split)]
    quick = rows_mod.net_changes(parts, ["k", "j"], ["v"])
    full = rows_mod.net_changes(parts, ["k", "j"], ["v"], consolidated=True)
    assert (quick.inserted, quick.retracted) == (full.inserted, full.retracted)

    def summed(x: pa.Table) -> Counter[tuple[Any, ...]]:
        out: Counter[tuple[Any, ...]] = Counter()
        for row, d in zip(canonical_rows(x, ["k", "j", "v"]), x["_diff"].to_pylist(), strict=True):
            out[row] += d
        return out

    assert summed(quick.updates) == summed(full.updates)
    signs: dict[tuple[Any, ...], set[bool]] = {}
    for row, d in zip(
        canonical_rows(quick.updates, ["k", "j", "v"]),
        quick.updates["_diff"].to_pylist(),
        strict=True,
    ):
        signs.setdefault(row, set()).add(d > 0)
    assert all(len(s) == 1 for s in signs.values())  # nothing left that could cancel


@pytest.mark.parametrize(
    "t", [pa.duration("ms"), pa.duration("s"), pa.time64("ns"), pa.timestamp("ns")]
)
def test_a_duplicate_key_message_shows_extreme_temporal_keys_exactly(
    client: PersistClient, path: Path, t: pa.DataType
) -> None:
    """A key Python cannot hold (a duration of 2**62 ms) or would truncate (7 ns) is
    named exactly in the refusal, not an ``OverflowError``."""
    w = shard(client, t)
    big = -(2**62) if pa.types.is_duration(t) else 7
    keys = pa.array([big, big], pa.int64()).view(t)
    with pytest.raises(InvalidUsage, match="two rows have one key") as e:
        path(client, w, ("upsert", pa.table({"k": keys, "v": pa.array([1, 2], INT)})))
    assert str(big) in str(e.value) or "00:00:00.000000007" in str(e.value)


_any_value = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1.9, -0.0, 2.0**53 + 2, 1e300, 0.5]),
    st.text(max_size=3),
    st.binary(max_size=4),
    st.decimals(allow_nan=False, allow_infinity=False, places=3),
    st.timedeltas(),
    st.datetimes(),
    st.times(),
    st.dates(),
)


@settings(max_examples=300, deadline=None)
@given(value=_any_value, t=st.sampled_from(COLUMN_TYPES), nullable=st.booleans())
def test_set_scalar_is_exact_or_invalid_usage(value: Any, t: pa.DataType, nullable: bool) -> None:
    """Any Python value for any column type: a scalar of that type holding the value
    exactly (numbers compared as numbers; a float32 column takes the nearest float32,
    not an overflow to infinity), or ``InvalidUsage``; never another error."""
    try:
        out = rows_mod.set_scalar(value, pa.field("v", t, nullable), "v")
    except InvalidUsage:
        return
    assert out.type == t
    if value is None:
        assert not out.is_valid and nullable
    elif isinstance(value, int | float) and not isinstance(value, bool):
        if pa.types.is_integer(t) or pa.types.is_floating(t):
            got = out.as_py()
            want = float(np.float32(value)) if t == pa.float32() else value  # rounded
            assert got == want or (math.isnan(got) and math.isnan(value))
