"""Races and faults: upper races, seqno races, racing writer processes, fault injection."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist import (
    BlobError,
    ConsensusError,
    FileBlob,
    MemoryBlob,
    PersistClient,
    PersistError,
    UnreliableBlob,
    UpperMismatch,
    collect_garbage,
)
from persist.keys import key_writer_id
from stash import Antichain, IndeterminateError, Stash, StashError
from tests.support.procs import process_context

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])


def ac(t: int) -> Antichain:
    return Antichain.from_elem(t)


def upd(k: str, v: int, t: int, d: int = 1) -> Any:
    return ((k,), (v,)), t, d


def contents(table: pa.Table) -> Counter[tuple[str, int]]:
    return Counter({(r["k"], r["v"]): r["_diff"] for r in table.to_pylist()})


@pytest.fixture
def stash() -> Iterator[Stash]:
    s = Stash.open("memory://", fenced=False)
    yield s
    s.close()


def shard_keys(client: PersistClient, shard: str) -> set[str]:
    return {k for k, _ in client.raw_blob.list_keys(client.shard_id(shard) + "/")}


def test_upper_race_commits_nothing_and_cleans_up(stash: Stash) -> None:
    blob = MemoryBlob()
    c1 = PersistClient(stash, blob, compaction="off", inline_max_bytes=0)
    c2 = PersistClient(stash, blob, compaction="off", inline_max_bytes=0)
    w1, r1 = c1.open("orders", KS, VS)
    w2, _ = c2.open("orders", KS, VS)
    w1.compare_and_append([upd("a", 1, 0)], 0, 1)
    before = shard_keys(c1, "orders")
    seqno = c1.inspect("orders").seqno
    sets = blob.metrics.snapshot().sets
    with pytest.raises(UpperMismatch) as e:
        w2.compare_and_append([upd("b", 2, 0)], 0, 1)
    assert e.value.expected == ac(0) and e.value.current == ac(1)
    assert blob.metrics.snapshot().sets == sets + 1  # it did upload its part first...
    assert shard_keys(c1, "orders") == before  # ...and deleted it after losing
    st = c1.inspect("orders")
    # Only w2's registration (before its upload, so GC knows the owner) was committed.
    assert st.seqno == seqno + 1 and st.upper == ac(1)
    assert set(st.writers) == {w1.writer_id, w2.writer_id}
    assert contents(r1.snapshot(0)) == Counter({("a", 1): 1})
    c1.close()
    c2.close()


def test_seqno_race_retries_metadata_only(stash: Stash) -> None:
    blob = MemoryBlob()
    c1 = PersistClient(stash, blob, compaction="off", inline_max_bytes=0)
    c2 = PersistClient(stash, blob, compaction="off", inline_max_bytes=0)
    w1, _ = c1.open("orders", KS, VS)
    _, r2 = c2.open("orders", KS, VS)
    w1.compare_and_append([upd("a", 1, 0)], 0, 1)
    # Another process changes the state (not the upper): w1's cached seqno is stale.
    r2.downgrade_since(1)
    lost = w1._machine.metrics["cas_lost"]
    sets = blob.metrics.snapshot().sets
    w1.compare_and_append([upd("b", 1, 1)], 1, 2)
    assert w1._machine.metrics["cas_lost"] == lost + 1  # lost once on the seqno...
    assert blob.metrics.snapshot().sets == sets + 1  # ...but uploaded exactly once
    assert contents(r2.snapshot(1)) == Counter({("a", 1): 1, ("b", 1): 1})
    c1.close()
    c2.close()


def test_rejected_batch_is_retried_without_upload(stash: Stash) -> None:
    blob = MemoryBlob()
    c = PersistClient(stash, blob, compaction="off", inline_max_bytes=0)
    w1, r = c.open("orders", KS, VS)
    w2 = c.open_writer("orders", KS, VS)
    batch = w1.batch([upd("x", 1, 0), upd("y", 1, 1)], 0, 2)
    sets = blob.metrics.snapshot().sets
    w2.compare_and_append([upd("z", 1, 0)], 0, 1)  # w2 wins the race
    with pytest.raises(UpperMismatch) as e:
        w1.compare_and_append_batch([batch], ac(0), ac(2))
    assert not batch.consumed and e.value.current == ac(1)
    assert contents(r.snapshot(0)) == Counter({("z", 1): 1})
    # Retry the same batch at the current upper: metadata only.
    batch.rewrite_ts(e.value.current, ac(2))
    w1.compare_and_append_batch([batch], e.value.current, ac(2))
    assert blob.metrics.snapshot().sets == sets + 1  # only w2's part since
    assert contents(r.snapshot(1)) == Counter({("x", 1): 1, ("y", 1): 1, ("z", 1): 1})
    c.close()


def _writer_process(stash_url: str, blob_root: str, who: int, n: int, q: Any) -> None:
    s = Stash.open(stash_url, fenced=False)
    c = PersistClient(
        s,
        FileBlob(blob_root, fsync=False),
        compaction="inline",
        inline_max_bytes=0 if who % 2 else 4096,
    )
    w, r = c.open("race", KS, VS)
    mismatches = 0
    upper = w.upper.as_option()
    assert upper is not None
    i = 0
    while i < n:
        try:
            w.compare_and_append([upd(f"w{who}-{i}", who, upper)], upper, upper + 1)
            i += 1
            upper += 1
        except UpperMismatch as e:
            mismatches += 1
            cur = e.current.as_option()
            assert cur is not None
            upper = cur
        if who == 0 and i % 10 == 0:
            r.downgrade_since(max(0, upper - 5))
    c.close()
    s.close()
    q.put((who, mismatches))


def test_four_writer_processes_race_on_one_shard(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/stash.db"
    blob_root = str(tmp_path / "blob")
    with Stash.open(url, fenced=False) as s:  # migrate/create once, up front
        c0 = PersistClient(s, FileBlob(blob_root), compaction="off")
        w0, r0 = c0.open("race", KS, VS)
        r0.expire()  # its reader's seqno hold would keep retired parts
        c0.close()
    ctx = process_context()
    q = ctx.Queue()
    n = 25
    procs = [ctx.Process(target=_writer_process, args=(url, blob_root, i, n, q)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    results = dict(q.get(timeout=5) for _ in procs)
    assert set(results) == {0, 1, 2, 3}
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(s, FileBlob(blob_root), compaction="off")
        _, r = c.open("race", KS, VS)
        st = c.inspect("race")
        st.trace.validate()
        upper = st.upper.as_option()
        assert upper == 4 * n
        got = contents(r.snapshot(upper - 1))
        want = Counter({(f"w{who}-{i}", who): 1 for who in range(4) for i in range(n)})
        assert got == want  # nothing lost, nothing doubled
        c.compactor.compact_once("race")
        assert contents(r.snapshot(upper - 1)) == want
        r.heartbeat()  # no read in progress: its seqno hold moves to the latest version
        collect_garbage(c, "race", grace_seconds=0)
        assert shard_keys(c, "race") == c.inspect("race").referenced_blob_keys()
        c.close()


class FlakyStash:
    """Wraps a stash; while ``on``, calls fail at random.  A failing ``append`` either
    fails before committing (a plain ``StashError``) or commits and then reports an
    ``IndeterminateError`` (the connection was lost during COMMIT)."""

    def __init__(self, inner: Stash, p: float, seed: int) -> None:
        self.inner = inner
        self.p = p
        self.rng = random.Random(seed)
        self.on = True
        self.injected = 0

    def _maybe_fail(self, what: str) -> None:
        if self.on and self.rng.random() < self.p:
            self.injected += 1
            raise StashError(f"injected failure in {what}")

    def append(self, batches: Any) -> None:
        batches = list(batches)
        self._maybe_fail("append")
        self.inner.append(batches)
        if self.on and self.rng.random() < self.p:
            self.injected += 1
            raise IndeterminateError("injected: connection lost during COMMIT")

    def iter(self, c: Any) -> Any:
        self._maybe_fail("iter")
        return self.inner.iter(c)

    def iter_key(self, c: Any, k: Any) -> Any:
        self._maybe_fail("iter_key")
        return self.inner.iter_key(c, k)

    def upper(self, c: Any) -> Any:
        self._maybe_fail("upper")
        return self.inner.upper(c)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_fault_injection_all_or_nothing(seed: int) -> None:
    inner = Stash.open("memory://", fenced=False)
    base = MemoryBlob()
    ublob = UnreliableBlob(base, fail_probability=0.15, seed=seed)
    flaky = FlakyStash(inner, p=0.1, seed=seed)
    # Setup without faults.
    ublob.faults(False)
    flaky.on = False
    c = PersistClient(
        flaky,
        ublob,
        compaction="inline",
        blob_retries=1,  # type: ignore[arg-type]
        consensus_retries=1,
        inline_max_bytes=0 if seed % 2 else 4096,
    )
    w, r = c.open("faulty", KS, VS)
    model: Counter[tuple[str, int]] = Counter()
    upper = 0
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()

    def faults(on: bool) -> None:
        ublob.faults(on)
        flaky.on = on

    for step in range(120):
        rows = [
            upd(f"k{rng.randrange(6)}", rng.randrange(2), upper, rng.choice([1, 1, -1]))
            for _ in range(rng.randrange(1, 4))
        ]
        faults(True)
        try:
            w.compare_and_append(rows, upper, upper + 1)
            ok: bool | None = True
        except (BlobError, ConsensusError) as e:
            ok = None if e.is_indeterminate() else False
            outcomes["indeterminate" if ok is None else "failed"] += 1
        except UpperMismatch:
            ok = False
            outcomes["mismatch"] += 1
        finally:
            faults(False)
        now = w.fetch_recent_upper().as_option()
        if ok is None:  # the outcome is learned by reading
            ok = now == upper + 1
        if ok:
            outcomes["ok"] += 1
            assert now == upper + 1
            for (k, v), _t, d in rows:
                model[(k[0], v[0])] += d
            upper += 1
        else:
            assert now == upper  # nothing visible
        if step % 7 == 0:
            faults(True)
            try:
                r.downgrade_since(max(0, upper - 3))
            except PersistError:
                pass
            finally:
                faults(False)
        if upper:
            want = {kv: d for kv, d in model.items() if d}
            assert dict(contents(r.snapshot(upper - 1))) == want
        c.inspect("faulty").trace.validate()
    assert outcomes["ok"] > 20 and outcomes["failed"] > 0
    # Later calls recover: with faults off everything works, and GC leaves only
    # referenced parts.
    for i in range(5):
        w.compare_and_append([upd("after", i, upper)], upper, upper + 1)
        model[("after", i)] += 1
        upper += 1
    c.compactor.compact_once("faulty")
    want = {kv: d for kv, d in model.items() if d}
    assert dict(contents(r.snapshot(upper - 1))) == want
    r.heartbeat()  # no read in progress: its seqno hold moves to the latest version
    collect_garbage(c, "faulty", grace_seconds=0)
    # What is left besides the referenced parts belongs to live writers (the writer's
    # failed appends, the compactor's unapplied outputs).
    st = c.inspect("faulty")
    left = shard_keys(c, "faulty") - st.referenced_blob_keys()
    assert all(key_writer_id(k) in st.live_writers(c.machine(st.shard_id).now_ms()) for k in left)
    w.expire()
    c.compactor.expire_writers()
    collect_garbage(c, "faulty", grace_seconds=0)
    assert shard_keys(c, "faulty") == c.inspect("faulty").referenced_blob_keys()
    assert dict(contents(r.snapshot(upper - 1))) == want
    c.close()
    inner.close()
