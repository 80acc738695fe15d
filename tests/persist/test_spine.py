"""Tests of persist.spine: the fueled Spine trace ported from Materialize's
``src/persist-client/src/internal/trace.rs``.

What is checked: the public API and its errors, each ``ApplyMergeResult`` case,
Materialize's redundant-request filter, that ``validate`` / ``from_json`` catch broken
invariants, an acceptance test (10,000 one-row appends with a moving since and a
compactor answering every request keep at most 2*log2(10,000) batches), and a hypothesis
state machine of random pushes, since downgrades, merge results (faithful, consolidated,
oversized, later since, subsets, stale) and JSON reloads, with every invariant checked after
every step.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from persist.spine import (
    ApplyMergeResult,
    FueledMergeReq,
    FueledMergeRes,
    IdHollowBatch,
    SpineId,
    SpineMetrics,
    Trace,
)
from persist.spine_merge import merge_output_desc
from persist.types import Description, HollowBatch, PartRef
from stash import Antichain
from tests.reliability.campaign import runs

A = Antichain.from_elem
EMPTY = Antichain()


def desc(lower: int, upper: int | None, since: int | None = 0) -> Description:
    return Description(A(lower), Antichain.from_option(upper), Antichain.from_option(since))


def part(key: str, rows: int) -> PartRef:
    return PartRef(key=key, rows=rows, encoded_size_bytes=100 + rows, checksum="0" * 64)


def hb(lower: int, upper: int | None, n: int = 1, since: int | None = 0) -> HollowBatch:
    """A hollow batch of ``n`` rows in one part named after its bounds."""
    parts = (part(f"p{lower}-{upper}", n),) if n else ()
    return HollowBatch(desc(lower, upper, since), parts, n)


def reload(t: Trace) -> Trace:
    """Flatten to JSON text and back, as another process would."""
    return Trace.from_json(json.loads(json.dumps(t.to_json())))


def answer(req: FueledMergeReq, n: int | None = None) -> FueledMergeRes:
    """The fake compactor: the output is the inputs' parts, in order, with ``desc``; an
    output consolidated to ``n == 0`` rows has no parts."""
    parts = tuple(p for i in req.inputs for p in i.batch.parts) if n != 0 else ()
    total = sum(i.batch.len for i in req.inputs)
    return FueledMergeRes(HollowBatch(req.desc, parts, total if n is None else n))


def keys(t: Trace) -> list[str | None]:
    return [p.key for b in t.batches() for p in b.parts]


# --------------------------------------------------------------------------- basics


def test_new_trace_is_empty_at_zero() -> None:
    t = Trace()
    assert t.since == A(0) and t.upper == A(0)
    assert list(t.batches()) == []
    assert (t.num_spine_batches(), t.num_hollow_batches(), t.num_updates()) == (0, 0, 0)
    assert t.all_fueled_merge_reqs() == []
    assert t.spine_metrics() == SpineMetrics(0, 0, 0)
    t.validate()
    assert reload(t) == t
    assert t.to_json()["spine_batches"] == {}


def test_apply_merge_result_predicates() -> None:
    R = ApplyMergeResult
    assert [r.applied() for r in R] == [True, True, False, False, False]
    assert [r.matched() for r in R] == [True, True, False, False, True]
    assert {r.name for r in R} == {
        "APPLIED_EXACT",
        "APPLIED_SUBSET",
        "NOT_APPLIED_NO_MATCH",
        "NOT_APPLIED_INVALID_SINCE",
        "NOT_APPLIED_TOO_MANY_UPDATES",
    }


def test_spine_id_str_and_parse() -> None:
    assert str(SpineId(3, 7)) == "3-7"
    assert SpineId.parse("3-7") == SpineId(3, 7)
    assert SpineId(0, 2) < SpineId(2, 3)
    for bad in ["3", "7-3", "3-3", "a-b", "-1-2", "1-2-3"]:
        with pytest.raises(ValueError, match="spine id"):
            SpineId.parse(bad)


def test_push_batch_checks_contiguity_and_commits_nothing_on_error() -> None:
    t = Trace()
    assert t.push_batch(hb(0, 2)) == []
    before = t.copy()
    with pytest.raises(ValueError, match=r"lower \{3\} is not the trace upper \{2\}"):
        t.push_batch(hb(3, 4))
    with pytest.raises(ValueError, match=r"lower \{1\} is not the trace upper \{2\}"):
        t.push_batch(hb(1, 4))
    with pytest.raises(ValueError, match="lower == upper"):
        t.push_batch(hb(2, 2))
    with pytest.raises(ValueError, match=r"batch since \{1\} is beyond the trace since \{0\}"):
        t.push_batch(hb(2, 3, since=1))
    with pytest.raises(ValueError, match="negative len"):
        t.push_batch(HollowBatch(desc(2, 3), (), -1))
    assert t == before
    t.validate()
    t.push_batch(hb(2, 3))
    assert t.upper == A(3)
    assert [b.desc.upper for b in t.batches()] == [A(2), A(3)]


def test_push_batch_to_the_empty_upper_closes_the_trace() -> None:
    t = Trace()
    t.push_batch(hb(0, None, 3))
    assert t.upper == EMPTY
    with pytest.raises(ValueError, match="lower"):
        t.push_batch(hb(5, 6))
    t.validate()
    assert reload(t) == t


def test_downgrade_since_only_advances() -> None:
    t = Trace()
    t.downgrade_since(A(5))
    assert t.since == A(5)
    t.downgrade_since(A(5))
    with pytest.raises(ValueError, match=r"since can only advance: \{4\} is not >= \{5\}"):
        t.downgrade_since(A(4))
    assert t.since == A(5)
    t.downgrade_since(EMPTY)
    assert t.since == EMPTY
    with pytest.raises(ValueError):
        t.downgrade_since(A(10))
    t.validate()
    assert reload(t).since == EMPTY


def test_first_merge_request_after_three_one_row_batches() -> None:
    t = Trace()
    assert t.push_batch(hb(0, 1)) == []
    assert t.push_batch(hb(1, 2)) == []  # level 0 is now full and merging
    t.downgrade_since(A(1))
    reqs = t.push_batch(hb(2, 3))  # fuel finishes the level-0 merge
    assert len(reqs) == 1
    (req,) = reqs
    # The merge began while the since was {0}.
    assert req.desc == desc(0, 2, 0)
    assert [i.id for i in req.inputs] == [SpineId(0, 1), SpineId(1, 2)]
    assert [i.batch for i in req.inputs] == [hb(0, 1), hb(1, 2)]
    assert t.all_fueled_merge_reqs() == reqs
    assert t.spine_metrics() == SpineMetrics(
        compact_batches=1, compacting_batches=1, noncompact_batches=0
    )
    assert t.num_spine_batches() == 2 and t.num_hollow_batches() == 3
    assert t.apply_merge_res(answer(req)) is ApplyMergeResult.APPLIED_EXACT
    assert t.num_spine_batches() == 2 and t.num_hollow_batches() == 2
    assert t.all_fueled_merge_reqs() == []
    assert keys(t) == ["p0-1", "p1-2", "p2-3"]
    # Answering again is harmless: the batch is merged already, equal length.
    assert t.apply_merge_res(answer(req)) is ApplyMergeResult.APPLIED_EXACT
    t.validate()


def test_empty_batches_are_fused() -> None:
    t = Trace()
    for i in range(50):
        assert t.push_batch(hb(i, i + 1, n=0)) == []
        t.validate()
    assert t.num_spine_batches() == 1
    (b,) = t.batches()
    assert b.desc.lower == A(0) and b.desc.upper == A(50) and b.len == 0
    # A non-empty batch then empties: the empties fuse behind it.
    t.push_batch(hb(50, 51, n=1))
    for i in range(51, 60):
        t.push_batch(hb(i, i + 1, n=0))
        t.validate()
    assert t.upper == A(60)
    assert t.num_updates() == 1
    assert t.num_spine_batches() <= 4
    assert reload(t) == t


def test_levels_follow_the_seed_spine_by_hand() -> None:
    """A small case worked out by hand from Materialize's Spine: a 100-row batch enters
    at level 7 (next power of two 128), rolling the 1-row batch up with it; the next
    100-row batch's fuel (8 << 7) finishes that merge into level 8, and tidying draws the
    level-8 batch back down to level 7 (101 rows fit under 2**7; nothing lies below), where
    it starts merging with the new batch."""
    t = Trace()
    assert t.push_batch(hb(0, 1, 1)) == []
    assert t.push_batch(hb(1, 2, 100)) == []
    d = t.to_json()
    assert {k: v["level"] for k, v in d["spine_batches"].items()} == {"0-1": 7, "1-2": 7}
    assert d["fueling_merges"] == {"0-2": {"since": [0], "remaining_work": 101}}
    (req,) = t.push_batch(hb(2, 3, 100))
    assert req.desc == desc(0, 2) and [i.id for i in req.inputs] == [SpineId(0, 1), SpineId(1, 2)]
    d = t.to_json()
    assert t.num_levels() == 8
    assert {k: v["level"] for k, v in d["spine_batches"].items()} == {"0-2": 7, "2-3": 7}
    assert d["spine_batches"]["0-2"]["parts"] == ["0-1", "1-2"]
    assert d["fueling_merges"] == {"0-3": {"since": [0], "remaining_work": 201}}
    t.validate()


def _trace_with_fueled_batch(n: int) -> tuple[Trace, FueledMergeReq]:
    """A trace whose oldest spine batch is fueled over ``n`` >= 3 one-row hollow batches
    (nothing answered), and that batch's request."""
    t = Trace()
    i = 0
    while True:
        t.push_batch(hb(i, i + 1))
        i += 1
        reqs = t.all_fueled_merge_reqs()
        if reqs and len(reqs[0].inputs) >= n:
            return t, reqs[0]


