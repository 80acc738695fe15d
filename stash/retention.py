"""Retention: how far back a collection's history stays readable, so its since follows
a setting instead of moving with every append.

The setting of collection ``NAME`` is the value of key ``NAME`` in the collection
``stash.retention`` (JSON ``{"keep_times": N}``: the last ``N`` times stay readable;
``{"keep_times": null}``: every time since the setting).  Invariants kept here:

* every writer that picks a batch's since asks :func:`retained_since` in the
  transaction (or read) that picks its upper: ``make_batch``
  (:func:`batch_frontiers`) and the one-transaction typed writes (:mod:`stash.keyed`);
  without a setting the since moves to the batch's time, as it always did;
* the since never goes back and never passes the batch's time;
* batches a caller builds by hand (``AppendBatch(..., compact=...)``) keep the since
  they ask for.

Source of the idea: Materialize's compaction windows (``logical_compaction_window``,
``RETAIN HISTORY``), which hold a collection's since back by a duration.
"""

from __future__ import annotations

import json
from typing import Any

from stash.codec import canonical_json
from stash.collection import StashCollection
from stash.txn import Txn

__all__ = ["RETENTION_COLLECTION", "batch_frontiers", "retained_since"]

RETENTION_COLLECTION = "stash.retention"


def _policy(tx: Txn, name: str) -> dict[str, Any] | None:
    """The retention recorded for collection ``name``, read in ``tx`` (``None``: none).
    Read with ``rows`` (no lock: a write of one collection never waits for writers of
    others on the retention collection)."""
    found = tx.lookup_collection(RETENTION_COLLECTION)
    if found is None:
        return None
    sums: dict[str, int] = {}
    for _, v, _, d in tx.rows(found[0], canonical_json(name)):
        sums[v] = sums.get(v, 0) + d
    live = [v for v, d in sums.items() if d == 1]
    return json.loads(live[0]) if len(live) == 1 else None


def retained_since(tx: Txn, cid: int, name: str, t: int) -> int:
    """The since a write at time ``t`` (the new upper ``t + 1``) leaves collection ``cid``
    at: ``t`` without a retention (every append compacts, as before), else the since the
    retention keeps (never below the current since, never beyond ``t``)."""
    policy = _policy(tx, name)
    if policy is None:
        return t
    since, _ = tx.frontiers(cid)
    cur = 0 if since is None else since
    keep = policy.get("keep_times")
    if keep is None:
        return cur
    return min(t, max(cur, t + 1 - int(keep)))


def batch_frontiers(stash: Any, collection: StashCollection[Any, Any]) -> tuple[int | None, int]:
    """``(upper, compact)`` for ``make_batch``, read in one read transaction: the upper
    ``t`` (``None``: empty) and the since the batch compacts to."""
    cid = collection.id

    def read(tx: Txn) -> tuple[int | None, int]:
        _, upper = tx.frontiers(cid)
        if upper is None:
            return None, 0
        return upper, retained_since(tx, cid, collection.name, upper)

    result: tuple[int | None, int] = stash._read(read, codecs=())
    return result
