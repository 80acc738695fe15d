"""Composite keys (tuples, frozen dataclasses, NamedTuples, typed tuples of records) through
every TypedCollection and TableTransaction method on every backend, and equality by
canonical encoding (``True`` is not ``1``)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stash import Antichain, Stash, StashError, TableTransaction, TypedCollection
from stash.codec import resolve_codec
from tests.stash.conftest_helpers import tick


@dataclasses.dataclass(frozen=True)
class Point:
    x: int
    y: int


@dataclasses.dataclass(frozen=True)
class Span:
    start: Point
    end: Point
    tags: tuple[str, ...]


class Route(NamedTuple):
    origin: str
    dest: str


def _commit(stash: Stash, tc: TypedCollection[Any, Any], tt: TableTransaction[Any, Any]) -> None:
    c = tc.get(stash)
    tick(stash, c, tt.pending())


CASES: list[tuple[str, Any, list[Any]]] = [
    ("tuple", tuple, [("a", 1), ("a", 2), ("b", (1, "x")), (True, None)]),
    ("tuple-name", "tuple", [(1, 2), (2, 1)]),
    ("typed-tuple", tuple[str, Point], [("a", Point(1, 2)), ("a", Point(2, 1))]),
    ("frozen-dataclass", Point, [Point(0, 0), Point(0, 1), Point(-3, 7)]),
    (
        "nested-record",
        Span,
        [Span(Point(0, 0), Point(1, 1), ("x", "y")), Span(Point(0, 0), Point(1, 1), ())],
    ),
    ("namedtuple", Route, [Route("ams", "lhr"), Route("lhr", "ams")]),
]


@pytest.mark.parametrize(("name", "codec", "keys"), CASES, ids=[c[0] for c in CASES])
def test_composite_keys_through_every_typed_collection_method(
    stash: Stash, name: str, codec: Any, keys: list[Any]
) -> None:
    tc: TypedCollection[Any, Any] = TypedCollection(name, key=codec, value="json")
    k0, k1 = keys[0], keys[1]
    assert tc.insert_without_overwrite(stash, k0, {"n": 0}) == {"n": 0}
    assert tc.insert_without_overwrite(stash, k0, {"n": 9}) == {"n": 0}
    tc.upsert_key(stash, k1, [1])
    tc.upsert_key(stash, k1, [2])
    tc.upsert(stash, [(k, {"i": i}) for i, k in enumerate(keys)])
    want = {k: {"i": i} for i, k in enumerate(keys)}
    got = tc.peek_one(stash)
    assert got == want
    for k in got:
        assert type(k) is type(keys[0]) and hash(k) == hash(keys[keys.index(k)])
    assert tc.peek_key_one(stash, k1) == {"i": 1}
    c = tc.get(stash)
    assert [k for k, _, _ in stash.peek(c)] == list(got)
    assert [v for v, _, _ in stash.iter_key(c, k0)] == [{"i": 0}]

    # TableTransaction over the collection, every method, then committed.
    tt = tc.table(stash, lambda a, b: a.get("u") is not None and a.get("u") == b.get("u"))
    assert tt.items() == want
    assert tt.get(k0) == {"i": 0}
    tt.set(k0, {"i": 0, "u": 1})
    with pytest.raises(StashError, match="uniqueness violation"):
        tt.insert(k1, {"u": 1})
    with pytest.raises(StashError, match="key already exists"):
        tt.insert(k1, {"u": 2})
    assert tt.update(lambda k, v: {"i": 10} if k == k1 else None) == 1
    last = keys[-1]
    before = tt.get(last)
    assert tt.delete(lambda k, v: k == last) == [(last, before)]
    assert tt.get(last) is None
    seen: list[Any] = []
    tt.for_values(lambda k, v: seen.append(k))
    assert sorted(map(repr, seen)) == sorted(map(repr, keys[:-1]))
    expect = {**want, k0: {"i": 0, "u": 1}, k1: {"i": 10}}
    del expect[last]
    assert tt.items() == expect
    _commit(stash, tc, tt)
    assert tc.peek_one(stash) == expect
    assert all(type(k) is type(k0) for k in tc.peek_one(stash))


def test_tuple_codec_is_recorded_and_reopens(open_stash: Any) -> None:
    s = open_stash()
    c = s.collection("t", key=tuple, value="int")
    assert c.key_codec.name == "tuple"
    s.update(c, (("a", 1), 5), 0, 1)
    s.seal(c, Antichain.from_elem(1))
    s2 = open_stash()
    assert s2.collection("t", key="tuple", value="int").key_codec.name == "tuple"
    listed = s2.collections()["t"]
    assert s2.peek_one(listed) == {("a", 1): 5}
    with pytest.raises(StashError, match=r"codecs \(key=tuple, value=int\)"):
        s2.collection("t", key="json", value="int")
    # A record type keeps its recorded name (backward compatible).
    assert resolve_codec(Point).name == f"record:{__name__}.Point"
    assert resolve_codec(Route).name == f"record:{__name__}.Route"


def test_tuple_keys_with_the_default_json_codec(stash: Stash) -> None:
    """The default codec stores a tuple as a JSON array (``peek`` gives a list): upsert
    still works, and ``peek_one`` returns the keys as tuples (it refused them before)."""
    tc: TypedCollection[Any, Any] = TypedCollection("j")
    tc.upsert(stash, [(("a", 1), 1), (("b", 2), 2)])
    tc.upsert(stash, [(("a", 1), 3)])
    c = tc.get(stash)
    assert stash.peek(c) == [(["a", 1], 3, 1), (["b", 2], 2, 1)]
    assert tc.peek_one(stash) == {("a", 1): 3, ("b", 2): 2}


def test_tuple_codec_refuses_non_tuples(stash: Stash) -> None:
    c = stash.collection("t", key=tuple)
    with pytest.raises(StashError, match="tuple codec: expected a tuple, got list"):
        stash.update(c, (["a"], 1), 0, 1)


# ------------------------------------------------- equality by canonical encoding
def test_table_update_from_1_to_true_is_pending() -> None:
    tt = TableTransaction({"a": 1, "b": 0, "c": 1.0})
    assert tt.update(lambda k, v: {"a": True, "b": False, "c": 1}[k]) == 3
    # 1.0 and 1 have one canonical encoding; True and 1 do not.
    assert tt.pending() == [("a", 1, -1), ("a", True, 1), ("b", 0, -1), ("b", False, 1)]


def test_update_from_1_to_true_is_a_change(stash: Stash) -> None:
    tc: TypedCollection[str, Any] = TypedCollection("flags", key="str")
    tc.upsert(stash, [("a", 1), ("b", 0)])
    tt = tc.table(stash)
    assert tt.update(lambda k, v: True if v == 1 else False) == 2
    assert tt.pending() == [("a", 1, -1), ("a", True, 1), ("b", 0, -1), ("b", False, 1)]
    _commit(stash, tc, tt)
    got = tc.peek_one(stash)
    assert got == {"a": True, "b": False}
    assert [type(v) for v in got.values()] == [bool, bool]


def test_keys_true_and_1_are_distinct(stash: Stash) -> None:
    tc: TypedCollection[Any, str] = TypedCollection("mixed")
    tc.upsert(stash, [(True, "bool"), (1, "int")])
    c = tc.get(stash)
    assert stash.peek(c) == [(True, "bool", 1), (1, "int", 1)]
    # Not reported as a duplicate key: a dict simply cannot hold both.
    with pytest.raises(StashError, match="distinct stash keys but equal in Python"):
        stash.peek_one(c)
    tc.upsert(stash, [(1, "int2")])
    assert stash.peek(c) == [(True, "bool", 1), (1, "int2", 1)]
    assert tc.peek_key_one(stash, True) == "bool"
    tt = TableTransaction([(True, "bool"), (1, "int2")])
    tt.set(1, "int3")
    assert tt.pending() == [(1, "int2", -1), (1, "int3", 1)]
    assert tt.get(True) == "bool"


# --------------------------------------------------------------- properties
TUPLE_KEYS = st.tuples(st.sampled_from(["a", "b"]), st.sampled_from([0, 1, True, False]))
KEYS = st.one_of(
    TUPLE_KEYS,
    st.builds(Point, st.integers(0, 1), st.integers(0, 1)),
)
VALUES = st.sampled_from([0, 1, True, False, None, 1.0, "1"])
OPS = st.lists(
    st.tuples(st.sampled_from(["set", "insert", "delete", "update"]), KEYS, VALUES), max_size=12
)


def _canon(x: Any) -> str:
    from stash.codec import canonical_json, to_json

    return canonical_json(to_json(x))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(initial=st.lists(st.tuples(KEYS, VALUES), max_size=5), ops=OPS)
def test_table_transaction_matches_a_model_keyed_by_encoding(
    initial: list[tuple[Any, Any]], ops: list[tuple[str, Any, Any]]
) -> None:
    init: dict[str, tuple[Any, Any]] = {}
    for k, v in initial:
        init.setdefault(_canon(k), (k, v))
    tt: TableTransaction[Any, Any] = TableTransaction(list(init.values()))
    model = dict(init)
    for op, k, v in ops:
        ck = _canon(k)
        if op == "set":
            tt.set(k, v)
            if v is None:
                model.pop(ck, None)
            else:
                model[ck] = (k, v)
        elif op == "insert" and v is not None:
            if ck in model:
                with pytest.raises(StashError):
                    tt.insert(k, v)
            else:
                tt.insert(k, v)
                model[ck] = (k, v)
        elif op == "delete":
            tt.delete(lambda kk, vv, ck=ck: _canon(kk) == ck)
            model.pop(ck, None)
        elif op == "update" and v is not None:
            n = tt.update(lambda kk, vv, ck=ck, v=v: v if _canon(kk) == ck else None)
            assert n == (1 if ck in model else 0)
            if ck in model:
                model[ck] = (model[ck][0], v)
    visible: dict[str, Any] = {}
    tt.for_values(lambda kk, vv: visible.__setitem__(_canon(kk), _canon(vv)))
    assert visible == {ck: _canon(v) for ck, (_, v) in model.items()}
    # pending() applied to the initial contents gives the model, by encoding.
    acc: dict[tuple[str, str], int] = {}
    for k, v in init.values():
        acc[(_canon(k), _canon(v))] = 1
    for k, v, d in tt.pending():
        key = (_canon(k), _canon(v))
        acc[key] = acc.get(key, 0) + d
    assert {kv for kv, n in acc.items() if n} == {(ck, _canon(v)) for ck, (_, v) in model.items()}
    assert all(n in (0, 1) for n in acc.values())


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(entries=st.lists(st.tuples(TUPLE_KEYS, VALUES.filter(lambda v: v is not None)), max_size=6))
def test_table_transaction_commits_composite_keys_to_every_backend(
    stash: Stash, entries: list[tuple[Any, Any]]
) -> None:
    tc: TypedCollection[Any, Any] = TypedCollection("prop", key=tuple, value="json")
    tt = tc.table(stash)
    model: dict[str, Any] = {}
    tt.for_values(lambda k, v: model.__setitem__(_canon(k), _canon(v)))
    for k, v in entries:
        tt.set(k, v)
        model[_canon(k)] = _canon(v)
    _commit(stash, tc, tt)
    c = tc.get(stash)
    assert {_canon(k): _canon(v) for k, v, _ in stash.peek(c)} == model


def test_tuple_key_with_the_default_json_codec_reads_back_as_a_tuple(stash: Stash) -> None:
    """A tuple key written through the default JSON codec is stored as a JSON array;
    ``peek_one`` returns it as a tuple (recursively), so what went in comes back (it
    refused the collection before: "peek_one needs hashable keys")."""
    tc: TypedCollection[Any, str] = TypedCollection("default-codec-tuples")
    tc.upsert_key(stash, (1, "x"), "v")
    tc.upsert_key(stash, (2, ("y", 3)), "w")
    assert tc.peek_one(stash) == {(1, "x"): "v", (2, ("y", 3)): "w"}
    assert tc.peek_key_one(stash, (1, "x")) == "v"
    tc.upsert_key(stash, (1, "x"), "v2")  # found by encoding, retracted, replaced
    assert tc.peek_one(stash) == {(1, "x"): "v2", (2, ("y", 3)): "w"}
