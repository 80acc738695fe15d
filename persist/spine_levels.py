"""The levels of the Spine and the bookkeeping of their fueled merges.

A :class:`~persist.spine.Trace` keeps its batches in levels (:class:`MergeState`): level
``i`` holds at most :data:`BATCHES_PER_LEVEL` spine batches (:class:`SpineBatch`) of at
most ``2**i`` updates each, and a full level carries an in-progress merge
(:class:`FuelingMerge`) that pushed batches fuel until it completes into one fueled spine
batch, handing out a :class:`~persist.spine_merge.FueledMergeReq`.  Only bookkeeping: no
data is read or merged here.  A port of Materialize's
``src/persist-client/src/internal/trace.rs`` (``SpineBatch``, ``IdFuelingMerge``,
``MergeState``), itself after differential dataflow's fueled Spine.

Invariants kept here: a :class:`SpineBatch` is immutable and caches the summed ``len`` of
its hollow batches (:meth:`SpineBatch.check` verifies its own invariants); a
:class:`MergeState` refuses a batch that does not follow its last one, and any batch once
full or merging; :meth:`MergeState.complete` always leaves the level vacant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from persist.spine_merge import (
    ApplyMergeResult,
    FueledMergeReq,
    FueledMergeRes,
    IdHollowBatch,
    SpineId,
)
from persist.types import Description, HollowBatch
from stash import Antichain

__all__ = [
    "BATCHES_PER_LEVEL",
    "EFFORT",
    "FUEL_PER_UPDATE",
    "FuelingMerge",
    "MergeState",
    "SpineBatch",
    "begin_merge",
    "level_for_len",
]

#: The most batches a level holds; a full level is merging (Materialize's constant).
BATCHES_PER_LEVEL = 2

#: Fuel per unit of ``2**level`` of an introduced batch (Materialize's ``8 << batch_index``),
#: scaled by the spine's effort (always 1 here, as in Materialize's persist).
FUEL_PER_UPDATE = 8
EFFORT = 1


def level_for_len(n: int) -> int:
    """``log2(next_power_of_two(n))``, with ``n == 0`` at level 0 (as in Materialize's persist)."""
    return (n - 1).bit_length() if n > 1 else 0


@dataclass(frozen=True, slots=True)
class SpineBatch:
    """One batch of the spine: merged (one hollow batch, ``fueled`` false) or fueled
    (two or more hollow batches awaiting a merge result, described by ``desc``).

    ``len`` caches the summed ``len`` of ``parts``; for a fueled batch it is an upper bound
    on the merged batch's length.  Running counters of the batch, computed once when it is
    made (a spine batch is immutable and shared by every version that holds it, so the
    trace's totals cost a sum over its few spine batches, never a pass over its hollow
    batches): ``inline_bytes`` (summed :attr:`HollowBatch.inline_bytes`),
    ``num_parts`` (parts of all hollow batches) and ``part_index`` (part id ->
    ``(rows, encoded bytes)`` of every part that has an id; do not mutate it).
    """

    id: SpineId
    desc: Description
    parts: tuple[IdHollowBatch, ...]
    len: int
    fueled: bool
    inline_bytes: int = field(init=False, compare=False, repr=False)
    num_parts: int = field(init=False, compare=False, repr=False)
    part_index: dict[str, tuple[int, int]] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        inline = count = 0
        index: dict[str, tuple[int, int]] = {}
        for p in self.parts:
            b = p.batch
            inline += b.inline_bytes
            count += len(b.parts)
            for part in b.parts:
                if (pid := part.part_id) is not None:
                    index[pid] = (part.rows, part.encoded_size_bytes)
        object.__setattr__(self, "inline_bytes", inline)
        object.__setattr__(self, "num_parts", count)
        object.__setattr__(self, "part_index", index)

    @staticmethod
    def merged(b: IdHollowBatch) -> SpineBatch:
        return SpineBatch(b.id, b.batch.desc, (b,), b.batch.len, False)

    @staticmethod
    def make_fueled(id: SpineId, desc: Description, parts: tuple[IdHollowBatch, ...]) -> SpineBatch:
        return SpineBatch(id, desc, parts, sum(p.batch.len for p in parts), True)

    @staticmethod
    def fueled_of(id: SpineId, desc: Description, bs: Sequence[SpineBatch]) -> SpineBatch:
        """:meth:`make_fueled` of the hollow batches of ``bs`` (in order), its running
        counters summed from theirs instead of recounted from every part (the merge
        that completes on a push does this once per append; a test compares it with
        :meth:`make_fueled`)."""
        parts: list[IdHollowBatch] = []
        index: dict[str, tuple[int, int]] = {}
        n = inline = count = 0
        for b in bs:
            parts.extend(b.parts)
            index.update(b.part_index)
            n += b.len
            inline += b.inline_bytes
            count += b.num_parts
        sb = object.__new__(SpineBatch)
        put = object.__setattr__
        put(sb, "id", id)
        put(sb, "desc", desc)
        put(sb, "parts", tuple(parts))
        put(sb, "len", n)
        put(sb, "fueled", True)
        put(sb, "inline_bytes", inline)
        put(sb, "num_parts", count)
        put(sb, "part_index", index)
        return sb

    def is_empty(self) -> bool:
        return self.len == 0

    def is_compact(self) -> bool:
        return not self.fueled and not self.parts[0].batch.runs

    def maybe_replace(
        self, res: FueledMergeRes, trace_since: Antichain
    ) -> tuple[ApplyMergeResult, SpineBatch | None]:
        """Try to swap ``res`` in: the result and the replacement batch (``None`` unless
        applied).  Materialize's ``SpineBatch::maybe_replace``, checking the since after the
        bounds so that a bounds match with an invalid since is reported as such.

        The output's since is checked against ``trace_since``, the since of the trace
        the result is applied to (the committed state being written), not against this
        batch's since: a compactor consolidates at the since of the state it read
        (:func:`persist.spine_merge.merge_output_desc`), which may be past the since this
        batch's merge began at.  The replacement carries the output's since (a fueled
        batch whose run of hollow batches is replaced takes the join of both sinces).
        """
        out = res.output
        od = out.desc
        d = self.desc
        if od.lower == d.lower and od.upper == d.upper:
            # The output was consolidated at the since of a committed version; the
            # shard's since never regresses, so anything beyond it was not.
            if not od.since <= trace_since:
                return ApplyMergeResult.NOT_APPLIED_INVALID_SINCE, None
            # A longer output means this range was already compacted harder: keep that.
            if out.len > self.len:
                return ApplyMergeResult.NOT_APPLIED_TOO_MANY_UPDATES, None
            return ApplyMergeResult.APPLIED_EXACT, SpineBatch.merged(IdHollowBatch(self.id, out))
        if not self.fueled:
            return ApplyMergeResult.NOT_APPLIED_NO_MATCH, None
        # The spine's structure may have changed since the request was made: the result
        # may still replace a contiguous run of this fueled batch's parts.
        lo_i: int | None = None
        hi_i: int | None = None
        for i, p in enumerate(self.parts):
            pd = p.batch.desc
            if lo_i is None and pd.lower == od.lower:
                lo_i = i
            if hi_i is None and pd.upper == od.upper:
                hi_i = i
            if lo_i is not None and hi_i is not None:
                break
        if lo_i is None or hi_i is None or lo_i > hi_i:
            return ApplyMergeResult.NOT_APPLIED_NO_MATCH, None
        if not od.since <= trace_since:
            return ApplyMergeResult.NOT_APPLIED_INVALID_SINCE, None
        # Not every part: covering them all would have been an exact match above.
        new_part = IdHollowBatch(SpineId(self.parts[lo_i].id.lo, self.parts[hi_i].id.hi), out)
        new_parts = (*self.parts[:lo_i], new_part, *self.parts[hi_i + 1 :])
        new_desc = (
            d if od.since <= d.since else Description(d.lower, d.upper, d.since.join(od.since))
        )
        replacement = SpineBatch.make_fueled(self.id, new_desc, new_parts)
        if replacement.len > self.len:
            return ApplyMergeResult.NOT_APPLIED_TOO_MANY_UPDATES, None
        return ApplyMergeResult.APPLIED_SUBSET, replacement

    def check(self, trace_since: Antichain) -> None:
        """Raise ``ValueError`` if this batch's own invariants do not hold."""
        if not self.parts:
            raise ValueError(f"spine batch {self.id} lists no hollow batch")
        for p in self.parts:
            if p.batch.len < 0:
                raise ValueError(f"hollow batch {p.id} has a negative len {p.batch.len}")
        if self.len != sum(p.batch.len for p in self.parts):
            raise ValueError(
                f"spine batch {self.id} caches len {self.len}, its parts hold "
                f"{sum(p.batch.len for p in self.parts)}"
            )
        if not self.desc.since <= trace_since:
            raise ValueError(
                f"since {self.desc.since} of spine batch {self.id} is beyond "
                f"the trace since {trace_since}"
            )
        if not self.fueled:
            (p,) = self.parts
            if p.id != self.id or p.batch.desc != self.desc:
                raise ValueError(
                    f"merged spine batch {self.id} does not match its hollow "
                    f"batch {p.id} {p.batch.desc}"
                )
            return
        if len(self.parts) < 2:
            raise ValueError(f"fueled spine batch {self.id} lists fewer than two hollow batches")
        if self.parts[0].id.lo != self.id.lo or self.parts[-1].id.hi != self.id.hi:
            raise ValueError(
                f"hollow batch ids {self.parts[0].id}..{self.parts[-1].id} do "
                f"not span fueled spine batch {self.id}"
            )
        if self.parts[0].batch.desc.lower != self.desc.lower:
            raise ValueError(
                f"fueled spine batch {self.id} lower {self.desc.lower} is not "
                f"its first hollow batch's {self.parts[0].batch.desc.lower}"
            )
        if self.parts[-1].batch.desc.upper != self.desc.upper:
            raise ValueError(
                f"fueled spine batch {self.id} upper {self.desc.upper} is not "
                f"its last hollow batch's {self.parts[-1].batch.desc.upper}"
            )
        prev: IdHollowBatch | None = None
        for p in self.parts:
            if not p.batch.desc.since <= self.desc.since:
                raise ValueError(
                    f"hollow batch {p.id} since {p.batch.desc.since} is beyond "
                    f"its fueled spine batch's since {self.desc.since}"
                )
            if prev is not None:
                if p.id.lo != prev.id.hi:
                    raise ValueError(
                        f"hollow batch id {p.id} does not follow {prev.id} in spine batch {self.id}"
                    )
                if p.batch.desc.lower != prev.batch.desc.upper:
                    raise ValueError(
                        f"hollow batch {p.id} lower {p.batch.desc.lower} is not "
                        f"the previous upper {prev.batch.desc.upper}"
                    )
            prev = p


def begin_merge(
    bs: Sequence[SpineBatch], compaction_frontier: Antichain | None
) -> FuelingMerge | None:
    """Start merging ``bs``: the merge's since is the join of their sinces and the
    compaction frontier; its work is their summed length (Materialize's ``begin_merge``)."""
    if not bs:
        return None
    since = bs[0].desc.since
    for b in bs[1:]:
        since = since.join(b.desc.since)
    if compaction_frontier is not None:
        since = since.join(compaction_frontier)
    return FuelingMerge(SpineId(bs[0].id.lo, bs[-1].id.hi), since, sum(b.len for b in bs))


@dataclass(slots=True)
class FuelingMerge:
    """An in-progress merge of a full level: bookkeeping only (Materialize's
    ``IdFuelingMerge``).  ``remaining_work`` is in updates (rows)."""

    id: SpineId
    since: Antichain
    remaining_work: int

    def done(self, bs: list[SpineBatch], log: list[FueledMergeReq] | None) -> SpineBatch:
        """The merged spine batch of ``bs``; logs a merge request unless all are empty."""
        first, last = bs[0], bs[-1]
        id = SpineId(first.id.lo, last.id.hi)
        # A merge result applied while this merge fueled may have advanced a batch's
        # since past the one the merge began at: the merged batch covers them all.
        since = self.since
        for b in bs:
            since = since.join(b.desc.since)
        desc = Description(first.desc.lower, last.desc.upper, since)
        if all(b.len == 0 for b in bs):
            return SpineBatch.merged(IdHollowBatch(id, HollowBatch(desc)))
        merged = SpineBatch.fueled_of(id, desc, bs)
        if log is not None:
            log.append(FueledMergeReq(desc, merged.parts))
        return merged


class MergeState:
    """One level: zero, one or two batches (oldest first) and, when two, their merge."""

    __slots__ = ("batches", "merge")

    def __init__(self) -> None:
        self.batches: list[SpineBatch] = []
        self.merge: FuelingMerge | None = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MergeState):
            return NotImplemented
        return self.batches == other.batches and self.merge == other.merge

    __hash__ = None  # type: ignore[assignment]

    def copy(self) -> MergeState:
        c = MergeState()
        c.batches = list(self.batches)
        if self.merge is not None:
            m = self.merge
            c.merge = FuelingMerge(m.id, m.since, m.remaining_work)
        return c

    def id(self) -> SpineId | None:
        if not self.batches:
            return None
        return SpineId(self.batches[0].id.lo, self.batches[-1].id.hi)

    def push_batch(self, batch: SpineBatch) -> None:
        if self.batches:
            last = self.batches[-1]
            if last.id.hi != batch.id.lo or last.desc.upper != batch.desc.lower:
                raise ValueError(
                    f"spine batch {batch.id} {batch.desc} does not follow "
                    f"{last.id} {last.desc} at its level"
                )
        if self.merge is not None:
            raise ValueError(f"spine batch {batch.id} pushed into a level that is merging")
        if len(self.batches) >= BATCHES_PER_LEVEL:
            raise ValueError(f"spine batch {batch.id} pushed into a full level")
        self.batches.append(batch)

    def len(self) -> int:
        return sum(b.len for b in self.batches)

    def is_empty(self) -> bool:
        return all(b.len == 0 for b in self.batches)

    def is_full(self) -> bool:
        return len(self.batches) >= BATCHES_PER_LEVEL

    def complete(self, log: list[FueledMergeReq] | None) -> SpineBatch | None:
        """Take this level's contents, finishing its merge whatever its fuel; leaves the
        level vacant."""
        batches, merge = self.batches, self.merge
        self.batches, self.merge = [], None
        if len(batches) <= 1:
            return batches[0] if batches else None
        if merge is None:  # pragma: no cover - full levels always carry a merge
            merge = begin_merge(batches, None)
            assert merge is not None
        return merge.done(batches, log)
