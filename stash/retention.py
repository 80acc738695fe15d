"""Retention: how far back a collection's history stays readable, so its since follows
a setting instead of moving with every append.

The setting of collection ``NAME`` is the value of key ``NAME`` in the collection
``stash.retention``, a JSON object: ``"keep_times": N`` keeps the last ``N`` times
readable (``null``: every time since the setting); ``"keep_for_ms": D`` keeps every time
committed within the last ``D`` milliseconds of wall clock (the since becomes the newest
time committed at or before ``now - D``).  With both, the since keeps what either asks
for (the older of the two).  Invariants kept here:

* every writer that picks a batch's since asks this module in the transaction (or read)
  that picks its upper: ``make_batch`` (:func:`batch_frontiers`), the one-transaction
  typed writes (:mod:`stash.keyed`) and ``with_transaction`` (:func:`commit_since`);
  without a setting the since moves to the batch's time, as it always did;
* the since never goes back and never passes the batch's time;
* under a retention by duration, each time those writers commit records its wall clock
  (``Stash.clock``) in the same transaction (table ``commit_times``), never earlier than
  a time recorded before it (:func:`record_commit_time`: a commit under a clock that
  stepped back is not recorded); a time without a record (committed before the
  setting, by a batch built by hand, or under a clock stepped back) only holds the
  since back: the since moves past it once a later recorded time is old enough;
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
from stash.errors import StashError
from stash.txn import Txn

__all__ = [
    "RETENTION_COLLECTION",
    "batch_frontiers",
    "commit_since",
    "now_ms",
    "record_commit_time",
]

RETENTION_COLLECTION = "stash.retention"


#: The largest ``keep_for_ms`` a setting may hold (about 146 million years): ``now -
#: keep_for_ms`` is a 64-bit parameter of the ``commit_times`` query.
_MAX_KEEP_MS = 2**62


def _count_ok(value: Any, top: int | None = None) -> bool:
    """Whether ``value`` of a retention setting is ``None`` or a positive int (not a
    bool) of at most ``top``."""
    return value is None or (type(value) is int and value >= 1 and (top is None or value <= top))


def _policy(tx: Txn, name: str) -> dict[str, Any] | None:
    """The retention recorded for collection ``name``, read in ``tx`` (``None``: none).
    Read with ``rows`` (no lock: a write of one collection never waits for writers of
    others on the retention collection).

    Raises:
        StashError: the setting is not what ``Stash.set_retention`` writes (anyone may
            write the collection): not an object, or a count that is not a positive
            int or null (``keep_for_ms`` at most ``2**62``).
    """
    found = tx.lookup_collection(RETENTION_COLLECTION)
    if found is None:
        return None
    sums: dict[str, int] = {}
    for _, v, _, d in tx.rows(found[0], canonical_json(name)):
        sums[v] = sums.get(v, 0) + d
    live = [v for v, d in sums.items() if d == 1]
    if len(live) != 1:
        return None
    policy = json.loads(live[0])
    if not isinstance(policy, dict) or not (
        _count_ok(policy.get("keep_times")) and _count_ok(policy.get("keep_for_ms"), _MAX_KEEP_MS)
    ):
        raise StashError(
            f"the retention setting of collection {name} (its key in collection "
            f"{RETENTION_COLLECTION}) is {live[0]}, not an object whose keep_times is a "
            f"positive int or null and keep_for_ms a positive int up to {_MAX_KEEP_MS} "
            "(a bound of the commit_times query) or null: set it with Stash.set_retention"
        )
    return policy


def now_ms(stash: Any) -> int:
    """The stash's wall clock (``Stash.clock``, seconds since the epoch) in Unix ms."""
    return int(stash.clock() * 1000)


def _since(tx: Txn, cid: int, t: int, policy: dict[str, Any], now: int) -> int:
    """The since ``policy`` keeps for a write at time ``t``, at wall clock ``now``."""
    since, _ = tx.frontiers(cid)
    cur = 0 if since is None else since
    wanted = []
    if "keep_times" in policy:
        keep = policy["keep_times"]
        wanted.append(cur if keep is None else t + 1 - int(keep))
    keep_ms = policy.get("keep_for_ms")
    if keep_ms is not None:
        newest = tx.newest_time_committed_by(cid, now - int(keep_ms))
        wanted.append(cur if newest is None else newest)
    if not wanted:  # an unknown policy (a newer release's): keep everything
        return cur
    return min(t, max(cur, min(wanted)))


def commit_since(tx: Txn, cid: int, name: str, t: int, now: int) -> int:
    """The since a write committing time ``t`` (the new upper ``t + 1``) in ``tx`` at
    wall clock ``now`` (Unix ms) leaves collection ``cid`` at: ``t`` without a retention
    (every append compacts, as before), else the since the retention keeps (never below
    the current since, never beyond ``t``).  Under a retention by duration it records
    ``now`` as the commit time of ``t`` (and forgets the records before the new since)."""
    policy = _policy(tx, name)
    if policy is None:
        return t
    since = _since(tx, cid, t, policy, now)
    if policy.get("keep_for_ms") is not None:
        record_commit_time(tx, cid, t, now, since)
    return since


#: Later than any wall clock (Unix ms): "recorded at any time".
_ANY_MS = 2**62


def record_commit_time(tx: Txn, cid: int, t: int, now: int, since: int) -> None:
    """Record in ``tx`` that time ``t`` of collection ``cid`` commits at wall clock
    ``now`` (Unix ms), and forget the records before ``since`` -- unless a time already
    recorded committed later than ``now`` (the clock stepped back): then ``t`` is not
    recorded, which only holds the since back (it moves past ``t`` once a later recorded
    time is old enough).  So recorded commit times never decrease with the time, and a
    time committed after a step back never becomes "old enough" before the times
    committed just before it (the since would jump past those)."""
    newest = tx.newest_time_committed_by(cid, _ANY_MS)
    if newest is not None and tx.newest_time_committed_by(cid, now) != newest:
        return
    tx.record_commit_time(cid, t, now, since)


def batch_frontiers(
    stash: Any, collection: StashCollection[Any, Any]
) -> tuple[int | None, int, bool]:
    """``(upper, compact, stamp)`` for ``make_batch``, read in one read transaction: the
    upper ``t`` (``None``: empty), the since the batch compacts to, and whether its
    append records its commit time (a retention by duration)."""
    cid = collection.id
    now = now_ms(stash)

    def read(tx: Txn) -> tuple[int | None, int, bool]:
        _, upper = tx.frontiers(cid)
        if upper is None:
            return None, 0, False
        policy = _policy(tx, collection.name)
        if policy is None:
            return upper, upper, False
        stamp = policy.get("keep_for_ms") is not None
        return upper, _since(tx, cid, upper, policy, now), stamp

    result: tuple[int | None, int, bool] = stash._read(read, codecs=())
    return result
