"""Exactly-once appends against a model: two apps append numbered writes to one table
through two clients, with lost acknowledgements injected (the append lands, its outcome
stays unknown), and retry each write whose outcome is unknown with its
``(app_id, version)``, from either client, after the writers' leases ran out or not.
Another writer adds nullable columns meanwhile (a retry after it passes the same rows
in the newest columns).  The model: every write acknowledged is in the table exactly once, a write never
acknowledged is in it at most once, and after its acknowledged retry exactly once; a
version below an app's committed one is refused and changes nothing."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from persist import (
    AppTransaction,
    ConsensusError,
    MemoryBlob,
    PersistClient,
    StaleAppVersion,
    Table,
    Txn,
)
from stash import Stash
from tests.support.clock import Clock
from tests.support.stash_faults import AckLostStash

SCHEMA = pa.schema([("app", pa.string()), ("n", pa.int64())])
APPS = ("a", "b")


class AppTxnModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        inner = Stash.open("memory://", fenced=False)
        self.flaky = AckLostStash(inner)
        blob = MemoryBlob()
        kw: dict[str, Any] = {
            "clock": self.clock,
            "writer_lease_seconds": 60,
            "compaction": "off",
            "consensus_retries": 1,
        }
        self.clients = [
            PersistClient(self.flaky, blob, **kw),  # type: ignore[arg-type]
            PersistClient(inner, blob, **kw),
        ]
        self.tables: list[Table] = [self.clients[0].create_table("t", SCHEMA, key=["app"])]
        self.tables.append(self.clients[1].table("t"))
        self.committed: dict[str, int] = {}  # app -> newest acknowledged version
        self.unknown: dict[str, int] = {}  # app -> version whose outcome is unknown
        self.rows: Counter[tuple[str, int]] = Counter()  # acknowledged writes' rows

    def batch(self, app: str, version: int) -> pa.Table:
        # Two rows per write, numbered by the version: a write twice shows as 4 rows.
        # The columns another writer added since (evolve) are null.
        schema = self.clients[1].inspect("t").value_schema
        cols = {n: pa.nulls(2, schema.field(n).type) for n in schema.names}
        cols.update(app=pa.array([app, app]), n=pa.array([version, version]))
        return pa.table(cols)

    @rule()
    def evolve(self) -> None:
        """Another writer adds a nullable column (perhaps between a write whose outcome
        is unknown and its retry: the retry is still the same write)."""
        st_ = self.clients[1].inspect("t")
        if len(st_.value_schema) >= 3:
            return
        wide = pa.schema([*st_.value_schema, (f"c{len(st_.value_schema)}", pa.float64())])
        w, r = self.clients[1].open("t", st_.key_schema, wide)
        w.expire()
        r.expire()

    @rule(
        app=st.sampled_from(APPS),
        via=st.integers(0, 1),
        lose=st.booleans(),
        reads=st.sampled_from([0, 2, 1000]),
        expire=st.booleans(),
    )
    def write(self, app: str, via: int, lose: bool, reads: int, expire: bool) -> None:
        """The app's next write, or the retry of the one whose outcome is unknown."""
        if expire:
            self.clock.advance(3600)
        version = self.unknown.get(app, self.committed.get(app, -1) + 1)
        if lose and via == 0:
            self.flaky.arm(reads=reads)
        try:
            t = self.tables[via].append(
                self.batch(app, version), app_transaction=AppTransaction(app, version)
            )
        except ConsensusError as e:
            assert e.is_indeterminate()
            self.unknown[app] = version
            return
        finally:
            self.flaky.reads_to_fail = 0
        assert isinstance(t, int)
        self.unknown.pop(app, None)
        self.committed[app] = version
        self.rows[(app, version)] += 2

    @rule(app=st.sampled_from(APPS), via=st.integers(0, 1))
    def stale(self, app: str, via: int) -> None:
        """A write below the committed version is refused."""
        if self.committed.get(app, 0) < 1 or app in self.unknown:
            return
        # (The table's writer may be replaced first, after a schema change: a state
        # version of writers, not of the table's contents or history.)
        before = self.tables[1].history().num_rows
        with pytest.raises(StaleAppVersion):
            self.tables[via].append(self.batch(app, 0), app_transaction=AppTransaction(app, 0))
        assert self.tables[1].history().num_rows == before

    @invariant()
    def exactly_once(self) -> None:
        got = Counter((r["app"], r["n"]) for r in self.tables[1].to_arrow().to_pylist())
        for key, n in got.items():
            app, version = key
            if self.unknown.get(app) == version:
                assert n in (0, 2), (key, n)  # landed at most once
            else:
                assert n == self.rows[key], (key, n, self.rows[key])
        assert all(got[k] == n for k, n in self.rows.items())
        for app, version in self.committed.items():
            assert self.tables[1].transaction_version(app) >= version

    def teardown(self) -> None:
        for c in self.clients:
            c.close()
        self.flaky.inner.close()


def test_exactly_once_appends_against_a_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Txn, "resolve_attempts", 2)
    monkeypatch.setattr(Txn, "resolve_max_wait", 0.001)
    run_state_machine_as_test(
        AppTxnModel,
        settings=settings(
            max_examples=20,
            stateful_step_count=12,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture],
        ),
    )
