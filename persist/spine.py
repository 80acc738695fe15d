"""The Spine trace of a shard: its batches arranged in levels, merged by fueled merges.

A :class:`Trace` holds the :class:`~persist.types.HollowBatch` es of one shard, contiguous in
time, together with the shard's ``since`` and ``upper``.  It is a port of Materialize's Spine
(``src/persist-client/src/internal/trace.rs``), itself a fork of differential dataflow's
fueled Spine.  The Spine only does the *bookkeeping* of merges: when two batches at a level finish
"fueling", they become one *fueled* spine batch (a list of hollow batches with one merged
description) and a
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
would break the since invariant); ``apply_merge_res`` accepts an output consolidated at
any since up to the trace's (the since of the committed state the compactor read, see
:func:`persist.spine_merge.merge_output_desc`; Materialize's accepts one up to the matched
batch's) and reports ``NOT_APPLIED_INVALID_SINCE`` for one beyond it (Materialize's checked
the since before matching and so could only ever report no match); the JSON form stores
every batch with an id (no legacy, id-less batches).

The Spine is three modules: this one holds the :class:`Trace`; :mod:`persist.spine_merge`
the merge requests and results it hands out and takes back (re-exported here, so
``from persist.spine import FueledMergeReq`` keeps working), and
:mod:`persist.spine_levels` the levels and the bookkeeping of their fueled merges.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from persist.spine_levels import (
    BATCHES_PER_LEVEL,
    EFFORT,
    FUEL_PER_UPDATE,
    FuelingMerge,
    MergeState,
    SpineBatch,
    begin_merge,
    level_for_len,
)
from persist.spine_merge import (
    COMPACTION_MIN_INPUTS,
    COMPACTION_MIN_PARTS,
    COMPACTION_MIN_UPDATES,
    ApplyMergeResult,
    FueledMergeReq,
    FueledMergeRes,
    IdHollowBatch,
    SpineId,
    worth_compacting,
)
from persist.types import Description, HollowBatch
from stash import Antichain

__all__ = [
    "BATCHES_PER_LEVEL",
    "COMPACTION_MIN_INPUTS",
    "COMPACTION_MIN_PARTS",
    "COMPACTION_MIN_UPDATES",
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

_MINIMUM = Antichain.from_elem(MINIMUM_TIME)


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


#: What :meth:`Trace.to_json` remembers of a spine batch (see ``Trace._json_memo``).
_JsonMemo = tuple[SpineBatch, int, str, dict[str, Any], list[tuple[str, Any]]]


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
        self._levels: list[MergeState] = []
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

    def _spine_batches(self) -> Iterator[SpineBatch]:
        for level in reversed(self._levels):
            yield from level.batches

    def batches(self) -> Iterator[HollowBatch]:
        """The hollow batches, oldest first; their descriptions line up from ``{0}`` to
        :attr:`upper`."""
        for b in self._spine_batches():
            for p in b.parts:
                yield p.batch

    def spine_batches(self) -> Iterator[tuple[SpineBatch, int]]:
        """The spine batches with their levels, oldest first (a fueled batch once)."""
        for index in range(len(self._levels) - 1, -1, -1):
            for b in self._levels[index].batches:
                yield b, index

    def spine_index(self) -> dict[int, tuple[SpineBatch, int]]:
        """The spine batches with their levels by the batches' ``id()`` (what
        :meth:`spine_batches` yields, oldest first), for comparing two versions whose
        unchanged batches are the same objects."""
        levels = self._levels
        return {id(b): (b, i) for i in range(len(levels) - 1, -1, -1) for b in levels[i].batches}

    def part_indexes(self) -> list[dict[str, tuple[int, int]]]:
        """Every spine batch's :attr:`SpineBatch.part_index` (part id -> rows and bytes of
        each of its parts that has an id; read-only), oldest first."""
        return [b.part_index for level in reversed(self._levels) for b in level.batches]

    def spine_list(self) -> list[SpineBatch]:
        """The spine batches, oldest first, as a list (what :meth:`spine_batches`
        yields, without the levels)."""
        return [b for level in reversed(self._levels) for b in level.batches]

    def inline_bytes(self) -> int:
        """The summed size (bytes) of the inline parts of every hollow batch (a sum of
        the spine batches' running counters, see :class:`SpineBatch`)."""
        return sum(b.inline_bytes for level in self._levels for b in level.batches)

    def num_parts(self) -> int:
        """The number of parts of every hollow batch (from the spine batches' counters)."""
        return sum(b.num_parts for level in self._levels for b in level.batches)

    def references_part(self, part_id: str) -> bool:
        """Whether a part with this :attr:`~persist.types.PartRef.part_id` is in the
        trace (a lookup per spine batch, see :attr:`SpineBatch.part_index`)."""
        return any(part_id in b.part_index for level in self._levels for b in level.batches)

    def num_spine_batches(self) -> int:
        """The number of spine batches (a fueled batch counts once)."""
        return sum(len(level.batches) for level in self._levels)

    def num_hollow_batches(self) -> int:
        """The number of hollow batches (what :meth:`batches` yields)."""
        return sum(len(b.parts) for level in self._levels for b in level.batches)

    def num_updates(self) -> int:
        """The summed ``len`` (rows) of all hollow batches."""
        return sum(b.len for level in self._levels for b in level.batches)

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

    def run_merge_reqs(self) -> list[FueledMergeReq]:
        """A merge request for every merged spine batch holding several runs (e.g. one
        batch written by several tasks at once, each a sorted run of its own, their key
        ranges overlapping), oldest first: answered, each such batch becomes one sorted,
        consolidated run. The spine asks for none of these (it merges batches, not the
        runs of one); an explicit compaction answers them after the fueled ones."""
        return [
            FueledMergeReq(b.desc, b.parts)
            for b in self._spine_batches()
            if not b.fueled and not b.is_compact()
        ]

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
        one whose since is beyond this trace's since is ``NOT_APPLIED_INVALID_SINCE``, one
        with more updates than it would replace is ``NOT_APPLIED_TOO_MANY_UPDATES``; in
        these cases nothing changes.
        """
        invalid_since = False
        for level in reversed(self._levels):
            for i, b in enumerate(level.batches):
                result, replacement = b.maybe_replace(res, self._since)
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
        sb = SpineBatch.merged(IdHollowBatch(id, batch))
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

        self._introduce_batch(sb, level_for_len(batch.len), log)

    def _introduce_batch(
        self, batch: SpineBatch, index: int, log: list[FueledMergeReq] | None
    ) -> None:
        # 1. Fuel proportional to the batch's level goes to every merge in progress, so
        #    that merges finish before lower levels can produce their next input.
        self._apply_fuel((FUEL_PER_UPDATE << index) * EFFORT, log)
        # 2. Levels below `index` are rolled up so the batch lands on a vacant level.
        self._roll_up(index, log)
        # 3. Insert.
        self._insert_at(batch, index)
        # 4. Draw the largest level down if it is small enough for a lower one.
        self._tidy_layers()

    def _roll_up(self, index: int, log: list[FueledMergeReq] | None) -> None:
        levels = self._levels
        while len(levels) <= index:
            levels.append(MergeState())
        if any(level.batches for level in levels[:index]):
            merged: SpineBatch | None = None
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

    def _insert_at(self, batch: SpineBatch, index: int) -> None:
        levels = self._levels
        while len(levels) <= index:
            levels.append(MergeState())
        level = levels[index]
        level.push_batch(batch)
        if level.is_full():
            level.merge = begin_merge(level.batches, self._since)

    def _tidy_layers(self) -> None:
        levels = self._levels
        if not levels:
            return
        length = len(levels)
        if len(levels[-1].batches) != 1:
            return
        appropriate_level = level_for_len(levels[-1].len())
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

    def validate(self, checked: set[int] | None = None) -> None:
        """Check the invariants listed in the module docstring (``checked``: the ids of
        the only spine batches whose own invariants are checked, :meth:`SpineBatch.check`;
        ``None``: every one).

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
                if checked is None or id(b) in checked:
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

    def meta_json(self) -> dict[str, Any]:
        """The parts of :meth:`to_json` that are not batches: ``since``, ``upper``,
        ``next_id`` and ``fueling_merges`` (the same values; a pass over the levels only)."""
        merges: dict[str, Any] = {}
        for index in range(len(self._levels) - 1, -1, -1):
            fm = self._levels[index].merge
            if fm is not None:
                merges[str(fm.id)] = {
                    "since": fm.since.to_json(),
                    "remaining_work": fm.remaining_work,
                }
        return {
            "since": self._since.to_json(),
            "upper": self._upper.to_json(),
            "next_id": self._next_id,
            "fueling_merges": merges,
        }

    def flat_batch(
        self, b: SpineBatch, index: int
    ) -> tuple[str, dict[str, Any], list[tuple[str, Any]]]:
        """The flattened form of spine batch ``b`` at level ``index``, as :meth:`to_json`
        lists it: its name, its ``spine_batches`` entry and its ``hollow_batches``
        entries as ``(name, value)`` (shared, read-only objects when the last
        :meth:`to_json` made them)."""
        m = self._json_memo.get(b.id)
        if m is not None and m[0] is b and m[1] == index:
            return m[2], m[3], m[4]
        names = [str(p.id) for p in b.parts]
        entry = {"level": index, "desc": b.desc.to_json(), "parts": names}
        parts = [(n, p.batch.to_json()) for n, p in zip(names, b.parts, strict=True)]
        return str(b.id), entry, parts

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
        spine = sorted((SpineId.parse(k), v) for k, v in d["spine_batches"].items())
        batches: list[tuple[int, SpineBatch]] = []
        for id, v in spine:
            parts = []
            for name in v["parts"]:
                pid = SpineId.parse(name)
                if pid not in hollow:
                    raise ValueError(f"spine batch {id} references missing hollow batch {pid}")
                parts.append(IdHollowBatch(pid, hollow.pop(pid)))
            batches.append((v["level"], _spine_batch(id, v, parts)))
        if hollow:
            raise ValueError(
                f"{len(hollow)} hollow batches left after reconstructing the "
                f"spine: {', '.join(map(str, sorted(hollow)))}"
            )
        trace = cls._assemble(d, batches)
        trace.validate()
        return trace

    @classmethod
    def from_json_delta(
        cls,
        prev: Trace,
        meta: dict[str, Any],
        spine_entry: Callable[[str], Any],
        changed_spine: Mapping[str, Any],
        changed_hollow: Mapping[str, Any],
    ) -> Trace:
        """:meth:`from_json` of a newer version of ``prev``'s flattened form, decoding
        only what changed: ``meta`` (:meth:`meta_json`: since, upper, next_id,
        fueling_merges), the ``spine_batches`` and ``hollow_batches`` entries set or
        removed since ``prev`` (name -> JSON value; ``None`` for a removed one), and
        ``spine_entry(name)``, the newer version's ``spine_batches`` entry of a batch
        that holds a changed hollow batch.  Every other spine batch, and every hollow
        batch not among the changed, is ``prev``'s very object (shared, immutable).
        Equal to :meth:`from_json` of the whole newer form (checked in the test suite,
        :mod:`persist.state_check`).

        Raises:
            ValueError: the changes do not fit ``prev`` (a reference to a missing or
                removed hollow batch, a hollow batch left unreferenced) or the result
                breaks an invariant of :meth:`validate`.
        """
        try:
            return cls._from_json_delta(prev, meta, spine_entry, changed_spine, changed_hollow)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed trace JSON: {type(e).__name__}: {e}") from e

    @classmethod
    def _from_json_delta(
        cls,
        prev: Trace,
        meta: dict[str, Any],
        spine_entry: Callable[[str], Any],
        changed_spine: Mapping[str, Any],
        changed_hollow: Mapping[str, Any],
    ) -> Trace:
        hollow = {SpineId.parse(k): v for k, v in changed_hollow.items()}
        kept: dict[SpineId, tuple[int, SpineBatch]] = {}
        entries: dict[SpineId, Any] = {}
        removed: list[SpineBatch] = []  # prev's batches whose entry changed or went
        for sb, index in prev.spine_batches():
            name = str(sb.id)
            if name in changed_spine:
                removed.append(sb)
            elif any(sb.id.lo <= h.lo and h.hi <= sb.id.hi for h in hollow):
                removed.append(sb)  # its entry is unchanged, a hollow batch of it is not
                entries[sb.id] = spine_entry(name)
            else:
                kept[sb.id] = (index, sb)
        for name, v in changed_spine.items():
            if v is not None:
                entries[SpineId.parse(name)] = v
        old_parts = {p.id: p for sb in removed for p in sb.parts}
        used: set[SpineId] = set()
        batches = list(kept.values())
        for sid, v in sorted(entries.items()):
            parts = []
            for name in v["parts"]:
                pid = SpineId.parse(name)
                if pid in hollow:
                    if hollow[pid] is None:
                        raise ValueError(f"spine batch {sid} references removed hollow batch {pid}")
                    parts.append(IdHollowBatch(pid, HollowBatch.from_json(hollow[pid])))
                else:
                    p = old_parts.get(pid)
                    if p is None:
                        raise ValueError(f"spine batch {sid} references missing hollow batch {pid}")
                    parts.append(p)
                used.add(pid)
            batches.append((v["level"], _spine_batch(sid, v, parts)))
        left = sorted(
            ({pid for pid, v in hollow.items() if v is not None} | (old_parts.keys() - hollow))
            - used
        )
        if left:
            raise ValueError(
                f"{len(left)} hollow batches left after reconstructing the "
                f"spine: {', '.join(map(str, left))}"
            )
        batches.sort(key=lambda lb: lb[1].id)
        trace = cls._assemble(meta, batches)
        trace._json_memo = prev._json_memo  # read-only: each to_json replaces it whole
        trace.validate(checked={id(b) for _, b in batches} - {id(b) for _, b in kept.values()})
        return trace

    @classmethod
    def _assemble(cls, d: Mapping[str, Any], batches: list[tuple[int, SpineBatch]]) -> Trace:
        """The trace of ``d``'s ``since``, ``upper``, ``next_id`` and ``fueling_merges``
        and the spine ``batches`` (level, batch), oldest first (not yet validated)."""
        merges = {
            SpineId.parse(k): (Antichain.from_json(v["since"]), v["remaining_work"])
            for k, v in d["fueling_merges"].items()
        }
        next_id = d["next_id"]
        if isinstance(next_id, bool) or not isinstance(next_id, int):
            raise ValueError(f"trace next_id must be an int, got {next_id!r}")

        trace = cls()
        trace._since = Antichain.from_json(d["since"])
        trace._upper = Antichain.from_json(d["upper"])
        trace._next_id = next_id
        top = batches[0][0] if batches else -1
        # A batch's level is log2 of its update count (an i64), so no spine is deeper
        # than 64 levels: checked before allocating, so a corrupt level cannot exhaust
        # memory.
        if isinstance(top, bool) or not isinstance(top, int) or not -1 <= top <= 64:
            raise ValueError(f"spine batch level {top!r} is outside 0..64")
        n_levels = top + 1
        levels = [MergeState() for _ in range(n_levels)]
        for level, sb in batches:
            if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level < n_levels:
                raise ValueError(
                    f"spine batch {sb.id} has level {level!r}, outside 0..{n_levels - 1}"
                )
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
                state.merge = FuelingMerge(mid, since, work)
        if merges:
            raise ValueError(
                f"{len(merges)} merges left after reconstructing the spine: "
                f"{', '.join(map(str, sorted(merges)))}"
            )
        trace._levels = levels
        return trace


def _spine_batch(id: SpineId, v: Mapping[str, Any], parts: list[IdHollowBatch]) -> SpineBatch:
    """The spine batch ``id`` of the ``spine_batches`` entry ``v`` and its ``parts``."""
    level = v["level"]
    # A batch's level is log2 of its update count (an i64): a corrupt one is refused
    # before anything is built on it (and before levels are allocated for it).
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= 64:
        raise ValueError(f"spine batch {id} has level {level!r}, outside 0..64")
    desc = Description.from_json(v["desc"])
    if len(parts) == 1:
        sb = SpineBatch.merged(parts[0])
        if sb.id != id or sb.desc != desc:
            raise ValueError(
                f"spine batch {id} {desc} does not match its hollow batch {sb.id} {sb.desc}"
            )
        return sb
    return SpineBatch.make_fueled(id, desc, tuple(parts))
