"""Protects: a listen sees every update exactly once across rollups, compaction and GC.

A listen (and a fresh client) across rollups, compaction, since
downgrades, GC with no grace and an injected clock, on SQLite and Postgres, with
indeterminate appends (landed or not) at and around the rollup versions."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist import ConsensusError, PersistClient, UpperMismatch, collect_garbage, fsck
from stash import IndeterminateError, Stash

pytestmark = pytest.mark.adversarial

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])


class _Flaky:
    """The armed append raises IndeterminateError, after committing or not."""

    def __init__(self, inner: Stash) -> None:
        self.inner = inner
        self.armed: bool | None = None
        self.hits = 0

    def append(self, batches: Any) -> None:
        armed, self.armed = self.armed, None
        if armed is None:
            self.inner.append(batches)
            return
        self.hits += 1
        if armed:
            self.inner.append(batches)
        raise IndeterminateError("injected: connection lost during COMMIT")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture(params=["sqlite", "postgres"])
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/stash.db"
    from tests.support.dbutil import migrate_to_head

    url = str(request.getfixturevalue("postgres_url"))
    migrate_to_head(url)
    return url


@pytest.mark.parametrize("max_diffs", [0, 2, 3])
def test_listen_sees_every_acked_update_once_across_rollups(
    shared_url: str, tmp_path: Path, max_diffs: int
) -> None:
    now = [1_000_000.0]
    clock = lambda: now[0]  # noqa: E731
    blob = f"file://{tmp_path}/blob"
    with Stash.open(shared_url, fenced=False) as s1, Stash.open(shared_url, fenced=False) as s2:
        flaky = _Flaky(s1)
        wc = PersistClient(
            flaky,  # type: ignore[arg-type]
            blob,
            compaction="inline",
            inline_max_bytes=0,
            reader_lease_seconds=60,
            clock=clock,
            gc_grace_seconds=0,
            gc_interval_seconds=None,
        )
        wc.consensus.max_diffs = max_diffs
        rc = PersistClient(
            s2,
            blob,
            compaction="off",
            reader_lease_seconds=60,
            clock=clock,
            gc_grace_seconds=0,
            gc_interval_seconds=None,
        )
        rc.consensus.max_diffs = max_diffs
        w, _r0 = wc.open("lr", KS, VS)
        w.resolve_max_wait = 0.001
        _w2, r = rc.open("lr", KS, VS)
        w.compare_and_append([], 0, 1)
        lis = r.listen(0, hold_interval_seconds=0.0)
        seen: Counter[str] = Counter()
        last_progress = -1
        last_time = -1
        acked: Counter[str] = Counter()

        def drain() -> None:
            nonlocal last_progress, last_time
            for ev in lis.poll():
                if ev.kind == "updates":
                    assert ev.updates is not None
                    for row in ev.updates.to_pylist():
                        assert row["_time"] >= last_time, (row, last_time)
                        assert row["_time"] >= last_progress
                        last_time = row["_time"]
                        seen[row["k"]] += row["_diff"]
                else:
                    assert ev.progress is not None
                    p = ev.progress.as_option()
                    assert p is not None and p > last_progress, (p, last_progress)
                    last_progress = p

        t = 1
        for i in range(14):
            key = f"k{i}"
            seq = wc.machine(w.shard_id).seqno()
            # Indeterminate at the versions around each rollup.
            if max_diffs and (seq + 1) % (max_diffs + 1) in (0, 1, max_diffs):
                flaky.armed = i % 2 == 0
            tbl = [(((key,), (i,)), t, 1)]
            try:
                w.compare_and_append(tbl, t, t + 1)
            except ConsensusError as e:
                assert e.is_indeterminate()
                try:
                    w.compare_and_append(tbl, t, t + 1, idempotency_token=e.idempotency_token)
                except UpperMismatch:
                    raise
            acked[key] += 1
            t += 1
            now[0] += 1.0
            if i % 3 == 1:
                drain()
                r.downgrade_since(max(0, last_progress - 2))
            if i % 4 == 2:
                collect_garbage(rc, "lr", grace_seconds=0)
            if i % 5 == 4:
                drain()
        drain()
        assert last_progress == t
        assert flaky.hits > 0 or max_diffs == 0
        assert seen == acked, (seen, acked)
        # A fresh client reads the same state.
        with Stash.open(shared_url, fenced=False) as s3:
            fc = PersistClient(s3, blob, compaction="off", clock=clock, gc_interval_seconds=None)
            _fw, fr = fc.open("lr", KS, VS)
            snap = fr.snapshot(t - 1)
            got = Counter({row["k"]: row["_diff"] for row in snap.to_pylist()})
            assert got == acked
            rep = fsck(fc, "lr")
            assert not rep.missing and not rep.wrong_size and not rep.wrong_checksum, rep
            fc.close()
        lis.close()
        rc.close()
        wc.close()
