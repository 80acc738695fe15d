"""Compaction consolidates at the since of the committed state the compactor read.

A merge request carries the since the trace had when its merge began, usually long before
the readers downgrade theirs; the compactor advances the inputs' times to the later since
of the state version it works from, and the output's description records it.  Checked on
real SQLite stashes and file blobs, with a second process moving the since between a
merge's compute and its apply.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist import FileBlob, HollowBatch, PersistClient, read_batches
from persist.parts import updates_schema
from persist.types import Description
from stash import Antichain, Stash

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string())])
TIME = "_time"
A = Antichain.from_elem

Update = tuple[int, str, int, int]


def _updates(n: int) -> list[Update]:
    """Times ``0..n-1``: key 1 takes value ``v{t}`` at each time ``t`` (the previous value
    retracted), key 2 holds ``same`` with diffs +1 at 0, +1 at ``n // 2`` and -1 at
    ``n - 3``, and key ``10 + t`` is inserted at ``t``."""
    ups: list[Update] = []
    for t in range(n):
        if t:
            ups.append((1, f"v{t - 1}", t, -1))
        ups.append((1, f"v{t}", t, 1))
        ups.append((10 + t, "x", t, 1))
    ups += [(2, "same", 0, 1), (2, "same", n // 2, 1), (2, "same", n - 3, -1)]
    return ups


def _model(ups: list[Update], as_of: int) -> Counter[tuple[int, str]]:
    c: Counter[tuple[int, str]] = Counter()
    for k, v, t, d in ups:
        if t <= as_of:
            c[(k, v)] += d
    return Counter({x: n for x, n in c.items() if n})


def _snapshot(r: Any, as_of: int) -> Counter[tuple[int, str]]:
    c: Counter[tuple[int, str]] = Counter()
    for row in r.snapshot(as_of).to_pylist():
        c[(row["k"], row["v"])] += row["_diff"]
    return Counter({x: n for x, n in c.items() if n})


def _append(w: Any, ups: list[Update], lo: int, hi: int) -> None:
    rows = [(((k,), (v,)), t, d) for k, v, t, d in ups if lo <= t < hi]
    w.compare_and_append(rows, lo, hi)


def _write(w: Any, ups: list[Update], n: int, width: int = 2) -> None:
    for lo in range(0, n, width):
        _append(w, ups, lo, min(n, lo + width))


def _times(b: HollowBatch) -> set[int]:
    """The distinct stored ``_time`` of a batch's parts, by their statistics (each part's
    min and max)."""
    out: set[int] = set()
    for p in b.parts:
        assert p.key is not None and p.stats is not None, p
        ((lo, hi),) = [(lo, hi) for name, lo, hi, _n in p.stats if name == TIME]
        out |= {int(lo), int(hi)}
    return out


def _stored_rows(blob: Any, b: HollowBatch) -> list[dict[str, Any]]:
    """The rows of ``b`` as stored (read under a description with since 0, so that no
    time is advanced on the way)."""
    raw = HollowBatch(Description(b.desc.lower, b.desc.upper, A(0)), b.parts, b.len, b.runs)
    return read_batches(blob, [raw], updates_schema(KS, VS)).to_pylist()


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[tuple[str, str]]:
    yield f"sqlite:///{tmp_path / 'stash.db'}", str(tmp_path / "blob")


def _client(stash: Stash, blob_dir: str, **kw: Any) -> PersistClient:
    return PersistClient(stash, FileBlob(blob_dir), compaction="off", inline_max_bytes=0, **kw)


def _compacted(client: PersistClient, shard: str, since: int) -> list[HollowBatch]:
    return [b for b in client.inspect(shard).trace.batches() if b.desc.since == A(since)]


N = 10
"""Times ``0..N-1`` are written by :func:`_written`."""


@contextlib.contextmanager
def _written(
    stores: tuple[str, str], since: int | None = None
) -> Iterator[tuple[Stash, PersistClient, Any, Any, list[Update]]]:
    """A shard ``s`` holding :func:`_updates` of ``N`` times (five batches), its reader's
    since downgraded to ``since`` if given: ``(stash, client, writer, reader,
    updates)``; the client is closed at the end."""
    stash_url, blob_dir = stores
    ups = _updates(N)
    with Stash.open(stash_url, fenced=False) as s:
        c = _client(s, blob_dir)
        try:
            w, r = c.open("s", KS, VS)
            _write(w, ups, N)
            if since is not None:
                r.downgrade_since(A(since))
            yield s, c, w, r, ups
        finally:
            c.close()


def test_compaction_after_a_since_downgrade_leaves_one_time(stores: tuple[str, str]) -> None:
    """Times 0..9 appended in five batches, the reader's since downgraded to 9, then
    compacted: every output records since 9, its parts' ``_time`` statistics show the
    single time 9, key 1 (updated at every time) and key 2 (+1, +1, -1 at three times)
    are one row each, and every readable as_of reads the model."""
    n = N
    with _written(stores) as (_s, c, w, r, ups):
        assert c.inspect("s").trace.all_fueled_merge_reqs()  # made while the since was 0
        r.downgrade_since(A(n - 1))
        report = c.compactor.compact_once("s")
        assert report.applied >= 1 and report.not_applied == 0 and report.failed == 0
        st = c.inspect("s")
        st.trace.validate()
        outs = _compacted(c, "s", n - 1)
        assert outs, [b.desc for b in st.trace.batches()]
        for b in outs:
            assert _times(b) == {n - 1}, b.desc
        # The merge from time 0 (inputs [0, 8), made at since 0): each (key, value)
        # is one row, its diff the sum of its updates below the output's upper.
        (first,) = [b for b in outs if b.desc.lower == A(0)]
        hi = first.desc.upper.as_option()
        assert hi is not None and hi >= 6
        rows = _stored_rows(c.blob, first)
        per_key = Counter(row["k"] for row in rows)
        assert per_key[1] == 1 and per_key[2] == 1 and set(per_key.values()) == {1}, rows
        got = Counter({(row["k"], row["v"]): row["_diff"] for row in rows})
        assert got == _model(ups, hi - 1)
        # Later appends; every readable as_of (since <= as_of < upper) reads the model.
        more = [(1, f"v{n - 1}", n, -1), (1, "late", n + 1, 1), (50, "y", n + 2, 1)]
        _append(w, more, n, n + 3)
        for as_of in range(n - 1, n + 3):
            assert _snapshot(r, as_of) == _model(ups + more, as_of), as_of


def test_a_stale_version_in_hand_advances_less_but_still_applies(
    stores: tuple[str, str],
) -> None:
    """The compactor's cached version has since 4; another client (in this process, a
    separate cache) downgrades the since to 9 before the compaction, which works from
    its cached version: the output is consolidated at 4 (never at a since it did not
    read), applies on the fresh state, and reads equal the model."""
    _stash_url, blob_dir = stores
    n = N
    with _written(stores, since=4) as (s, c, _w, r, ups):
        comp = _client(s, blob_dir)
        m = comp.machine(comp.shard_id("s"))
        assert m.fetch().since == A(4)  # the compactor's cache
        r.downgrade_since(A(n - 1))  # through the writer's client
        report = comp.compactor.compact_once("s", fresh=False)
        assert report.applied >= 1 and report.not_applied == 0
        st = c.inspect("s")
        st.trace.validate()
        assert st.since == A(n - 1)
        outs = _compacted(c, "s", 4)
        assert outs and not _compacted(c, "s", n - 1)
        for b in outs:
            assert min(_times(b)) == 4, b.desc
        assert _snapshot(r, n - 1) == _model(ups, n - 1)
        comp.close()


_DOWNGRADE = """
import sys
from persist import FileBlob, PersistClient
from stash import Antichain, Stash
import pyarrow as pa
stash_url, blob_dir, since = sys.argv[1], sys.argv[2], int(sys.argv[3])
with Stash.open(stash_url, fenced=False) as s:
    c = PersistClient(s, FileBlob(blob_dir), compaction="off")
    r = c.open_reader("s", pa.schema([("k", pa.int64())]), pa.schema([("v", pa.string())]))
    r.downgrade_since(Antichain.from_elem(since))
    c.close()
