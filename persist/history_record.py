"""The history record of a state version: what changed, when and how much
(:func:`make_record`), decided by the state machine on the version it publishes.

A record is ``{"seqno", "time", "ms", "op", "params", "metrics"}``: the version's seqno,
the logical time its contents are read at (``upper - 1`` of the new version, ``None``
before anything is definite), the commit timestamp (UTC ms), the operation (one of
:data:`persist.commit_note.OPERATIONS`), its parameters and metrics (``rows_inserted``,
``rows_retracted`` when the operation knew them, ``None`` otherwise; ``updates_added``,
``bytes_added``, ``parts_added``, ``parts_removed`` from the parts the version adds
and drops).  They are written to the shard's history log in the same atomic
append as the version (:class:`persist.consensus.HistoryAppend`).

Invariants kept here: only a version that changes the shard's contents, schema,
retention or since-by-retention gets a record (lease renewals, registrations and
expiries get none: they are hidden from history); the timestamps never decrease from
one record to the next (``max(now, previous)``, the previous one being in the state
the version is computed from, so it holds across processes and clocks).

Source of the idea: Delta Lake's ``commitInfo`` (``timestamp``, ``operation``,
``operationParameters``, ``operationMetrics``) and its monotonic commit timestamps
(the ``inCommitTimestamp`` table feature).
"""

from __future__ import annotations

from typing import Any

from persist.commit_note import current
from persist.spine_levels import SpineBatch
from persist.state import ShardState

__all__ = ["make_record"]

#: The machine's command names that may make a record.
COMMAND_OPS = ("create", "append", "txn", "optimize", "schema", "since", "retention")


def _parts(st: ShardState) -> dict[str, tuple[int, int]]:
    """Part id -> (rows, bytes) of every part ``st`` references (the full recount that
    :func:`parts_changed` must agree with; used by the tests' checks)."""
    return {
        pid: (p.rows, p.encoded_size_bytes)
        for b in st.trace.batches()
        for p in b.parts
        if (pid := p.part_id) is not None
    }


def parts_changed(old: ShardState, new: ShardState) -> tuple[list[tuple[int, int]], int]:
    """The ``(rows, bytes)`` of each part ``new`` references and ``old`` does not, and
    how many parts ``old`` references that ``new`` does not (by part id).

    Proportional to what changed: spine batches are immutable and shared between
    versions, so only the spine batches of one version that are not (the same object)
    in the other are looked into.  A part of a new spine batch is first looked up among
    the parts of the spine batches it replaced (one set: a fueled merge's batch lists
    the parts of the batches it replaced), and only if absent there in each shared
    spine batch's :attr:`~persist.spine_levels.SpineBatch.part_index`; the same the
    other way round for the removed parts.
    """
    before = old.trace.spine_list()
    after = new.trace.spine_list()
    old_ids = set(map(id, before))
    fresh = [b for b in after if id(b) not in old_ids]
    if not fresh and len(after) == len(before):
        return [], 0  # the same spine batches (ids are unique among the live ones)
    new_ids = set(map(id, after))
    gone = [b for b in before if id(b) not in new_ids]
    shared = [b for b in after if id(b) in old_ids]
    gone_ids = {pid for b in gone for pid in b.part_index}
    added: dict[str, tuple[int, int]] = {}
    for b in fresh:
        for pid, v in b.part_index.items():
            if pid not in gone_ids and not _in_any(pid, shared):
                added[pid] = v
    fresh_ids = {pid for b in fresh for pid in b.part_index}
    removed = {pid for pid in gone_ids if pid not in fresh_ids and not _in_any(pid, shared)}
    return list(added.values()), len(removed)


def _in_any(pid: str, batches: list[SpineBatch]) -> bool:
    """Whether a part with id ``pid`` is in one of ``batches``."""
    for b in batches:
        if pid in b.part_index:
            return True
    return False


def make_record(
    old: ShardState, new: ShardState, command: str, now_ms: int
) -> dict[str, Any] | None:
    """The history record of ``new`` (a version about to be published on ``old``) made
    by the machine command ``command`` (one of :data:`COMMAND_OPS`), or ``None`` when
    the version is one history hides.  Reads the running table operation's note
    (:func:`persist.commit_note.current`)."""
    note = current()
    op, params, metrics = command, {}, {}
    if command in ("append", "txn"):
        if note is not None:
            op, params, metrics = note.op, dict(note.params), dict(note.metrics)
    elif command == "optimize":
        params = {"auto": True}
        if note is not None and note.op == "optimize":
            params = dict(note.params)
    elif command == "since":
        if note is None or note.op != "retention":
            return None
        op, params = "retention", dict(note.params)
    elif command == "retention" and note is not None:
        params = dict(note.params)
    if command in ("optimize", "since") and (
        old.since == new.since and list(old.trace.batches()) == list(new.trace.batches())
    ):
        return None
    if command == "schema" and old.schema_history == new.schema_history:
        return None
    added, removed = parts_changed(old, new)
    metrics.setdefault("rows_inserted", None)
    metrics.setdefault("rows_retracted", None)
    metrics["updates_added"] = sum(r for r, _b in added)
    metrics["bytes_added"] = sum(b for _r, b in added)
    metrics["parts_added"] = len(added)
    metrics["parts_removed"] = removed
    upper = new.upper.as_option()
    return {
        "seqno": new.seqno,
        "time": None if not upper else upper - 1,
        "ms": max(now_ms, old.history_ms),
        "op": op,
        "params": storable(params),
        "metrics": metrics,
    }


def storable(value: Any) -> Any:
    """``value`` with each NUL character of its strings written as JSON escapes it
    (``\\u0000``, six characters): the stash refuses NULs in a value (Postgres' jsonb
    cannot hold them), and a record's parameters are the text of what the user passed
    (a predicate over string keys may hold one), shown as JSON text."""
    if isinstance(value, str):
        return value.replace("\x00", "\\u0000") if "\x00" in value else value
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [storable(v) for v in value]
    return value
