"""``stash.metrics.Histogram`` (the histogram every stash transaction observes, cheaper
per observation than ``prometheus_client.Histogram``) is exposed exactly as
``prometheus_client.Histogram`` exposes the same observations: a differential test on the
text exposition, ``_created`` series included (their timestamps aside)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import Histogram as PromHistogram

from stash import Stash
from stash.metrics import TXN_SECONDS, Histogram

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


def _text(registry: CollectorRegistry) -> list[str]:
    lines = generate_latest(registry).decode().splitlines()
    return [ln.rsplit(" ", 1)[0] if "_created" in ln else ln for ln in lines]


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["sqlite", "postgresql", "memory"]),
            st.sampled_from(["read", "write"]),
            st.one_of(
                st.floats(0, 20, allow_nan=False),
                st.sampled_from([*BUCKETS, 0.0, math.inf]),
            ),
        ),
        max_size=30,
    )
)
def test_the_exposition_is_prometheus_clients(obs: list[tuple[str, str, float]]) -> None:
    mine, theirs = CollectorRegistry(), CollectorRegistry()
    args = ("stash_txn_duration_seconds", "Wall time.", ["backend", "kind"])
    h = Histogram(*args, buckets=BUCKETS, registry=mine)
    p = PromHistogram(*args, buckets=BUCKETS, registry=theirs)
    for backend, kind, x in obs:
        h.labels(backend, kind).observe(x)
        p.labels(backend, kind).observe(x)
    assert _text(mine) == _text(theirs)


def test_a_write_is_counted(tmp_path: object) -> None:
    child = TXN_SECONDS.labels("sqlite", "write")
    before = child.snapshot()[0]
    with Stash.open(f"sqlite:///{tmp_path}/s.db", fenced=False) as s:
        s.collection("c", key="int", value="int")
    assert sum(child.snapshot()[0]) > sum(before)
