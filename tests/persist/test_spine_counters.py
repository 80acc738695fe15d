"""A fueled spine batch made from the spine batches it merges
(``SpineBatch.fueled_of``, its counters summed from theirs) against one made from their
hollow batches (``SpineBatch.make_fueled``, the counters recounted from every part): the
same batch, the same running counters."""

from __future__ import annotations

import uuid
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from persist.spine_levels import SpineBatch
from persist.spine_merge import IdHollowBatch, SpineId
from persist.types import Description, HollowBatch, PartRef
from stash import Antichain


def _part(draw: Any) -> PartRef:
    rows = draw(st.integers(0, 5))
    kind = draw(st.sampled_from(["blob", "inline", "inline-old"]))
    if kind == "blob":
        return PartRef(f"s/b/{uuid.uuid4().hex}", rows, draw(st.integers(1, 99)), "0" * 64)
    data = b"x" * draw(st.integers(1, 9))
    nonce = None if kind == "inline-old" else uuid.uuid4().hex
    return PartRef(None, rows, len(data), "0" * 64, inline=data, nonce=nonce)


@st.composite
def _spine_batches(draw: Any) -> list[SpineBatch]:
    out: list[SpineBatch] = []
    t = n = 0
    for _ in range(draw(st.integers(1, 4))):
        hollows = []
        for _ in range(draw(st.integers(1, 3))):
            parts = tuple(_part(draw) for _ in range(draw(st.integers(0, 3))))
            d = Description(Antichain.from_elem(t), Antichain.from_elem(t + 1))
            hollows.append(
                IdHollowBatch(SpineId(n, n + 1), HollowBatch(d, parts, sum(p.rows for p in parts)))
            )
            t += 1
            n += 1
        if len(hollows) == 1:
            out.append(SpineBatch.merged(hollows[0]))
        else:
            first, last = hollows[0], hollows[-1]
            desc = Description(first.batch.desc.lower, last.batch.desc.upper)
            out.append(
                SpineBatch.make_fueled(SpineId(first.id.lo, last.id.hi), desc, tuple(hollows))
            )
    return out


def _counters(b: SpineBatch) -> tuple[Any, ...]:
    return (b.inline_bytes, b.num_parts, b.part_index, list(b.part_index))


@settings(max_examples=200, deadline=None)
@given(_spine_batches())
def test_fueled_of_is_make_fueled(bs: list[SpineBatch]) -> None:
    id = SpineId(bs[0].id.lo, bs[-1].id.hi)
    desc = Description(bs[0].desc.lower, bs[-1].desc.upper)
    want = SpineBatch.make_fueled(id, desc, tuple(p for b in bs for p in b.parts))
    got = SpineBatch.fueled_of(id, desc, bs)
    assert got == want
    assert _counters(got) == _counters(want)
    assert (got.len, got.fueled) == (want.len, want.fueled)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_part_indexes_name_every_referenced_part(data: st.DataObject) -> None:
    """The union of the spine batches' part indexes (what
    ``ShardStateBase.referenced_part_ids`` takes) is the set of ids of every part the
    trace's hollow batches reference, through pushes and the merges they complete."""
    from persist.spine import Trace

    trace = Trace()
    for t in range(data.draw(st.integers(0, 12))):
        parts = tuple(_part(data.draw) for _ in range(data.draw(st.integers(0, 2))))
        d = Description(Antichain.from_elem(t), Antichain.from_elem(t + 1))
        trace.push_batch(HollowBatch(d, parts, sum(p.rows for p in parts)))
        want = {i for b in trace.batches() for p in b.parts if (i := p.part_id) is not None}
        assert set().union(*trace.part_indexes()) == want
