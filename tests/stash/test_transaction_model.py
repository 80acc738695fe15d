"""``Stash.with_transaction`` against a model, with threads and two processes.

Writers move units between accounts (one collection) and count their moves in another
collection, in one transaction each; readers read both collections in one transaction.
Moves commute, so whatever order the commits land in, the final state is the model's:

* no torn read: every read sees the accounts summing to the total and the move counter
  equal to the number of moves the accounts' own counter records (the two collections
  at one moment);
* no lost update: at the end the balances and the counter are exactly the model's.

Sizes grow under ``STASH_RELIABILITY=long`` (``sized``).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stash import Stash, TypedCollection

LONG = os.environ.get("STASH_RELIABILITY") == "long"
ROOT = Path(__file__).resolve().parents[2]
ACCOUNTS = 4
TOTAL = 100
_names = itertools.count()


def _collections(tag: str) -> tuple[TypedCollection[str, int], TypedCollection[str, int]]:
    return (
        TypedCollection(f"accounts_{tag}", key="str", value="int"),
        TypedCollection(f"moves_{tag}", key="str", value="int"),
    )


def _setup(s: Stash, tag: str) -> None:
    acc, moves = _collections(tag)

    def init(tx: Any) -> None:
        t = tx.table(acc)
        for i in range(ACCOUNTS):
            t.insert(f"a{i}", TOTAL // ACCOUNTS)
        t.insert("seq", 0)
        tx.table(moves).insert("count", 0)

    s.with_transaction(init)


def _move(s: Stash, tag: str, src: int, dst: int, amount: int) -> None:
    acc, moves = _collections(tag)

    def fn(tx: Any) -> None:
        t = tx.table(acc)
        t.set(f"a{src}", t.get(f"a{src}") - amount)
        t.set(f"a{dst}", t.get(f"a{dst}") + amount)
        t.set("seq", t.get("seq") + 1)
        m = tx.table(moves)
        m.set("count", m.get("count") + 1)

    s.with_transaction(fn, retries=1000)


def _check_read(s: Stash, tag: str) -> tuple[int, int]:
    acc, moves = _collections(tag)
    a, m = s.with_transaction(lambda tx: (tx.peek_one(acc), tx.peek_key_one(moves, "count")))
    assert sum(v for k, v in a.items() if k != "seq") == TOTAL, a
    assert a["seq"] == m, (a, m)
    return a["seq"], m


def _final(s: Stash, tag: str, moves: list[tuple[int, int, int]]) -> None:
    acc, mc = _collections(tag)
    model = {f"a{i}": TOTAL // ACCOUNTS for i in range(ACCOUNTS)}
    for src, dst, amount in moves:
        model[f"a{src}"] -= amount
        model[f"a{dst}"] += amount
    model["seq"] = len(moves)
    assert acc.peek_one(s) == dict(sorted(model.items()))
    assert mc.peek_one(s) == {"count": len(moves)}


moves_st = st.lists(
    st.tuples(st.integers(0, ACCOUNTS - 1), st.integers(0, ACCOUNTS - 1), st.integers(1, 5)),
    min_size=1,
    max_size=24 if LONG else 6,
)


@pytest.mark.sized
@settings(
    max_examples=25 if LONG else 3,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(per_thread=st.lists(moves_st, min_size=2, max_size=3))
def test_threads_against_the_model(open_stash, per_thread: list[list[Any]]) -> None:  # type: ignore[no-untyped-def]
    tag = f"t{next(_names)}"
    handles = [open_stash() for _ in per_thread]
    _setup(handles[0], tag)
    errors: list[BaseException] = []
    done = threading.Event()

    def writer(s: Stash, moves: list[tuple[int, int, int]]) -> None:
        try:
            for mv in moves:
                _move(s, tag, *mv)
        except BaseException as e:  # reported below
            errors.append(e)

    def reader(s: Stash) -> None:
        try:
            while not done.is_set():
                _check_read(s, tag)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [
        threading.Thread(target=writer, args=(h, m))
        for h, m in zip(handles, per_thread, strict=True)
    ]
    r = threading.Thread(target=reader, args=(open_stash(),))
    for t in [*threads, r]:
        t.start()
    for t in threads:
        t.join()
    done.set()
    r.join()
    assert not errors, errors
    _final(handles[0], tag, [mv for moves in per_thread for mv in moves])


_CHILD = """
import json, sys
from tests.stash.test_transaction_model import _check_read, _move
from stash import Stash

url, tag, moves = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
with Stash.open(url, fenced=False) as s:
    for src, dst, amount in moves:
        _move(s, tag, src, dst, amount)
        _check_read(s, tag)
"""


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_two_processes_and_threads_against_the_model(
    request: pytest.FixtureRequest, backend: str, tmp_path: Path
) -> None:
    import json
    import random

    from tests.support.dbutil import backend_url

    url = backend_url(request, backend, tmp_path)
    rng = random.Random(7)
    n = 40 if LONG else 8

    def plan() -> list[tuple[int, int, int]]:
        return [
            (rng.randrange(ACCOUNTS), rng.randrange(ACCOUNTS), rng.randint(1, 5)) for _ in range(n)
        ]

    child_moves, thread_moves = plan(), [plan(), plan()]
    tag = "p"
    with Stash.open(url, fenced=False) as s0:
        _setup(s0, tag)
        child = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_CHILD), url, tag, json.dumps(child_moves)],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        errors: list[BaseException] = []

        def writer(moves: list[tuple[int, int, int]]) -> None:
            try:
                with Stash.open(url, fenced=False) as s:
                    for mv in moves:
                        _move(s, tag, *mv)
                        _check_read(s, tag)
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=writer, args=(m,)) for m in thread_moves]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, (out, err[-3000:])
        assert not errors, errors
        _final(s0, tag, [*child_moves, *thread_moves[0], *thread_moves[1]])


@pytest.mark.sized
def test_writers_of_distinct_keys_commit_without_retries(open_stash) -> None:  # type: ignore[no-untyped-def]
    """Threads (each with its own handle) that each write only their own key never run
    their function twice: the commit checks the keys read, not the collection."""
    t = TypedCollection[str, int](f"own_{next(_names)}", key="str", value="int")
    n, writers = (30 if LONG else 6), 3
    runs = [0] * writers
    errors: list[BaseException] = []

    def writer(i: int, s: Stash) -> None:
        def fn(tx: Any) -> None:
            runs[i] += 1
            tt = tx.table(t)
            tt.set(f"k{i}", (tt.get(f"k{i}") or 0) + 1)

        try:
            for _ in range(n):
                s.with_transaction(fn, retries=0)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i, open_stash())) for i in range(writers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert runs == [n] * writers
    assert t.peek_one(open_stash()) == {f"k{i}": n for i in range(writers)}
