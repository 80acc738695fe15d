"""Tests of the one-row append paths (``persist/write.py``): each fast path gives
what its reference (slow) path gives, so a wrong fast path fails here."""

from __future__ import annotations

import os
import signal
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import persist.write as write_mod
from persist import MemoryBlob, PersistClient, spine
from persist.errors import InvalidUsage
from persist.spine import FueledMergeReq, IdHollowBatch, SpineId, worth_compacting
from persist.types import Description, HollowBatch, PartRef
from persist.updates import to_updates_table
from persist.write import _time_range
from stash import Antichain, Stash

KS = pa.schema([("k", pa.int64()), ("name", pa.string())])
VS = pa.schema([pa.field("v", pa.float64(), nullable=False)])


@pytest.fixture
def client(tmp_path: Path) -> Iterator[PersistClient]:
    s = Stash.open(f"sqlite:///{tmp_path / 'stash.db'}", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="inline")
    yield c
    c.close()
    s.close()


_types = {"k": pa.int64(), "name": pa.string(), "v": pa.float64()}
_alt_types = {"k": pa.int32(), "name": pa.large_string(), "v": pa.float32()}


@st.composite
def _tables(draw: Any) -> pa.Table:
    """Update tables near the shard's schema: columns reordered, widened types, nulls
    where they are not allowed, metadata, a missing column."""
    n = draw(st.integers(0, 40))
    names = ["k", "name", "v", "_time", "_diff"]
    if draw(st.booleans()):
        names = draw(st.permutations(names))
    if draw(st.integers(0, 9)) == 0:
        names = names[:-1]
    arrays = []
    fields = []
    for name in names:
        if name in ("_time", "_diff"):
            vals = draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=n, max_size=n))
            typ: pa.DataType = pa.int64()
        else:
            alt = draw(st.integers(0, 5)) == 0
            typ = _alt_types[name] if alt else _types[name]
            if name == "k":
                lim = 2**31 - 1 if alt else 2**63 - 1
                elem: Any = st.integers(-lim - 1, lim)
            elif name == "name":
                elem = st.text(max_size=3)
            else:
                elem = st.floats(width=32 if alt else 64, allow_nan=False)
            vals = draw(
                st.lists(
                    st.one_of(st.none(), elem) if draw(st.booleans()) else elem,
                    min_size=n,
                    max_size=n,
                )
            )
        nullable = name not in ("_time", "_diff") or draw(st.integers(0, 4)) == 0
        meta = {b"m": b"1"} if draw(st.integers(0, 9)) == 0 else None
        fields.append(pa.field(name, typ, nullable=nullable, metadata=meta))
        arrays.append(pa.array(vals, typ))
    schema = pa.schema(fields, metadata={b"s": b"1"} if draw(st.integers(0, 9)) == 0 else None)
    return pa.Table.from_arrays(arrays, schema=schema)


def _outcome(fn: Any) -> Any:
    try:
        t = fn()
    except InvalidUsage as e:
        return ("error", str(e))
    return ("ok", t.schema, t.schema.metadata, [f.metadata for f in t.schema], t.to_pylist())


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(_tables())
def test_normalize_gives_what_to_updates_table_gives(
    client: PersistClient, table: pa.Table
) -> None:
    w, r = client.open("norm", KS, VS)
    fast = _outcome(lambda: w._normalize(table))
    again = _outcome(lambda: w._normalize(table))  # with the handle's schema memo set
    slow = _outcome(lambda: to_updates_table(table, KS, VS))
    assert fast == slow
    assert again == slow


def test_normalize_returns_a_conforming_table_as_it_is(client: PersistClient) -> None:
    w, _r = client.open("norm", KS, VS)
    t = pa.Table.from_pylist(
        [{"k": 1, "name": "a", "v": 1.0, "_time": 3, "_diff": 1}], schema=w.schema
    )
    assert w._normalize(t) is t
    # A null in the non-nullable value column is refused as the slow path refuses it.
    bad = pa.Table.from_arrays(
        [
            pa.array([1]),
            pa.array(["a"]),
            pa.array([None], pa.float64()),
            pa.array([3]),
            pa.array([1]),
        ],
        schema=w.schema,
    )
    with pytest.raises(InvalidUsage, match="'v' has 1 nulls"):
        w._normalize(bad)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=70), st.integers(0, 3))
def test_time_range_gives_what_min_max_gives(times: list[int], chunks: int) -> None:
    arr = pa.array(times, pa.int64())
    cut = len(times) // 2 if chunks else len(times)
    col = pa.chunked_array([arr[:cut], arr[cut:]], pa.int64())
    table = pa.table({"_time": col})
    if not times:
        assert _time_range(table) is None
        return
    mm = pc.min_max(col)
    assert _time_range(table) == (mm["min"].as_py(), mm["max"].as_py())


# ------------------------------------------------------------ compaction heuristic


