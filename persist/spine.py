"""The Spine trace of a shard: its batches arranged in levels, merged by fueled merges.

A :class:`Trace` holds the :class:`~persist.types.HollowBatch` es of one shard, contiguous in
time, together with the shard's ``since`` and ``upper``.  It is a port of Materialize's Spine
(``src/persist-client/src/internal/trace.rs``), itself a fork of differential dataflow's fueled Spine.  The Spine only does the
*bookkeeping* of merges: when two batches at a level finish "fueling", they become one
*fueled* spine batch (a list of hollow batches with one merged description) and a
:class:`FueledMergeReq` is handed out; a compactor may later answer it with a
:class:`FueledMergeRes`, which :meth:`Trace.apply_merge_res` swaps in.  A merge that is never
answered costs nothing but the extra hollow batches it keeps listing.

Invariants kept (checked by :meth:`Trace.validate`):

* the spine batches, oldest first (highest level first), have descriptions that line up:
  the first lower is ``{0}`` (:data:`MINIMUM_TIME`), each upper is the next lower, the last
  upper is the trace's ``upper``; within a fueled spine batch the hollow batches line up the
  same way and span exactly the spine batch's description;
* the :class:`SpineId` s of the spine batches (and of the hollow batches inside them) are
  contiguous half-open ranges covering ``[0, next_id)``; each pushed batch takes one id;
* every since inside the trace (of a batch, of a fueled description, of an in-progress
  merge) is ``<=`` the trace's ``since``; the trace's ``since`` only advances;
* a batch at level ``i`` holds at most ``2**i`` updates (its ``len``; Materialize's level
  bound: a pushed batch enters at the level of its length rounded up to a power of two,
  fuel finishes every merge below it first, and a merge result never grows a batch);
* a level holds at most :data:`BATCHES_PER_LEVEL` (2) batches; exactly the full levels carry
  an in-progress merge, whose id spans the level's batches; the highest level is not
  vacant; a fueled spine batch lists at least two hollow batches and caches their summed
  ``len``.

Not checked but kept by construction: the number of levels, hence of spine batches, stays
logarithmic in the number of pushed updates, because pushing a batch applies
``8 * 2**level`` units of fuel to every in-progress merge before rolling the lower levels
up (Materialize's fuel discipline); with every merge request answered the hollow batches are
as few (at most ``2 * log2(rows)`` for one-row pushes, tested).

A trace round-trips exactly through :meth:`Trace.to_json` / :meth:`Trace.from_json`
(Materialize's flatten/unflatten), levels and in-progress merges included, so that a trace
stored in the shard state by one process behaves identically when loaded by another.

Differences from Materialize's persist, on purpose: errors are ``ValueError`` s rather than panics
and are raised before anything changes; ``downgrade_since`` refuses to move the since
backwards and ``push_batch`` refuses a batch whose since is beyond the trace's since (both
would break the since invariant); ``apply_merge_res`` reports
``NOT_APPLIED_INVALID_SINCE`` when the batch it matched has an earlier since (Materialize's
checked the since before matching and so could only ever report no match); the JSON form
stores every batch with an id (no legacy, id-less batches).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from persist.types import Description, HollowBatch
from stash import Antichain

__all__ = [
    "BATCHES_PER_LEVEL",
    "MINIMUM_TIME",
    "ApplyMergeResult",
    "FueledMergeReq",
    "FueledMergeRes",
    "IdHollowBatch",
    "SpineId",
    "SpineMetrics",
    "Trace",
    "worth_compacting",
]

#: The least time of a shard (Materialize's ``T::minimum()``): a new trace has since and upper
#: ``{MINIMUM_TIME}``, like a new stash collection.
MINIMUM_TIME = 0

#: The most batches a level holds; a full level is merging (Materialize's constant).
BATCHES_PER_LEVEL = 2

#: Fuel per unit of ``2**level`` of an introduced batch (Materialize's ``8 << batch_index``),
#: scaled by the spine's effort (always 1 here, as in Materialize's persist).
_FUEL_PER_UPDATE = 8
_EFFORT = 1

#: The compaction heuristic (after persist-client's ``compaction_heuristic_min_*``): a
#: merge request is worth answering after an append only if it has at least this many
#: inputs (hollow batches), or its inputs this many parts, or this many updates.  Smaller
#: requests are skipped: their fueled spine batch keeps listing its few hollow batches
#: (the Spine's bookkeeping is unchanged) until a merge above it includes them, so the
#: state stays O(log n) hollow batches (fewer than ``COMPACTION_MIN_INPUTS`` per fueled
#: batch below ``COMPACTION_MIN_UPDATES`` updates) while one-row appends do about one
#: physical merge per ``COMPACTION_MIN_INPUTS`` appends instead of one per append.
COMPACTION_MIN_INPUTS = 8
COMPACTION_MIN_PARTS = 8
COMPACTION_MIN_UPDATES = 1024

_MINIMUM = Antichain.from_elem(MINIMUM_TIME)


def _level_for_len(n: int) -> int:
    """``log2(next_power_of_two(n))``, with ``n == 0`` at level 0 (as in Materialize's persist)."""
    return (n - 1).bit_length() if n > 1 else 0


@dataclass(frozen=True, order=True, slots=True)
class SpineId:
    """The half-open range ``[lo, hi)`` of push numbers a batch covers.

    The ``n``-th batch pushed into a trace (counting from 0) gets ``SpineId(n, n + 1)``; a
    merge of adjacent batches gets the union of their ranges.  Its JSON form is the string
    ``"lo-hi"``.
    """

    lo: int
    hi: int

    def __str__(self) -> str:
        return f"{self.lo}-{self.hi}"

    @classmethod
    def parse(cls, s: str) -> SpineId:
        """Inverse of ``str()``.

        Raises:
            ValueError: ``s`` is not ``"lo-hi"`` with ``0 <= lo < hi`` integers.
        """
        lo_s, sep, hi_s = s.partition("-")
        if not sep or not lo_s.isdigit() or not hi_s.isdigit():
            raise ValueError(f"spine id must look like 'lo-hi', got {s!r}")
        lo, hi = int(lo_s), int(hi_s)
        if not lo < hi:
            raise ValueError(f"spine id {s!r} must have lo < hi")
        return cls(lo, hi)


@dataclass(frozen=True, slots=True)
class IdHollowBatch:
    """A hollow batch together with the :class:`SpineId` it holds in the trace."""

    id: SpineId
    batch: HollowBatch


@dataclass(frozen=True, slots=True)
class FueledMergeReq:
    """A request to merge ``inputs`` (contiguous, oldest first) into one batch with ``desc``.

    ``desc.lower`` is the first input's lower, ``desc.upper`` the last input's upper and
    ``desc.since`` the since the output's times may be advanced to (Materialize's
    ``FueledMergeReq``).
    """

    desc: Description
    inputs: tuple[IdHollowBatch, ...]


@dataclass(frozen=True, slots=True)
class FueledMergeRes:
    """The answer to a :class:`FueledMergeReq`: the merged batch (Materialize's ``FueledMergeRes``).

    ``output.desc`` is normally the request's ``desc``; ``output.len`` must not exceed the
    summed ``len`` of the inputs it replaces.
    """

    output: HollowBatch


def worth_compacting(req: FueledMergeReq) -> bool:
    """Whether ``req`` passes the compaction heuristic (see :data:`COMPACTION_MIN_INPUTS`):
    enough inputs, parts or updates that a physical merge pays for itself."""
    inputs = req.inputs
    if len(inputs) >= COMPACTION_MIN_INPUTS:
        return True
    if sum(len(i.batch.parts) for i in inputs) >= COMPACTION_MIN_PARTS:
        return True
    return sum(i.batch.len for i in inputs) >= COMPACTION_MIN_UPDATES


class ApplyMergeResult(enum.Enum):
    """What :meth:`Trace.apply_merge_res` did with a merge result (Materialize's enum)."""

    #: The output replaced a spine batch with exactly its lower and upper.
    APPLIED_EXACT = "applied_exact"
    #: The output replaced a contiguous run of hollow batches inside a fueled spine batch.
    APPLIED_SUBSET = "applied_subset"
    #: No spine batch (or run of hollow batches) has the output's lower and upper.
    NOT_APPLIED_NO_MATCH = "not_applied_no_match"
    #: A batch matched, but its since is earlier than the output's since.
    NOT_APPLIED_INVALID_SINCE = "not_applied_invalid_since"
    #: A batch matched, but the output holds more updates than what it would replace.
    NOT_APPLIED_TOO_MANY_UPDATES = "not_applied_too_many_updates"

    def applied(self) -> bool:
        """True if the trace changed."""
        return self in (ApplyMergeResult.APPLIED_EXACT, ApplyMergeResult.APPLIED_SUBSET)

    def matched(self) -> bool:
        """True if the output's bounds matched a batch (Materialize's definition: an invalid
        since does not count as a match, too many updates does)."""
        return self in (
            ApplyMergeResult.APPLIED_EXACT,
            ApplyMergeResult.APPLIED_SUBSET,
            ApplyMergeResult.NOT_APPLIED_TOO_MANY_UPDATES,
        )


@dataclass(frozen=True, slots=True)
class SpineMetrics:
    """Counts of spine batches by state (Materialize's ``SpineMetrics``).

    Attributes:
        compact_batches: merged spine batches of a single run.
        compacting_batches: fueled spine batches (a merge request is outstanding).
        noncompact_batches: merged spine batches of several runs.
    """

    compact_batches: int = 0
    compacting_batches: int = 0
    noncompact_batches: int = 0


@dataclass(frozen=True, slots=True)
class _SpineBatch:
    """One batch of the spine: merged (one hollow batch, ``fueled`` false) or fueled
    (two or more hollow batches awaiting a merge result, described by ``desc``).

    ``len`` caches the summed ``len`` of ``parts``; for a fueled batch it is an upper bound
    on the merged batch's length.
    """

    id: SpineId
    desc: Description
    parts: tuple[IdHollowBatch, ...]
    len: int
    fueled: bool

    @staticmethod
    def merged(b: IdHollowBatch) -> _SpineBatch:
        return _SpineBatch(b.id, b.batch.desc, (b,), b.batch.len, False)

    @staticmethod
    def make_fueled(
        id: SpineId, desc: Description, parts: tuple[IdHollowBatch, ...]
    ) -> _SpineBatch:
        return _SpineBatch(id, desc, parts, sum(p.batch.len for p in parts), True)

    def is_empty(self) -> bool:
        return self.len == 0

    def is_compact(self) -> bool:
        return not self.fueled and not self.parts[0].batch.runs

    def maybe_replace(self, res: FueledMergeRes) -> tuple[ApplyMergeResult, _SpineBatch | None]:
        """Try to swap ``res`` in: the result and the replacement batch (``None`` unless
        applied).  Materialize's ``SpineBatch::maybe_replace``, checking the since after the
        bounds so that a bounds match with an invalid since is reported as such."""
        out = res.output
        od = out.desc
        d = self.desc
        if od.lower == d.lower and od.upper == d.upper:
            # The spine's since may be ahead of the result's (the trace was reloaded, or
            # the since moved on), never behind it.
            if not od.since <= d.since:
                return ApplyMergeResult.NOT_APPLIED_INVALID_SINCE, None
            # A longer output means this range was already compacted harder: keep that.
            if out.len > self.len:
                return ApplyMergeResult.NOT_APPLIED_TOO_MANY_UPDATES, None
            return ApplyMergeResult.APPLIED_EXACT, _SpineBatch.merged(IdHollowBatch(self.id, out))
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
        if not od.since <= d.since:
            return ApplyMergeResult.NOT_APPLIED_INVALID_SINCE, None
        # Not every part: covering them all would have been an exact match above.
        new_part = IdHollowBatch(SpineId(self.parts[lo_i].id.lo, self.parts[hi_i].id.hi), out)
        new_parts = (*self.parts[:lo_i], new_part, *self.parts[hi_i + 1 :])
        replacement = _SpineBatch.make_fueled(self.id, d, new_parts)
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


def _begin_merge(
    bs: Sequence[_SpineBatch], compaction_frontier: Antichain | None
) -> _FuelingMerge | None:
    """Start merging ``bs``: the merge's since is the join of their sinces and the
    compaction frontier; its work is their summed length (Materialize's ``begin_merge``)."""
    if not bs:
        return None
    since = bs[0].desc.since
    for b in bs[1:]:
        since = since.join(b.desc.since)
    if compaction_frontier is not None:
        since = since.join(compaction_frontier)
    return _FuelingMerge(SpineId(bs[0].id.lo, bs[-1].id.hi), since, sum(b.len for b in bs))


@dataclass(slots=True)
class _FuelingMerge:
    """An in-progress merge of a full level: bookkeeping only (Materialize's
    ``IdFuelingMerge``).  ``remaining_work`` is in updates (rows)."""

    id: SpineId
    since: Antichain
    remaining_work: int

    def done(self, bs: list[_SpineBatch], log: list[FueledMergeReq] | None) -> _SpineBatch:
        """The merged spine batch of ``bs``; logs a merge request unless all are empty."""
        first, last = bs[0], bs[-1]
        id = SpineId(first.id.lo, last.id.hi)
        desc = Description(first.desc.lower, last.desc.upper, self.since)
        if all(b.len == 0 for b in bs):
            return _SpineBatch.merged(IdHollowBatch(id, HollowBatch(desc)))
        parts: list[IdHollowBatch] = []
        for b in bs:
            parts.extend(b.parts)
        merged = _SpineBatch.make_fueled(id, desc, tuple(parts))
        if log is not None:
            log.append(FueledMergeReq(desc, merged.parts))
        return merged


class _MergeState:
    """One level: zero, one or two batches (oldest first) and, when two, their merge."""

    __slots__ = ("batches", "merge")

    def __init__(self) -> None:
        self.batches: list[_SpineBatch] = []
        self.merge: _FuelingMerge | None = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _MergeState):
            return NotImplemented
        return self.batches == other.batches and self.merge == other.merge

    __hash__ = None  # type: ignore[assignment]

    def copy(self) -> _MergeState:
        c = _MergeState()
        c.batches = list(self.batches)
        if self.merge is not None:
            m = self.merge
            c.merge = _FuelingMerge(m.id, m.since, m.remaining_work)
        return c

    def id(self) -> SpineId | None:
        if not self.batches:
            return None
        return SpineId(self.batches[0].id.lo, self.batches[-1].id.hi)

    def push_batch(self, batch: _SpineBatch) -> None:
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

    def complete(self, log: list[FueledMergeReq] | None) -> _SpineBatch | None:
        """Take this level's contents, finishing its merge whatever its fuel; leaves the
        level vacant."""
        batches, merge = self.batches, self.merge
        self.batches, self.merge = [], None
        if len(batches) <= 1:
            return batches[0] if batches else None
        if merge is None:  # pragma: no cover - full levels always carry a merge
            merge = _begin_merge(batches, None)
            assert merge is not None
        return merge.done(batches, log)