def test_apply_merge_res_exact_subset_and_refusals() -> None:
    t, req = _trace_with_fueled_batch(4)
    assert req.desc.lower == A(0)
    ins = req.inputs
    total = sum(i.batch.len for i in ins)
    t.validate()

    def unchanged(res: FueledMergeRes, expected: ApplyMergeResult) -> None:
        before = t.copy()
        assert t.apply_merge_res(res) is expected
        assert t == before

    # Bounds matching nothing.
    unchanged(FueledMergeRes(hb(0, 10_000, 1)), ApplyMergeResult.NOT_APPLIED_NO_MATCH)
    unchanged(FueledMergeRes(hb(1, 10_000, 1)), ApplyMergeResult.NOT_APPLIED_NO_MATCH)
    unchanged(
        FueledMergeRes(HollowBatch(Description(A(-1), A(2)), (), 0)),
        ApplyMergeResult.NOT_APPLIED_NO_MATCH,
    )
    # More updates than the batch holds.
    unchanged(answer(req, total + 1), ApplyMergeResult.NOT_APPLIED_TOO_MANY_UPDATES)
    # A since beyond the batch's.
    later = Description(req.desc.lower, req.desc.upper, A(10**6))
    unchanged(FueledMergeRes(HollowBatch(later, (), 0)), ApplyMergeResult.NOT_APPLIED_INVALID_SINCE)

    # A subset: the second and third hollow batches, consolidated to 1 row.
    sub = FueledMergeReq(
        Description(ins[1].batch.desc.lower, ins[2].batch.desc.upper, req.desc.since),
        ins[1:3],
    )
    unchanged(answer(sub, 3), ApplyMergeResult.NOT_APPLIED_TOO_MANY_UPDATES)
    hollow = t.num_hollow_batches()
    assert t.apply_merge_res(answer(sub, 1)) is ApplyMergeResult.APPLIED_SUBSET
    t.validate()
    assert t.num_hollow_batches() == hollow - 1
    assert t.num_updates() == total_updates_pushed(t) - 1
    merged = t.all_fueled_merge_reqs()[0]
    assert merged.inputs[1].id == SpineId(ins[1].id.lo, ins[2].id.hi)
    assert reload(t) == t

    # The original request now holds one update more than the batch: refused.
    unchanged(answer(req), ApplyMergeResult.NOT_APPLIED_TOO_MANY_UPDATES)
    # The whole batch, consolidated further: exact.
    assert t.apply_merge_res(answer(req, total - 2)) is ApplyMergeResult.APPLIED_EXACT
    t.validate()
    assert t.all_fueled_merge_reqs()[:1] != [merged]
    assert keys(t)[: len(ins)] == [f"p{i}-{i + 1}" for i in range(len(ins))]
    assert reload(t) == t


