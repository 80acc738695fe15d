"""Protects: ``with_transaction`` across two collections stays serializable when other
writers commit between its reads and its commit.

A hypothesis state machine against a dict model: a transaction reads a key of each
collection (by key, whole collections, or through lazy tables) and moves a unit from one
to the other; on its first attempt another handle commits sets and deletions of either
collection between the reads and the commit. The transaction's result (what it read on
its last attempt) must be what the model holds after those other commits, and both
collections must equal the model after every step. On the old code a deletion by the
other writer, consolidated with the row it retracted, went unseen by a key read: the
transaction committed over it and the key read back at multiplicity -1."""

from __future__ import annotations

import itertools
import tempfile
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from stash import Stash, TypedCollection

pytestmark = pytest.mark.adversarial

A = TypedCollection("A", key="str", value="int")
B = TypedCollection("B", key="str", value="int")
KEYS = st.sampled_from(["x", "y", "z"])
OTHER = st.lists(
    st.tuples(st.sampled_from("AB"), KEYS, st.one_of(st.none(), st.integers(0, 3))), max_size=3
)
_n = itertools.count()


class Interleaved(RuleBasedStateMachine):
    @initialize(backend=st.sampled_from(["memory", "sqlite"]))
    def start(self, backend: str) -> None:
        if backend == "memory":
            url = f"memory://interleaved-{next(_n)}"
        else:
            url = f"sqlite:///{tempfile.mkdtemp()}/s.db"
        self.s = Stash.open(url, fenced=False)
        self.other = Stash.open(url, fenced=False)
        self.model: dict[str, dict[str, int]] = {"A": {}, "B": {}}

    def teardown(self) -> None:
        if hasattr(self, "s"):
            self.s.close()
            self.other.close()

    def _set(self, coll: str, k: str, v: int | None) -> None:
        if v is None:
            self.model[coll].pop(k, None)
        else:
            self.model[coll][k] = v

    def _others(self, ops: list[tuple[str, str, int | None]]) -> None:
        for coll, k, v in ops:
            t = A if coll == "A" else B
            self.other.with_transaction(lambda tx, t=t, k=k, v=v: tx.table(t).set(k, v))
            self._set(coll, k, v)

    @rule(k=KEYS, j=KEYS, how=st.sampled_from(["key", "full", "lazy"]), others=OTHER)
    def move(self, k: str, j: str, how: str, others: list[Any]) -> None:
        attempts: list[int] = []

        def fn(tx: Any) -> tuple[int | None, int | None]:
            attempts.append(1)
            if how == "key":
                a, b = tx.peek_key_one(A, k), tx.peek_key_one(B, j)
            elif how == "full":
                a, b = tx.peek_one(A).get(k), tx.peek_one(B).get(j)
            else:
                a, b = tx.table(A).get(k), tx.table(B).get(j)
            if len(attempts) == 1:
                self._others(others)  # other writers commit between read and commit
            if a is None:
                tx.table(A).set(k, 3)
            else:
                tx.table(A).set(k, None if a <= 1 else a - 1)
                tx.table(B).set(j, (b or 0) + 1)
            return a, b

        a, b = self.s.with_transaction(fn, retries=20)
        assert (a, b) == (self.model["A"].get(k), self.model["B"].get(j))
        if a is None:
            self._set("A", k, 3)
        else:
            self._set("A", k, None if a <= 1 else a - 1)
            self._set("B", j, (b or 0) + 1)

    @rule(others=OTHER)
    def plain(self, others: list[Any]) -> None:
        self._others(others)

    @invariant()
    def equals_model(self) -> None:
        if hasattr(self, "s"):
            assert A.peek_one(self.s) == self.model["A"]
            assert B.peek_one(self.s) == self.model["B"]


Interleaved.TestCase.settings = settings(max_examples=60, stateful_step_count=10, deadline=None)
test_interleaved = Interleaved.TestCase
