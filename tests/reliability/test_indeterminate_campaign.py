"""Indeterminate-commit campaign: COMMITs land but their
acknowledgement is lost, and the re-reads that follow fail for a while.  Each append is
retried the way a caller that retries everything would: after an indeterminate error it
retries the same append (same rows and bounds: a token names one append exactly),
passing the error's ``idempotency_token``; after ``UpperMismatch`` it re-reads the
upper and appends the rows there without a token.

Invariants checked: every acknowledged append is visible exactly once (``duplicated ==
0``, ``lost == 0``), no append is ever reported as a lost race when it was its own
success, and nothing unacknowledged is visible.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist import ConsensusError, MemoryBlob, PersistClient, UpperMismatch
from stash import Stash
from tests.reliability.campaign import record, runs
from tests.support.stash_faults import AckLostStash

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])


def _append_until_acknowledged(w: Any, i: int, stats: Counter[str]) -> None:
    """Append row ``i`` once, as a caller that retries everything would: an append
    whose outcome is unknown is retried as it was (same rows, same bounds) with the
    error's token, which names that append exactly; only after ``UpperMismatch`` (it
    did not land) are the rows appended at a fresh upper."""
    token: str | None = None
    attempt: tuple[list[Any], int] | None = None  # (rows, lower) being tried
    for _ in range(200):
        if attempt is None:
            try:
                upper = w.fetch_recent_upper().as_option()
            except ConsensusError:
                stats["read_errors"] += 1
                continue
            attempt, token = ([(((f"r{i}",), (i,)), upper, 1)], upper), None
        rows, lower = attempt
        try:
            w.compare_and_append(rows, lower, lower + 1, idempotency_token=token)
            return
        except ConsensusError as e:
            if e.is_indeterminate():
                stats["gave_up"] += 1
                token = e.idempotency_token
            stats["retried"] += 1
        except UpperMismatch:
            stats["races_reported"] += 1  # a single writer: never a real race
            stats["retried"] += 1
            attempt = None
    raise AssertionError(f"append {i} never acknowledged")


@pytest.mark.campaign
@pytest.mark.parametrize("backend", ["memory", "sqlite"])
def test_indeterminate_commits_never_duplicate(backend: str, tmp_path: Path) -> None:
    url = "memory://" if backend == "memory" else f"sqlite:///{tmp_path / 'stash.db'}"
    inner = Stash.open(url, fenced=False)
    flaky = AckLostStash(inner, seed=7)
    c = PersistClient(
        flaky,  # type: ignore[arg-type]
        MemoryBlob(),
        compaction="inline",
        consensus_retries=1,
    )
    w, r = c.open("indeterminate", KS, VS)
    w.resolve_max_wait = 0.001
    rng = random.Random(11)
    n = runs(60, 600)
    stats: Counter[str] = Counter()
    flaky.p, flaky.max_reads = 0.35, 12
    for i in range(n):
        w.resolve_attempts = rng.choice([1, 2, 4, 8])  # sometimes it must give up
        _append_until_acknowledged(w, i, stats)
    flaky.p, flaky.reads_to_fail = 0.0, 0
    upper = w.fetch_recent_upper().as_option()
    assert upper is not None
    snap = r.snapshot(upper - 1)
    got = Counter(snap.column("k").to_pylist())
    diffs = Counter(snap.column("_diff").to_pylist())
    duplicated = sum(
        1
        for k, d in zip(snap.column("k").to_pylist(), snap.column("_diff").to_pylist(), strict=True)
        if d > 1
    )
    lost = sum(1 for i in range(n) if got[f"r{i}"] == 0)
    unacknowledged = len(set(got) - {f"r{i}" for i in range(n)})
    assert flaky.lost_acks > 0 and stats["gave_up"] > 0, "the campaign injected nothing"
    assert duplicated == 0, f"duplicated appends: {diffs}"
    assert lost == 0 and unacknowledged == 0
    assert upper == n, "an append landed twice (at two uppers)"
    assert stats["races_reported"] == 0, "an append's own success was reported as a race"
    record(
        f"indeterminate commits: persist on {backend} (ack lost, re-reads failing)",
        runs=n,
        faults=flaky.lost_acks,
        acknowledged=n,
        lost=lost,
        duplicated=duplicated,
        partial=0,
        unclear=0,
        indeterminate_commits=flaky.lost_acks,
        retried_with_token=stats["gave_up"],
        races_reported=stats["races_reported"],
    )
    c.close()
    inner.close()
