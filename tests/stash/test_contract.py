"""The stash contract suite: every test runs unchanged on every backend (memory, memory
over SQLite, SQLite, Postgres). Messages are checked to the letter (``stash/errors.py``:
every one starts ``stash error: ``)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from stash import (
    Antichain,
    AppendBatch,
    AppendLowerMismatch,
    PeekSinceUpperError,
    Stash,
    StashError,
    TableTransaction,
    TypedCollection,
    UniquenessViolation,
)
from stash.antichain import I64_MAX
from tests.stash.conftest_helpers import tick

A = Antichain.from_elem
EMPTY = Antichain()


def err(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    return str(excinfo.value)


# --------------------------------------------------------------- collections
def test_new_collection_is_empty_with_zero_frontiers(stash: Stash) -> None:
    c = stash.collection("orders")
    assert stash.since(c) == A(0)
    assert stash.upper(c) == A(0)
    assert stash.iter(c) == []
    assert "orders" in stash.collections()
    with pytest.raises(PeekSinceUpperError) as e:
        stash.peek(c)
    assert err(e) == "stash error: collection orders since {0} is not less than upper {0}"
    assert stash.peek_one(c) == {}  # nothing was ever appended: empty
    assert stash.peek_key_one(c, "k") is None
    # The frontiers the peek read travel with the error, so a caller decides on them.
    assert (e.value.since, e.value.upper) == (A(0), A(0))
    assert e.value.never_written()


def test_collection_handles_share_state(open_stash) -> None:  # type: ignore[no-untyped-def]
    s1, s2 = open_stash(), open_stash()
    c1, c2 = s1.collection("orders"), s2.collection("orders")
    assert c1.id == c2.id
    s1.update(c1, ("k", "v"), 0, 1)
    s1.seal(c1, A(1))
    assert s2.peek(c2) == [("k", "v", 1)]


@pytest.mark.parametrize("name", ["", "x" * 256, "bad\x00name", "tab\tname", 7])
def test_bad_collection_name_is_rejected_and_creates_nothing(stash: Stash, name: object) -> None:
    with pytest.raises(StashError) as e:
        stash.collection(name)  # type: ignore[arg-type]
    assert str(e.value).startswith("stash error: collection name")
    assert stash.collections() == {}


def test_name_of_255_characters_is_accepted(stash: Stash) -> None:
    name = "n" * 255
    c = stash.collection(name)
    assert stash.collections()[name].id == c.id


def test_reopen_with_other_codecs_names_both(open_stash) -> None:  # type: ignore[no-untyped-def]
    s = open_stash()
    s.collection("ids", key="int", value="str")
    s2 = open_stash()
    with pytest.raises(StashError) as e:
        s2.collection("ids", key="json", value="str")
    assert "key=int, value=str" in err(e) and "key=json, value=str" in err(e)
    assert s2.collection("ids", key=int, value=str).key_codec.name == "int"


def test_sql_injection_in_names_keys_values_is_data(stash: Stash) -> None:
    evil = "x'); DROP TABLE data; --"
    c = stash.collection(evil)
    stash.update(c, ({"k": evil}, evil), 0, 1)
    stash.seal(c, A(1))
    assert stash.peek(c) == [({"k": evil}, evil, 1)]
    assert evil in stash.collections()


# ------------------------------------------------------------- update / seal
def test_update_then_seal_then_peek(stash: Stash) -> None:
    c = stash.collection("c")
    stash.update(c, ("a", 1), 0, 1)
    stash.update_many(c, [(("b", 2), 1, 1), (("a", 1), 2, 1), (("c", 3), 5, 1)])
    stash.seal(c, A(3))
    assert stash.peek_timestamp(c) == 2
    assert stash.peek(c) == [("a", 1, 2), ("b", 2, 1)]
    assert stash.iter(c) == [(("a", 1), 0, 1), (("a", 1), 2, 1), (("b", 2), 1, 1), (("c", 3), 5, 1)]
    assert stash.iter_key(c, "a") == [(1, 0, 1), (1, 2, 1)]


def test_entry_time_before_upper_is_rejected_and_nothing_written(stash: Stash) -> None:
    c = stash.collection("c")
    stash.seal(c, A(3))
    with pytest.raises(StashError) as e:
        stash.update_many(c, [(("ok", 1), 3, 1), (("late", 1), 2, 1)])
    assert err(e) == "stash error: entry time 2 is less than the current upper frontier {3}"
    stash.seal(c, A(4))
    assert stash.peek(c) == []


def test_seal_backwards_is_rejected(stash: Stash) -> None:
    c = stash.collection("c")
    stash.seal(c, A(3))
    with pytest.raises(StashError) as e:
        stash.seal(c, A(2))
    assert err(e) == "stash error: seal request {2} is less than the current upper frontier {3}"
    assert stash.upper(c) == A(3)


def test_seal_batch_is_atomic(stash: Stash) -> None:
    a, b = stash.collection("a"), stash.collection("b")
    stash.seal(b, A(5))
    with pytest.raises(StashError):
        stash.seal_batch([(a, A(3)), (b, A(4))])
    assert stash.upper(a) == A(0)
    stash.seal_batch([(a, A(3)), (b, A(6))])
    assert (stash.upper(a), stash.upper(b)) == (A(3), A(6))


def test_empty_upper_frontier(stash: Stash) -> None:
    c = stash.collection("c")
    stash.update(c, ("k", "v"), 7, 1)
    stash.seal(c, EMPTY)
    assert stash.upper(c) == EMPTY
    assert stash.peek_timestamp(c) == I64_MAX
    assert stash.peek(c) == [("k", "v", 1)]
    with pytest.raises(StashError) as e:
        stash.update(c, ("k", "v"), 8, 1)
    assert err(e) == "stash error: entry time 8 is less than the current upper frontier {}"
    stash.seal(c, EMPTY)  # sealing to {} again is fine
    with pytest.raises(StashError) as e2:
        c.make_batch(stash)
    assert err(e2) == "stash error: cannot determine batch timestamp"


# ---------------------------------------------------------------- compaction
def test_compact_rules(stash: Stash) -> None:
    c = stash.collection("c")
    stash.seal(c, A(3))
    stash.compact(c, A(2))
    with pytest.raises(StashError) as e:
        stash.compact(c, A(1))
    assert err(e) == "stash error: compact request {1} is less than the current since frontier {2}"
    with pytest.raises(StashError) as e:
        stash.compact(c, A(4))
    assert (
        err(e) == "stash error: compact request {4} is greater than the current upper frontier {3}"
    )
    assert stash.since(c) == A(2)


def test_compact_advances_times_and_consolidate_keeps_contents(stash: Stash) -> None:
    c = stash.collection("c")
    stash.update_many(
        c,
        [(("a", 1), 0, 1), (("a", 1), 1, 1), (("b", 1), 1, 1), (("b", 1), 2, -1), (("x", 9), 4, 1)],
    )
    stash.seal(c, A(4))
    stash.compact(c, A(3))
    before = stash.iter(c)
    assert before == [(("a", 1), 3, 2), (("x", 9), 4, 1)]
    stash.consolidate(c)
    assert stash.iter(c) == before
    assert stash.peek(c) == [("a", 1, 2)]
    stash.consolidate_batch([c])
    assert stash.iter(c) == before


def test_compact_batch_and_empty_since(stash: Stash) -> None:
    c = stash.collection("c")
    stash.update(c, ("a", 1), 0, 1)
    stash.seal(c, EMPTY)
    stash.compact_batch([(c, EMPTY)])
    assert stash.since(c) == EMPTY
    with pytest.raises(StashError) as e:
        stash.iter(c)
    assert err(e) == "stash error: cannot iterate collection with empty since frontier"
    with pytest.raises(StashError) as e:
        stash.iter_key(c, "a")
    assert err(e) == "stash error: cannot iterate collection with empty since frontier"
    with pytest.raises(PeekSinceUpperError) as e2:
        stash.peek(c)
    assert err(e2) == f"stash error: collection {c.name} since {{}} is not less than upper {{}}"
    assert (e2.value.since, e2.value.upper) == (EMPTY, EMPTY)
    assert not e2.value.never_written()
    stash.consolidate(c)


# --------------------------------------------------------------------- peek
def test_peek_at_pairs_the_peek_time_with_its_entries(stash: Stash) -> None:
    c = stash.collection("c")
    stash.update_many(c, [(("a", 1), 0, 1), (("b", 2), 1, 1), (("late", 0), 5, 1)])
    stash.seal(c, A(2))
    assert stash.peek_at(c) == (1, [("a", 1, 1), ("b", 2, 1)])
    assert stash.peek_at(c) == (stash.peek_timestamp(c), stash.peek(c))
    with pytest.raises(PeekSinceUpperError) as e:
        stash.peek_at(stash.collection("never"))
    assert e.value.never_written()


def test_peek_one_and_peek_key_one(stash: Stash) -> None:
    c = stash.collection("c")
    stash.update_many(c, [(("a", 1), 0, 1), (("b", 2), 0, 1), (("late", 0), 5, 1)])
    stash.seal(c, A(1))
    assert stash.peek_one(c) == {"a": 1, "b": 2}
    assert stash.peek_key_one(c, "a") == 1
    assert stash.peek_key_one(c, "late") is None
    assert stash.peek_key_one(c, "nope") is None
    stash.update(c, ("a", 1), 1, 1)
    stash.seal(c, A(2))
    with pytest.raises(StashError) as e:
        stash.peek_one(c)
    assert err(e) == (
        "stash error: unexpected peek multiplicity: collection 'c' holds key \"a\" with "
        "multiplicity 2, and each key must be held once with multiplicity 1 — was the same "
        "update written twice? Retract the extra one, or read the collection with peek()"
    )
    with pytest.raises(StashError) as e:
        stash.peek_key_one(c, "a")
    assert err(e) == "stash error: multiple values unexpected"
    stash.update_many(c, [(("a", 1), 2, -1), (("b", 3), 2, 1)])
    stash.seal(c, A(3))
    with pytest.raises(StashError) as e:
        stash.peek_one(c)
    assert err(e) == (
        "stash error: duplicate peek keys: collection 'c' holds key \"b\" with two values "
        "— retract one of them, or read the collection with peek()"
    )


@pytest.mark.parametrize("size", [10_000, 100_000])
def test_long_keys_work_on_every_backend(stash: Stash, size: int) -> None:
    """Keys far beyond a btree entry's 2704 bytes (Postgres indexes a hash of the key):
    written, updated in place (consolidation finds the key's rows), read by key, and
    told apart from keys that differ only in their last character or in one nested
    field."""
    c = stash.collection("long", key="json", value="int")
    # Incompressible (Postgres compresses a long index entry before checking its size).
    noise = random.Random(size).randbytes(size // 2).hex()
    k1, k2 = noise[:-1] + "1", noise[:-1] + "2"
    k3 = {"path": noise, "n": 1}
    k4 = {"path": noise, "n": 2}
    tick(stash, c, [(k1, 1, 1), (k2, 2, 1), (k3, 3, 1), (k4, 4, 1)])
    tick(stash, c, [(k1, 1, -1), (k1, 10, 1), (k3, 3, -1)])
    stash.compact(c, A(1))
    assert stash.peek_key_one(c, k1) == 10
    assert stash.peek_key_one(c, k2) == 2
    assert stash.peek_key_one(c, k3) is None
    assert stash.iter_key(c, k4) == [(4, 1, 1)]
    assert stash.iter_key(c, k1) == [(10, 1, 1)]
    stash.consolidate(c)
    peeked = stash.peek(c)
    assert sorted(v for _, v, _ in peeked) == [2, 4, 10]
    # Physically consolidated: one row per live (key, value).
    assert len(stash.iter(c)) == 3


# ------------------------------------------------------------------- append
def test_append_single_and_make_batch(stash: Stash) -> None:
    c = stash.collection("orders")
    b = c.make_batch(stash)
    assert (b.lower, b.upper, b.compact, b.timestamp) == (A(0), A(1), A(0), 0)
    c.append_to_batch(b, "k", {"qty": 1}, 1)
    stash.append([b])
    assert (stash.upper(c), stash.since(c)) == (A(1), A(0))
    tick(stash, c, [("k", {"qty": 1}, -1), ("k", {"qty": 2}, 1)])
    assert stash.peek_one(c) == {"k": {"qty": 2}}
    assert stash.iter(c) == [(("k", {"qty": 2}), 1, 1)]


def test_append_lower_mismatch_message(stash: Stash) -> None:
    c = stash.collection("orders")
    b = AppendBatch(c, lower=A(1), upper=A(3), compact=A(1), timestamp=1)
    stash.seal(c, A(2))
    with pytest.raises(AppendLowerMismatch) as e:
        stash.append([b])
    assert err(e) == (
        "stash error: append lower {1} does not match the current upper frontier {2} "
        "of collection orders"
    )
    assert (e.value.expected, e.value.current) == (A(1), A(2))


@pytest.mark.parametrize("bad_first", [True, False])
def test_append_is_atomic_across_collections(stash: Stash, bad_first: bool) -> None:
    good, bad = stash.collection("good"), stash.collection("bad")
    stash.seal(bad, A(5))
    gb = good.make_batch(stash)
    good.append_to_batch(gb, "k", "v", 1)
    bb = AppendBatch(bad, lower=A(0), upper=A(6), compact=A(0), timestamp=0)
    bad.append_to_batch(bb, "k", "v", 1)
    with pytest.raises(AppendLowerMismatch):
        stash.append([bb, gb] if bad_first else [gb, bb])
    assert stash.upper(good) == A(0) and stash.iter(good) == []
    assert stash.upper(bad) == A(5) and stash.iter(bad) == []


@pytest.mark.parametrize(
    ("upper", "compact", "message"),
    [
        (A(0), A(0), None),
        (
            A(2),
            A(3),
            "stash error: compact request {3} is greater than the current upper frontier {2}",
        ),
        (
            A(2),
            A(-1),
            "stash error: compact request {-1} is less than the current since frontier {0}",
        ),
    ],
)
def test_append_checks_seal_and_compact(
    stash: Stash, upper: Antichain, compact: Antichain, message: str | None
) -> None:
    ok, c = stash.collection("ok"), stash.collection("c")
    okb = ok.make_batch(stash)
    ok.append_to_batch(okb, 1, 1, 1)
    b = AppendBatch(c, lower=A(0), upper=upper, compact=compact, timestamp=0)
    c.append_to_batch(b, "k", "v", 1)
    if message is None:
        stash.append([okb, b])
        assert stash.upper(c) == upper
        return
    with pytest.raises(StashError) as e:
        stash.append([okb, b])
    assert err(e) == message
    assert stash.upper(ok) == A(0) and stash.iter(ok) == [] and stash.iter(c) == []


def test_append_entry_before_lower_commits_nothing(stash: Stash) -> None:
    c = stash.collection("c")
    b = AppendBatch(c, lower=A(0), upper=A(5), compact=A(0), timestamp=0)
    b.entries.append((('"k"', '"v"'), 0, 1))
    stash.seal(c, A(0))
    b2 = AppendBatch(c, lower=A(0), upper=A(5), compact=A(0), timestamp=-1)
    c.append_to_batch(b2, "k", "v", 1)
    with pytest.raises(StashError) as e:
        stash.append([b2])
    assert err(e) == "stash error: entry time -1 is less than the current upper frontier {0}"
    stash.append([b])
    assert stash.peek(c) == [("k", "v", 1)]


def test_two_batches_for_one_collection_chain(stash: Stash) -> None:
    c = stash.collection("c")
    b1 = AppendBatch(c, lower=A(0), upper=A(1), compact=A(0), timestamp=0)
    b2 = AppendBatch(c, lower=A(1), upper=A(2), compact=A(1), timestamp=1)
    c.append_to_batch(b1, "a", 1, 1)
    c.append_to_batch(b2, "a", 1, -1)
    stash.append([b1, b2])
    assert stash.upper(c) == A(2) and stash.peek(c) == []


def test_empty_append_is_noop(stash: Stash) -> None:
    stash.append([])


def test_append_rejects_unencoded_entries(stash: Stash) -> None:
    c = stash.collection("c")
    b = c.make_batch(stash)
    b.entries.append((("k", {"not": "encoded"}), 0, 1))  # type: ignore[arg-type]
    with pytest.raises(StashError):
        stash.append([b])
    assert stash.upper(c) == A(0)


# ------------------------------------------------------------------- codecs
@dataclasses.dataclass(frozen=True)
class Item:
    name: str
    qty: int


def test_codecs_round_trip(stash: Stash) -> None:
    cases = [
        ("ints", "int", "int", 5, -(2**63)),
        ("strs", "str", "str", "ключ", "värde"),
        ("bytes", "bytes", "bytes", b"\x00\xff", b""),
        ("json", "json", "json", {"b": [1, 2.5, None, True]}, ["x", {"y": {}}]),
        ("records", "str", Item, "k", Item("w", 3)),
    ]
    for name, kc, vc, k, v in cases:
        c = stash.collection(name, key=kc, value=vc)
        stash.update(c, (k, v), 0, 1)
        stash.seal(c, A(1))
        assert stash.peek(c) == [(k, v, 1)], name
        assert stash.peek_key_one(c, k) == v


def test_json_is_canonical(stash: Stash) -> None:
    c = stash.collection("c")
    stash.update_many(c, [(({"b": 1, "a": 2}, 1.0), 0, 1), (({"a": 2, "b": 1}, 1), 0, 1)])
    stash.seal(c, A(1))
    assert stash.peek(c) == [({"a": 2, "b": 1}, 1, 2)]


@pytest.mark.parametrize(
    "value", [float("nan"), {1: "int key"}, {"s": {1, 2}}, object(), "nul\x00"]
)
def test_non_json_value_is_rejected_and_nothing_written(stash: Stash, value: object) -> None:
    c = stash.collection("c")
    with pytest.raises(StashError):
        stash.update_many(c, [(("ok", 1), 0, 1), (("bad", value), 0, 1)])
    b = c.make_batch(stash)
    with pytest.raises(StashError):
        c.append_to_batch(b, "bad", value, 1)
    stash.seal(c, A(1))
    assert stash.peek(c) == []


def test_too_deep_value_is_rejected(stash: Stash) -> None:
    c = stash.collection("c")
    deep: object = 1
    for _ in range(100):
        deep = [deep]
    with pytest.raises(StashError) as e:
        stash.update(c, ("k", deep), 0, 1)
    assert "nested deeper" in err(e)


@pytest.mark.parametrize(("t", "d"), [(2**63, 1), (0, 2**63), ("1", 1), (0, 1.5), (True, 1)])
def test_bad_time_or_diff(stash: Stash, t: object, d: object) -> None:
    c = stash.collection("c")
    with pytest.raises(StashError):
        stash.update(c, ("k", "v"), t, d)  # type: ignore[arg-type]


def test_bad_frontier_type(stash: Stash) -> None:
    c = stash.collection("c")
    with pytest.raises(StashError):
        stash.seal(c, 3)  # type: ignore[arg-type]


# ---------------------------------------------------------- TypedCollection
def test_typed_collection(stash: Stash) -> None:
    t: TypedCollection[str, int] = TypedCollection("config", key="str", value="int")
    assert t.insert_without_overwrite(stash, "a", 1) == 1
    assert t.insert_without_overwrite(stash, "a", 2) == 1
    t.upsert_key(stash, "a", 3)
    t.upsert_key(stash, "b", 4)
    assert t.peek_one(stash) == {"a": 3, "b": 4}
    t.upsert(stash, [("a", 5), ("c", 6)])
    assert t.peek_one(stash) == {"a": 5, "b": 4, "c": 6}
    assert t.peek_key_one(stash, "c") == 6
    assert t.upper(stash) == stash.upper(t.get(stash))


def test_typed_collection_writes_when_since_equals_upper(stash: Stash) -> None:
    # One write transaction reads every sealed time and writes at the upper: one tick
    # (the read no longer needs an empty batch to bump the upper first).
    t: TypedCollection[str, str] = TypedCollection("t")
    c = t.get(stash)
    stash.seal(c, A(4))
    stash.compact(c, A(4))
    t.upsert_key(stash, "k", "v")
    assert t.peek_one(stash) == {"k": "v"}
    assert stash.upper(c) == A(5) and stash.since(c) == A(4)
    t.upsert_key(stash, "k", "v")  # unchanged: writes nothing
    assert stash.upper(c) == A(5)


def test_typed_collection_lost_race_raises(open_stash) -> None:  # type: ignore[no-untyped-def]
    s1 = open_stash()
    t: TypedCollection[str, int] = TypedCollection("t")
    t.upsert_key(s1, "k", 1)
    c = t.get(s1)
    batch = c.make_batch(s1)
    t.upsert_key(open_stash(), "k", 2)
    c.append_to_batch(batch, "k", 3, 1)
    with pytest.raises(AppendLowerMismatch):
        s1.append([batch])
    assert t.peek_one(s1) == {"k": 2}


# --------------------------------------------------------- TableTransaction
def test_table_transaction_commit(stash: Stash) -> None:
    c = stash.collection("users")
    tick(stash, c, [(1, {"name": "ann"}, 1), (2, {"name": "bob"}, 1)])
    tt = TableTransaction(stash.peek_one(c), lambda a, b: a["name"] == b["name"])
    tt.insert(3, {"name": "cy"})
    with pytest.raises(StashError) as e:
        tt.insert(4, {"name": "ann"})
    assert err(e).startswith("stash error: uniqueness violation")
    assert isinstance(e.value, UniquenessViolation)
    assert (e.value.key, e.value.existing_key) == (4, 1)
    with pytest.raises(StashError):
        tt.insert(1, {"name": "zed"})
    assert tt.update(lambda k, v: {"name": "bo"} if k == 2 else None) == 1
    with pytest.raises(StashError):
        tt.update(lambda k, v: {"name": "same"})
    assert tt.delete(lambda k, v: k == 1) == [(1, {"name": "ann"})]
    tt.set(5, {"name": "ann"})  # ann was deleted, so the name is free again
    tt.set(3, None)
    assert tt.items() == {2: {"name": "bo"}, 5: {"name": "ann"}}
    assert tt.pending() == [
        (1, {"name": "ann"}, -1),
        (2, {"name": "bob"}, -1),
        (2, {"name": "bo"}, 1),
        (5, {"name": "ann"}, 1),
    ]
    b = c.make_batch(stash)
    for k, v, d in tt.pending():
        c.append_to_batch(b, k, v, d)
    stash.append([b])
    assert stash.peek_one(c) == tt.items()


# ------------------------------------------------------------------ reopen
def test_reopen_and_read(open_stash, backend: str) -> None:  # type: ignore[no-untyped-def]
    s = open_stash()
    c = s.collection("c", key="int")
    tick(s, c, [(1, "one", 1)])
    s.close()
    s2 = open_stash()
    c2 = s2.collection("c", key="int")
    assert s2.peek_one(c2) == {1: "one"}
    assert s2.upper(c2) == A(1)


def test_closed_handle_refuses(open_stash) -> None:  # type: ignore[no-untyped-def]
    s = open_stash()
    c = s.collection("c")
    s.close()
    with pytest.raises(StashError):
        s.upper(c)


# -------------------------------------------------------------------- modes
def test_readonly_mode(open_stash) -> None:  # type: ignore[no-untyped-def]
    w = open_stash(fenced=True)
    c = w.collection("c")
    tick(w, c, [("k", "v", 1)])
    r = open_stash(mode="readonly")
    rc = r.collection("c")
    assert r.peek(rc) == [("k", "v", 1)]
    for op in (
        lambda: r.update(rc, ("x", 1), 5, 1),
        lambda: r.seal(rc, A(9)),
        lambda: r.compact(rc, A(1)),
        lambda: r.consolidate(rc),
        lambda: r.append([rc.make_batch(r)]),
        lambda: r.collection("new"),
    ):
        with pytest.raises(StashError) as e:
            op()
        assert "readonly" in err(e)
    w.confirm_leadership()  # the readonly open did not take the epoch
    assert w.peek(c) == [("k", "v", 1)]


def test_savepoint_mode_commits_nothing(open_stash) -> None:  # type: ignore[no-untyped-def]
    w = open_stash(fenced=True)
    c = w.collection("c")
    tick(w, c, [("k", "v", 1)])
    sp = open_stash(mode="savepoint")
    sc = sp.collection("c")
    tick(sp, sc, [("k", "v", -1), ("k2", "v2", 1)])
    new = sp.collection("brand-new")
    sp.update(new, ("x", 1), 0, 1)
    assert sp.peek(sc) == [("k2", "v2", 1)]
    w.confirm_leadership()
    assert w.peek(c) == [("k", "v", 1)]
    assert "brand-new" not in w.collections()
    sp.close()
    assert w.peek(c) == [("k", "v", 1)]


# ------------------------------------------------------------------ fencing
def test_fencing(open_stash) -> None:  # type: ignore[no-untyped-def]
    old = open_stash(fenced=True)
    c = old.collection("c")
    tick(old, c, [("a", 1, 1)])
    optimistic = open_stash(fenced=False)
    new = open_stash(fenced=True)
    with pytest.raises(StashError) as e:
        tick(old, c, [("b", 2, 1)])
    assert e.value.is_unrecoverable()
    with pytest.raises(StashError) as e:
        old.confirm_leadership()
    assert e.value.is_unrecoverable()
    with pytest.raises(StashError) as e:
        old.peek(c)
    assert e.value.is_unrecoverable()
    nc = new.collection("c")
    assert new.peek(nc) == [("a", 1, 1)]
    new.confirm_leadership()
    tick(optimistic, optimistic.collection("c"), [("c", 3, 1)])
    fresh = open_stash(mode="readonly")
    assert fresh.peek(fresh.collection("c")) == [("a", 1, 1), ("c", 3, 1)]


def test_error_kinds() -> None:
    e = StashError("boom")
    assert str(e) == "stash error: boom"
    assert not e.is_unrecoverable() and not e.is_indeterminate()


@pytest.mark.parametrize(
    "url",
    [
        "",
        "nonsense",
        "mysql://u:pw@h/db",
        "sqlite://",
        "sqlite:///:memory:",
        "postgresql+pg8000://u@h/d",
    ],
)
def test_malformed_url(url: str) -> None:
    with pytest.raises(StashError) as e:
        Stash.open(url)
    assert err(e).startswith("stash error: ")
    assert "pw" not in err(e)


# ------------------------------------------------- defects of a stash review
def test_stored_json_null_is_a_value_for_upsert_key_and_insert(stash: Stash) -> None:
    """A key whose value is JSON ``null`` holds a value: ``insert_without_overwrite``
    keeps it and ``upsert_key`` retracts it (both took it as absent, and the key ended
    with two values)."""
    t = TypedCollection[str, object]("nulls")
    t.upsert(stash, [("a", None), ("b", None)])
    assert t.insert_without_overwrite(stash, "a", 1) is None
    assert t.peek_one(stash) == {"a": None, "b": None}
    t.upsert_key(stash, "b", 2)
    assert t.peek_one(stash) == {"a": None, "b": 2}
    t.upsert_key(stash, "a", None)
    t.upsert_key(stash, "a", None)
    assert t.peek_one(stash) == {"a": None, "b": 2}
    assert t.peek_key_one(stash, "a") is None


def test_migrate_rewrites_entries_at_and_beyond_the_upper(stash: Stash) -> None:
    """Entries ``update`` wrote at or beyond the upper are migrated at their own times:
    none is left in the old encoding (they were, and every later peek failed)."""
    t = TypedCollection[str, object]("mig")
    t.upsert(stash, [("a", 1)])
    c = t.get(stash)
    up = stash.upper(c).as_option()
    assert up is not None
    stash.update(c, ("b", 2), up, 1)  # at the upper
    stash.update(c, ("c", 3), up + 5, 1)  # beyond it
    new = t.migrate(stash, "str", "str", lambda k, v: (k, str(v)))
    assert new.peek_one(stash) == {"a": "1", "b": "2"}
    nc = new.get(stash)
    stash.seal(nc, A(up + 6))
    assert new.peek_one(stash) == {"a": "1", "b": "2", "c": "3"}
    assert [(kv, d) for kv, _, d in stash.iter(nc)] == [
        (("a", "1"), 1),
        (("b", "2"), 1),
        (("c", "3"), 1),
    ]


def test_pre_encoded_entries_are_canonical_on_every_backend(stash: Stash) -> None:
    """Entries encoded by hand are checked and stored as the codecs encode them: ``1.0``
    and ``1`` are one value on every backend (they stayed apart on memory and SQLite and
    merged on Postgres), and a key that is not JSON commits nothing (it was committed on
    memory and SQLite)."""
    c = stash.collection("pre")
    b = c.make_batch(stash)
    b.entries.append((("1.0", '{"b": 1, "a": 2.0}'), b.timestamp, 1))
    b.entries.append((("1", '{"a":2,"b":1}'), b.timestamp, 1))
    stash.append([b])
    assert stash.peek(c) == [(1, {"a": 2, "b": 1}, 2)]
    assert [(kv, d) for kv, _, d in stash.iter(c)] == [((1, {"a": 2, "b": 1}), 2)]

    b = c.make_batch(stash)
    c.append_to_batch(b, "ok", 1, 1)
    b.entries.append((("not json", "1"), b.timestamp, 1))
    with pytest.raises(StashError) as e:
        stash.append([b])
    assert "collection pre" in err(e) and "'not json'" in err(e) and "json codec" in err(e)
    assert stash.upper(c) == A(1)
    assert stash.peek(c) == [(1, {"a": 2, "b": 1}, 2)]

    # Cleared, reordered and mixed with entries encoded by hand: every hand entry checked.
    b = c.make_batch(stash)
    c.append_to_batch(b, "gone", 1, 1)
    b.entries.clear()
    c.append_to_batch(b, "x", 1, 1)
    b.entries.insert(0, (("2.0", "[1.0]"), b.timestamp, 1))
    stash.append([b])
    assert stash.peek(c) == [(1, {"a": 2, "b": 1}, 2), (2, [1], 1), ("x", 1, 1)]

    ints = stash.collection("pre_int", key="int", value="str")
    b = ints.make_batch(stash)
    b.entries.append((("7.0", '"x"'), b.timestamp, 1))
    stash.append([b])
    assert stash.peek_one(ints) == {7: "x"}
    b = ints.make_batch(stash)
    b.entries.append((("8", "9"), b.timestamp, 1))  # a number is no str value
    with pytest.raises(StashError, match="str codec"):
        stash.append([b])


# --------------------------------------- transactions with one consistent read
def test_table_commit_never_commits_over_a_newer_write(open_stash) -> None:  # type: ignore[no-untyped-def]
    """``TypedCollection.table`` is bound to the upper it read: a commit after another
    writer's append fails and commits nothing (the documented path used to append the
    changes over it, retracting a value no longer live and breaking every later peek)."""
    s1, s2 = open_stash(), open_stash()
    t = TypedCollection[str, int]("tbl", key="str", value="int")
    t.upsert(s1, [("a", 1)])
    tt = t.table(s1)
    tt.set("a", 2)
    t.upsert_key(s2, "a", 5)  # lands between the read and the commit
    with pytest.raises(AppendLowerMismatch) as e:
        tt.commit()
    assert e.value.collection == "tbl"
    assert t.peek_one(s1) == {"a": 5}
    tt = t.table(s1)  # read again: commits
    tt.set("a", 2)
    tt.set("b", 3)
    tt.commit()
    assert t.peek_one(s2) == {"a": 2, "b": 3}
    with pytest.raises(StashError, match="committed already"):
        tt.commit()
    with pytest.raises(StashError, match="not bound"):
        TableTransaction({}).commit()


def test_table_commit_on_a_new_collection(stash: Stash) -> None:
    """A new collection reads as empty and its table commits at lower {0} (the old
    batch-first order failed there with AppendLowerMismatch)."""
    t = TypedCollection[str, int]("fresh", key="str", value="int")
    assert t.peek_one(stash) == {}
    tt = t.table(stash)
    assert tt.items() == {}
    tt.insert("a", 1)
    tt.commit()
    assert t.peek_one(stash) == {"a": 1}
    assert stash.upper(t.get(stash)) == A(1)
    unchanged = t.table(stash)
    unchanged.commit()  # nothing pending: nothing written
    assert stash.upper(t.get(stash)) == A(1)


def test_uniqueness_violation_names_collection_and_both_keys(stash: Stash) -> None:
    t = TypedCollection[str, dict]("people", key="str")
    t.upsert(stash, [("ann", {"name": "Ann"})])
    tt = t.table(stash, lambda a, b: a["name"] == b["name"])
    with pytest.raises(UniquenessViolation) as e:
        tt.insert("ann2", {"name": "Ann"})
    assert (e.value.collection, e.value.key, e.value.existing_key) == ("people", "ann2", "ann")
    assert "people" in err(e) and "'ann2'" in err(e) and "'ann'" in err(e)
    with pytest.raises(UniquenessViolation) as e:
        tt.insert("ann", {"name": "Other"})
    assert err(e).startswith("stash error: uniqueness violation: key already exists")
    assert isinstance(e.value, StashError)


def test_with_transaction_commits_atomically_and_returns_the_result(stash: Stash) -> None:
    tables = TypedCollection[str, int]("w_tables", key="str", value="int")
    columns = TypedCollection[tuple, str]("w_columns", key=tuple, value="str")

    def create(tx):  # type: ignore[no-untyped-def]
        t = tx.table(tables)
        t.insert("orders", 1)
        c = tx.table(columns)
        c.insert(("orders", "id"), "int")
        c.insert(("orders", "qty"), "int")
        assert tx.peek_one(tables) == {"orders": 1}  # its own changes
        assert tx.peek_key_one(columns, ("orders", "id")) == "int"
        with pytest.raises(StashError, match="with_transaction"):
            t.commit()
        return "done"

    assert stash.with_transaction(create) == "done"
    assert tables.peek_one(stash) == {"orders": 1}
    assert columns.peek_one(stash) == {("orders", "id"): "int", ("orders", "qty"): "int"}

    def failing(tx):  # type: ignore[no-untyped-def]
        tx.table(tables).set("orders", None)
        tx.table(columns).insert(("orders", "id"), "dup")  # raises: nothing commits

    with pytest.raises(UniquenessViolation):
        stash.with_transaction(failing)
    assert tables.peek_one(stash) == {"orders": 1}
    uppers = (stash.upper(tables.get(stash)), stash.upper(columns.get(stash)))
    assert stash.with_transaction(lambda tx: tx.peek_one(tables)) == {"orders": 1}
    assert (stash.upper(tables.get(stash)), stash.upper(columns.get(stash))) == uppers


def test_with_transaction_reads_at_one_point_and_runs_again(open_stash) -> None:  # type: ignore[no-untyped-def]
    """A write landing between two reads of one attempt ends the attempt before the
    function sees a torn state; the function runs again and sees the new state whole."""
    s, other = open_stash(), open_stash()
    a = TypedCollection[str, int]("one_a", key="str", value="int")
    b = TypedCollection[str, int]("one_b", key="str", value="int")
    a.upsert(s, [("x", 1)])
    b.upsert(s, [("x", 1)])
    seen: list[tuple[int, int | None]] = []

    def rename(tx):  # type: ignore[no-untyped-def]
        va = tx.peek_key_one(a, "x")
        if not seen:  # the first attempt: another writer moves both collections now
            other.with_transaction(lambda t2: (t2.table(a).set("x", 2), t2.table(b).set("x", 2)))
        seen.append((va, None))
        vb = tx.peek_key_one(b, "x")
        seen[-1] = (va, vb)
        tx.table(a).set("x", va + 10)
        return va, vb

    assert s.with_transaction(rename) == (2, 2)
    assert seen == [(1, None), (2, 2)]  # the first attempt never read b's newer value
    assert a.peek_one(s) == {"x": 12}


def test_with_transaction_checks_collections_it_only_read(open_stash) -> None:  # type: ignore[no-untyped-def]
    s, other = open_stash(), open_stash()
    src = TypedCollection[str, int]("ro_src", key="str", value="int")
    dst = TypedCollection[str, int]("ro_dst", key="str", value="int")
    src.upsert(s, [("n", 1)])
    runs: list[int] = []

    def copy(tx):  # type: ignore[no-untyped-def]
        n = tx.peek_key_one(src, "n")
        runs.append(n)
        if len(runs) == 1:
            src.upsert_key(other, "n", 7)  # after the read, before the commit
        tx.table(dst).set("n", n)

    s.with_transaction(copy)
    assert runs == [1, 7]
    assert dst.peek_one(s) == {"n": 7}  # never the stale 1


def test_with_transaction_gives_up_after_retries(open_stash) -> None:  # type: ignore[no-untyped-def]
    s, other = open_stash(), open_stash()
    t = TypedCollection[str, int]("busy", key="str", value="int")
    t.upsert(s, [("k", 0)])
    runs = []

    def contended(tx):  # type: ignore[no-untyped-def]
        runs.append(1)
        v = tx.peek_key_one(t, "k")
        t.upsert_key(other, "k", v + 100)  # always someone faster
        tx.table(t).set("k", v + 1)

    with pytest.raises(AppendLowerMismatch) as e:
        s.with_transaction(contended, retries=2)
    assert len(runs) == 3 and e.value.collection == "busy"
    assert t.peek_one(s) == {"k": 300}  # only the other writer's changes
    with pytest.raises(StashError, match="retries"):
        s.with_transaction(contended, retries=-1)


def test_writers_of_distinct_keys_do_not_conflict(open_stash) -> None:  # type: ignore[no-untyped-def]
    """A transaction checks the keys it read, not the whole collection: another
    writer's commit of a different key in between costs no retry (it cost one, and two
    processes inserting different keys conflicted hundreds of times); the same key, or
    a rule that reads every row, still conflicts (serializable)."""
    s, other = open_stash(), open_stash()
    t = TypedCollection[str, int]("keys", key="str", value="int")
    t.upsert(s, [("a", 1), ("b", 1)])
    runs: list[int] = []

    def bump_a(tx):  # type: ignore[no-untyped-def]
        runs.append(1)
        tt = tx.table(t)
        v = tt.get("a")
        if len(runs) == 1:
            t.upsert_key(other, "b", 5)  # a distinct key, between the read and the commit
            other.with_transaction(lambda t2: t2.table(t).insert("c", 9))
        tt.set("a", v + 1)
        assert tx.peek_key_one(t, "a") == v + 1

    s.with_transaction(bump_a)
    assert runs == [1]
    assert t.peek_one(s) == {"a": 2, "b": 5, "c": 9}

    # A bound table too: a distinct key lands, the commit succeeds.
    tt = t.table(s)
    tt.set("a", 3)
    t.upsert_key(other, "b", 6)
    tt.commit()
    assert t.peek_one(s) == {"a": 3, "b": 6, "c": 9}

    # The same key: a conflict.
    tt = t.table(s)
    tt.set("a", 4)
    t.upsert_key(other, "a", 7)
    with pytest.raises(AppendLowerMismatch, match="key"):
        tt.commit()
    assert t.peek_one(s) == {"a": 7, "b": 6, "c": 9}

    # A key read as absent, then inserted by another writer: a conflict (no phantom).
    tt = t.table(s)
    assert tt.get("d") is None
    t.upsert_key(other, "d", 1)
    tt.insert("d", 2)  # "d" was read before the other insert: still absent here
    with pytest.raises(AppendLowerMismatch):
        tt.commit()
    assert t.peek_key_one(s, "d") == 1

    # A uniqueness rule reads every row: any other write is a conflict.
    tt = t.table(s, lambda x, y: x == y)
    tt.set("e", 100)
    t.upsert_key(other, "f", 1)
    with pytest.raises(AppendLowerMismatch):
        tt.commit()
    assert "e" not in t.peek_one(s)

    # items() reads every row too.
    runs.clear()

    def count(tx):  # type: ignore[no-untyped-def]
        runs.append(1)
        tt = tx.table(t)
        n = len(tt.items())
        if len(runs) == 1:
            t.upsert_key(other, "g", 1)
        tt.set("n", n)

    s.with_transaction(count)
    assert len(runs) == 2 and t.peek_key_one(s, "n") == 6
