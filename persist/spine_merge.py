"""What the Spine hands out and takes back: merge requests, merge results and their verdicts.

A :class:`~persist.spine.Trace` hands out a :class:`FueledMergeReq` when a level's merge
finishes its fuel; a compactor answers it with a :class:`FueledMergeRes`, which
:meth:`~persist.spine.Trace.apply_merge_res` swaps in and judges with an
:class:`ApplyMergeResult`.  :class:`SpineId` names the range of pushed batches a batch
covers; :func:`worth_compacting` is the heuristic deciding which requests a compactor
answers.  After Materialize's ``src/persist-client/src/internal/trace.rs`` (``SpineId``,
``FueledMergeReq``, ``FueledMergeRes``, ``ApplyMergeResult``) and persist-client's
``compaction_heuristic_min_*`` settings.

Invariants kept here: every type is immutable (frozen dataclasses, an enum); a
:class:`SpineId` is a non-empty half-open range ``lo < hi`` and round-trips through its
string form ``"lo-hi"``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from persist.types import Description, HollowBatch
from stash import Antichain

__all__ = [
    "COMPACTION_MIN_INPUTS",
    "COMPACTION_MIN_PARTS",
    "COMPACTION_MIN_UPDATES",
    "ApplyMergeResult",
    "FueledMergeReq",
    "FueledMergeRes",
    "IdHollowBatch",
    "SpineId",
    "merge_output_desc",
    "worth_compacting",
]

#: The compaction heuristic (after persist-client's ``compaction_heuristic_min_*``): a
#: merge request is worth answering after an append only if it has at least this many
#: inputs (hollow batches), or its inputs this many parts, or this many updates.  Smaller
#: requests are skipped: their fueled spine batch keeps listing its few hollow batches
#: (the Spine's bookkeeping is unchanged) until a merge above it includes them, so the
#: state stays O(log n) hollow batches (fewer than ``COMPACTION_MIN_INPUTS`` per fueled
#: batch below ``COMPACTION_MIN_UPDATES`` updates) while one-row appends do about one
#: physical merge per ``COMPACTION_MIN_INPUTS - 1`` appends instead of one per append,
#: and each row is read again by about ``log(n) / log(COMPACTION_MIN_INPUTS)`` merges.
#:
#: Materialize uses 8 inputs and 8 parts.  Here a physical merge costs more against the
#: rows it moves (Python and pyarrow calls, per column: merges of 8 small inline parts
#: of 21 columns took 0.94 ms of CPU on average, of 16 such parts 1.33 ms, on a busy
#: two-core machine), so at 16 one-row appends cost the background compactor about a
#: third less CPU per append (0.16 against 0.24 ms, medians of 5 runs of 2,000 appends
#: on SQLite), for at most 15 one-row hollow batches per fueled spine batch instead of
#: 7 (a hollow batch costs a commit well under a microsecond, and a snapshot one small
#: part's decoding).
COMPACTION_MIN_INPUTS = 16
COMPACTION_MIN_PARTS = 16
COMPACTION_MIN_UPDATES = 1024


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
    ``desc.since`` the trace's since when the merge began (Materialize's
    ``FueledMergeReq``).  A compactor consolidates at the later since of the state it
    reads (:func:`merge_output_desc`).
    """

    desc: Description
    inputs: tuple[IdHollowBatch, ...]


@dataclass(frozen=True, slots=True)
class FueledMergeRes:
    """The answer to a :class:`FueledMergeReq`: the merged batch (Materialize's ``FueledMergeRes``).

    ``output.desc`` has the request's lower and upper and the since the output was
    consolidated at (:func:`merge_output_desc`: at or after the request's, never after
    the trace's since when applied); ``output.len`` must not exceed the summed ``len`` of
    the inputs it replaces.
    """

    output: HollowBatch


def merge_output_desc(req: FueledMergeReq, state_since: Antichain) -> Description:
    """The description of a merge's output: the request's lower and upper, and as since the
    join of the request's since and ``state_since``, the since of the committed state
    version the compactor read.  The output's times are advanced to (and consolidated at)
    that since.

    ``state_since`` must come from a committed version of the shard's state: the shard's
    since never regresses, so it is ``<=`` the since of every later version (the one the
    result is applied to included) and of every ``as_of`` a reader may still read at.  A
    stale version is safe (an earlier since advances less, so the output keeps more
    distinct times) but never a since no version committed (a cache of a reader's hold, a
    clock reading).  An empty ``state_since`` (a finalized shard) leaves the request's
    since: there is nothing left to read.

    Materialize's ``FueledMergeReq`` carries the since the merge began at, and its
    ``maybe_replace`` accepts an output whose since is at most the spine's (the comment
    in ``src/persist-client/src/internal/trace.rs``: "the Spine since must be in advance
    of the merge res since"); this takes the state's since instead of the request's so
    that a shard whose since moved on after the request was made is consolidated that far.
    """
    d = req.desc
    if state_since.is_empty():
        return d
    since = d.since.join(state_since)
    return d if since == d.since else Description(d.lower, d.upper, since)


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
    #: A batch matched, but the output's since is beyond the trace's since (it was not
    #: consolidated at a since any committed version of the shard had).
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