def total_updates_pushed(t: Trace) -> int:
    """Rows pushed into a trace built by ``_trace_with_fueled_batch`` (one per time)."""
    upper = t.upper.as_option()
    assert upper is not None
    return upper


def test_remove_redundant_merge_reqs_as_in_the_seed() -> None:
    def req(lower: int, upper: int, since: int | None = None) -> FueledMergeReq:
        return FueledMergeReq(desc(lower, upper, since), ())

    f = Trace._remove_redundant_merge_reqs
    assert f([]) == []
    assert f([req(0, 1)]) == [req(0, 1)]
    assert f([req(0, 1), req(0, 1)]) == [req(0, 1)]
    assert f([req(0, 1), req(1, 2)]) == [req(1, 2), req(0, 1)]
    assert f([req(1, 2), req(0, 3)]) == [req(0, 3)]
    assert f([req(0, 2), req(0, 3)]) == [req(0, 3)]
    assert f([req(1, 3), req(0, 3)]) == [req(0, 3)]
    assert f([req(0, 3), req(1, 2)]) == [req(0, 3)]
    assert f([req(0, 2), req(1, 3)]) == [req(1, 3), req(0, 2)]
    assert f([req(1, 3), req(0, 2)]) == [req(0, 2), req(1, 3)]
    assert f([req(0, 1), req(0, 1, 5)]) == [req(0, 1, 5), req(0, 1)]


