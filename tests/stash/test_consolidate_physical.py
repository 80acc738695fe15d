"""``consolidate`` leaves the same physical rows on every backend: every row at
``max(time, since)``, one row per ``(key, value, time)``, no zero diff, as the memory
backend holds them.  The SQL backends' rows are read with plain SQL on ``stash_entries``."""

from __future__ import annotations

import itertools
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stash import Antichain, MemoryStash, Stash, StashCollection, StashError
from stash.antichain import I64_MAX, I64_MIN
from stash.postgres import canonical_text
from tests.support.dbutil import migrate_to_head

A = Antichain.from_elem
_names = itertools.count()

PhysRow = tuple[str, str, int, int]


class Backends:
    """One memory, one SQLite and one Postgres stash, and plain-SQL access to their rows."""

    def __init__(self, tmp: Path, pg_url: str) -> None:
        self.sqlite_path = tmp / "phys.db"
        self.pg_url = pg_url
        self.stashes: dict[str, Stash] = {
            "memory": Stash.open(f"memory://phys{next(_names)}", fenced=False),
            "sqlite": Stash.open(f"sqlite:///{self.sqlite_path}", fenced=False),
            "postgres": Stash.open(pg_url, fenced=False),
        }
        self.pg_engine = sa.create_engine(pg_url)

    def physical(self, name: str, c: StashCollection[Any, Any]) -> list[PhysRow]:
        s = self.stashes[name]
        if name == "memory":
            assert isinstance(s, MemoryStash)
            rows = s._store.colls[c.id].rows
            return sorted((k, v, t, d) for (k, v, t), d in rows.items())
        q = "SELECT key, value, time, diff FROM stash_entries WHERE collection = "
        if name == "sqlite":
            with sqlite3.connect(self.sqlite_path) as db:
                got = db.execute(q + "?", (c.name,)).fetchall()
            return sorted((k, v, int(t), int(d)) for k, v, t, d in got)
        with self.pg_engine.connect() as conn:
            got = conn.exec_driver_sql(
                "SELECT key::text, value::text, time, diff FROM stash_entries WHERE collection = %(n)s",
                {"n": c.name},
            ).fetchall()
        return sorted((canonical_text(k), canonical_text(v), int(t), int(d)) for k, v, t, d in got)

    def close(self) -> None:
        for s in self.stashes.values():
            s.close()
        self.pg_engine.dispose()


@pytest.fixture
def backends(tmp_path: Path, postgres_url: str) -> Iterator[Backends]:
    migrate_to_head(postgres_url)
    b = Backends(tmp_path, postgres_url)
    yield b
    b.close()


def _all_physical(b: Backends, name: str) -> dict[str, list[PhysRow]]:
    out = {}
    for backend, s in b.stashes.items():
        out[backend] = b.physical(backend, s.collection(name))
    return out


def test_consolidate_moves_lone_rows_to_since_and_drops_zero_diffs(backends: Backends) -> None:
    for s in backends.stashes.values():
        c = s.collection("c")
        s.update(c, ("lone", 1), 0, 1)
        s.update(c, ("zero", 1), 1, 0)
        s.update_many(c, [(("twice", 1), 5, 1), (("twice", 1), 5, 2)])  # beyond the since
        s.update_many(c, [(("gone", 1), 1, 1), (("gone", 1), 2, -1)])
        s.seal(c, A(6))
        s.compact(c, A(3))
        s.consolidate(c)
    phys = _all_physical(backends, "c")
    assert phys["memory"] == [('"lone"', "1", 3, 1), ('"twice"', "1", 5, 3)]
    assert phys["sqlite"] == phys["memory"]
    assert phys["postgres"] == phys["memory"]


DIFFS = st.one_of(
    st.integers(-2, 2), st.sampled_from([I64_MAX, I64_MIN, 2**62, -(2**62), I64_MAX - 1])
)
OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("update"),
            st.sampled_from(["a", "b"]),
            st.sampled_from([0, 1, True]),
            st.integers(0, 3),
            DIFFS,
        ),
        st.tuples(st.just("seal"), st.integers(0, 2)),
        st.tuples(st.just("compact"), st.integers(0, 3)),
        st.tuples(st.just("consolidate")),
        st.tuples(
            st.just("tick"),
            st.sampled_from(["a", "b"]),
            st.sampled_from([0, 1]),
            st.integers(-1, 1),
        ),
    ),
    max_size=10,
)


def _apply(s: Stash, c: StashCollection[Any, Any], op: tuple[Any, ...]) -> None:
    upper = s.upper(c).as_option()
    since = s.since(c).as_option()
    assert upper is not None and since is not None
    if op[0] == "update":
        _, k, v, dt, d = op
        s.update(c, (k, v), upper + dt, d)
    elif op[0] == "seal":
        s.seal(c, A(upper + op[1]))
    elif op[0] == "compact":
        s.compact(c, A(min(upper, since + op[1])))
    elif op[0] == "consolidate":
        s.consolidate(c)
    else:
        _, k, v, d = op
        b = c.make_batch(s)
        if d:
            c.append_to_batch(b, k, v, d)
        s.append([b])


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=OPS)
def test_consolidate_leaves_the_same_physical_rows_on_every_backend(
    backends: Backends, ops: list[tuple[Any, ...]]
) -> None:
    name = f"p{next(_names)}"
    outcomes: dict[str, list[str]] = {}
    for backend, s in backends.stashes.items():
        c = s.collection(name)
        out = outcomes[backend] = []
        for op in ops:
            try:
                _apply(s, c, op)
                out.append("ok")
            except StashError as e:  # diff sums beyond i64: refused alike everywhere
                assert "diff sums must fit in i64" in str(e)
                out.append(str(e))
            out.append(repr(s.iter(c)))
        s.consolidate(c)
    assert outcomes["sqlite"] == outcomes["memory"]
    assert outcomes["postgres"] == outcomes["memory"]
    phys = _all_physical(backends, name)
    assert phys["sqlite"] == phys["memory"]
    assert phys["postgres"] == phys["memory"]
    since = backends.stashes["memory"].since(backends.stashes["memory"].collection(name))
    s0 = since.as_option()
    assert all(d != 0 and (s0 is None or t >= s0) for _, _, t, d in phys["memory"])
    iters = {n: s.iter(s.collection(name)) for n, s in backends.stashes.items()}
    assert iters["sqlite"] == iters["memory"] == iters["postgres"]
