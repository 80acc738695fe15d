"""Garbage collection of a shard's blobs and consensus versions.

Blob keys of a shard all start with ``<shard_id>/`` and name their creation time:
``<shard_id>/<kind>/<unix ms>-<random>-<uuid>.parquet`` (one flat directory per kind, so
that an upload creates no directory; keys of the earlier layout
``<shard_id>/<kind>/<unix ms>-<random>/<uuid>.parquet``, still written by Spark jobs,
are understood too; ``kind`` is ``b`` for batches written by writers, ``c`` for
compaction outputs).  :func:`collect_garbage` deletes

* *retired* keys: parts a compaction replaced; the shard's retired collection records when
  each stopped being referenced, and it is deleted once that is older than the grace period (a reader that
  fetched an older state version may still be reading it until then);
* *abandoned* keys: keys no state references and that are not retired, created longer
  ago than the grace period: batches of writers that failed (crashed between upload and
  commit, lost an upper race and could not delete, or never appended a built batch) and
  compaction outputs that were never applied;

and then truncates consensus (physically consolidates the shard's stash collection;
logically, every compare-and-set already truncated the older versions).

Invariants kept here: a key referenced by the latest state is never deleted; a key is
deleted only if it has been unreferenced (or, when unknown, existed) for at least the
grace period; GC's own state change (forgetting deleted retired keys) goes through
compare-and-set like every other transition.  A batch must therefore be appended within
the grace period of its writing, or it counts as abandoned.

Sources: the first engine's blob bookkeeping (``000``/``001``); persist-client's GC.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from persist.consensus import ShardMachine
from persist.errors import BlobError
from persist.state import ShardState

if TYPE_CHECKING:
    from persist.client import PersistClient

__all__ = ["GcReport", "collect_garbage", "key_created_ms"]

log = logging.getLogger(__name__)


def key_created_ms(key: str) -> int | None:
    """The creation time (unix ms) encoded in a part's blob key, or ``None`` if the key
    does not follow persist's layout."""
    segs = key.split("/")
    if len(segs) < 3:
        return None
    head = segs[2].split("-", 1)[0]
    return int(head) if head.isdigit() else None


@dataclass
class GcReport:
    """What a GC pass did.

    Attributes:
        shard_id: the shard.
        deleted_retired: retired keys deleted.
        deleted_abandoned: abandoned keys deleted.
        kept_recent: unreferenced keys kept because they are younger than the grace.
        referenced: keys the latest state references.
        failed: keys whose deletion failed (tried again next time).
        deleted_temporaries: temporary files of interrupted uploads deleted (FileBlob).
    """

    shard_id: str
    deleted_retired: list[str] = field(default_factory=list)
    deleted_abandoned: list[str] = field(default_factory=list)
    kept_recent: int = 0
    referenced: int = 0
    failed: list[str] = field(default_factory=list)
    deleted_temporaries: int = 0


def collect_garbage(
    client: PersistClient, shard: str, *, grace_seconds: float | None = None
) -> GcReport:
    """Delete a shard's unreferenced blobs older than the grace period and truncate its
    consensus versions (see the module docstring).

    Args:
        client: the client (its stash and blob store).
        shard: the shard's name or id.
        grace_seconds: the grace period (default: the client's ``gc_grace_seconds``).

    Raises:
        InvalidUsage: unknown shard.  BlobError, ConsensusError: listing or the final
        state update failed (deletions already done are harmless).
    """
    shard_id = client.shard_id(shard)
    grace = client.gc_grace_seconds if grace_seconds is None else grace_seconds
    m: ShardMachine = client.machine(shard_id)
    listed = client.blob.list_keys(f"{shard_id}/")
    # Read after listing: a key listed, then retired, is seen as retired.
    st = m.fetch()
    retired = client.consensus.retired(shard_id)
    now = m.now_ms()
    grace_ms = int(grace * 1000)
    referenced = st.referenced_blob_keys()
    report = GcReport(shard_id, referenced=len(referenced))

    due_retired = [k for k, ms in retired.items() if ms + grace_ms <= now]
    abandoned: list[str] = []
    for key, _size in listed:
        if key in referenced or key in retired:
            continue
        created = key_created_ms(key)
        if created is not None and created + grace_ms <= now:
            abandoned.append(key)
        else:
            report.kept_recent += 1

    for key, out in ((k, report.deleted_retired) for k in due_retired):
        try:
            client.blob.delete(key)
            out.append(key)
        except BlobError as e:
            log.warning("GC could not delete retired part %s: %s", key, e)
            report.failed.append(key)
    for key in abandoned:
        try:
            client.blob.delete(key)
            report.deleted_abandoned.append(key)
        except BlobError as e:
            log.warning("GC could not delete abandoned part %s: %s", key, e)
            report.failed.append(key)

    if report.deleted_retired:
        done = {k: retired[k] for k in report.deleted_retired}

        def fn(s: ShardState, fresh: bool) -> tuple[None, bool]:
            return None, s.forget_retired(done)

        m.apply(fn)
    sweep = getattr(client.raw_blob, "sweep_temporaries", None)
    if sweep is not None:  # a FileBlob: uploads killed mid-write leave temporary files
        report.deleted_temporaries = sweep(f"{shard_id}/", grace)
    client.consensus.truncate(shard_id)
    return report
