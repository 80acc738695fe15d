"""Protects: a transaction that read a key never commits over a deletion of that key.

A key read by a transaction (``TypedCollection.table(...).get``, ``tx.peek_key_one``, a
lazy ``tx.table``) is checked at commit. A deletion by another writer is consolidated at
once with the row it retracts (the since follows every append by default), so the key
is left with no row at all, none at or after the upper the transaction read it at: the
commit must still see that the key changed. It once did not, and appended the
retraction of a value already gone: the collection held the key with multiplicity -1
and every ``peek_one`` of it failed from then on.

A hypothesis state machine then runs bound tables against a dict model with a second
writer between the read and the commit: a commit may be refused, but one that lands
only lands when every key it read still holds what it read, and the collection always
equals the model."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from stash import AppendLowerMismatch, Stash, TypedCollection

pytestmark = pytest.mark.adversarial

CFG = TypedCollection("cfg", key="str", value="int")


def test_bound_table_refuses_commit_over_a_deleted_key(open_stash: Any) -> None:
    s, other = open_stash(), open_stash()
    CFG.upsert(s, [("a", 1), ("b", 1)])
    tt = CFG.table(s)
    assert tt.get("a") == 1
    other.with_transaction(lambda tx: tx.table(CFG).set("a", None))  # another writer
    tt.set("a", 5)
    with pytest.raises(AppendLowerMismatch):
        tt.commit()
    assert CFG.peek_one(s) == {"b": 1}
    assert CFG.peek_one(other) == {"b": 1}


def test_with_transaction_reruns_after_a_deleted_key(open_stash: Any) -> None:
    s, other = open_stash(), open_stash()
    CFG.upsert(s, [("a", 1), ("b", 1)])
    runs: list[Any] = []

    def bump(tx: Any) -> Any:
        seen = tx.peek_key_one(CFG, "a")
        runs.append(seen)
        if len(runs) == 1:  # another writer deletes the key between read and commit
            other.with_transaction(lambda t2: t2.table(CFG).set("a", None))
        tx.table(CFG).set("a", (seen or 0) + 10)
        return seen

    assert s.with_transaction(bump) is None
    assert runs == [1, None]
    assert CFG.peek_one(s) == {"a": 10, "b": 1}


_n = itertools.count()
KEYS = st.sampled_from(["a", "b", "c"])
VALS = st.one_of(st.none(), st.integers(0, 2))


class ReadThenOtherWrites(RuleBasedStateMachine):
    """A bound table reads keys, another handle writes (or deletes) keys, the table sets
    keys and commits."""

    @initialize()
    def start(self) -> None:
        url = f"memory://key-read-deleted-{next(_n)}"
        self.s = Stash.open(url, fenced=False)
        self.other = Stash.open(url, fenced=False)
        self.model: dict[str, int] = {}

    def teardown(self) -> None:
        self.other.close()
        self.s.close()

    @rule(
        seed=st.dictionaries(KEYS, st.integers(0, 2)),
        reads=st.lists(KEYS, max_size=3),
        writes=st.dictionaries(KEYS, VALS, max_size=3),
        mine=st.dictionaries(KEYS, VALS, min_size=1, max_size=3),
    )
    def read_other_write_commit(
        self,
        seed: dict[str, int],
        reads: list[str],
        writes: dict[str, int | None],
        mine: dict[str, int | None],
    ) -> None:
        if seed:
            CFG.upsert(self.s, list(seed.items()))
            self.model.update(seed)
        tt = CFG.table(self.s)
        seen = {k: tt.get(k) for k in reads}
        if writes:
            self.other.with_transaction(
                lambda tx: [tx.table(CFG).set(k, v) for k, v in writes.items()]
            )
            for k, v in writes.items():
                if v is None:
                    self.model.pop(k, None)
                else:
                    self.model[k] = v
        # set() reads a key it has not read yet (now, after the other writer): the
        # commit checks every key read, each against what it held when read.
        for k in mine:
            seen.setdefault(k, self.model.get(k))
        try:
            for k, v in mine.items():
                tt.set(k, v)  # a lazy read checks the earlier ones: it may conflict
            writing = bool(tt.pending())
            tt.commit()
        except AppendLowerMismatch:
            return
        # A commit that writes nothing is read-only: it serializes where it read.
        assert not writing or all(self.model.get(k) == v for k, v in seen.items()), (
            "a commit landed over a change of a key it read"
        )
        for k, v in mine.items() if writing else ():
            if v is None:
                self.model.pop(k, None)
            else:
                self.model[k] = v

    @invariant()
    def equals_model(self) -> None:
        if hasattr(self, "s"):
            assert CFG.peek_one(self.s) == self.model


ReadThenOtherWrites.TestCase.settings = settings(
    max_examples=60, stateful_step_count=8, deadline=None
)
test_read_then_other_writes = ReadThenOtherWrites.TestCase
