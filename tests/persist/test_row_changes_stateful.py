"""A hypothesis stateful test of row-level changes against a dict model.

Protects: ``WriteHandle.upsert`` / ``delete`` / ``update`` and ``Txn.upsert`` / ``delete`` /
``update`` (:mod:`persist.rows`, :mod:`persist.txn_rows`) interleaved with raw appends
(duplicates included), compaction, since downgrades (beyond the upper) and schema
evolution (a widened value column, then an added nullable one), on memory, SQLite and
Postgres stashes with inline and blob parts.  After every step the shard's live rows equal
the model ``{(id, v, note): count}``, so every key that last went through an upsert has one
row with ``_diff`` 1.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from persist import MemoryBlob, PersistClient, RowChanges
from stash import Stash

KEY = pa.schema([pa.field("id", pa.int64(), False)])
#: The value schema's versions: v starts as int32, is widened to int64, then gains `note`.
VALS = [
    pa.schema([pa.field("v", pa.int32())]),
    pa.schema([pa.field("v", pa.int64())]),
    pa.schema([pa.field("v", pa.int64()), pa.field("note", pa.string())]),
]

ids = st.integers(0, 5)
vals = st.integers(-3, 3)
notes = st.sampled_from([None, "a", "b"])

Row = tuple[int, int, "str | None"]


class RowChangesModel(RuleBasedStateMachine):
    """One shard under changes, raw appends and maintenance; the model is a Counter."""

    def __init__(self, stash_url: str, inline_max_bytes: int) -> None:
        super().__init__()
        self.stash = Stash.open(stash_url, fenced=False)
        self.client = PersistClient(
            self.stash, MemoryBlob(), compaction="off", inline_max_bytes=inline_max_bytes
        )
        self.name = f"m-{uuid.uuid4().hex}"
        self.version = 0
        self.w, self.r = self.client.open(self.name, KEY, VALS[0])
        self.model: Counter[Row] = Counter()

    def teardown(self) -> None:
        self.client.close()
        self.stash.close()

    # ------------------------------------------------------------------ helpers
    @property
    def has_note(self) -> bool:
        return self.version >= 2

    def table(self, rows: list[Row]) -> pa.Table:
        schema = pa.schema([*KEY, *VALS[self.version]])
        cols: dict[str, list[Any]] = {"id": [r[0] for r in rows], "v": [r[1] for r in rows]}
        if self.has_note:
            cols["note"] = [r[2] for r in rows]
        return pa.table(cols, schema=schema)

    def row(self, i: int, v: int, note: str | None) -> Row:
        return (i, v, note if self.has_note else None)

    def upper(self) -> int:
        u = self.w.fetch_recent_upper().as_option()
        assert u is not None
        return u

    def moved(self, i: int, f: Callable[[Row], Row]) -> None:
        """The model of an update of key ``i``: all its rows retracted, then re-inserted."""
        old = [(k, self.model.pop(k)) for k in [k for k in self.model if k[0] == i]]
        for k, n in old:
            self.model[f(k)] += n

    def counted(self, ch: RowChanges, before: Counter[Row], upper: int) -> None:
        """``ch`` counts exactly the model's net change (a row equal to its live row
        counts in neither), and a change that changed nothing moved no upper."""
        after = +self.model
        assert (ch.inserted, ch.retracted) == (
            sum((after - before).values()),
            sum((before - after).values()),
        )
        assert self.upper() == (upper if after == before else upper + 1)

    def replaced(self, rows: dict[int, Row]) -> None:
        for k in [k for k in self.model if k[0] in rows]:
            del self.model[k]
        self.model.update(rows.values())

    # ------------------------------------------------------------------ rules
    @rule(rows=st.dictionaries(ids, st.tuples(vals, notes), max_size=4))
    def upsert(self, rows: dict[int, tuple[int, str | None]]) -> None:
        new = {i: self.row(i, v, n) for i, (v, n) in rows.items()}
        before, upper = +self.model, self.upper()
        ch = self.w.upsert(self.table(sorted(new.values())))
        self.replaced(new)
        self.counted(ch, before, upper)

    @rule(keys=st.frozensets(ids, max_size=3))
    def delete(self, keys: frozenset[int]) -> None:
        before, upper = +self.model, self.upper()
        ch = self.w.delete(pc.field("id").isin(sorted(keys)))
        for k in [k for k in self.model if k[0] in keys]:
            del self.model[k]
        self.counted(ch, before, upper)

    @rule(i=ids, x=vals)
    def update_add(self, i: int, x: int) -> None:
        before, upper = +self.model, self.upper()
        ch = self.w.update(pc.field("id") == i, {"v": pc.field("v") + x})
        self.moved(i, lambda k: (k[0], k[1] + x, k[2]))
        self.counted(ch, before, upper)

    @precondition(lambda self: self.has_note)
    @rule(i=ids, note=notes)
    def update_note(self, i: int, note: str | None) -> None:
        before, upper = +self.model, self.upper()
        ch = self.w.update(pc.field("id") == i, {"note": note})
        self.moved(i, lambda k: (k[0], k[1], note))
        self.counted(ch, before, upper)

    @rule(rows=st.lists(st.tuples(ids, vals, notes), max_size=3))
    def append_raw(self, rows: list[tuple[int, int, str | None]]) -> None:
        """Raw updates, duplicates of live rows included."""
        upper = self.upper()
        new = [self.row(*r) for r in rows]
        vals_of = (lambda r: (r[1], r[2])) if self.has_note else (lambda r: (r[1],))
        self.w.compare_and_append(
            [(((r[0],), vals_of(r)), upper, 1) for r in new], upper, upper + 1
        )
        self.model.update(new)

    @rule(up=st.integers(0, 3), i=ids, x=vals, j=ids)
    def txn(self, up: int, i: int, x: int, j: int) -> None:
        """An upsert of ``up`` keys, an update of key ``i`` and a delete of ``j`` in one
        transaction, applied in order at one time."""
        new = {k: self.row(k, 10 + k, "t") for k in range(up)}
        with self.client.begin() as t:
            t.upsert(self.name, self.table(sorted(new.values())))
            t.update(self.name, pc.field("id") == i, {"v": pc.field("v") + x})
            t.delete(self.name, pc.field("id") == j)
        self.replaced(new)
        self.moved(i, lambda k: (k[0], k[1] + x, k[2]))
        for k in [k for k in self.model if k[0] == j]:
            del self.model[k]

    @rule()
    def compact(self) -> None:
        self.client.compactor.compact_once(self.name)

    @rule(beyond=st.integers(0, 2))
    def downgrade_since(self, beyond: int) -> None:
        """Up to beyond the upper: compaction may then advance times past it."""
        self.r.downgrade_since(self.upper() + beyond)

    @precondition(lambda self: self.version < len(VALS) - 1)
    @rule()
    def evolve(self) -> None:
        """The next schema version: widen ``v``, then add ``note``; writes go through
        the new handle (an older one is refused from now on)."""
        self.version += 1
        since = self.r.since
        self.w, r = self.client.open(self.name, KEY, VALS[self.version])
        r.downgrade_since(since.as_option() or 0)
        self.r.expire()
        self.r = r

    # ------------------------------------------------------------------ invariants
    @invariant()
    def live_rows_equal_the_model(self) -> None:
        t = self.w.read_live(self.w.change_state(), None)
        cols = [t.column("id").to_pylist(), t.column("v").to_pylist()]
        cols.append(t.column("note").to_pylist() if self.has_note else [None] * t.num_rows)
        got = Counter(
            dict(zip(zip(*cols, strict=True), t.column("_diff").to_pylist(), strict=True))
        )
        assert got == +self.model


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def stash_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return "memory://"
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'stash.db'}"
    from tests.support.dbutil import migrate_to_head

    url = str(request.getfixturevalue("postgres_url"))
    migrate_to_head(url)
    return url


@pytest.mark.parametrize("inline_max_bytes", [16 * 1024, 0], ids=["inline", "blob"])
def test_row_changes_against_a_dict_model(stash_url: str, inline_max_bytes: int) -> None:
    run_state_machine_as_test(
        lambda: RowChangesModel(stash_url, inline_max_bytes),
        settings=settings(
            max_examples=15,
            stateful_step_count=12,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture],
        ),
    )