#: What :meth:`Trace.to_json` remembers of a spine batch (see ``Trace._json_memo``).
_JsonMemo = tuple[_SpineBatch, int, str, dict[str, Any], list[tuple[str, Any]]]


class Trace:
    """The batches of a shard with its since and upper, merged in a fueled Spine.

    Construct empty with ``Trace()`` (since and upper ``{0}``) or load with
    :meth:`from_json`.  Not thread-safe: callers serialise access (in persist each state
    version owns its trace; :meth:`copy` gives an independent one).
    """

    __slots__ = ("_json_memo", "_levels", "_next_id", "_since", "_upper")

    def __init__(self) -> None:
        self._since: Antichain = _MINIMUM
        self._upper: Antichain = _MINIMUM
        self._next_id = 0
        self._levels: list[_MergeState] = []
        # Spine id -> (the spine batch, its level, its entry name, its spine_batches
        # entry, its hollow_batches entries) of the last to_json: the flattened form of
        # a batch that is still the same object at the same level is reused.
        self._json_memo: dict[SpineId, _JsonMemo] = {}

    # ------------------------------------------------------------------ accessors

    @property
    def since(self) -> Antichain:
        """The trace's compaction frontier: reads see times advanced to it."""
        return self._since

    @property
    def upper(self) -> Antichain:
        """The trace's upper: the upper of its newest batch (``{0}`` when it has none)."""
        return self._upper

    def _spine_batches(self) -> Iterator[_SpineBatch]:
        for level in reversed(self._levels):
            yield from level.batches

    def batches(self) -> Iterator[HollowBatch]:
        """The hollow batches, oldest first; their descriptions line up from ``{0}`` to
        :attr:`upper`."""
        for b in self._spine_batches():
            for p in b.parts:
                yield p.batch

    def num_spine_batches(self) -> int:
        """The number of spine batches (a fueled batch counts once)."""
        return sum(len(level.batches) for level in self._levels)

    def num_hollow_batches(self) -> int:
        """The number of hollow batches (what :meth:`batches` yields)."""
        return sum(len(b.parts) for b in self._spine_batches())

    def num_updates(self) -> int:
        """The summed ``len`` (rows) of all hollow batches."""
        return sum(b.len for b in self._spine_batches())

    def num_levels(self) -> int:
        """The number of levels of the spine (for diagnostics)."""
        return len(self._levels)

    def spine_metrics(self) -> SpineMetrics:
        """Counts of compact, compacting (fueled) and non-compact spine batches."""
        compact = compacting = noncompact = 0
        for b in self._spine_batches():
            if b.fueled:
                compacting += 1
            elif b.is_compact():
                compact += 1
            else:
                noncompact += 1
        return SpineMetrics(compact, compacting, noncompact)

    def worth_compacting_reqs(self) -> list[FueledMergeReq]:
        """:meth:`all_fueled_merge_reqs` that pass :func:`worth_compacting` (what a
        background compactor answers)."""
        return [r for r in self.all_fueled_merge_reqs() if worth_compacting(r)]

    def all_fueled_merge_reqs(self) -> list[FueledMergeReq]:
        """A merge request for every fueled spine batch, oldest first (to re-issue
        requests lost to a crash or a lost compare-and-set)."""
        return [FueledMergeReq(b.desc, b.parts) for b in self._spine_batches() if b.fueled]

    def copy(self) -> Trace:
        """An independent copy (batches are immutable and shared)."""
        t = Trace()
        t._since = self._since
        t._upper = self._upper
        t._next_id = self._next_id
        t._levels = [level.copy() for level in self._levels]
        t._json_memo = self._json_memo  # read-only: each to_json replaces it whole
        return t

    def __eq__(self, other: object) -> bool:
        """Structural equality: same since, upper, levels, batches and merges in progress
        (stricter than Materialize's persist, which compared only the hollow batches)."""
        if not isinstance(other, Trace):
            return NotImplemented
        return (
            self._since == other._since
            and self._upper == other._upper
            and self._next_id == other._next_id
            and self._levels == other._levels
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        levels = []
        for i, level in enumerate(self._levels):
            bs = " ".join(
                f"[{b.id}]{b.desc.lower}{b.desc.upper}{b.len}"
                + (f"/{len(b.parts)}" if b.fueled else "")
                for b in level.batches
            )
            m = level.merge
            merge = f" merging({m.remaining_work})" if m is not None else ""
            levels.append(f"{i}: {bs}{merge}")
        return (
            f"Trace(since={self._since}, upper={self._upper}, next_id={self._next_id}, "
            f"levels=[{'; '.join(levels)}])"
        )

    # ------------------------------------------------------------------ changes

    def downgrade_since(self, since: Antichain) -> None:
        """Advance the trace's since to ``since`` (new merges advance times to it).

        Raises:
            ValueError: ``since`` is not ``>=`` the current since (nothing changes).
        """
        if not self._since <= since:
            raise ValueError(f"trace since can only advance: {since} is not >= {self._since}")
        self._since = since

    def push_batch(self, batch: HollowBatch) -> list[FueledMergeReq]:
        """Append ``batch`` (the next one in time) and return the merge requests this
        produced, minus those covered by another (Materialize's ``push_batch``).

        An empty batch following an empty batch alone at the lowest occupied level is
        fused with it instead (no fuel, no request), as in Materialize's persist.

        Raises:
            ValueError: ``batch.desc.lower`` is not the trace's upper, ``lower == upper``,
                or ``batch.desc.since`` is beyond the trace's since (nothing changes).
        """
        reqs: list[FueledMergeReq] = []
        self._insert(batch, reqs)
        return self._remove_redundant_merge_reqs(reqs)

    def push_batch_no_merge_reqs(self, batch: HollowBatch) -> None:
        """:meth:`push_batch` without building the merge requests (cheaper)."""
        self._insert(batch, None)

    def apply_merge_res(self, res: FueledMergeRes) -> ApplyMergeResult:
        """Swap a merge result in for the batch (or the run of hollow batches in a fueled
        batch) with the same lower and upper (Materialize's ``apply_merge_res``).

        Stale results are harmless: a result matching nothing is ``NOT_APPLIED_NO_MATCH``,
        one whose since is beyond the matched batch's is ``NOT_APPLIED_INVALID_SINCE``, one
        with more updates than it would replace is ``NOT_APPLIED_TOO_MANY_UPDATES``; in
        these cases nothing changes.
        """
        invalid_since = False
        for level in reversed(self._levels):
            for i, b in enumerate(level.batches):
                result, replacement = b.maybe_replace(res)
                if replacement is not None:
                    level.batches[i] = replacement
                if result.matched():
                    return result
                if result is ApplyMergeResult.NOT_APPLIED_INVALID_SINCE:
                    invalid_since = True
        if invalid_since:
            return ApplyMergeResult.NOT_APPLIED_INVALID_SINCE
        return ApplyMergeResult.NOT_APPLIED_NO_MATCH

    @staticmethod
    def _remove_redundant_merge_reqs(reqs: list[FueledMergeReq]) -> list[FueledMergeReq]:
        """Drop requests another one covers (same since, bounds within), largest first;
        roll-ups yield ``(a, b), (a, b, c), ...`` and only the last is worth doing."""

        def covers(b0: FueledMergeReq, b1: FueledMergeReq) -> bool:
            return (
                b0.desc.lower <= b1.desc.lower
                and b1.desc.upper <= b0.desc.upper
                and b0.desc.since == b1.desc.since
            )

        ret: list[FueledMergeReq] = []
        while reqs:
            req = reqs.pop()
            if not any(covers(r, req) for r in ret):
                ret = [r for r in ret if not covers(req, r)]
                ret.append(req)
        return ret

    # ------------------------------------------------------------------ the spine

    def _insert(self, batch: HollowBatch, log: list[FueledMergeReq] | None) -> None:
        d = batch.desc
        if d.lower != self._upper:
            raise ValueError(
                f"batch lower {d.lower} is not the trace upper {self._upper}: "
                "batches must be pushed contiguously"
            )
        if d.lower == d.upper:
            raise ValueError(f"batch {d} is empty in time (lower == upper)")
        if not d.since <= self._since:
            raise ValueError(f"batch since {d.since} is beyond the trace since {self._since}")
        if batch.len < 0:
            raise ValueError(f"batch {d} has a negative len {batch.len}")
        id = SpineId(self._next_id, self._next_id + 1)
        self._next_id += 1
        sb = _SpineBatch.merged(IdHollowBatch(id, batch))
        self._upper = d.upper

        # Two empty batches in a row are fused rather than fueled through the levels.
        if batch.len == 0:
            for position, level in enumerate(self._levels):
                if level.batches:
                    if len(level.batches) == 1 and level.is_empty():
                        self._insert_at(sb, position)
                        merged = self._levels[position].complete(log)
                        assert merged is not None
                        self._levels[position].push_batch(merged)
                        return
                    break

        self._introduce_batch(sb, _level_for_len(batch.len), log)

    def _introduce_batch(
        self, batch: _SpineBatch, index: int, log: list[FueledMergeReq] | None
    ) -> None:
        # 1. Fuel proportional to the batch's level goes to every merge in progress, so
        #    that merges finish before lower levels can produce their next input.
        self._apply_fuel((_FUEL_PER_UPDATE << index) * _EFFORT, log)
        # 2. Levels below `index` are rolled up so the batch lands on a vacant level.
        self._roll_up(index, log)
        # 3. Insert.
        self._insert_at(batch, index)
        # 4. Draw the largest level down if it is small enough for a lower one.
        self._tidy_layers()

    def _roll_up(self, index: int, log: list[FueledMergeReq] | None) -> None:
        levels = self._levels
        while len(levels) <= index:
            levels.append(_MergeState())
        if any(level.batches for level in levels[:index]):
            merged: _SpineBatch | None = None
            for i in range(index):
                if merged is not None:
                    self._insert_at(merged, i)
                merged = levels[i].complete(log)
            if merged is not None:
                self._insert_at(merged, index)
            if levels[index].is_full():
                full = levels[index].complete(log)
                assert full is not None
                self._insert_at(full, index + 1)

    def _apply_fuel(self, fuel: int, log: list[FueledMergeReq] | None) -> None:
        levels = self._levels
        for index in range(len(levels)):
            m = levels[index].merge
            if m is None:
                continue
            m.remaining_work = max(0, m.remaining_work - fuel)
            if m.remaining_work == 0:
                complete = levels[index].complete(log)
                assert complete is not None
                self._insert_at(complete, index + 1)

    def _insert_at(self, batch: _SpineBatch, index: int) -> None:
        levels = self._levels
        while len(levels) <= index:
            levels.append(_MergeState())
        level = levels[index]
        level.push_batch(batch)
        if level.is_full():
            level.merge = _begin_merge(level.batches, self._since)

    def _tidy_layers(self) -> None:
        levels = self._levels
        if not levels:
            return
        length = len(levels)
        if len(levels[-1].batches) != 1:
            return
        appropriate_level = _level_for_len(levels[-1].len())
        while appropriate_level < length - 1:
            current = levels[length - 2]
            if not current.batches:
                del levels[length - 2]
                length = len(levels)
                continue
            if not current.is_full():
                # Capacity (by level, not by actual length) of the levels below `current`.
                smaller = sum(len(lv.batches) << i for i, lv in enumerate(levels[: length - 2]))
                if smaller <= (1 << length) // 8:
                    state = levels.pop(length - 2)
                    for b in state.batches:
                        self._insert_at(b, length - 2)
            break

    # ------------------------------------------------------------------ validation

    def validate(self) -> None:
        """Check the invariants listed in the module docstring.

        Raises:
            ValueError: naming the first invariant found broken.
        """
        expected_lo = 0
        frontier = _MINIMUM
        n = len(self._levels)
        if n and not self._levels[-1].batches:
            raise ValueError(f"highest level {n - 1} of the spine is vacant")
        for index in range(n - 1, -1, -1):
            level = self._levels[index]
            if len(level.batches) > BATCHES_PER_LEVEL:
                raise ValueError(
                    f"level {index} holds {len(level.batches)} batches, more "
                    f"than {BATCHES_PER_LEVEL}"
                )
            if level.is_full() != (level.merge is not None):
                raise ValueError(
                    f"level {index}: all (and only) full levels should be merging "
                    f"(full={level.is_full()}, merge={level.merge})"
                )
            m = level.merge
            if m is not None:
                if m.id != level.id():
                    raise ValueError(
                        f"level {index}: merge id {m.id} is not the range of the "
                        f"level's batch ids {level.id()}"
                    )
                if m.remaining_work < 0:
                    raise ValueError(f"level {index}: negative remaining work {m.remaining_work}")
                if not m.since <= self._since:
                    raise ValueError(
                        f"level {index}: merge since {m.since} is beyond the "
                        f"trace since {self._since}"
                    )
            for b in level.batches:
                if b.id.lo != expected_lo:
                    raise ValueError(
                        f"spine batch id {b.id} does not follow the previous id "
                        f"(expected lo {expected_lo})"
                    )
                if b.desc.lower != frontier:
                    raise ValueError(
                        f"spine batch {b.id} lower {b.desc.lower} does not match "
                        f"the previous upper {frontier}"
                    )
                if b.len > 1 << index:
                    raise ValueError(
                        f"spine batch {b.id} holds {b.len} updates, more than the 2**{index} "
                        f"allowed at level {index}"
                    )
                b.check(self._since)
                expected_lo = b.id.hi
                frontier = b.desc.upper
        if self._next_id != expected_lo:
            raise ValueError(
                f"spine next_id {self._next_id} does not match the last batch id's hi {expected_lo}"
            )
        if self._upper != frontier:
            raise ValueError(
                f"spine upper {self._upper} does not match the last batch's upper {frontier}"
            )

    # ------------------------------------------------------------------ JSON

    def to_json(self) -> dict[str, Any]:
        """The flattened trace as JSON-able values (Materialize's ``flatten``)::

            {"since": [t] | [], "upper": [t] | [], "next_id": n,
             "hollow_batches": {"lo-hi": HollowBatch.to_json(), ...},
             "spine_batches": {"lo-hi": {"level": i, "desc": Description.to_json(),
                                         "parts": ["lo-hi", ...]}, ...},
             "fueling_merges": {"lo-hi": {"since": [t] | [], "remaining_work": n}, ...}}

        Maps are in id order.  Hollow batches are stored once, by id, so merging two spine
        batches changes only the small ``spine_batches`` entries.  The entries of a spine
        batch that is unchanged since the last call are the same (shared, read-only)
        objects as then, so a new version re-flattens only the batches that changed.
        """
        hollow: dict[str, Any] = {}
        spine: dict[str, Any] = {}
        merges: dict[str, Any] = {}
        memo = self._json_memo
        new_memo: dict[SpineId, _JsonMemo] = {}
        for index in range(len(self._levels) - 1, -1, -1):
            level = self._levels[index]
            for b in level.batches:
                m = memo.get(b.id)
                if m is None or m[0] is not b or m[1] != index:
                    names = [str(p.id) for p in b.parts]
                    entry = {"level": index, "desc": b.desc.to_json(), "parts": names}
                    parts = [(n, p.batch.to_json()) for n, p in zip(names, b.parts, strict=True)]
                    m = (b, index, str(b.id), entry, parts)
                new_memo[b.id] = m
                hollow.update(m[4])
                spine[m[2]] = m[3]
            if level.merge is not None:
                fm = level.merge
                merges[str(fm.id)] = {
                    "since": fm.since.to_json(),
                    "remaining_work": fm.remaining_work,
                }
        self._json_memo = new_memo
        return {
            "since": self._since.to_json(),
            "upper": self._upper.to_json(),
            "next_id": self._next_id,
            "hollow_batches": hollow,
            "spine_batches": spine,
            "fueling_merges": merges,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Trace:
        """Rebuild a trace from :meth:`to_json` output (Materialize's ``unflatten``); the
        result is equal to the flattened trace and validated.

        Raises:
            ValueError: ``d`` is malformed, references a missing hollow batch, leaves a
                hollow batch or merge unused, or breaks an invariant of :meth:`validate`.
        """
        try:
            return cls._from_json(d)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed trace JSON: {type(e).__name__}: {e}") from e

    @classmethod
    def _from_json(cls, d: dict[str, Any]) -> Trace:
        hollow = {
            SpineId.parse(k): HollowBatch.from_json(v) for k, v in d["hollow_batches"].items()
        }
        merges = {
            SpineId.parse(k): (Antichain.from_json(v["since"]), v["remaining_work"])
            for k, v in d["fueling_merges"].items()
        }
        spine = sorted((SpineId.parse(k), v) for k, v in d["spine_batches"].items())
        next_id = d["next_id"]
        if isinstance(next_id, bool) or not isinstance(next_id, int):
            raise ValueError(f"trace next_id must be an int, got {next_id!r}")

        trace = cls()
        trace._since = Antichain.from_json(d["since"])
        trace._upper = Antichain.from_json(d["upper"])
        trace._next_id = next_id
        top = spine[0][1]["level"] if spine else -1
        # A batch's level is log2 of its update count (an i64), so no spine is deeper
        # than 64 levels: checked before allocating, so a corrupt level cannot exhaust
        # memory.
        if isinstance(top, bool) or not isinstance(top, int) or not -1 <= top <= 64:
            raise ValueError(f"spine batch level {top!r} is outside 0..64")
        n_levels = top + 1
        levels = [_MergeState() for _ in range(n_levels)]
        for id, v in spine:
            level = v["level"]
            if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level < n_levels:
                raise ValueError(f"spine batch {id} has level {level!r}, outside 0..{n_levels - 1}")
            desc = Description.from_json(v["desc"])
            parts = []
            for name in v["parts"]:
                pid = SpineId.parse(name)
                if pid not in hollow:
                    raise ValueError(f"spine batch {id} references missing hollow batch {pid}")
                parts.append(IdHollowBatch(pid, hollow.pop(pid)))
            if len(parts) == 1:
                sb = _SpineBatch.merged(parts[0])
                if sb.id != id or sb.desc != desc:
                    raise ValueError(
                        f"spine batch {id} {desc} does not match its hollow batch {sb.id} {sb.desc}"
                    )
            else:
                sb = _SpineBatch.make_fueled(id, desc, tuple(parts))
            state = levels[level]
            state.push_batch(sb)
            if state.is_full():
                mid = state.id()
                assert mid is not None
                if mid not in merges:
                    raise ValueError(f"full level {level} has no fueling merge {mid}")
                since, work = merges.pop(mid)
                if isinstance(work, bool) or not isinstance(work, int):
                    raise ValueError(f"merge {mid} remaining_work must be an int, got {work!r}")
                state.merge = _FuelingMerge(mid, since, work)
        if hollow:
            raise ValueError(
                f"{len(hollow)} hollow batches left after reconstructing the "
                f"spine: {', '.join(map(str, sorted(hollow)))}"
            )
        if merges:
            raise ValueError(
                f"{len(merges)} merges left after reconstructing the spine: "
                f"{', '.join(map(str, sorted(merges)))}"
            )
        trace._levels = levels
        trace.validate()
        return trace
