"""Exactly-once streaming writes of the ``persist`` Spark source (``df.writeStream``).

Usage::

    (df.writeStream.format("persist")
        .option("stash", stash_url).option("blob", blob_uri)
        .option("key_columns", "id")
        .option("checkpointLocation", "/data/checkpoints/orders")
        .start("orders"))

Each micro-batch's tasks write their rows as batches on the executors (the parts go to
the blob store from there, as the batch writer's do) and hand the driver only their
transmittable bytes.  The driver-side ``commit(messages, batchId)`` then commits every
task's batch, at one new time, together with the micro-batch's identity, in ONE persist
transaction (:class:`persist.Txn`: one stash append, all or nothing):

* the identity is recorded in the stash collection :data:`COMMITS_COLLECTION`, keyed by
  the shard id and the stream's checkpoint location, with the ``batchId`` and the
  query id Spark keeps in ``checkpointLocation/metadata``.  This is Delta Lake's
  ``txn`` action (``appId`` -> ``version``, written in the same commit as the data;
  see delta-io's ``PROTOCOL.md``, "Transaction Identifiers");
* before committing, the driver reads that record from the stash's committed state
  and appends its own under the stash's lower check.  A micro-batch whose ``batchId``
  is already recorded for the same query (Spark replays the last micro-batch when its
  entry in ``checkpointLocation/commits/`` is missing, e.g. after the driver died
  between the persist commit and Spark's) adds nothing: its new parts are deleted.  A
  race with another writer of the record (a zombie run of the same query) fails the
  lower check; the driver reads the record again and decides again, so the decision is
  always taken on the committed state, never on a cache;
* ``abort(messages, batchId)`` deletes the parts the tasks wrote (unless the shard
  references them).

A checkpoint location that is deleted and made again starts a new query (a new id in
its ``metadata``): its ``batchId`` s start again at 0 and are not taken for replays.
When the ``metadata`` file cannot be read through pyarrow's filesystems (e.g. an
``s3a://`` location), the location alone identifies the stream.

``option("mode", "upsert")`` applies each micro-batch as an upsert
(:func:`persist.rows.plan_upsert`): every live row with a key of the micro-batch is
retracted, the micro-batch's rows are inserted, all at one new time ``t`` equal to the
shard's upper, planned on the live rows as of ``t - 1`` of the same state version, and
re-planned when the commit loses the race for the upper.  The retractions are computed
in the commit, on the driver side, from the micro-batch's rows (read back from the
parts the executors wrote, which are then committed as they are: nothing is uploaded
twice) and a key-range read of the shard.  Why not Spark executors (as
:mod:`spark.row_changes` does): the commit runs in a Python worker the JVM starts,
without a SparkSession to run a job from, and it must put the retractions in the same
transaction as the micro-batch's record to stay exactly-once.  Two rows with one key in
a micro-batch fail the query (nothing of the micro-batch is committed).

Options: ``stash``, ``blob``, the shard (``start(shard)`` or ``shard``/``path``),
``checkpointLocation`` (required: it names the stream), ``key_columns``,
``value_columns``, ``diff_column`` (append mode only), ``compaction``, ``mergeSchema``
and ``mode`` (``append``, the default, or ``upsert``).  A micro-batch is written at one
new time, so ``time``, ``time_column`` and ``upper`` are refused.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from spark.options import check_names
from spark.persist_common import (
    COMMIT_ATTEMPTS,
    DIFF,
    PersistSourceError,
    _opt,
    persist_client,
)
from spark.persist_writer import (
    PersistCommitMessage,
    WriteSettings,
    delete_unreferenced,
    updates_table,
)

__all__ = [
    "COMMITS_COLLECTION",
    "STREAM_WRITE_OPTIONS",
    "PersistStreamWriter",
    "StreamWriteSettings",
    "committed_batch",
]

log = logging.getLogger(__name__)

COMMITS_COLLECTION = "spark.persist_stream_commits"
"""The stash collection recording, per (shard id, checkpoint location), the last
micro-batch committed: key ``"<shard id> <location>"``, value ``{"batch_id": int,
"query_id": str | None}``."""

STREAM_WRITE_OPTIONS = (
    "stash",
    "blob",
    "path",
    "shard",
    "key_columns",
    "value_columns",
    "diff_column",
    "compaction",
    "mergeSchema",
    "checkpointLocation",
    "mode",
)
"""Every option a streaming write to the persist source understands."""

STREAM_MODES = ("append", "upsert")


def _location(raw: str) -> str:
    """A checkpoint location in one spelling: a local path (or ``file:`` location) made
    absolute and written as a ``file://`` URI, every character that is not plain in a
    URI percent-escaped (:meth:`pathlib.PurePath.as_uri`); no trailing slash.  A local
    location is taken literally, as Hadoop's ``Path`` takes it (``%41`` names the three
    characters, not ``A``), so the URI names the directory Spark writes to.  Other
    schemes are kept as given."""
    loc = raw.strip()
    if loc.startswith("file://"):
        loc = loc[len("file://") :]
        if not loc.startswith("/"):  # file://host/...: not a local path
            return raw.strip().rstrip("/")
    elif loc.startswith("file:"):
        loc = loc[len("file:") :]
    elif "://" in loc:
        return loc.rstrip("/")
    return Path(os.path.abspath(loc)).as_uri()


def _local_path(location: str) -> str | None:
    """The local path a ``file://`` location of :func:`_location` names, else ``None``."""
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(location)
    if parts.scheme != "file":
        return None
    return unquote(parts.path)


