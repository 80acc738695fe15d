"""Bad-input campaign, stash side: hypothesis-generated garbage for every public
entry point (frontiers, times outside bounds, huge and deeply nested values, wrong types,
wrong codecs). Each call either succeeds or raises a StashError whose message starts with
``stash error: `` — never another exception — and a failed call changes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stash import Antichain, AppendBatch, Stash, StashError
from tests.reliability.campaign import record, runs

garbage = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=20),
    st.binary(max_size=10),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=3),
    st.builds(object),
    st.just(float("nan")),
    st.just("\x00"),
    st.integers(min_value=2**63, max_value=2**70),
    st.integers(min_value=-(2**70), max_value=-(2**63) - 1),
    st.builds(Antichain.from_elem, st.integers(-(2**63), 2**63 - 1)),
    st.just(Antichain()),
    st.recursive(st.integers(), lambda s: st.lists(s, min_size=1, max_size=1), max_leaves=80),
)

OPS = [
    "update",
    "update_many",
    "seal",
    "compact",
    "append",
    "collection",
    "iter_key",
    "peek_key_one",
    "seal_batch",
    "compact_batch",
    "append_raw",
]


def _snapshot(s: Stash, names: list[str]) -> Any:
    out = []
    for n in names:
        c = s.collection(n)
        out.append(
            (n, s.since(c), s.upper(c), s.iter(c) if s.since(c).as_option() is not None else None)
        )
    return out


@pytest.mark.campaign
@pytest.mark.parametrize("backend", ["memory", "sqlite"])
def test_garbage_never_crashes_or_half_writes(backend: str, tmp_path: Path) -> None:
    url = (
        "memory://garbage" + str(id(tmp_path))
        if backend == "memory"
        else f"sqlite:///{tmp_path}/g.db"
    )
    s = Stash.open(url, fenced=False)
    c = s.collection("target")
    s.update(c, ("seed", 1), 0, 1)
    counts = {"calls": 0, "errors": 0}

    @settings(max_examples=runs(150, 1500), deadline=None, suppress_health_check=list(HealthCheck))
    @given(op=st.sampled_from(OPS), a=garbage, b=garbage, d=garbage)
    def run(op: str, a: Any, b: Any, d: Any) -> None:
        before = _snapshot(s, ["target"])
        counts["calls"] += 1
        try:
            if op == "update":
                s.update(c, (a, b), d, 1)  # type: ignore[arg-type]
            elif op == "update_many":
                s.update_many(c, [(("ok", 1), 10**6, 1), ((a, b), d, 1)])  # type: ignore[list-item]
            elif op == "seal":
                s.seal(c, a)
            elif op == "compact":
                s.compact(c, a)
            elif op == "append":
                batch = AppendBatch(c, a, b, d, timestamp=0)
                s.append([batch])
            elif op == "collection":
                s.collection(a, key=b)
            elif op == "iter_key":
                s.iter_key(c, a)
            elif op == "peek_key_one":
                s.peek_key_one(c, a)
            elif op == "seal_batch":
                s.seal_batch([(c, a), (c, b)])
            elif op == "compact_batch":
                s.compact_batch([(c, a)])
            elif op == "append_raw":
                batch = c.make_batch(s) if s.upper(c).as_option() is not None else None
                if batch is not None:
                    batch.entries.append(((a, b), d, 1))  # type: ignore[arg-type]
                    s.append([batch])
        except StashError as e:
            counts["errors"] += 1
            assert str(e).startswith("stash error: ") and len(str(e)) > len("stash error: ")
            assert _snapshot(s, ["target"]) == before, f"{op} failed but changed state"

    run()
    s.close()
    assert counts["errors"] > 0
    record(
        f"bad input: stash on {backend}",
        runs=counts["calls"],
        faults=counts["errors"],
        acknowledged=counts["calls"] - counts["errors"],
        lost=0,
        duplicated=0,
        partial=0,
        unclear=0,
    )