def test_copy_is_independent() -> None:
    t, _ = _trace_with_fueled_batch(3)
    c = t.copy()
    assert c == t
    c.push_batch(hb(c.upper.as_option() or 0, (c.upper.as_option() or 0) + 1))
    assert c != t
    t.validate()
    c.validate()


# --------------------------------------------------------------------------- JSON


def test_to_json_shape_and_round_trip_with_merges_in_progress() -> None:
    t = Trace()
    for i in range(16):
        t.push_batch(hb(i, i + 1))
        t.downgrade_since(A(i // 2))
    d = t.to_json()
    assert set(d) == {
        "since",
        "upper",
        "next_id",
        "hollow_batches",
        "spine_batches",
        "fueling_merges",
    }
    assert d["since"] == [7] and d["upper"] == [16] and d["next_id"] == 16
    assert d["fueling_merges"], "some level should be merging"
    assert len(t.all_fueled_merge_reqs()) == 3
    assert len(d["hollow_batches"]) == 16  # nothing answered: every pushed batch is there
    assert all(isinstance(v["level"], int) for v in d["spine_batches"].values())
    assert json.loads(json.dumps(d)) == d
    u = reload(t)
    assert u == t and u.to_json() == d
    # The reloaded trace behaves the same from here on.
    for i in range(16, 60):
        assert u.push_batch(hb(i, i + 1)) == t.push_batch(hb(i, i + 1))
        assert u == t


def corrupt(t: Trace, f: Any) -> dict[str, Any]:
    d: dict[str, Any] = json.loads(json.dumps(t.to_json()))
    f(d)
    return d


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: d.__setitem__("next_id", d["next_id"] + 1), "next_id"),
        (lambda d: d.__setitem__("upper", [10**6]), "spine upper"),
        (lambda d: d.__setitem__("since", [0]), "beyond the trace since"),
        (lambda d: d["hollow_batches"].popitem(), "missing hollow batch"),
        (lambda d: d["hollow_batches"].__setitem__("900-901", hb(0, 1).to_json()), "left"),
        (lambda d: d["fueling_merges"].clear(), "no fueling merge"),
        (
            lambda d: d["fueling_merges"].__setitem__(
                "900-902", {"since": [0], "remaining_work": 1}
            ),
            "merges left",
        ),
        (lambda d: d["spine_batches"].popitem(), "missing|left|follow|upper|next_id"),
        (
            lambda d: [v.__setitem__("level", 0) for v in d["spine_batches"].values()],
            "full level|more than|merging",
        ),
        (lambda d: next(iter(d["spine_batches"].values())).__setitem__("level", 0), "level"),
        (lambda d: d.pop("fueling_merges"), "malformed"),
        (lambda d: d.__setitem__("next_id", "7"), "next_id"),
    ],
)
def test_from_json_rejects_broken_invariants(damage: Any, message: str) -> None:
    t = Trace()
    for i in range(16):
        t.push_batch(hb(i, i + 1))
        t.downgrade_since(A(i // 2))
    assert t.to_json()["fueling_merges"]
    with pytest.raises(ValueError, match=message):
        Trace.from_json(corrupt(t, damage))


def test_validate_rejects_oversized_batch_at_its_level() -> None:
    t = Trace()
    t.push_batch(hb(0, 1, n=1))
    t.push_batch(hb(1, 2, n=1))
    t.push_batch(hb(2, 3, n=1))
    d = t.to_json()
    # Grow a level-0 batch to 2 rows: beyond the 2**0 allowed there.
    levels = {k: v["level"] for k, v in d["spine_batches"].items()}
    k0 = next(k for k, lvl in levels.items() if lvl == 0)
    d["hollow_batches"][k0]["len"] = 2
    with pytest.raises(ValueError, match=r"more than the 2\*\*0 allowed at level 0"):
        Trace.from_json(d)


def test_validate_rejects_misaligned_descriptions() -> None:
    t = Trace()
    for i in range(5):
        t.push_batch(hb(2 * i, 2 * i + 2))
    d = t.to_json()
    last = max(d["hollow_batches"], key=SpineId.parse)
    d["hollow_batches"][last]["desc"]["lower"] = [7]
    d["spine_batches"][last]["desc"]["lower"] = [7]
    with pytest.raises(ValueError, match=r"lower \{7\} does not match the previous upper \{8\}"):
        Trace.from_json(d)


def test_from_json_rejects_non_dict() -> None:
    with pytest.raises(ValueError, match="malformed"):
        Trace.from_json({})
    with pytest.raises(ValueError):
        Trace.from_json({"hollow_batches": [], "fueling_merges": {}, "spine_batches": {}})


# --------------------------------------------------------------------------- acceptance


def test_ten_thousand_one_row_appends_keep_a_logarithmic_number_of_batches() -> None:
    """The lead's acceptance test: 10,000 one-row appends, a since trailing the upper,
    and a compactor answering every merge request with the union of its inputs' parts."""
    n = 10_000
    bound = 2 * math.log2(n)
    t = Trace()
    most = 0
    applied = 0
    for i in range(n):
        for req in t.push_batch(hb(i, i + 1)):
            assert req.desc.since <= t.since
            if t.apply_merge_res(answer(req)).applied():
                applied += 1
        t.downgrade_since(A(max(0, i - 3)))
        most = max(most, t.num_hollow_batches())
        if i % 500 == 0:
            t.validate()
            assert reload(t) == t
    t.validate()
    assert t.num_hollow_batches() <= bound
    assert t.num_spine_batches() <= bound
    assert most <= bound, f"the trace held {most} batches at some point"
    assert applied > n // 2
    assert t.num_updates() == n
    assert keys(t) == [f"p{i}-{i + 1}" for i in range(n)]
    assert t.upper == A(n) and t.since == A(n - 4)
    assert reload(t) == t


def test_without_a_compactor_spine_batches_stay_logarithmic() -> None:
    n = 3000
    t = Trace()
    for i in range(n):
        t.push_batch_no_merge_reqs(hb(i, i + 1))
    t.validate()
    assert t.num_spine_batches() <= 2 * math.log2(n)
    assert t.num_hollow_batches() == n  # unanswered merges keep listing every batch
    reqs = t.all_fueled_merge_reqs()
    assert reqs and sum(len(r.inputs) for r in reqs) <= n
    for r in reqs:
        assert t.apply_merge_res(answer(r)) is ApplyMergeResult.APPLIED_EXACT
    assert t.num_hollow_batches() == t.num_spine_batches()
    assert keys(t) == [f"p{i}-{i + 1}" for i in range(n)]
    t.validate()


# --------------------------------------------------------------------------- hypothesis

MODES = ["faithful", "consolidated", "oversized", "later_since", "subset", "state_since"]


class SpineMachine(RuleBasedStateMachine):
    """Random pushes, since downgrades, merge results and reloads.

    ``trace`` is reloaded from JSON from time to time; ``shadow`` never is and receives
    the same operations: they must stay equal and answer alike.  Every output is made of
    its inputs' parts, so until an output is consolidated the sequence of part keys is
    exactly the pushed one (afterwards, an ordered subsequence of it).
    """

    @initialize()
    def init(self) -> None:
        self.trace = Trace()
        self.shadow = Trace()
        self.pushed_keys: list[str | None] = []
        self.pushed_rows = 0
        self.consolidated = False
        self.pending: list[FueledMergeReq] = []

    def _upper(self) -> int:
        u = self.trace.upper.as_option()
        assert u is not None
        return u

    @precondition(lambda self: not self.trace.upper.is_empty())
    @rule(
        rows=st.one_of(st.integers(0, 2), st.sampled_from([0, 3, 4, 7, 16, 33, 100])),
        width=st.integers(1, 3),
        close=st.integers(0, 150),
    )
    def push(self, rows: int, width: int, close: int) -> None:
        lo = self._upper()
        hi = None if close == 0 else lo + width
        b = hb(lo, hi, rows)
        reqs = self.trace.push_batch(b)
        assert self.shadow.push_batch(b) == reqs
        self.pushed_keys.extend(p.key for p in b.parts)
        self.pushed_rows += rows
        for r in reqs:
            assert r.desc.since <= self.trace.since
            assert r.desc.lower == r.inputs[0].batch.desc.lower
            assert r.desc.upper == r.inputs[-1].batch.desc.upper
            assert len(r.inputs) >= 2
        self.pending = (self.pending + reqs)[-40:]

    @rule(step=st.integers(0, 4), to_empty=st.integers(0, 30))
    def downgrade_since(self, step: int, to_empty: int) -> None:
        s = self.trace.since.as_option()
        new = EMPTY if to_empty == 0 or s is None else A(s + step)
        self.trace.downgrade_since(new)
        self.shadow.downgrade_since(new)

    @rule()
    def bad_since_is_refused(self) -> None:
        s = self.trace.since.as_option()
        if s is not None and s > 0:
            with pytest.raises(ValueError):
                self.trace.downgrade_since(A(s - 1))

    @rule(data=st.data())
    def answer_some(self, data: st.DataObject) -> None:
        reqs = self.pending + self.trace.all_fueled_merge_reqs()
        if not reqs:
            return
        chosen = data.draw(st.lists(st.sampled_from(reqs), max_size=4))
        for req in chosen:
            mode = data.draw(st.sampled_from(MODES))
            total = sum(i.batch.len for i in req.inputs)
            if mode in ("subset", "state_since"):
                a = data.draw(st.integers(0, len(req.inputs) - 1))
                b = data.draw(st.integers(a, len(req.inputs) - 1))
                ins = req.inputs[a : b + 1]
                d = Description(ins[0].batch.desc.lower, ins[-1].batch.desc.upper, req.desc.since)
                req = FueledMergeReq(d, ins)
                total = sum(i.batch.len for i in ins)
                mode = "faithful" if mode == "subset" else mode
            n = total
            if mode == "consolidated":
                n = data.draw(st.integers(0, total))
            elif mode == "oversized":
                n = total + data.draw(st.integers(1, 3))
            res = answer(req, n)
            if mode == "later_since":
                s = req.desc.since.as_option()
                later = Description(
                    req.desc.lower, req.desc.upper, EMPTY if s is None else A(s + 1)
                )
                res = FueledMergeRes(HollowBatch(later, res.output.parts, n))
            elif mode == "state_since":
                # Consolidated at the trace's since (a compactor's committed state).
                out = merge_output_desc(req, self.trace.since)
                res = FueledMergeRes(HollowBatch(out, res.output.parts, n))
            before = self.trace.copy()
            updates_before = self.trace.num_updates()
            result = self.trace.apply_merge_res(res)
            assert self.shadow.apply_merge_res(res) is result
            event(f"{mode} -> {result.name}")
            # The since is judged against the trace's, not the matched batch's.
            since_ok = res.output.desc.since <= self.trace.since
            assert (result is ApplyMergeResult.NOT_APPLIED_INVALID_SINCE) == (
                not since_ok and result is not ApplyMergeResult.NOT_APPLIED_NO_MATCH
            ), (mode, result)
            if not result.applied():
                assert self.trace == before
            if mode == "oversized":
                assert not result.applied(), result
            if result.applied():
                delta = updates_before - self.trace.num_updates()
                assert 0 <= delta <= total - n
                if n < total:
                    self.consolidated = True
            self.trace.validate()

    @rule()
    def reload_from_json(self) -> None:
        self.trace = reload(self.trace)

    def teardown(self) -> None:
        event(f"levels: {self.trace.num_levels()}")
        event(f"pushes: {min(len(self.pushed_keys), 50) // 10 * 10}+")

    @invariant()
    def valid(self) -> None:
        self.trace.validate()
        self.shadow.validate()

    @invariant()
    def round_trips_and_matches_shadow(self) -> None:
        d = self.trace.to_json()
        again = Trace.from_json(json.loads(json.dumps(d)))
        assert again == self.trace
        assert again.to_json() == d
        assert self.trace == self.shadow
        assert list(self.trace.batches()) == list(self.shadow.batches())

    @invariant()
    def batches_line_up_and_keep_every_part(self) -> None:
        frontier = A(0)
        for b in self.trace.batches():
            assert b.desc.lower == frontier
            assert b.desc.since <= self.trace.since
            frontier = b.desc.upper
        assert frontier == self.trace.upper
        if not self.consolidated:
            assert keys(self.trace) == self.pushed_keys
        else:  # outputs consolidated to nothing drop their parts; order is kept
            it = iter(self.pushed_keys)
            assert all(k in it for k in keys(self.trace))
        assert self.trace.num_spine_batches() <= self.trace.num_hollow_batches()
        m = self.trace.spine_metrics()
        assert (
            m.compact_batches + m.compacting_batches + m.noncompact_batches
            == self.trace.num_spine_batches()
        )

    @invariant()
    def updates_are_conserved(self) -> None:
        if not self.consolidated:
            assert self.trace.num_updates() == self.pushed_rows
        else:
            assert self.trace.num_updates() <= self.pushed_rows


SpineMachine.TestCase.settings = settings(
    max_examples=runs(50, 200),
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSpineMachine = pytest.mark.sized(SpineMachine.TestCase)


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 3), st.floats(0, 1)),
        min_size=50,
        max_size=400,
    )
)
def test_long_random_runs_stay_valid(ops: list[tuple[int, int, float]]) -> None:
    """Deeper spines than the state machine reaches: long runs of pushes, a moving since
    and a compactor answering each request with probability ``p`` (later, in order),
    consolidating at the trace's since when it answers (as persist's compactor does with
    the since of the committed state it reads): every answer whose bounds still match
    applies, whatever since its merge began at."""
    t = Trace()
    backlog: list[FueledMergeReq] = []
    rows = 0
    for i, (n, since_step, p) in enumerate(ops):
        backlog += t.push_batch(hb(i, i + 1, n))
        rows += n
        s = t.since.as_option()
        assert s is not None
        t.downgrade_since(A(min(i, s + since_step)))
        keep = []
        for j, req in enumerate(backlog):
            if (j * 7919 + i) % 100 < p * 100:
                res = answer(req)
                out = HollowBatch(merge_output_desc(req, t.since), res.output.parts, res.output.len)
                r = t.apply_merge_res(FueledMergeRes(out))
                assert r is not ApplyMergeResult.NOT_APPLIED_INVALID_SINCE, (req.desc, t.since)
            else:
                keep.append(req)
        backlog = keep[-20:]
        t.validate()
        assert t.num_updates() == rows
    assert reload(t) == t
    assert keys(t) == [f"p{i}-{i + 1}" for i, (n, _, _) in enumerate(ops) if n]


def test_id_hollow_batch_is_a_value() -> None:
    a = IdHollowBatch(SpineId(0, 1), hb(0, 1))
    assert a == IdHollowBatch(SpineId(0, 1), hb(0, 1))
    assert a != IdHollowBatch(SpineId(0, 1), hb(0, 2))
