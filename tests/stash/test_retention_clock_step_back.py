"""A retention by duration keeps every time committed within it readable, even when the
wall clock steps back between two commits (an NTP correction, a VM restored): a time
committed after a clock step back was recorded with the earlier reading, became "old
enough" before the times committed just before it, and the since jumped past those,
compacting away history the retention promised.  Commit times recorded are now never
earlier than one already recorded (a commit under a clock behind them is not recorded,
which only holds the since back)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from stash import Stash, TypedCollection
from tests.support.clock import Clock
from tests.support.dbutil import backend_url

MINUTE = 60.0


@pytest.mark.parametrize(
    "backend", ["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("path", ["typed", "make_batch", "with_transaction"])
def test_a_clock_step_back_never_moves_the_since_past_a_recent_time(
    request: pytest.FixtureRequest, tmp_path: Path, backend: str, path: str
) -> None:
    clock = Clock()
    start = clock.now
    with Stash.open(backend_url(request, backend, tmp_path), clock=clock) as s:
        runs = TypedCollection("runs", key="str", value="int")
        c = runs.get(s)
        s.set_retention(c, keep_for=timedelta(minutes=15))

        def write(v: int) -> None:
            if path == "typed":
                runs.upsert_key(s, "last", v)
            elif path == "make_batch":
                b = c.make_batch(s)
                c.append_to_batch(b, str(v), v, 1)
                s.append([b])
            else:
                s.with_transaction(lambda tx: tx.table(runs).set("last", v))

        # time -> the wall clock it committed at, as a clock that never steps back
        # would read it (the newest reading so far)
        committed: dict[int, float] = {}
        for minute in (0, 10, 20, 30, 40, 5, 50, 52, 70):
            clock.now = start + minute * MINUTE
            t = s.upper(c).as_option()
            assert t is not None
            write(minute)
            committed[t] = max([minute, *committed.values()])
            since = s.since(c).as_option()
            assert since is not None
            now = max(committed.values())
            kept = [t for t, m in committed.items() if m > now - 15]
            assert since <= min(kept), (minute, since, committed)
