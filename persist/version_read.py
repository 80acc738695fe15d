"""Reading a shard without a lease: the consolidated snapshot of one state version at
one time (:func:`read_version`), what tables, ``snapshot_many`` and ``persist cat`` /
``persist sql`` read with, on writable and readonly stashes alike.

A leased reader (:class:`~persist.read.ReadHandle`) records a seqno hold in the state
so that GC keeps every part of the version it reads; that costs state versions and needs
a writable stash.  A read without a lease writes nothing: it reads the parts of the
version it read, and GC may delete a part of it only after a newer version stopped
referencing it and the grace period passed.  When a part is found missing, the read
starts again on the newer version at the SAME time, which is exact as long as that time
is still at or after the newer version's since; otherwise it fails naming the since.

Invariants kept here: the result is exactly the consolidated snapshot at ``as_of`` of
one state version (:func:`persist.fetch.snapshot_table`), in the newest schema version
of the state it was read from; nothing is written to consensus or blob; a missing part
is reported (``CorruptPart``) only when the latest version still references it.

Source of the idea: Materialize's persist-client ``ReadHandle::snapshot_and_fetch`` and
its "leased reader" vs. "critical reader" split (``src/persist-client/src/read.rs``):
a reader that does not need to hold the since back does not register one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

import pyarrow as pa
import pyarrow.compute as pc
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt

from persist.context import PersistContext
from persist.errors import CorruptPart, DiffOverflow, InvalidUsage, SinceViolation
from persist.fetch import snapshot_table
from persist.filters import check_filter
from persist.machine import ShardMachine
from persist.parts import updates_schema
from persist.state import ShardState
from persist.types import HollowBatch
from persist.updates import SchemaHistory

__all__ = [
    "MISSING_RETRIES",
    "VersionReader",
    "check_readable",
    "on_newest_version",
    "read_at",
    "read_version",
    "version_batches",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: How many times a read starts again on a newer version after meeting a missing part.
MISSING_RETRIES = 3


def check_readable(st: ShardState, as_of: int, name: str) -> None:
    """Raise unless ``since <= as_of < upper`` on ``st`` (the whole time range is
    readable once the upper is empty).

    Raises:
        InvalidUsage: a dropped shard; ``as_of`` at or beyond the upper.
        SinceViolation: ``as_of`` before the since (naming it).
    """
    st.check_not_finalized()
    if not st.since.less_equal(as_of):
        raise SinceViolation(as_of, st.since)
    if st.upper.less_equal(as_of):
        raise InvalidUsage(
            f"{name!r}: as_of {as_of} is not before its upper {st.upper}: no data is "
            "definite there yet"
        )


def version_batches(st: ShardState, as_of: int) -> list[HollowBatch]:
    """The batches of the version ``st`` that hold updates a read at ``as_of`` sees
    (non-empty, lower at or before ``as_of``), listed without a lease."""
    return [b for b in st.batches() if b.len > 0 and b.desc.lower.less_equal(as_of)]


def on_newest_version(
    machine: ShardMachine,
    st: ShardState,
    read: Callable[[ShardState], T],
    missing: Callable[[BaseException], bool] = lambda e: isinstance(e, CorruptPart) and e.missing,
) -> T:
    """``read(st)``; when it fails because a part of ``st`` is gone (``missing(e)``: GC
    deleted it after a newer version stopped referencing it), ``read`` again on the
    newest version, at most :data:`MISSING_RETRIES` times (tenacity), then the error.

    Raises: whatever ``read`` raises (``CorruptPart`` once the newest version still
        references the missing part); ConsensusError reading the newer version.
    """
    state = [st]

    def newer(rs: RetryCallState) -> None:
        e = rs.outcome.exception() if rs.outcome is not None else None
        log.info("read of shard %s met a missing part, re-reading: %s", state[0].name, e)
        state[0] = machine.refresh()

    retrying = Retrying(
        stop=stop_after_attempt(MISSING_RETRIES + 1),
        retry=retry_if_exception(missing),
        before_sleep=newer,
        reraise=True,
    )
    return retrying(lambda: read(state[0]))


def read_version(
    ctx: PersistContext,
    machine: ShardMachine,
    st: ShardState,
    as_of: int,
    *,
    columns: Sequence[str] | None = None,
    filter: pc.Expression | None = None,
) -> pa.Table:
    """The consolidated snapshot of the version ``st`` at ``as_of`` (what
    :meth:`ReadHandle.snapshot <persist.read.ReadHandle.snapshot>` returns: key and
    value columns, ``_time`` = ``as_of``, ``_diff``; with ``columns``, only those), read
    without a lease (see the module docstring): :func:`read_at` on
    :func:`on_newest_version`.

    Raises:
        SinceViolation: ``as_of`` is before the since (of ``st``, or of the newer version
            read after GC removed a part).
        InvalidUsage: ``as_of`` at or beyond the upper; a bad filter; a dropped shard.
        CorruptPart: a part the latest version references is missing or corrupt.
        DiffOverflow: a row's diffs sum beyond int64 (naming the shard).
        BlobError, ConsensusError: storage failed.
    """
    return on_newest_version(
        machine, st, lambda s: read_at(ctx, s, as_of, columns=columns, filter=filter)
    )


def read_at(
    ctx: PersistContext,
    st: ShardState,
    as_of: int,
    *,
    columns: Sequence[str] | None = None,
    filter: pc.Expression | None = None,
) -> pa.Table:
    """:func:`read_version` of ``st`` alone: a missing part is not read again elsewhere.

    Raises: as :func:`read_version` (``CorruptPart`` for a missing part of ``st``).
    """
    check_readable(st, as_of, st.name)
    schema = updates_schema(st.key_schema, st.value_schema)
    keys, values = st.key_schema.names, st.value_schema.names
    check_filter(filter, schema, keys, values)
    try:
        return snapshot_table(
            ctx.blob,
            version_batches(st, as_of),
            schema,
            keys,
            values,
            as_of,
            max_workers=ctx.config.read_workers,
            schemas=(st.schemas(), st.schemas().newest),
            filter=filter,
            columns=columns,
        )
    except DiffOverflow as e:
        raise e.in_shard(f"{st.name!r} ({st.shard_id})") from e


class VersionReader:
    """A reader of one state version without a lease: the calls of
    :class:`~persist.read.ReadHandle` that planning a read of parts makes
    (:meth:`read_schemas`, :meth:`snapshot_batches`, :meth:`detach`, :meth:`expire`,
    :meth:`downgrade_since`), writing nothing, as a client over a readonly stash must.
    It holds back neither the since nor GC: a part GC deletes after a newer version
    stopped referencing it is missing for a reader of this version (callers that read
    parts themselves, such as Spark's, fail naming it; run the read again).

    Attributes:
        schema: the updates schema (key, newest value schema, ``_time``, ``_diff``).
    """

    def __init__(self, st: ShardState) -> None:
        st.check_not_finalized()
        self._st = st
        self.schema = updates_schema(st.key_schema, st.value_schema)

    def read_schemas(self) -> tuple[SchemaHistory, int]:
        """``(schema history, newest schema id)`` of the version."""
        return self._st.schemas(), self._st.schemas().newest

    def snapshot_batches(self, as_of: int) -> list[HollowBatch]:
        """The version's batches a read at ``as_of`` sees (:func:`version_batches`).

        Raises: as :func:`check_readable`.
        """
        check_readable(self._st, as_of, self._st.name)
        return version_batches(self._st, as_of)

    def downgrade_since(self, since: int) -> None:
        """Nothing: a reader without a lease holds no since."""

    def detach(self, hold_since: bool = False) -> None:
        """Nothing: there is no lease to leave running."""

    def expire(self) -> None:
        """Nothing: there is no lease to end."""

    def __enter__(self) -> VersionReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.expire()
