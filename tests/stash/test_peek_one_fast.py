"""The whole-column ``peek_one`` path (:func:`stash.peek.peek_one_fast`) against the checked
one-entry-at-a-time path it short-cuts (:func:`stash.peek.peek_one_checked`) and a model
(the diffs of each ``(key, value)`` summed over the sealed times), on random collections
with retractions, multiplicities, duplicate keys, keys equal in Python (``True`` and
``1``), list and object keys; and the bulk decode (:func:`stash.codec.decode_all`)
against one ``decode`` per text, on every backend of the contract suite."""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stash import Antichain, Stash, StashError
from stash.codec import IntCodec, JsonCodec, StrCodec, decode_all
from stash.collection import StashCollection
from stash.peek import peek_one_checked, peek_one_fast

_names = itertools.count()

KEYS: dict[str, list[Any]] = {
    "int": [2, 10, 1, -3, 2**40, 0],  # text order is not numeric order
    "str": ["", "a", "b", "ab", "é"],
    "json": [0, 1, True, False, None, "a", 1.5, [1, 2], [[1], "x"], {"a": 1}],
}
VALUES = [0, 1, "v", None, [1, 2], {"x": [1, {"y": 2}]}, 2.5]

entries = st.lists(
    st.tuples(
        st.integers(0, 9),  # key index (modulo the pool)
        st.sampled_from(VALUES),
        st.integers(0, 3),  # time
        st.sampled_from([1, 1, 1, 1, -1, 2, -2]),  # mostly inserts: a fast path answer
    ),
    max_size=12,
)


def _outcome(fn: Any) -> tuple[str, Any]:
    try:
        got = fn()
    except StashError as e:
        return ("error", str(e))
    return ("ok", [(k, type(k), v) for k, v in got.items()])


def _model(
    ups: list[tuple[Any, Any, int, int]], kc: Any, vc: Any, upper: int
) -> dict[tuple[str, str], int]:
    sums: Counter[tuple[str, str]] = Counter()
    for k, v, t, d in ups:
        if t < upper:
            sums[(kc.encode(k), vc.encode(v))] += d
    return {kv: d for kv, d in sums.items() if d}


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    key=st.sampled_from(sorted(KEYS)),
    ups=entries,
    upper=st.integers(1, 4),
    since=st.integers(0, 4),
)
def test_peek_one_fast_path_matches_checked_path(
    stash: Stash, key: str, ups: list[tuple[int, Any, int, int]], upper: int, since: int
) -> None:
    c: StashCollection[Any, Any] = stash.collection(f"p{next(_names)}", key=key)
    pool = KEYS[key]
    rows = [(pool[i % len(pool)], v, t, d) for i, v, t, d in ups]
    if rows:
        stash.update_many(c, [((k, v), t, d) for k, v, t, d in rows])
    stash.seal(c, Antichain.from_option(upper))
    stash.compact(c, Antichain.from_option(min(since, upper - 1)))

    raw = stash._peek_raw(c)
    checked = _outcome(lambda: peek_one_checked(c, list(raw)))
    direct = peek_one_fast(c, list(raw))
    if direct is not None:  # the fast path answered: exactly what the checked path says
        assert checked == ("ok", [(k, type(k), v) for k, v in direct.items()])
    fast = _outcome(lambda: stash.peek_one(c))
    assert fast == checked

    model = _model(rows, c.key_codec, c.value_codec, upper)
    if fast[0] == "ok":
        got = stash.peek_one(c)
        assert {
            (c.key_codec.encode(list(k) if type(k) is tuple else k), c.value_codec.encode(v))
            for k, v in got.items()
        } == set(model)
        assert set(model.values()) <= {1}
        assert list(got) == sorted(got, key=c.key_codec.sort_key)
    else:
        # The model agrees that some check must fail.
        encs = [k for k, _ in model]
        assert set(model.values()) - {1} or len(set(encs)) != len(encs) or key == "json"


CODEC_TEXTS: list[tuple[Any, list[Any]]] = [
    (JsonCodec(), ['{"a":1}', " 1", "[1,2]", "1 ", "nope", "", "null", '"x"', "1e5", "-0"]),
    (IntCodec(), ["1", "-7", "1.0", "1e2", "true", "x", " 3", "1_0", "2.5"]),
    (StrCodec(), ['"a"', "1", '"\\u00e9"', "x"]),
]


