"""Hypothesis properties: consolidation, antichain order, codecs, TableTransaction."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from stash import Antichain, StashError, TableTransaction
from stash.codec import JsonCodec, canonical_json, json_sort_key
from stash.consolidation import consolidate_updates

updates = st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 3), st.integers(-2, 2)))


@given(updates)
def test_consolidation_preserves_weighted_multiset(ups: list[tuple[str, int, int]]) -> None:
    out = consolidate_updates(ups)
    ref: Counter[tuple[str, int]] = Counter()
    for d, t, n in ups:
        ref[(d, t)] += n
    assert {(d, t): n for d, t, n in out} == {k: v for k, v in ref.items() if v}
    assert all(n != 0 for _, _, n in out)
    assert len({(d, t) for d, t, _ in out}) == len(out)
    assert consolidate_updates(out) == out  # idempotent


opt = st.one_of(st.none(), st.integers(-5, 5))


@given(opt, opt, opt)
def test_antichain_partial_order(a: int | None, b: int | None, c: int | None) -> None:
    x, y, z = Antichain.from_option(a), Antichain.from_option(b), Antichain.from_option(c)
    assert x <= x
    if x <= y and y <= x:
        assert x == y
    if x <= y and y <= z:
        assert x <= z
    assert x <= y or y <= x  # total order over i64
    assert Antichain() >= x  # the empty frontier is the top
    assert x.join(y) >= x and x.meet(y) <= x
    assert Antichain.from_json(x.to_json()) == x


texts = st.text(alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)))
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**60), 2**60)
    | st.floats(allow_nan=False, allow_infinity=False)
    | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=10,
)


@given(json_values, json_values)
def test_json_codec_is_canonical_and_ordered(a: Any, b: Any) -> None:
    c = JsonCodec()
    ta, tb = c.encode(a), c.encode(b)
    assert c.encode(c.decode(ta)) == ta
    assert (ta == tb) == (c.decode(ta) == c.decode(tb))
    ka, kb = json_sort_key(c.decode(ta)), json_sort_key(c.decode(tb))
    assert (ka < kb) or (kb < ka) or (ka == kb)


def _reference_canonical_json(value: Any, depth: int = 0) -> str:
    """The codec's rules written plainly (a walk that checks every node, then a
    normalising copy), the model the fast :func:`canonical_json` must agree with."""
    import json
    import math

    def check(v: Any, d: int) -> None:
        if d > 64:
            raise StashError("too deep")
        if isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str):
                    raise StashError("key")
                check(k, d + 1)
                check(x, d + 1)
        elif isinstance(v, list | tuple):
            for x in v:
                check(x, d + 1)
        elif isinstance(v, float) and not math.isfinite(v):
            raise StashError("nan")
        elif isinstance(v, str):
            if "\x00" in v:
                raise StashError("nul")
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise StashError("surrogate") from None
        elif v is not None and not isinstance(v, int | float | bool):
            raise StashError("type")

    def norm(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [norm(x) for x in v]
        return v

    check(value, depth)
    return json.dumps(norm(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


any_texts = st.text(alphabet=st.sampled_from(["a", "\x00", "\\", "u", "0", "\ud800", "é", '"']))
# Mostly JSON, with some garbage: NaN and infinities (floats), NUL characters, lone
# surrogates and spelled-out backslash-u0000 (texts), sets, bytes, objects, int keys.
any_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | any_texts
    | any_texts
    | any_texts
    | st.sampled_from([b"x", frozenset({1}), object()]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.dictionaries(any_texts | any_texts | any_texts | st.integers(0, 3), inner, max_size=3)
    ),
    max_leaves=8,
)


def _nest(value: Any, levels: int) -> Any:
    for i in range(levels):
        value = [value] if i % 2 else {"k": value}
    return value


@settings(max_examples=400)
@given(any_values, st.integers(0, 3), st.sampled_from([0, 60, 62, 63, 64, 65]))
def test_canonical_json_agrees_with_the_plain_rules(value: Any, scalar: int, levels: int) -> None:
    """Same text or both a StashError: on garbage (NaN, sets, bytes, int keys, NUL
    characters, lone surrogates, a literal backslash-u0000 spelled out) and around the
    depth limit."""
    value = _nest([value, [scalar], {}, []][scalar], levels)
    try:
        want: str | None = _reference_canonical_json(value)
    except StashError:
        want = None
    try:
        got: str | None = canonical_json(value)
    except StashError:
        got = None
    assert got == want


def test_canonical_json_gives_the_same_texts_in_threads_at_once() -> None:
    """The one encoder canonical_json shares keeps no state between calls: the texts
    several threads make at once are those made one at a time."""
    from concurrent.futures import ThreadPoolExecutor

    values = [
        {"k": [i, {"b": "é" * (i % 3), "a": float(i), "n": {"x": [i] * (i % 4)}}], "z": None}
        for i in range(3000)
    ]
    want = [canonical_json(v) for v in values]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(canonical_json, values, chunksize=25))
    assert got == want


json_texts = st.text(
    alphabet=st.sampled_from(list('{}[]",:0123456789.eE+-tfnrualse \n\\u\t')), max_size=16
)


@settings(max_examples=400)
@given(any_values, json_texts, st.sampled_from(["", " ", "\n", "  "]), st.booleans())
def test_stored_texts_decode_exactly_as_json_loads(
    value: Any, garbage: str, pad: str, pad_left: bool
) -> None:
    """The codecs' fast decoding path gives what ``json.loads`` gives, or a StashError
    where it raises: on canonical texts (the stored form), padded texts and garbage."""
    texts = [garbage, garbage.strip()]
    try:
        texts.append(canonical_json(value))
    except StashError:
        pass
    for text in [*texts, *((pad + t) if pad_left else (t + pad) for t in texts)]:
        try:
            want: Any = ("ok", json.loads(text))
        except ValueError:
            want = ("error",)
        try:
            got: Any = ("ok", JsonCodec().decode(text))
        except StashError:
            got = ("error",)
        # NaN (from garbage such as "NaN") is not equal to itself: compare the texts.
        assert json.dumps(got) == json.dumps(want), text


users = st.dictionaries(st.integers(0, 6), st.sampled_from(["ann", "bob", "cy", "dee"]), max_size=4)
ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "set", "delete", "update"]),
        st.integers(0, 6),
        st.one_of(st.none(), st.sampled_from(["ann", "bob", "cy", "dee", "eve"])),
    ),
    max_size=12,
)


@given(users, ops)
def test_table_transaction_against_model(initial0: dict[int, str], ops_: list[Any]) -> None:
    # Make the initial state itself unique by name.
    initial: dict[int, str] = {}
    for k, v in initial0.items():
        if v not in initial.values():
            initial[k] = v
    tt = TableTransaction(initial, lambda a, b: a == b)
    model = dict(initial)
    for op, k, v in ops_:
        before = tt.items()
        try:
            if op == "insert":
                assert v is not None or True
                tt.insert(k, v or "x")
                assert k not in model and (v or "x") not in model.values()
                model[k] = v or "x"
            elif op == "set":
                tt.set(k, v)
                if v is None:
                    model.pop(k, None)
                else:
                    assert all(mv != v for mk, mv in model.items() if mk != k)
                    model[k] = v
            elif op == "delete":
                deleted = tt.delete(lambda kk, vv, k=k: kk == k)
                assert deleted == ([(k, model[k])] if k in model else [])
                model.pop(k, None)
            else:
                n = tt.update(lambda kk, vv, k=k, v=v: v if kk == k and v else None)
                assert n == (1 if k in model and v else 0)
                if k in model and v:
                    assert all(mv != v for mk, mv in model.items() if mk != k)
                    model[k] = v
        except StashError as e:
            assert "uniqueness violation" in str(e)
            assert tt.items() == before  # a rejected edit changes nothing
        assert tt.items() == dict(sorted(model.items()))
        names = list(tt.items().values())
        assert len(names) == len(set(names))
    # Applying pending() to the initial state gives items().
    acc: Counter[tuple[int, str]] = Counter({(k, v): 1 for k, v in initial.items()})
    keys_seen = []
    for k, v, d in tt.pending():
        acc[(k, v)] += d
        keys_seen.append(k)
        assert d in (1, -1)
    assert {kv for kv, n in acc.items() if n} == set(tt.items().items())
    assert all(n in (0, 1) for n in acc.values())
    assert keys_seen == sorted(keys_seen)
    canonical_json(list(tt.items().items()))