"""


def test_a_second_process_downgrades_the_since_between_compute_and_apply(
    stores: tuple[str, str],
) -> None:
    """Merges computed at since 4 (the version the compactor read); a second process
    moves the shard's since to 9 before they are applied: they apply (the shard's since
    only moved on), their descriptions say 4, their stored times are at least 4, and
    every readable as_of reads the model."""
    stash_url, blob_dir = stores
    n = N
    with _written(stores, since=4) as (_s, c, _w, r, ups):
        r.expire()  # the second process's reader alone holds the since from here
        m = c.machine(c.shard_id("s"))
        st = m.fetch()
        assert st.since == A(4)
        reqs = st.trace.all_fueled_merge_reqs()
        assert reqs and all(q.desc.since == A(0) for q in reqs)
        results = [c.compactor.compute(m, q)[0] for q in reqs]
        assert {res.output.desc.since for res in results} == {A(4)}
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
        subprocess.run(
            [sys.executable, "-c", _DOWNGRADE, stash_url, blob_dir, str(n - 1)],
            check=True,
            env=env,
            timeout=120,
        )
        assert m.state().since == A(4)  # the compactor's version is now stale
        rs = c.compactor.apply(m, results)
        assert all(x.applied() for x in rs), rs
        st = c.inspect("s")
        st.trace.validate()
        assert st.since == A(n - 1)
        outs = _compacted(c, "s", 4)
        assert len(outs) == len(results)
        for b in outs:
            assert min(_times(b)) >= 4, b.desc
        r2 = c.open_reader("s", KS, VS)
        assert _snapshot(r2, n - 1) == _model(ups, n - 1)