def _req(lens: list[int], parts: int = 1) -> FueledMergeReq:
    inputs = []
    lo = 0
    for n in lens:
        d = Description(
            Antichain.from_elem(lo), Antichain.from_elem(lo + 1), Antichain.from_elem(0)
        )
        refs = tuple(
            PartRef(key=f"k{lo}-{j}", rows=1, encoded_size_bytes=1, checksum="0")
            for j in range(parts)
        )
        inputs.append(IdHollowBatch(SpineId(lo, lo + 1), HollowBatch(d, refs, n)))
        lo += 1
    d = Description(Antichain.from_elem(0), Antichain.from_elem(lo), Antichain.from_elem(0))
    return FueledMergeReq(d, tuple(inputs))


def test_worth_compacting_thresholds() -> None:
    assert not worth_compacting(_req([1, 1]))
    assert not worth_compacting(_req([1] * (spine.COMPACTION_MIN_INPUTS - 1)))
    assert worth_compacting(_req([1] * spine.COMPACTION_MIN_INPUTS))
    assert worth_compacting(_req([1, 1], parts=spine.COMPACTION_MIN_PARTS // 2))
    assert not worth_compacting(_req([1, 1], parts=spine.COMPACTION_MIN_PARTS // 2 - 1))
    assert worth_compacting(_req([spine.COMPACTION_MIN_UPDATES // 2] * 2))
    assert not worth_compacting(_req([spine.COMPACTION_MIN_UPDATES // 2 - 1] * 2))


ROW = pa.schema([("k", pa.int64())])


def _row(i: int) -> pa.Table:
    return pa.table(
        {"k": pa.array([i], pa.int64()), "_time": pa.array([i]), "_diff": pa.array([1])}
    )


def test_one_row_appends_skip_small_merges_and_keep_the_state_small(
    client: PersistClient,
) -> None:
    """One-row appends with inline compaction do about one physical merge per
    ``COMPACTION_MIN_INPUTS`` appends (not one per append), the hollow batches stay
    logarithmic in number, and every row reads back."""
    w, r = client.open("heur", ROW, pa.schema([]))
    machine = client.machine(client.shard_id("heur"))
    n = 512
    most = 0
    for i in range(n):
        w.compare_and_append(_row(i), i, i + 1)
        # The committed version, as cached (each checked against its full decoding by
        # PERSIST_CHECK_INCREMENTAL): a fresh read per append doubled the test's time.
        most = max(most, machine.state().trace.num_hollow_batches())
    assert machine.state() == client.inspect("heur")  # the cache is the stored head
    done = client.compactor.totals.applied + client.compactor.totals.not_applied
    assert 0 < done <= n // spine.COMPACTION_MIN_INPUTS + 16
    # Fewer than COMPACTION_MIN_INPUTS hollow batches per spine batch below the updates
    # threshold: a small multiple of the log2(n) of a fully compacted trace.
    assert most <= 4 * n.bit_length()
    snap = r.snapshot(n - 1)
    assert sorted(snap.column("k").to_pylist()) == list(range(n))
    # An explicit compaction still answers every outstanding request.
    client.compactor.compact_once("heur")
    st = client.inspect("heur")
    assert not st.trace.all_fueled_merge_reqs()


WID = "w" + "ab" * 16


def test_fresh_tokens_are_distinct_valid_and_redrawn_in_a_child() -> None:
    """Tokens name their writer (16 hex digits of its id), then the drawing process (8
    random hex digits), then a counter, then the seqno the append was first tried
    after (persist/landed.py): distinct, ordered within a process, and the process
    digits drawn again after a fork."""
    from persist.lease_state import token_lo

    src = write_mod._TokenSource()
    tokens = [src.next(WID, 7) for _ in range(2000)]
    assert len(set(tokens)) == len(tokens)
    assert all(len(t.rsplit(".", 1)[0]) == 34 and t[:16] == WID[1:17] for t in tokens)
    assert all(int(x, 16) >= 0 for t in tokens for x in t.split("."))
    assert all(token_lo(t) == 7 for t in tokens)
    assert [int(t[26:34], 16) for t in tokens] == sorted(int(t[26:34], 16) for t in tokens)
    assert all(write_mod._token(t, WID) == t for t in tokens[:5])  # valid caller tokens too
    process = tokens[0][17:25]
    assert {t[17:25] for t in tokens} == {process}
    src._pid = -1  # as after a fork: new process digits, the counter restarts
    again = src.next(WID)
    assert again[17:25] != process and again not in tokens


def test_a_fork_while_another_thread_draws_a_token_does_not_deadlock_the_child() -> None:
    """The token source's lock is held by another thread at the fork; the
    child (where that thread does not exist) must still draw a fresh token, with a new
    prefix.  Before the fix the child blocked forever on the inherited lock."""
    src = write_mod._tokens
    parent_token = src.next(WID)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with src._lock:
            held.set()
            release.wait()

    t = threading.Thread(target=hold)
    t.start()
    held.wait()
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
        pid = os.fork()
    if pid == 0:  # the child: give up after 5 s instead of hanging the suite
        code = 1
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(5)
            os.write(w, src.next(WID).encode())
            code = 0
        finally:
            os._exit(code)
    release.set()
    t.join()
    os.close(w)
    _, status = os.waitpid(pid, 0)
    child_token = os.read(r, 64).decode()
    os.close(r)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"
    assert len(child_token.rsplit(".", 1)[0]) == 34 and child_token[17:25] != parent_token[17:25]