def _query_id(location: str) -> str | None:
    """The query id Spark keeps in ``<location>/metadata`` (``{"id": "<uuid>"}``), or
    ``None`` when the file cannot be read through pyarrow's filesystems."""
    from pyarrow import fs

    try:
        local = _local_path(location)
        if local is not None:
            filesystem: Any = fs.LocalFileSystem()
            path = local
        else:
            filesystem, path = fs.FileSystem.from_uri(location)
        with filesystem.open_input_stream(path.rstrip("/") + "/metadata") as f:
            first = f.read().decode("utf-8").splitlines()[0]
        qid = json.loads(first).get("id")
        return str(qid) if qid else None
    except (OSError, ValueError, IndexError, pa.ArrowException) as e:
        log.info("no query id from %s/metadata (%s): the location names the stream", location, e)
        return None


@dataclass(frozen=True)
class StreamWriteSettings:
    """Parsed options of a streaming write (picklable).

    Attributes:
        write: the batch writer's settings (columns and schemas; ``time_mode`` ``"auto"``).
        location: the checkpoint location (:func:`_location` spelling).
        mode: ``"append"`` or ``"upsert"``.
    """

    write: WriteSettings
    location: str
    mode: str

    @classmethod
    def from_options(
        cls,
        options: Any,
        schema: StructType,
        registered: tuple[pa.Schema, pa.Schema] | None,
    ) -> StreamWriteSettings:
        """Check and parse the options (:data:`STREAM_WRITE_OPTIONS`).

        Raises:
            PersistSourceError: an unknown option, no ``checkpointLocation``, a ``mode``
                other than append or upsert, a diff column in upsert mode, or what
                :meth:`WriteSettings.from_options` raises.
        """
        given = {str(k).lower() for k in options}
        for name in ("time", "time_column", "upper"):
            if name in given:
                raise PersistSourceError(
                    f"option {name!r} is not available for a streaming write to the persist "
                    "source: each micro-batch is written at one new time (the shard's upper)"
                )
        check_names(
            options,
            STREAM_WRITE_OPTIONS,
            "a streaming write to the persist source",
            PersistSourceError,
        )
        raw = _opt(options, "checkpointLocation")
        if raw is None:
            raise PersistSourceError(
                "a streaming write to the persist source needs option checkpointLocation "
                "(given to writeStream, not only as spark.sql.streaming.checkpointLocation): "
                "it names the stream whose micro-batches are committed exactly once"
            )
        mode = (_opt(options, "mode") or "append").lower()
        if mode not in STREAM_MODES:
            raise PersistSourceError(
                f"option mode must be one of {', '.join(STREAM_MODES)}, got {mode!r}"
            )
        write = WriteSettings.from_options(options, schema, registered)
        if mode == "upsert" and write.diff_column is not None:
            raise PersistSourceError(
                f"mode upsert takes rows of key and value columns; the diff column "
                f"{write.diff_column!r} cannot be written with it (each row replaces "
                "the live rows of its key)"
            )
        return cls(write=write, location=_location(raw), mode=mode)


