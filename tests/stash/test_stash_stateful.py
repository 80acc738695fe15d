"""Hypothesis: random sequences of update / seal / compact / consolidate / append against
each backend and a plain-Python reference model; after every step ``iter``, ``peek``,
``since`` and ``upper`` must match the model (and errors must match too)."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from stash import Antichain, AppendBatch, Memory, Stash, StashError
from stash.antichain import I64_MAX
from stash.codec import canonical_json, json_sort_key
from tests.support.dbutil import backend_url, migrate_to_head

NAMES = ["a", "b", "c"]
keys = st.sampled_from(["k1", "k2", "k3"])
values = st.one_of(st.integers(-3, 3), st.sampled_from(["x", "y"]), st.just({"n": 1}))
diffs = st.sampled_from([-1, 1, 2])
_ids = itertools.count()


class Model:
    """Reference: per collection a Counter of ((k, v), t) -> diff, since and upper."""

    def __init__(self) -> None:
        self.data: dict[str, Counter[tuple[Any, int]]] = {n: Counter() for n in NAMES}
        self.since: dict[str, int | None] = dict.fromkeys(NAMES, 0)
        self.upper: dict[str, int | None] = dict.fromkeys(NAMES, 0)

    def iter(self, n: str) -> list[Any]:
        since = self.since[n]
        assert since is not None
        acc: Counter[tuple[Any, int]] = Counter()
        for (kv, t), d in self.data[n].items():
            acc[(kv, max(t, since))] += d
        out = [((k, json.loads(v)), t, d) for ((k, v), t), d in acc.items() if d]
        return sorted(out, key=lambda e: (json_sort_key(e[0][0]), json_sort_key(e[0][1]), e[1]))

    def peek(self, n: str) -> list[Any] | None:
        s, u = Antichain.from_option(self.since[n]), Antichain.from_option(self.upper[n])
        if u <= s:
            return None
        ts = I64_MAX if self.upper[n] is None else self.upper[n] - 1  # type: ignore[operator]
        acc: Counter[Any] = Counter()
        for ((k, v), t), d in self.data[n].items():
            if t <= ts:
                acc[(k, v)] += d
        out = [(k, json.loads(v), d) for (k, v), d in acc.items() if d]
        return sorted(out, key=lambda e: (json_sort_key(e[0]), json_sort_key(e[1])))


class StashMachine(RuleBasedStateMachine):
    url: str
    wrap: bool

    @initialize()
    def setup(self) -> None:
        self.stash: Stash = Stash.open(self.url_factory(), fenced=False)
        if self.wrap:
            self.stash = Memory(self.stash)
        self.model = Model()
        self.colls = {n: self.stash.collection(n) for n in NAMES}

    def teardown(self) -> None:
        if hasattr(self, "stash"):
            self.stash.close()

    def _upper(self, n: str) -> int | None:
        return self.model.upper[n]

    @rule(n=st.sampled_from(NAMES), k=keys, v=values, dt=st.integers(0, 3), d=diffs)
    def update(self, n: str, k: Any, v: Any, dt: int, d: int) -> None:
        upper = self._upper(n)
        t = (upper if upper is not None else 0) + dt - 1
        ok = upper is not None and t >= upper
        try:
            self.stash.update(self.colls[n], (k, v), t, d)
            assert ok, "update below upper was accepted"
            self.model.data[n][((k, canonical_json(v)), t)] += d
        except StashError as e:
            assert not ok, str(e)
            assert str(e) == (
                f"stash error: entry time {t} is less than the current upper "
                f"frontier {Antichain.from_option(upper)}"
            )

    @rule(n=st.sampled_from(NAMES), delta=st.integers(-1, 3), empty=st.booleans())
    def seal(self, n: str, delta: int, empty: bool) -> None:
        cur = self._upper(n)
        new = None if empty and delta == 3 else ((cur if cur is not None else 0) + delta)
        ok = Antichain.from_option(cur) <= Antichain.from_option(new)
        try:
            self.stash.seal(self.colls[n], Antichain.from_option(new))
            assert ok
            self.model.upper[n] = new
        except StashError:
            assert not ok

    @rule(n=st.sampled_from(NAMES), delta=st.integers(-1, 3))
    def compact(self, n: str, delta: int) -> None:
        cur = self.model.since[n]
        if cur is None:
            return
        new = cur + delta
        ok = delta >= 0 and Antichain.from_elem(new) <= Antichain.from_option(self._upper(n))
        try:
            self.stash.compact(self.colls[n], Antichain.from_elem(new))
            assert ok
            self.model.since[n] = new
        except StashError:
            assert not ok

    @rule(n=st.sampled_from(NAMES))
    def consolidate(self, n: str) -> None:
        self.stash.consolidate(self.colls[n])

    @rule(
        picks=st.lists(
            st.tuples(st.sampled_from(NAMES), keys, values, diffs, st.booleans()),
            min_size=1,
            max_size=4,
        ),
        stale=st.booleans(),
    )
    def append(self, picks: list[Any], stale: bool) -> None:
        batches: dict[str, AppendBatch] = {}
        ok = True
        for n, k, v, d, _ in picks:
            c = self.colls[n]
            if n not in batches:
                upper = self._upper(n)
                if upper is None:
                    return
                lower = upper - 1 if stale and upper > 0 else upper
                ok = ok and lower == upper
                batches[n] = AppendBatch(
                    c,
                    Antichain.from_elem(lower),
                    Antichain.from_elem(lower + 1),
                    Antichain.from_elem(lower),
                    timestamp=lower,
                )
            c.append_to_batch(batches[n], k, v, d)
        ok = ok and all(
            Antichain.from_option(self.model.since[n]) <= b.compact for n, b in batches.items()
        )
        try:
            self.stash.append(list(batches.values()))
            assert ok
        except StashError:
            assert not ok
            return
        for n, b in batches.items():
            for (kj, vj), t, d in b.entries:
                c = self.colls[n]
                self.model.data[n][((c.key_codec.decode(kj), vj), t)] += d
            self.model.upper[n] = b.upper.as_option()
            self.model.since[n] = b.compact.as_option()

    @invariant()
    def matches_model(self) -> None:
        if not hasattr(self, "stash"):
            return
        for n, c in self.colls.items():
            assert self.stash.upper(c) == Antichain.from_option(self.model.upper[n])
            assert self.stash.since(c) == Antichain.from_option(self.model.since[n])
            assert self.stash.iter(c) == self.model.iter(n)
            expected = self.model.peek(n)
            if expected is None:
                with pytest.raises(StashError):
                    self.stash.peek(c)
            else:
                assert self.stash.peek(c) == expected


@pytest.mark.parametrize("backend", ["memory", "memory-over-sqlite", "sqlite", "postgres"])
def test_stash_matches_model(backend: str, tmp_path: Any, request: pytest.FixtureRequest) -> None:
    if backend == "postgres":
        base = backend_url(request, backend, tmp_path)
        import sqlalchemy as sa

        counter = itertools.count()
        engine = sa.create_engine(base, isolation_level="AUTOCOMMIT")

        def factory() -> str:
            # A fresh, migrated schema per example: drop and recreate the public schema.
            with engine.connect() as conn:
                conn.exec_driver_sql("DROP SCHEMA public CASCADE")
                conn.exec_driver_sql("CREATE SCHEMA public")
            migrate_to_head(base)
            next(counter)
            return base
    else:

        def factory() -> str:
            if backend == "memory":
                return f"memory://stateful{next(_ids)}"
            return f"sqlite:///{tmp_path}/stateful{next(_ids)}.db"

    machine = type(
        "M",
        (StashMachine,),
        {"url_factory": staticmethod(factory), "wrap": backend == "memory-over-sqlite"},
    )
    examples = 60 if backend == "memory" else 15
    machine.TestCase.settings = settings(
        max_examples=examples,
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    machine.TestCase().runTest()
