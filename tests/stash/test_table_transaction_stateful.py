"""Protects: a TableTransaction's view and commits equal a dict model, unique names
included.

TableTransaction against a dict model (hypothesis stateful), with commits through a
real stash (TypedCollection.table + append) and a unique ``name`` in the values:
deletes then inserts of the same name, swaps of names between rows in one update,
set_many that frees a name another row takes, on memory:// and SQLite."""

from __future__ import annotations

import itertools
import json
import tempfile
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from stash import Stash, StashError, TypedCollection

pytestmark = pytest.mark.adversarial

KEYS = st.sampled_from([1, 2, 3, "1", "a", "b"])
NAMES = st.sampled_from(["x", "y", "z", "w"])
VALUES = st.builds(lambda n, i: {"name": n, "i": i}, NAMES, st.integers(0, 1))
_n = itertools.count()


def _tok(k: Any) -> Any:
    return ("t", tuple(k)) if isinstance(k, (tuple, list)) else (type(k).__name__, k)


def _canon(x: Any) -> str:
    return json.dumps(x, sort_keys=True)


def _violates(a: Any, b: Any) -> bool:
    return a["name"] == b["name"]


def _valid(model: dict) -> bool:
    names = [v["name"] for _, v in model.values()]
    return len(names) == len(set(names))


class TableMachine(RuleBasedStateMachine):
    backend = "memory"

    @initialize()
    def start(self) -> None:
        if self.backend == "memory":
            url = f"memory://tt{next(_n)}"
        else:
            url = f"sqlite:///{tempfile.mkdtemp()}/s.db"
        self.stash = Stash.open(url, fenced=False)
        self.coll = TypedCollection("people", key="json", value="json")
        self.committed: dict = {}  # token -> (key, value)
        self._begin()

    def teardown(self) -> None:
        if hasattr(self, "stash"):
            self.stash.close()

    def _begin(self) -> None:
        self.tt = self.coll.table(self.stash, _violates)
        self.model = dict(self.committed)

    def _attempt(self, trial: dict, fn: Any, extra_ok: bool = True) -> None:
        before = self.tt.items()
        if _valid(trial) and extra_ok:
            fn()
            self.model = trial
        else:
            try:
                fn()
            except StashError as e:
                assert "uniqueness violation" in str(e)
            else:
                raise AssertionError(f"accepted an edit that breaks uniqueness: {trial}")
            assert self.tt.items() == before

    @rule(k=KEYS, v=VALUES)
    def insert(self, k: Any, v: Any) -> None:
        trial = dict(self.model)
        exists = _tok(k) in trial
        trial[_tok(k)] = (k, v)
        self._attempt(trial, lambda: self.tt.insert(k, v), not exists)

    @rule(k=KEYS, v=st.one_of(st.none(), VALUES))
    def set(self, k: Any, v: Any) -> None:
        trial = dict(self.model)
        if v is None:
            trial.pop(_tok(k), None)
        else:
            trial[_tok(k)] = (k, v)
        self._attempt(trial, lambda: self.tt.set(k, v))

    @rule(entries=st.lists(st.tuples(KEYS, st.one_of(st.none(), VALUES)), max_size=4))
    def set_many(self, entries: list) -> None:
        trial = dict(self.model)
        for k, v in entries:
            if v is None:
                trial.pop(_tok(k), None)
            else:
                trial[_tok(k)] = (k, v)
        self._attempt(trial, lambda: self.tt.set_many(entries))

    @rule(ks=st.sets(KEYS, max_size=3))
    def delete(self, ks: set) -> None:
        toks = {_tok(k) for k in ks}
        got = self.tt.delete(lambda k, v: _tok(k) in toks)
        expect = sorted(_canon(kv) for t, kv in self.model.items() if t in toks)
        assert sorted(_canon((k, v)) for k, v in got) == expect, (got, expect)
        self.model = {t: kv for t, kv in self.model.items() if t not in toks}

    @rule(perm=st.permutations(["x", "y", "z", "w"]), ks=st.sets(KEYS, max_size=4))
    def rename(self, perm: list, ks: set) -> None:
        """Rename the chosen rows' names by a permutation (swaps between rows)."""
        mapping = dict(zip(["x", "y", "z", "w"], perm, strict=True))
        toks = {_tok(k) for k in ks}
        trial = {
            t: (k, {**v, "name": mapping[v["name"]]}) if t in toks else (k, v)
            for t, (k, v) in self.model.items()
        }
        n = sum(1 for t in self.model if t in toks)

        def fn() -> None:
            got = self.tt.update(
                lambda k, v: {**v, "name": mapping[v["name"]]} if _tok(k) in toks else None
            )
            assert got == n

        self._attempt(trial, fn)

    @rule()
    def commit(self) -> None:
        c = self.coll.get(self.stash)
        batch = c.make_batch(self.stash)
        for k, v, d in self.tt.pending():
            assert d in (1, -1)
            c.append_to_batch(batch, k, v, d)
        self.stash.append([batch])
        self.committed = dict(self.model)
        got = self.coll.peek_one(self.stash)
        assert sorted(_canon(kv) for kv in got.items()) == sorted(
            _canon(kv) for kv in self.committed.values()
        )
        self._begin()

    @rule()
    def abandon(self) -> None:
        self._begin()

    @invariant()
    def visible(self) -> None:
        if not hasattr(self, "tt"):
            return
        got = []
        self.tt.for_values(lambda k, v: got.append((_tok(k), _canon(v))))
        assert sorted(got, key=repr) == sorted(
            ((t, _canon(v)) for t, (k, v) in self.model.items()), key=repr
        )
        for _t, (k, v) in self.model.items():
            assert self.tt.get(k) == v


class TableMachineSqlite(TableMachine):
    backend = "sqlite"


TestTableMemory = TableMachine.TestCase
TestTableMemory.settings = settings(max_examples=150, stateful_step_count=25, deadline=None)
TestTableSqlite = TableMachineSqlite.TestCase
TestTableSqlite.settings = settings(max_examples=25, stateful_step_count=15, deadline=None)
