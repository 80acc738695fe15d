"""A table's retention: the since follows ``now - duration`` (pure functions on a
:class:`~persist.state.ShardState`, run by the state machine with each recorded version
and by the ``set_retention`` / ``advance_retention`` commands).

With a retention of ``d`` the table keeps every state it had during the last ``d``: its
since is held at the time of the newest version committed at or before ``now - d`` (the
*retention hold*, :attr:`ShardState.retention_hold`, which joins the readers' holds in
the meet that makes the since: a reader may hold the since further back, never
forward).  To move it at every commit without reading history, the state keeps
*marks*: ``(commit ms, time)`` of recorded versions, at most one per
:func:`mark_width` (a 32nd of the duration), pruned once passed; the hold moves to the
newest mark at or before ``now - d``, so it lags the exact time by at most a mark's
width plus the gap between commits.  ``Table.vacuum()`` moves it exactly, from the
history (:func:`exact_hold`).

Invariants kept here: the hold only advances, and only to the time of a version
committed at or before ``now - d`` (so every instant of the last ``d`` stays readable,
whatever the clock of the process committing: marks carry the monotonic history
timestamps); setting or clearing the retention never moves the since backwards.

Source of the idea: Delta Lake's ``delta.logRetentionDuration`` /
``deletedFileRetentionDuration`` and pyiceberg's ``expire_snapshots(older_than=)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from persist.state import ShardState

__all__ = [
    "advance",
    "exact_hold",
    "mark_width",
    "marks_from",
    "note_commit",
    "set_retention",
]


def mark_width(retention_ms: int) -> int:
    """The least gap (ms) between two kept marks: a 32nd of the retention."""
    return max(1, retention_ms // 32)


def note_commit(st: ShardState, ms: int, time: int) -> None:
    """Keep ``(ms, time)`` (a version just recorded) as a mark if the newest mark is at
    least :func:`mark_width` older (else the older mark stands for it)."""
    if st.retention_ms is None:
        return
    marks = st.retention_marks
    if marks and ms - marks[-1][0] < mark_width(st.retention_ms):
        return
    st.retention_marks = (*marks, (ms, time))


def advance(st: ShardState, now_ms: int) -> bool:
    """Move the retention hold to the newest mark at or before ``now_ms - retention``
    (never backwards), drop the marks before it and recompute the since.  Returns
    whether anything changed."""
    if st.retention_ms is None:
        return False
    cutoff = now_ms - st.retention_ms
    passed = [i for i, (ms, _t) in enumerate(st.retention_marks) if ms <= cutoff]
    if not passed:
        return False
    i = passed[-1]
    t = st.retention_marks[i][1]
    changed = i > 0
    st.retention_marks = st.retention_marks[i:]
    if st.retention_hold is None or t > st.retention_hold:
        st.retention_hold = t
        changed = True
    return st._recompute_since() or changed


def exact_hold(records: Iterable[dict[str, Any]], now_ms: int, retention_ms: int) -> int | None:
    """The time of the newest recorded version committed at or before
    ``now_ms - retention_ms`` (``None``: none), from history records."""
    cutoff = now_ms - retention_ms
    best: dict[str, Any] | None = None
    for r in records:
        if r.get("time") is not None and int(r["ms"]) <= cutoff:
            if best is None or int(r["seqno"]) > int(best["seqno"]):
                best = r
    return None if best is None else int(best["time"])


def marks_from(records: Sequence[dict[str, Any]], retention_ms: int) -> tuple[tuple[int, int], ...]:
    """The marks a newly set retention starts with: the recorded versions (oldest
    first), one per :func:`mark_width`."""
    out: list[tuple[int, int]] = []
    width = mark_width(retention_ms)
    for r in sorted(records, key=lambda r: int(r["seqno"])):
        if r.get("time") is None:
            continue
        ms, t = int(r["ms"]), int(r["time"])
        if out and ms - out[-1][0] < width:
            continue
        out.append((ms, t))
    return tuple(out)


def set_retention(
    st: ShardState,
    retention_ms: int | None,
    marks: tuple[tuple[int, int], ...],
    hold: int | None,
    now_ms: int,
) -> bool:
    """Set (``None``: clear) the retention, starting from ``marks`` and the exact
    ``hold`` read from history (:func:`exact_hold`), and move the since by it.
    Returns whether anything changed."""
    if retention_ms is None:
        changed = st.retention_ms is not None
        st.retention_ms, st.retention_marks, st.retention_hold = None, (), None
        return changed
    changed = st.retention_ms != retention_ms
    st.retention_ms = retention_ms
    st.retention_marks = marks
    if hold is not None and (st.retention_hold is None or hold > st.retention_hold):
        st.retention_hold = hold
        changed = True
    return advance(st, now_ms) or st._recompute_since() or changed


def advance_to(st: ShardState, hold: int | None, now_ms: int) -> bool:
    """Move the retention hold to ``hold`` (the exact one read from history), if later,
    then :func:`advance`.  Returns whether anything changed."""
    if st.retention_ms is None:
        return False
    changed = False
    if hold is not None and (st.retention_hold is None or hold > st.retention_hold):
        st.retention_hold = hold
        changed = True
    return advance(st, now_ms) or st._recompute_since() or changed
