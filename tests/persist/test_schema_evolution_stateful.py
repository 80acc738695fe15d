"""A hypothesis stateful test of schema evolution against a reference.

Random compatible value schema changes (add a nullable column, drop one, widen one, make
one nullable) interleaved with appends by writers of any registered version,
compactions and snapshots; random incompatible changes, each refused with nothing
committed.  After every step, a reader of the newest version sees exactly the reference
conformed to the newest schema, and a reader of an older version its own view (its
columns, null where the newest version dropped them: dropped columns are gone).

The reference is independent of the implementation's by-name continuity rule: each
column gets an *identity* when it is added (dropping it ends the identity; adding the
name again starts a new one) and a row records values by identity, so conforming a row
to a version reads each of that version's columns by its identity (null if the row has
none) -- as Iceberg's field ids do.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from persist import MemoryBlob, PersistClient, SchemaMismatch
from stash import Stash

KS = pa.schema([pa.field("k", pa.int64(), nullable=False)])
NAMES = ["a", "b", "c", "d", "e"]
WIDER = {
    pa.int8(): [pa.int16(), pa.int32(), pa.int64()],
    pa.int16(): [pa.int32(), pa.int64()],
    pa.int32(): [pa.int64()],
    pa.float32(): [pa.float64()],
    pa.string(): [pa.large_string()],
    pa.large_string(): [pa.string()],
}
ADD_TYPES = [pa.int8(), pa.int32(), pa.float32(), pa.string()]

# Column: (name, type, nullable, identity).  A version: a tuple of columns.
Column = tuple[str, pa.DataType, bool, int]


def value_for(t: pa.DataType, nullable: bool, draw: int) -> Any:
    """A small value of type ``t`` (few distinct values, so rows collide)."""
    if nullable and draw % 4 == 3:
        return None
    if pa.types.is_integer(t):
        return draw % 3 - 1
    if pa.types.is_floating(t):
        return [0.5, 1.5, -2.0][draw % 3]
    return ["x", "y", "z"][draw % 3]


def to_schema(cols: tuple[Column, ...]) -> pa.Schema:
    return pa.schema([pa.field(n, t, nullable=nl) for n, t, nl, _ in cols])


class SchemaEvolution(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.stash = Stash.open("memory://", fenced=False)
        self.client = PersistClient(
            self.stash, MemoryBlob(), compaction="off", inline_max_bytes=1024, target_part_bytes=300
        )
        self.ids = itertools.count()
        v0 = (("a", pa.int8(), False, next(self.ids)), ("b", pa.string(), True, next(self.ids)))
        self.versions: list[tuple[Column, ...]] = [v0]
        self.newest = 0  # the id of the newest version
        w, r = self.client.open("s", KS, to_schema(v0))
        self.writers = {0: w}
        self.readers = {0: r}
        r.downgrade_since(0)
        # Reference: (k, {identity: value}, t, d).
        self.updates: list[tuple[int, dict[int, Any], int, int]] = []
        self.upper = 0

    def teardown(self) -> None:
        self.client.close()
        self.stash.close()

    # ----------------------------------------------------------------- helpers
    def _open(self, cols: tuple[Column, ...]) -> None:
        schema = to_schema(cols)
        # A registered version is reused only if no later version dropped one of its
        # columns (else its writers' values there would read as null for everyone).
        expect = next(
            (
                i
                for i in range(len(self.versions) - 1, -1, -1)
                if to_schema(self.versions[i]).equals(schema) and not self._lost(i)
            ),
            None,
        )
        # Columns of the newest version this schema lacks are dropped by name.
        drop = [c[0] for c in self.versions[self.newest] if c[0] not in schema.names]
        w, r = self.client.open("s", KS, schema, drop=drop)
        if expect is None:
            self.versions.append(cols)
            expect = self.newest = len(self.versions) - 1
        else:
            # Equal to a registered version: that version, nothing registered (its
            # columns keep that version's identities).
            assert len(self.client.inspect("s").schema_history) == len(self.versions)
        assert w.schema_id == expect and r.schema_id == expect
        self.writers.setdefault(expect, w)
        self.readers.setdefault(expect, r)

    def _lost(self, version: int) -> bool:
        """Whether a version after ``version`` dropped one of its columns."""
        live = {c[3] for c in self.versions[self.newest]}
        return any(c[3] not in live for c in self.versions[version])

    def _view(self, version: int) -> Counter[tuple[Any, ...]]:
        """The reference as the view of ``version``: its columns by identity, null for
        a column the newest version no longer has (dropped columns are gone)."""
        cols = self.versions[version]
        live = {c[3] for c in self.versions[self.newest]}
        acc: Counter[tuple[Any, ...]] = Counter()
        for k, vals, _t, d in self.updates:
            acc[(k, *(vals.get(ident) if ident in live else None for _, _, _, ident in cols))] += d
        return Counter({r: d for r, d in acc.items() if d})

    # ------------------------------------------------------------------- rules
    @rule(data=st.data())
    def add_column(self, data: st.DataObject) -> None:
        cols = self.versions[self.newest]
        free = [n for n in NAMES if n not in {c[0] for c in cols}]
        if not free:
            return
        name = data.draw(st.sampled_from(free))
        t = data.draw(st.sampled_from(ADD_TYPES))
        at = data.draw(st.integers(0, len(cols)))
        new = (*cols[:at], (name, t, True, next(self.ids)), *cols[at:])
        self._open(new)

    @rule(data=st.data())
    def drop_column(self, data: st.DataObject) -> None:
        cols = self.versions[self.newest]
        if len(cols) < 2:
            return
        i = data.draw(st.integers(0, len(cols) - 1))
        self._open(cols[:i] + cols[i + 1 :])

    @rule(data=st.data())
    def widen_column(self, data: st.DataObject) -> None:
        cols = self.versions[self.newest]
        i = data.draw(st.integers(0, len(cols) - 1))
        n, t, nl, ident = cols[i]
        if t not in WIDER:
            return
        wider = data.draw(st.sampled_from(WIDER[t]))
        self._open((*cols[:i], (n, wider, nl, ident), *cols[i + 1 :]))

    @rule(data=st.data())
    def make_nullable(self, data: st.DataObject) -> None:
        cols = self.versions[self.newest]
        i = data.draw(st.integers(0, len(cols) - 1))
        n, t, _, ident = cols[i]
        self._open((*cols[:i], (n, t, True, ident), *cols[i + 1 :]))

    @rule(data=st.data())
    def incompatible_change_commits_nothing(self, data: st.DataObject) -> None:
        cols = self.versions[self.newest]
        schema = to_schema(cols)
        kind = data.draw(
            st.sampled_from(["narrow", "not null added", "not null again", "key", "reorder"])
        )
        key = KS
        if kind == "narrow":
            nar = [
                i
                for i, c in enumerate(cols)
                if c[1] in (pa.int16(), pa.int32(), pa.int64(), pa.float64())
            ]
            if not nar:
                return
            i = data.draw(st.sampled_from(nar))
            n, t, nl, _ = cols[i]
            to = pa.float32() if t == pa.float64() else pa.int8()
            schema = schema.set(i, pa.field(n, to, nullable=nl))
        elif kind == "not null added":
            free = [n for n in NAMES if n not in schema.names]
            if not free:
                return
            schema = schema.append(pa.field(free[0], pa.int64(), nullable=False))
        elif kind == "not null again":
            nul = [i for i, c in enumerate(cols) if c[2]]
            if not nul:
                return
            i = data.draw(st.sampled_from(nul))
            schema = schema.set(i, schema.field(i).with_nullable(False))
        elif kind == "key":
            key = pa.schema([pa.field("k", pa.int32(), nullable=False)])
        else:
            if len(cols) < 2:
                return
            schema = pa.schema([*list(schema)[1:], schema.field(0)])
        if key.equals(KS) and any(to_schema(v).equals(schema) for v in self.versions):
            return  # a registered version (e.g. narrowed back to it): that one's view
        before = self.client.inspect("s")
        with pytest.raises(SchemaMismatch):
            self.client.open("s", key, schema)
        after = self.client.inspect("s")
        assert after.seqno == before.seqno and after.to_entries() == before.to_entries()

    @rule(data=st.data(), n=st.integers(0, 4))
    def append(self, data: st.DataObject, n: int) -> None:
        version = data.draw(st.sampled_from(sorted(self.writers)))
        cols = self.versions[version]
        batch = []
        pending = []
        for _ in range(n):
            k = data.draw(st.integers(0, 2))
            vals = {c[3]: value_for(c[1], c[2], data.draw(st.integers(0, 7))) for c in cols}
            d = data.draw(st.sampled_from([-1, 1, 2]))
            batch.append((((k,), tuple(vals[c[3]] for c in cols)), self.upper, d))
            pending.append((k, vals, self.upper, d))
        if self._lost(version):
            # A writer of a version that lost a column is refused (nothing commits) as
            # soon as it has a part to write; an append of no net updates loses nothing.
            net: Counter[Any] = Counter()
            for (k, vals), t, d in [
                ((u[0], tuple(sorted(u[1].items()))), u[2], u[3]) for u in pending
            ]:
                net[(k, vals, t)] += d
            before = self.client.inspect("s")
            if any(net.values()):
                with pytest.raises(SchemaMismatch):
                    self.writers[version].append(batch, self.upper, self.upper + 1)
                assert self.client.inspect("s").upper == before.upper
                return
        self.writers[version].append(batch, self.upper, self.upper + 1)
        self.updates.extend(pending)
        self.upper += 1

    @rule()
    def compact(self) -> None:
        self.client.compactor.compact_once("s")

    # -------------------------------------------------------------- invariants
    @invariant()
    def reads_match_the_reference(self) -> None:
        if self.upper == 0:
            return
        st_ = self.client.inspect("s")
        assert len(st_.schema_history) == len(self.versions)
        as_of = self.upper - 1
        for version in sorted({self.newest, *self.readers}):
            r = self.readers.get(version)
            if r is None:
                continue
            snap = r.snapshot(as_of)
            names = [c[0] for c in self.versions[version]]
            assert snap.column_names == ["k", *names, "_time", "_diff"]
            got: Counter[tuple[Any, ...]] = Counter()
            for row in snap.to_pylist():
                key = (row["k"], *(row[n] for n in names))
                assert key not in got, ("not consolidated", row)
                got[key] = row["_diff"]
            assert got == self._view(version), version


SchemaEvolution.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_schema_evolution_stateful = SchemaEvolution.TestCase