def _peek_record(stash: Any, coll: Any, key: str) -> dict[str, Any] | None:
    """The committed record of ``key`` (``None``: none, or a new empty collection)."""
    from stash import PeekSinceUpperError

    try:
        value = stash.peek_key_one(coll, key)
    except PeekSinceUpperError as e:
        # Decided on the upper the peek read: a second read of the upper may see
        # another driver's record appended since, which the caller's batch (made
        # before this read) then fails to follow, so its attempt is retried.
        if e.never_written():
            return None
        raise
    return None if value is None else dict(value)


def committed_batch(
    stash_url: str, blob_uri: str, shard: str, checkpoint_location: str
) -> int | None:
    """The last ``batchId`` the stream at ``checkpoint_location`` committed to ``shard``,
    read from the stash's committed state, or ``None`` (none yet)."""
    from spark.persist_common import ShardTarget

    with persist_client(ShardTarget(stash_url, blob_uri, shard), readonly=True) as client:
        stash = client.stash
        if COMMITS_COLLECTION not in stash.collections():
            return None
        coll = stash.collection(COMMITS_COLLECTION, key="str", value="json")
        rec = _peek_record(
            stash, coll, f"{client.shard_id(shard)} {_location(checkpoint_location)}"
        )
    return None if rec is None else int(rec["batch_id"])


HOLD_AFTER_COMMIT_ENV = "PERSIST_STREAM_HOLD_AFTER_COMMIT"
"""Fault injection for tests: when this environment variable names a file, the commit
of micro-batch 0 writes that file after its persist transaction committed and then
waits (for the test to SIGKILL the driver before Spark records the micro-batch in
``checkpointLocation/commits/``)."""


def _after_commit_hook(batch_id: int) -> None:
    marker = os.environ.get(HOLD_AFTER_COMMIT_ENV)
    if marker and batch_id == 0:
        import time

        Path(marker).write_text("committed")
        time.sleep(600)


