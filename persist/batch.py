"""Batches: updates written (to blob parts or inline) but not yet appended to a shard.

A :class:`Batch` wraps a :class:`~persist.types.HollowBatch` (description, parts, runs)
together with the shard it was written for (Materialize's ``Batch`` in
``src/persist-client/src/batch.rs``). It is made by :meth:`persist.write.BatchBuilder.finish` or
decoded from the bytes of
:meth:`Batch.into_transmittable`, and is consumed by
:meth:`persist.write.WriteHandle.compare_and_append_batch`.

Invariants kept here:

* a fresh batch's parts hold times in ``[lower, upper)``; :attr:`Batch.time_range`, when
  known (batches built here), is the ``(min, max)`` of those raw times;
* :meth:`Batch.rewrite_ts` is metadata-only (no blob call) and keeps the batch's
  ``lower``, as Materialize's ``rewrite_ts`` does: it records the rewrite frontier ``f``
  (every time ``t`` of the batch *means* ``max(t, f)``) and replaces the upper; the
  frontier and the upper never regress across calls, and the frontier stays strictly
  before the upper (:class:`~persist.errors.InvalidRewrite`); the rewrite is applied
  when the batch is appended (:meth:`persist.write.WriteHandle.compare_and_append_batch`,
  which follows Materialize's ``validate_truncate_batch``);
* while a batch is held unconsumed by a process that made or decoded it, the leases
  of the writers owning its parts are renewed in the background
  (:meth:`persist.write.WriteHandle.hold`), so it stays appendable however long it is
  held; the renewal stops once it is consumed or garbage-collected;
* a batch is *consumed* once appended (or turned into transmittable bytes): ``delete``
  of a consumed batch deletes nothing (its parts belong to the shard or to the holder of
  the bytes);
* ``delete`` removes exactly the batch's blob parts (inline parts need nothing);
* a batch is appended once: its parts' identities (:meth:`Batch.part_ids`: blob keys,
  and the random nonce each inline part draws when written, both carried in its
  transmittable bytes) name it, and an append (or a transaction) whose batches share one
  with each other, with the version it commits on, or with the parts that version
  retired, is refused (:class:`~persist.errors.BatchAppended`).  The window: a copy of
  an inline batch appended after GC forgot its retired ids (longer than the grace
  period after a compaction merged its parts away) is not recognised (a blob part's
  copy is refused by its retired key, then by its deleted blob); see
  :mod:`persist.appended`;
* transmittable bytes carry a SHA-256 digest of their content: bytes damaged in transit
  are refused with :class:`~persist.errors.InvalidUsage`, never appended.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from typing import Any

from persist.blob import Blob
from persist.errors import BlobError, InvalidRewrite, InvalidUsage
from persist.types import Description, HollowBatch
from stash import Antichain

__all__ = ["TRANSMIT_FORMAT", "Batch"]

log = logging.getLogger(__name__)

#: Format tag of transmittable batches.
TRANSMIT_FORMAT = "persist-batch-v1"


def _digest(body: dict[str, Any]) -> str:
    """SHA-256 hex of a transmittable batch's JSON body (keys sorted): a batch damaged in
    transit (a flipped part key, bound or checksum) is refused instead of appended."""
    text = json.dumps(body, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class Batch:
    """A batch of updates written for one shard, not yet appended.

    Attributes:
        shard_id: the shard it was written for.
        hollow: its :class:`HollowBatch` (description, parts, runs, len).
        time_range: ``(min, max)`` of the raw times in its parts, or ``None`` when not
            known (e.g. bytes from an older writer).
    """

    def __init__(
        self,
        blob: Blob,
        shard_id: str,
        hollow: HollowBatch,
        *,
        rewrite_frontier: Antichain | None = None,
        time_range: tuple[int, int] | None = None,
    ) -> None:
        self._blob = blob
        self.shard_id = shard_id
        self.hollow = hollow
        self._rewrite_frontier = rewrite_frontier
        self.time_range = time_range
        self._consumed = False
        #: Called once when the batch is consumed: stops the renewal of its owners'
        #: leases (see :meth:`persist.write.WriteHandle.hold`).
        self._on_consumed: Callable[[], None] | None = None
        #: Called once when the batch is transmitted (:meth:`into_transmittable`): its
        #: writer's handle counts the batches it handed off (see
        #: :meth:`persist.write.WriteHandle.expire`).
        self._on_transmit: Callable[[], None] | None = None
        #: Called once before :meth:`delete` deletes the parts of a batch decoded from
        #: transmitted bytes: the receiving handle counts it down from its writers'
        #: hand-off (see :meth:`persist.write.WriteHandle.batch_from_transmittable`).
        self._on_delete: Callable[[], None] | None = None
        #: The idempotency token of an append of this batch whose outcome is unknown
        #: (set by ``compare_and_append_batch``; a retry with this batch reuses it).
        self.pending_token: str | None = None

    def __repr__(self) -> str:
        d = self.hollow.desc
        return (
            f"Batch(shard={self.shard_id}, lower={d.lower}, upper={d.upper}, "
            f"rows={self.hollow.len}, parts={len(self.hollow.parts)})"
        )

    @property
    def lower(self) -> Antichain:
        """The batch's lower frontier."""
        return self.hollow.desc.lower

    @property
    def upper(self) -> Antichain:
        """The batch's upper frontier."""
        return self.hollow.desc.upper

    @property
    def len(self) -> int:
        """Number of updates (rows) in the batch (after consolidation)."""
        return self.hollow.len

    @property
    def rewrite_frontier(self) -> Antichain | None:
        """The frontier of the last :meth:`rewrite_ts` (``None`` if never rewritten)."""
        return self._rewrite_frontier

    @property
    def rewritten(self) -> bool:
        """Whether :meth:`rewrite_ts` was called on this batch."""
        return self._rewrite_frontier is not None

    def floor(self) -> Antichain:
        """The least time its updates mean: the rewrite frontier if rewritten (Materialize's
        ``ts_rewrite``), else the lower."""
        f = self._rewrite_frontier
        return self.lower if f is None else f

    def effective_time_range(self) -> tuple[int, int] | None:
        """``time_range`` with the rewrite applied (``t -> max(t, frontier)``)."""
        if self.time_range is None:
            return None
        lo, hi = self.time_range
        f = None if self._rewrite_frontier is None else self._rewrite_frontier.as_option()
        if f is not None:
            lo, hi = max(lo, f), max(hi, f)
        return lo, hi

    @property
    def consumed(self) -> bool:
        """Whether the batch was appended, deleted or transmitted."""
        return self._consumed

    def blob_keys(self) -> list[str]:
        """The blob keys of its non-inline parts."""
        return [p.key for p in self.hollow.parts if p.key is not None]

    def part_ids(self) -> list[str]:
        """The identities of its parts (:attr:`persist.types.PartRef.part_id`): blob
        keys, and ``inline:`` nonces of inline parts (older inline parts have none).
        Every decoding of one batch's transmittable bytes names the same ids."""
        return [i for p in self.hollow.parts if (i := p.part_id) is not None]

    def _check_live(self, what: str) -> None:
        if self._consumed:
            raise InvalidUsage(
                f"cannot {what} a batch of shard {self.shard_id} that was already "
                "appended, deleted or transmitted"
            )

    def rewrite_ts(self, frontier: Antichain, new_upper: Antichain) -> None:
        """Advance every timestamp of this not-yet-appended batch by ``frontier`` (each
        time ``t`` comes to mean ``max(t, frontier)``) and replace its upper by
        ``new_upper``; metadata only (Materialize's ``Batch::rewrite_ts``).  The batch's
        lower is kept; the frontier is recorded (:attr:`rewrite_frontier`).  May be
        called again with a frontier and upper that do not regress.  A rewritten batch
        can only be appended with ``new_upper`` equal to its upper and an expected upper
        ``<=`` its rewrite frontier (see
        :meth:`persist.write.WriteHandle.compare_and_append_batch`).

        Raises:
            InvalidRewrite: ``frontier`` is empty, earlier than a previous rewrite
                frontier, or not strictly before ``new_upper``; ``new_upper`` is earlier
                than the batch's upper.
            InvalidUsage: the batch was already consumed.
        """
        self._check_live("rewrite")
        if not isinstance(frontier, Antichain) or not isinstance(new_upper, Antichain):
            raise InvalidRewrite("rewrite_ts takes two Antichains (frontier, new_upper)")
        if frontier.is_empty():
            raise InvalidRewrite("rewrite frontier must not be the empty antichain")
        if self._rewrite_frontier is not None and not self._rewrite_frontier <= frontier:
            raise InvalidRewrite(
                f"rewrite frontier {frontier} regresses from the previous {self._rewrite_frontier}"
            )
        d = self.hollow.desc
        if not d.upper <= new_upper:
            raise InvalidRewrite(f"new upper {new_upper} regresses from the batch upper {d.upper}")
        if new_upper <= frontier:
            raise InvalidRewrite(
                f"rewrite frontier {frontier} is not strictly before the new upper {new_upper}"
            )
        self._rewrite_frontier = frontier
        self.hollow = HollowBatch(
            desc=Description(d.lower, new_upper, d.since),
            parts=self.hollow.parts,
            len=self.hollow.len,
            runs=self.hollow.runs,
        )

    def mark_consumed(self) -> None:
        """Record that the parts now belong elsewhere (appended or transmitted)."""
        self._consumed = True
        release, self._on_consumed = self._on_consumed, None
        if release is not None:
            release()

    def delete(self) -> None:
        """Delete the batch's blob parts (best effort: a failed delete leaves garbage for
        GC) and mark it consumed.  A consumed batch deletes nothing.  Only for a batch
        that was never appended: a copy of an appended batch (its transmittable bytes
        decoded again) names the same parts, which the shard then references; when in
        doubt, leave the parts to GC, which deletes only unreferenced ones."""
        if self._consumed:
            return
        self.mark_consumed()
        settle, self._on_delete = self._on_delete, None
        if settle is not None:
            settle()
        for key in self.blob_keys():
            try:
                self._blob.delete(key)
            except BlobError as e:
                log.warning("could not delete part %s of an abandoned batch: %s", key, e)

    def to_json(self) -> dict[str, Any]:
        """The JSON form carried by :meth:`into_transmittable`."""
        return {
            "format": TRANSMIT_FORMAT,
            "shard_id": self.shard_id,
            "batch": self.hollow.to_json(),
            "rewrite_frontier": (
                None if self._rewrite_frontier is None else self._rewrite_frontier.to_json()
            ),
            "time_range": None if self.time_range is None else list(self.time_range),
        }

    def into_transmittable(self) -> bytes:
        """The batch as bytes (UTF-8 JSON) to hand to another process, which turns it back
        with :meth:`persist.write.WriteHandle.batch_from_transmittable`.  This batch is
        consumed: the receiver becomes responsible for appending or deleting it.

        Raises:
            InvalidUsage: the batch was already consumed.
        """
        self._check_live("transmit")
        body = self.to_json()
        body["digest"] = _digest(body)
        data = json.dumps(body, separators=(",", ":")).encode("utf-8")
        self.mark_consumed()
        transmitted, self._on_transmit = self._on_transmit, None
        if transmitted is not None:
            transmitted()
        return data

    @classmethod
    def from_transmittable(cls, blob: Blob, data: bytes) -> Batch:
        """Inverse of :meth:`into_transmittable` (see
        :meth:`persist.write.WriteHandle.batch_from_transmittable`).

        Raises:
            InvalidUsage: ``data`` is not a transmittable batch.
        """
        try:
            d = json.loads(bytes(data).decode("utf-8"))
            if not isinstance(d, dict) or d.get("format") != TRANSMIT_FORMAT:
                raise ValueError(f"format tag is not {TRANSMIT_FORMAT!r}")
            digest = d.pop("digest", None)
            if digest != _digest(d):
                raise ValueError("its SHA-256 digest does not match (corrupted in transit)")
            hollow = HollowBatch.from_json(d["batch"])
            rf = d.get("rewrite_frontier")
            tr = d.get("time_range")
            time_range = None
            if tr is not None:
                lo, hi = (int(x) for x in tr)
                time_range = (lo, hi)
            # Bytes of older writers may say "rewritten" with the lower already raised to
            # the frontier: the recorded frontier gives the same meaning.
            return cls(
                blob,
                str(d["shard_id"]),
                hollow,
                rewrite_frontier=None if rf is None else Antichain.from_json(rf),
                time_range=time_range,
            )
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise InvalidUsage(f"not a transmittable persist batch: {e}") from e
