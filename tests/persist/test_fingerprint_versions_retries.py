"""Retries of appends recorded by the SHA-256 fingerprint (``V``), attacked: every way
a retry can differ from its landed attempt, and a retry after the writer's lease ran
out and another client expired it.

Contract (persist/fingerprint.py, persist/write.py): a retry passing the token of an
append that landed writes nothing again when it is the same append (same bounds, the
same values in the same row order, however chunked or given); a token reused on any
other append is refused (``InvalidUsage``), committing nothing.  A record made by the
``V`` version (before the ``X`` one) obeys the same rule: the retry's own ``V``
fingerprint is computed to check it.  Records outlive the writer's lease.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persist import InvalidUsage, MemoryBlob, PersistClient
from persist import write as write_module
from persist.fingerprint import updates_fingerprint
from persist.lease_state import TOKEN_SEP
from stash import Antichain, Stash
from tests.support.clock import Clock
from tests.support.dbutil import backend_url

pytest_plugins = ["tests.support.pg_fixtures"]

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])
TOKEN = "job-9-attempt-1"


def _v_version(e: Antichain, n: Antichain, t: pa.Table, version: str = "V") -> str:
    return updates_fingerprint(e, n, t, version)


def _table(rows: list[tuple[str, int, int]], chunks: int = 1) -> pa.Table:
    t = pa.table(
        {
            "k": pa.array([r[0] for r in rows], pa.string()),
            "v": pa.array([r[1] for r in rows], pa.int64()),
            "_time": pa.array([0] * len(rows), pa.int64()),
            "_diff": pa.array([r[2] for r in rows], pa.int64()),
        }
    )
    if chunks > 1 and len(rows) > 1:
        cut = len(rows) // 2
        t = pa.concat_tables([t.slice(0, cut), t.slice(cut)])
    return t


def _contents(r: Any, as_of: int = 0) -> Counter[tuple[str, int]]:
    out: Counter[tuple[str, int]] = Counter()
    for row in r.snapshot(as_of).to_pylist():
        out[(row["k"], row["v"])] += row["_diff"]
    return +out


def _landed_by_v(c: PersistClient, first: Any, monkeypatch: Any) -> None:
    w, _ = c.open("s", KS, VS)
    with monkeypatch.context() as m:
        m.setattr(write_module, "updates_fingerprint", _v_version)
        w.compare_and_append(first, 0, 1, idempotency_token=TOKEN)
    entries = {rec.entry.partition(TOKEN_SEP)[2][:1] for rec in c.inspect("s").landed.values()}
    assert entries == {"V"}


ROWS = st.lists(
    st.tuples(st.sampled_from("abc"), st.integers(-2, 2), st.integers(1, 2)),
    min_size=1,
    max_size=6,
)
VARIANTS: dict[str, Callable[[list[tuple[str, int, int]]], tuple[Any, int, int]]] = {
    "same list": lambda rows: ([(((k,), (v,)), 0, d) for k, v, d in rows], 0, 1),
    "same table": lambda rows: (_table(rows), 0, 1),
    "two chunks": lambda rows: (_table(rows, 2), 0, 1),
    "reversed": lambda rows: (_table(rows[::-1]), 0, 1),
    "one value more": lambda rows: (_table([*rows, ("z", 0, 1)]), 0, 1),
    "first diff doubled": lambda rows: (
        _table([(rows[0][0], rows[0][1], 2 * rows[0][2])] + rows[1:]),
        0,
        1,
    ),
    "other upper": lambda rows: (_table(rows), 0, 2),
}


@settings(max_examples=40, deadline=None)
@given(ROWS, st.sampled_from(list(VARIANTS)))
def test_a_retry_of_a_v_record_is_recognised_exactly_when_it_is_the_same_append(
    rows: list[tuple[str, int, int]], variant: str
) -> None:
    mp = pytest.MonkeyPatch()
    c = PersistClient(Stash.open("memory://", fenced=False), MemoryBlob(), compaction="off")
    try:
        _landed_by_v(c, _table(rows), mp)
        w, r = c.open("s", KS, VS)
        before, seqno = _contents(r), c.inspect("s").seqno
        updates, lo, hi = VARIANTS[variant](rows)
        same = variant in ("same list", "same table", "two chunks") or (
            variant == "reversed" and rows == rows[::-1]
        )
        if same:
            w.compare_and_append(updates, lo, hi, idempotency_token=TOKEN)
        else:
            with pytest.raises(InvalidUsage, match="different append"):
                w.compare_and_append(updates, lo, hi, idempotency_token=TOKEN)
        assert c.inspect("s").seqno == seqno  # nothing written either way
        assert _contents(r) == before
    finally:
        mp.undo()
        c.close()


def test_a_v_record_outlives_its_expired_writer() -> None:
    """The append landed under ``V``; its writer's lease ran out and another client's
    write expired it; the retry, on a new handle of a new client, writes nothing."""
    clock = Clock()
    s, blob = Stash.open("memory://", fenced=False), MemoryBlob()
    kw: dict[str, Any] = {"clock": clock, "writer_lease_seconds": 60, "compaction": "off"}
    c, other = PersistClient(s, blob, **kw), PersistClient(s, blob, **kw)
    mp = pytest.MonkeyPatch()
    try:
        rows = [("a", 1, 1), ("b", 2, 1)]
        _landed_by_v(c, _table(rows), mp)
        first = c.inspect("s").writers
        clock.advance(3600)
        wo, _ = other.open("s", KS, VS)
        wo.compare_and_append([(((("x",), (9,))), 1, 1)], 1, 2)
        assert not set(first) & set(other.inspect("s").writers)  # expired
        w2, r = other.open("s", KS, VS)
        seqno = other.inspect("s").seqno
        w2.compare_and_append(_table(rows), 0, 1, idempotency_token=TOKEN)
        with pytest.raises(InvalidUsage, match="different append"):
            w2.compare_and_append(_table(rows[:1]), 0, 1, idempotency_token=TOKEN)
        assert other.inspect("s").seqno == seqno
        assert _contents(r, 1) == Counter({("a", 1): 1, ("b", 2): 1, ("x", 9): 1})
    finally:
        mp.undo()
        c.close()
        other.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
@pytest.mark.parametrize("same", [True, False], ids=["same", "other-updates"])
def test_a_retry_racing_its_v_attempt_in_threads(
    request: pytest.FixtureRequest,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
    same: bool,
    backend: str,
) -> None:
    """The first attempt (made by the ``V`` version, in one thread) and the retry (``X``,
    another thread, another handle) commit at once, rounds over: with the same updates
    both return and the rows are there once; with other updates exactly one commits
    and the other is refused as a different append."""
    v_threads: set[int] = set()

    def versioned(e: Antichain, n: Antichain, t: pa.Table, version: str | None = None) -> str:
        # The fingerprint an attempt records: V in the first attempt's thread.  (A
        # release of the V version could not check an X record at all: that thread
        # still computes X when asked for it, so both orders of the race are checked
        # against this code.)
        if version is None:
            version = "V" if threading.get_ident() in v_threads else "X"
        return updates_fingerprint(e, n, t, version)

    monkeypatch.setattr(write_module, "updates_fingerprint", versioned)
    s = Stash.open(backend_url(request, backend, tmp_path), fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off")
    try:
        for i in range(6):
            name = f"s{i}"
            wa, r = c.open(name, KS, VS)
            wb, _ = c.open(name, KS, VS)
            a = _table([("a", 1, 1), ("b", 2, 1)])
            b = a if same else _table([("a", 1, 1)])
            barrier = threading.Barrier(2)
            outcome: dict[str, str] = {}

            def run(
                who: str,
                w: Any,
                rows: pa.Table,
                old: bool,
                barrier: threading.Barrier = barrier,
                outcome: dict[str, str] = outcome,
            ) -> None:
                if old:
                    v_threads.add(threading.get_ident())
                barrier.wait()
                try:
                    w.compare_and_append(rows, 0, 1, idempotency_token=TOKEN)
                    outcome[who] = "ok"
                except InvalidUsage as e:
                    outcome[who] = "refused" if "different append" in str(e) else repr(e)

            threads = [
                threading.Thread(target=run, args=("v", wa, a, True)),
                threading.Thread(target=run, args=("x", wb, b, False)),
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            got = _contents(r)
            if same:
                assert outcome == {"v": "ok", "x": "ok"}
                assert got == Counter({("a", 1): 1, ("b", 2): 1})
            else:
                assert sorted(outcome.values()) == ["ok", "refused"], outcome
                winner = a if outcome["v"] == "ok" else b
                assert got == Counter((row["k"], row["v"]) for row in winner.to_pylist())
    finally:
        c.close()
        s.close()


def test_a_v_record_retried_on_its_own_expired_handle() -> None:
    """The retry goes through the very handle whose writer another client expired (this
    process does not know): landed, nothing written; a token reused on other rows is
    refused before the expired lease matters."""
    clock = Clock()
    s, blob = Stash.open("memory://", fenced=False), MemoryBlob()
    kw: dict[str, Any] = {"clock": clock, "writer_lease_seconds": 60, "compaction": "off"}
    c, other = PersistClient(s, blob, **kw), PersistClient(s, blob, **kw)
    mp = pytest.MonkeyPatch()
    try:
        rows = [("a", 1, 1)]
        w, _ = c.open("s", KS, VS)
        with mp.context() as m:
            m.setattr(write_module, "updates_fingerprint", _v_version)
            w.compare_and_append(_table(rows), 0, 1, idempotency_token=TOKEN)
        clock.advance(3600)
        wo, _ = other.open("s", KS, VS)
        wo.compare_and_append([((("x",), (9,)), 1, 1)], 1, 2)
        assert w.writer_id not in other.inspect("s").writers
        seqno = other.inspect("s").seqno
        w.compare_and_append(_table(rows), 0, 1, idempotency_token=TOKEN)
        with pytest.raises(InvalidUsage, match="different append"):
            w.compare_and_append(_table([("b", 1, 1)]), 0, 1, idempotency_token=TOKEN)
        assert other.inspect("s").seqno == seqno
        assert _contents(other.open("s", KS, VS)[1], 1) == Counter({("a", 1): 1, ("x", 9): 1})
    finally:
        mp.undo()
        c.close()
        other.close()