class PersistStreamWriter(DataSourceStreamArrowWriter):
    """Executors write batches; the driver commits each micro-batch once (see the
    module docstring).  Spark makes a new instance for each commit or abort (in a
    Python worker the JVM starts), so the instance holds nothing but settings."""

    def __init__(self, settings: StreamWriteSettings) -> None:
        self.settings = settings
        s = settings.write
        # On the driver: create or check the shard (registers a mergeSchema evolution).
        with (
            persist_client(s.target) as client,
            client.open_writer(s.target.shard, s.key_schema, s.value_schema),
        ):
            pass

    # ------------------------------------------------------------ executor
    def write(self, iterator: Iterator[pa.RecordBatch]) -> PersistCommitMessage:
        """Write this task's rows as one batch at the transaction's raw time
        (:data:`persist.txn.RAW_TIME`; the commit gives it its time) and return its
        transmittable bytes."""
        from pyspark import TaskContext

        from persist.txn import RAW_TIME
        from stash import Antichain

        s = self.settings.write
        ctx = TaskContext.get()
        rows = 0
        with (
            persist_client(s.target) as client,
            client.open_writer(s.target.shard, s.key_schema, s.value_schema) as write,
        ):
            builder = write.builder(Antichain.from_elem(RAW_TIME))
            try:
                for rb in iterator:
                    if rb.num_rows:
                        rows += rb.num_rows
                        builder.add(updates_table(s, rb, RAW_TIME))
                batch = builder.finish(Antichain.from_elem(RAW_TIME + 1))
            except BaseException:
                builder.abort()  # delete the parts this task already uploaded
                raise
            payload = batch.into_transmittable()
        return PersistCommitMessage(
            batch=payload,
            lower=RAW_TIME,
            upper=RAW_TIME + 1,
            rows=rows,
            min_time=None,
            max_time=None,
            partition_id=ctx.partitionId() if ctx is not None else -1,
        )

    # -------------------------------------------------------------- driver
    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Commit micro-batch ``batchId``: every task's batch and the micro-batch's
        record in one transaction, unless the record shows it committed already (then
        its new parts are deleted).  A lost race re-reads the record (and, in upsert
        mode, re-plans the retractions) and tries again, :data:`COMMIT_ATTEMPTS`
        times at most.

        Raises:
            PersistSourceError: every attempt lost a race (naming the shard), or the
                micro-batch breaks a rule of its mode (two rows with one key in upsert
                mode); nothing of the micro-batch is committed.
            persist.PersistError: storage failed (an indeterminate outcome keeps the
                parts for GC; a restart decides on the committed record).
        """
        from tenacity import (
            RetryError,
            Retrying,
            retry_if_exception_type,
            stop_after_attempt,
            wait_random_exponential,
        )

        from persist.errors import InvalidUsage
        from persist.txn import TxnUpperMismatch

        st = self.settings
        s = st.write
        msgs = [m for m in messages if isinstance(m, PersistCommitMessage)]
        query_id = _query_id(st.location)
        with (
            persist_client(s.target, compaction=s.compaction) as client,
            client.open_writer(s.target.shard, s.key_schema, s.value_schema) as write,
        ):
            batches = []
            for m in msgs:
                b = write.batch_from_transmittable(m.batch)
                if b.len == 0:
                    b.delete()
                else:
                    batches.append(b)
            try:
                incoming = self._incoming(client, batches) if st.mode == "upsert" else None
                for attempt in Retrying(
                    stop=stop_after_attempt(COMMIT_ATTEMPTS),
                    wait=wait_random_exponential(multiplier=0.02, max=1.0),
                    retry=retry_if_exception_type(TxnUpperMismatch),
                    reraise=False,
                ):
                    with attempt:
                        self._attempt(client, write, batches, incoming, batchId, query_id)
            except RetryError as e:
                for b in batches:
                    b.delete()
                raise PersistSourceError(
                    f"micro-batch {batchId} of the stream at {st.location} lost the race "
                    f"for shard {s.target.shard} {COMMIT_ATTEMPTS} times "
                    f"({e.last_attempt.exception()}); nothing of it was committed"
                ) from None
            except InvalidUsage as e:
                for b in batches:
                    b.delete()
                raise PersistSourceError(
                    f"micro-batch {batchId} of the stream at {st.location} into shard "
                    f"{s.target.shard}: {e}"
                ) from None

    def _incoming(self, client: Any, batches: Sequence[Any]) -> pa.Table:
        """The micro-batch's rows (key and value columns), read back from its parts.

        A task's builder consolidates what it is given, so a row repeated within one
        task comes back once with ``_diff`` 2: every diff is checked to be 1 here, as
        the key check (:func:`persist.rows.check_distinct_keys`) sees only rows.

        Raises:
            persist.InvalidUsage: a row of the micro-batch came twice (naming the key
                columns and the key)."""
        from persist.errors import InvalidUsage
        from persist.fetch import read_batches
        from persist.parts import updates_schema

        s = self.settings.write
        schema = updates_schema(s.key_schema, s.value_schema)
        names = [*s.key_schema.names, *s.value_schema.names]
        if not batches:
            return pa.schema([schema.field(n) for n in names]).empty_table()
        rows = read_batches(client.blob, [b.hollow for b in batches], schema)
        repeated = rows.filter(pc.not_equal(rows.column(DIFF), 1))
        if repeated.num_rows:
            keys = s.key_schema.names
            key = [repeated.column(k)[0].as_py() for k in keys]
            raise InvalidUsage(
                f"upsert: two rows have one key {list(keys)} = {key} (the same row "
                f"{repeated.column(DIFF)[0].as_py()} times); each key may appear once; "
                "nothing was committed"
            )
        return rows.select(names)

    def _attempt(
        self,
        client: Any,
        write: Any,
        batches: list[Any],
        incoming: pa.Table | None,
        batch_id: int,
        query_id: str | None,
    ) -> None:
        """One commit attempt (see :meth:`commit`).  Raises ``TxnUpperMismatch`` when a
        race was lost (nothing committed; the executors' batches are kept for the next
        attempt, the retraction batch of this one deleted)."""
        from persist.txn import TxnUpperMismatch

        st = self.settings
        s = st.write
        stash = client.stash
        coll = stash.collection(COMMITS_COLLECTION, key="str", value="json")
        key = f"{client.shard_id(s.target.shard)} {st.location}"
        # The record batch first, then the read: a record appended in between fails
        # the batch's lower check, so the decision below is on the committed state.
        record = coll.make_batch(stash)
        prev = _peek_record(stash, coll, key)
        if prev is not None and prev.get("query_id") == query_id:
            if int(prev["batch_id"]) >= batch_id:
                log.info(
                    "micro-batch %s of the stream at %s is already in shard %s: its replay "
                    "adds nothing",
                    batch_id,
                    st.location,
                    s.target.shard,
                )
                for b in batches:
                    b.delete()
                return
        txn = client.begin()
        extra: list[Any] = []
        try:
            ts: int | None = None  # upsert: the time the retractions are planned at
            if batches:
                txn.write_batches(s.target.shard, batches)
            if incoming is not None:
                ts, extra = self._retractions(write, incoming)
                if extra:
                    txn.write_batches(s.target.shard, extra)
            if prev is not None:
                coll.append_to_batch(record, key, prev, -1)
            coll.append_to_batch(record, key, {"batch_id": batch_id, "query_id": query_id}, 1)
            txn.stash_append([record])
            if ts is not None:
                txn.commit_at(ts)
            else:
                txn.commit()
            _after_commit_hook(batch_id)
        except TxnUpperMismatch:
            for b in extra:
                b.delete()
            raise
        except BaseException:
            txn.abort()  # deletes the parts unless a commit of them may have landed
            raise

    def _retractions(self, write: Any, incoming: pa.Table) -> tuple[int, list[Any]]:
        """Plan the upsert of ``incoming`` on the shard's latest state: its upper ``t``
        (the commit time) and a batch of the retractions of every live row (as of
        ``t - 1``) with a key of the micro-batch (:func:`persist.rows.plan_upsert`
        unnetted: the micro-batch's own batches insert each of its rows, so a row equal
        to its live row is retracted and inserted, and consolidates to one; none when
        nothing is retracted).

        Raises:
            persist.InvalidUsage: two rows of the micro-batch have one key.
        """
        from persist import rows as rows_mod
        from persist.txn import RAW_TIME
        from persist.updates import updates_schema
        from stash import Antichain

        s = self.settings.write
        keys, values = list(s.key_schema.names), list(s.value_schema.names)
        rows_mod.check_unique_keys(incoming, keys)
        state = write.change_state()
        upper = state.upper.as_option()
        if upper is None:
            raise PersistSourceError(f"shard {s.target.shard} is closed (its upper is empty)")
        filt = rows_mod.key_filter(incoming, keys)
        live = write.read_live(state, filt) if incoming.num_rows else None
        if live is None or live.num_rows == 0:
            return upper, []
        planned = rows_mod.plan_upsert(live, incoming, keys, values, net=False)
        retract = planned.updates.filter(pc.less(planned.updates.column(DIFF), 0))
        if retract.num_rows == 0:
            return upper, []
        times = pa.array([RAW_TIME] * retract.num_rows, pa.int64())
        table = retract.select([*keys, *values]).append_column("_time", times)
        table = table.append_column(DIFF, retract.column(DIFF))
        table = table.cast(updates_schema(s.key_schema, s.value_schema))
        builder = write.builder(Antichain.from_elem(RAW_TIME))
        try:
            builder.add(table)
            batch = builder.finish(Antichain.from_elem(RAW_TIME + 1))
        except BaseException:
            builder.abort()
            raise
        return upper, [batch]

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Delete the parts the tasks of micro-batch ``batchId`` wrote (unless the shard
        references them: :func:`spark.persist_writer.delete_unreferenced`)."""
        delete_unreferenced(self.settings.write, messages)


def stream_writer(options: Any, schema: StructType, overwrite: bool) -> PersistStreamWriter:
    """The ``streamWriter`` of :class:`spark.persist_source.PersistDataSource`.

    Raises:
        PersistSourceError: ``outputMode("complete")`` (a shard is an append-only log;
            only ``append`` and ``update`` output modes write), or bad options.
    """
    from spark.persist_common import ShardTarget, registered_schemas

    if overwrite:
        raise PersistSourceError(
            "the persist source takes a stream's new rows only (outputMode append or "
            "update): a shard is an append-only log of updates, so outputMode complete "
            "(rewrite everything each micro-batch) is not available"
        )
    target = ShardTarget.from_options(options)
    settings = StreamWriteSettings.from_options(options, schema, registered_schemas(target))
    return PersistStreamWriter(settings)