@pytest.mark.parametrize("codec,texts", CODEC_TEXTS, ids=lambda x: getattr(x, "name", ""))
@given(data=st.data())
def test_decode_all_matches_decode(codec: Any, texts: list[Any], data: st.DataObject) -> None:
    picked = data.draw(st.lists(st.sampled_from(texts), max_size=6))

    def one_by_one() -> tuple[str, Any]:
        try:
            return ("ok", [codec.decode(t) for t in picked])
        except Exception as e:
            return ("error", type(e))

    try:
        bulk: tuple[str, Any] = ("ok", decode_all(codec, picked))
    except Exception as e:
        bulk = ("error", type(e))
    expect = one_by_one()
    assert bulk[0] == expect[0]
    if bulk[0] == "ok":
        assert [(type(x), x) for x in bulk[1]] == [(type(x), x) for x in expect[1]]
    else:
        assert bulk[1] is expect[1]


@pytest.mark.parametrize("key", ["int", "str", "json"])
def test_peek_one_orders_keys_by_codec(stash: Stash, key: str) -> None:
    """Keys whose stored texts sort otherwise (``"10" < "9"``) come back in the codec's
    order, through the fast path."""
    c: StashCollection[Any, Any] = stash.collection(f"o{next(_names)}", key=key)
    keys: list[Any] = list(range(25, -5, -1)) if key != "str" else ["b", "a", "ab", "é", ""]
    stash.update_many(c, [((k, str(k)), 0, 1) for k in keys])
    stash.seal(c, Antichain.from_option(1))
    assert peek_one_fast(c, stash._peek_raw(c)) is not None
    got = stash.peek_one(c)
    assert list(got) == sorted(keys, key=c.key_codec.sort_key)
    assert got == {k: str(k) for k in keys}


peek_rows = st.lists(
    st.tuples(
        st.sampled_from(["1", "10", "2", '"a"', '"é"', '"\U0001f600"', '"z"', "[1]"]),
        st.sampled_from(["0", '"v"', "{}", '"\u00ff"']),
        st.integers(-3, 3),
    ),
    max_size=14,
)


@settings(max_examples=200)
@given(rows=peek_rows)
def test_sqlite_peek_consolidation_matches_group_by(rows: list[tuple[str, str, int]]) -> None:
    """SQLite's whole-collection peek consolidates in Python exactly what the ``GROUP BY
    key, value HAVING sum(diff) <> 0`` query returned, in the same (key, value) order."""
    import sqlite3

    from stash.sql_txn import _consolidate_peek

    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE data (key TEXT, value TEXT, diff INTEGER)")
    db.executemany("INSERT INTO data VALUES (?, ?, ?)", rows)
    want = db.execute(
        "SELECT key, value, sum(diff) FROM data GROUP BY key, value HAVING sum(diff) <> 0"
        " ORDER BY key, value"
    ).fetchall()
    db.close()
    assert _consolidate_peek(list(rows)) == want


def test_sqlite_peek_rows_matches_group_by_query(tmp_path: Any) -> None:
    """On a stored collection with retractions, history beyond the peek time and
    duplicate keys, ``SqlTxn.peek_rows`` returns what the ``GROUP BY`` query returns."""
    from stash.sql_txn import _SQLITE_PEEK

    with Stash.open(f"sqlite:///{tmp_path}/p.db", fenced=False) as s:
        c: StashCollection[Any, Any] = s.collection("c", key="int")
        s.update_many(c, [((k, k % 3), 0, 1) for k in range(40)])
        s.update_many(c, [((k, k % 3), 1, -1) for k in range(0, 40, 4)])
        s.update_many(c, [((k, "x"), 1, 2) for k in range(0, 40, 5)])
        s.update_many(c, [((k, "late"), 3, 1) for k in range(10)])
        for ts in (0, 1, 2, 3):
            got, want = s._read(
                lambda tx, ts=ts: (
                    tx.peek_rows(c.id, ts),
                    tx.dbc.execute(
                        _SQLITE_PEEK + " ORDER BY key, value", {"c": c.id, "ts": ts}
                    ).fetchall(),
                ),
                codecs=(),
            )
            assert got == [tuple(r) for r in want]
            assert got  # non-trivial at every time
