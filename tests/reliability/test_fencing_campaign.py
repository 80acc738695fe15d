"""Fencing campaign: a deposed leader keeps trying to write for a while after a
new leader opens; none of its writes become visible, each attempt fails unrecoverably,
and the new leader's writes all land. The old leader runs in a separate process."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest

from stash import Stash, StashError
from tests.reliability.campaign import record, runs


def _old_leader(
    url: str, r: int, opened: mp.synchronize.Event, go: mp.synchronize.Event, out: mp.Queue
) -> None:  # type: ignore[type-arg]
    s = Stash.open(url, fenced=True)
    c = s.collection("leader", key="str", value="str")
    b = c.make_batch(s)
    c.append_to_batch(b, f"old-before-{r}", "x", 1)
    s.append([b])
    opened.set()
    go.wait(30)
    attempts = unrecoverable = 0
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        attempts += 1
        try:
            b = c.make_batch(s)
            c.append_to_batch(b, f"old-after-{attempts}", "x", 1)
            s.append([b])
        except StashError as e:
            unrecoverable += e.is_unrecoverable()
    out.put((attempts, unrecoverable))


@pytest.mark.campaign
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_deposed_leader_writes_nothing(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    from tests.support.dbutil import backend_url

    url = backend_url(request, backend, tmp_path)
    Stash.open(url, fenced=False).close()
    ctx = mp.get_context("spawn")
    total_attempts = 0
    rounds = runs(2, 20)
    for r in range(rounds):
        opened, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
        p = ctx.Process(target=_old_leader, args=(url, r, opened, go, out))
        p.start()
        assert opened.wait(60)
        new = Stash.open(url, fenced=True)
        go.set()
        c = new.collection("leader", key="str", value="str")
        for i in range(20):
            b = c.make_batch(new)
            c.append_to_batch(b, f"new-{r}-{i}", "y", 1)
            new.append([b])
        attempts, unrecoverable = out.get(timeout=60)
        p.join(30)
        assert attempts > 0 and unrecoverable == attempts
        contents = new.peek_one(c)
        assert not [k for k in contents if k.startswith("old-after")]
        assert all(f"new-{r}-{i}" in contents for i in range(20))
        new.close()
        total_attempts += attempts
    record(
        f"fencing: deposed leader on {backend}",
        runs=rounds,
        faults=rounds,
        acknowledged=20 * rounds,
        lost=0,
        duplicated=0,
        partial=0,
        unclear=0,
        deposed_attempts=total_attempts,
    )
