"""Compaction of a persist shard with Spark, for shards too large for one process.

The shard's Spine hands out merge requests (:class:`persist.FueledMergeReq`: merge these
contiguous hollow batches into one batch with this description). A small request is
answered on the driver by persist's own :class:`persist.Compactor`. A large one
(``min_spark_bytes`` of input parts or more) becomes a Spark job:

1. one task per input part reads it (times advanced to its batch's lower and since, as
   :func:`persist.read_batches` does) and emits Arrow batches;
2. the rows are hash-partitioned by the key columns (``repartition``), so that every
   update of one key lands in one task;
3. each task advances times to the merge's since (the later of the request's and the
   since of the committed state version the driver read,
   :func:`persist.spine_merge.merge_output_desc`, as persist's compactor does),
   consolidates (:func:`persist.consolidation.consolidate`), writes its rows as one
   sorted run of parts to the blob store and returns the part references;
4. the driver assembles one hollow batch with the request's lower and upper and that
   since, one run per task
   (the runs hold disjoint keys, so the batch is consolidated), and swaps it into the trace
   by compare-and-set (``apply_merge_res``); an output that is not applied (the trace moved
   on) is deleted unless the latest state references it.

Invariants: a merge never changes what any readable ``as_of`` sees (the output holds the
inputs' updates with times advanced to the merge's since, ``<=`` the shard's since at
apply time, consolidated); parts of a
failed merge are garbage for GC, never referenced; the trace is only changed by
compare-and-set.

Run: ``python -m spark.jobs.compact --stash URL --blob URI SHARD [--gc]``. The command
stops the SparkSession it built before it exits (a cluster would otherwise relaunch
executors while the JVM shuts down).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import click
import pyarrow as pa

from spark.jobs import store_options

DEFAULT_MIN_SPARK_BYTES = 64 * 1024 * 1024
"""Merge requests with fewer input bytes than this run on the driver."""

DEFAULT_BYTES_PER_TASK = 128 * 1024 * 1024
"""Output partitions of a Spark merge: one per this many input bytes (at least 1)."""

MAX_TASKS = 256
"""At most this many output partitions (runs) per merge."""


@dataclass
class CompactJobReport:
    """What :func:`compact_shard` did (counts; bytes are encoded Parquet bytes)."""

    requests: int = 0
    spark_merges: int = 0
    local_merges: int = 0
    applied: int = 0
    not_applied: int = 0
    failed: int = 0
    rows_in: int = 0
    rows_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    gc_deleted: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


def _req_bytes(req: Any) -> int:
    return sum(p.encoded_size_bytes for i in req.inputs for p in i.batch.parts)


def compact_shard(
    spark: Any,
    stash_url: str,
    blob_uri: str,
    shard: str,
    *,
    min_spark_bytes: int = DEFAULT_MIN_SPARK_BYTES,
    bytes_per_task: int = DEFAULT_BYTES_PER_TASK,
    gc: bool = False,
    gc_grace_seconds: float | None = None,
) -> CompactJobReport:
    """Answer every outstanding merge request of ``shard`` (large ones with Spark), then
    merge each batch of several runs smaller than ``min_spark_bytes`` into one run
    (:meth:`persist.spine.Trace.run_merge_reqs`), so that a native read
    (:mod:`spark.native_plan`) finds one consolidated run where a write left several.

    Args:
        spark: the SparkSession (only used for requests of ``min_spark_bytes`` or more).
        stash_url, blob_uri: absolute store locations every executor can reach.
        shard: the shard name.
        min_spark_bytes: smaller requests are merged on the driver.
        bytes_per_task: input bytes per output partition of a Spark merge.
        gc: run :func:`persist.collect_garbage` afterwards.
        gc_grace_seconds: GC grace period (default: the client's, one hour).

    Raises:
        persist.InvalidUsage: unknown shard.
    """
    from persist import PersistClient, collect_garbage
    from stash import Stash

    t0 = time.perf_counter()
    report = CompactJobReport()
    with Stash.open(stash_url, fenced=False) as s:
        client = PersistClient(s, blob_uri, compaction="off")
        try:
            machine = client.machine(client.shard_id(shard))
            st = machine.fetch()
            reqs = st.trace.all_fueled_merge_reqs()
            # Then every batch of several runs (e.g. a Spark write's tasks) under
            # min_spark_bytes becomes one run (merged on the driver: a Spark merge
            # writes one run per task), planned on the state the fueled merges leave.
            for phase in (0, 1):
                if phase == 1:
                    reqs = [
                        r
                        for r in machine.fetch().trace.run_merge_reqs()
                        if _req_bytes(r) < min_spark_bytes
                    ]
                report.requests += len(reqs)
                _answer(
                    spark,
                    client,
                    machine,
                    reqs,
                    report,
                    stash_url,
                    blob_uri,
                    min_spark_bytes,
                    bytes_per_task,
                )
            if gc:
                g = collect_garbage(client, shard, grace_seconds=gc_grace_seconds)
                report.gc_deleted = len(g.deleted_retired) + len(g.deleted_abandoned)
        finally:
            client.close()
    report.seconds = round(time.perf_counter() - t0, 3)
    return report


def _answer(
    spark: Any,
    client: Any,
    machine: Any,
    reqs: list[Any],
    report: CompactJobReport,
    stash_url: str,
    blob_uri: str,
    min_spark_bytes: int,
    bytes_per_task: int,
) -> None:
    """Answer merge requests ``reqs`` (large ones with Spark), adding to ``report``."""
    from persist import PersistError

    for req in reqs:
        nbytes = _req_bytes(req)
        report.bytes_in += nbytes
        try:
            if nbytes >= min_spark_bytes and spark is not None:
                report.spark_merges += 1
                applied, rows_in, rows_out, out_bytes = _spark_merge(
                    spark, client, machine, req, stash_url, blob_uri, nbytes, bytes_per_task
                )
            else:
                report.local_merges += 1
                r = client.compactor.merge(machine, req)
                applied, rows_in, rows_out, out_bytes = (
                    bool(r.applied),
                    r.rows_in,
                    r.rows_out,
                    r.bytes_written,
                )
        except PersistError as e:
            report.failed += 1
            report.errors.append(f"merge {req.desc}: {e}")
            continue
        report.applied += int(applied)
        report.not_applied += int(not applied)
        report.rows_in += rows_in
        report.rows_out += rows_out
        report.bytes_out += out_bytes


# ------------------------------------------------------------ Spark merge
def _spark_merge(
    spark: Any,
    client: Any,
    machine: Any,
    req: Any,
    stash_url: str,
    blob_uri: str,
    nbytes: int,
    bytes_per_task: int,
) -> tuple[bool, int, int, int]:
    """Merge one request with Spark; returns (applied, rows in, rows out, bytes out)."""
    from pyspark.sql import functions as F

    from persist import HollowBatch
    from persist.parts import updates_schema
    from persist.spine_merge import merge_output_desc
    from spark.persist_common import arrow_to_spark

    st = machine.state()
    if any(p.schema_id > st.schemas().newest for i in req.inputs for p in i.batch.parts):
        st = machine.fetch()  # a schema version registered since this process looked
    ks, vs = st.key_schema, st.value_schema
    schema = updates_schema(ks, vs)
    # Parts are conformed to the newest schema version before consolidating, and the
    # output records it (persist's compaction).
    schemas = (st.schemas(), st.schemas().newest)
    # Consolidated at the since of the committed version in hand, as persist's compactor
    # does (merge_output_desc); the output's description carries it.
    desc = merge_output_desc(req, st.since)
    since = desc.since.as_option()
    # One input row per part: the part's hollow batch slice, as JSON.
    pieces = [
        json.dumps(HollowBatch(i.batch.desc, (p,), p.rows).to_json())
        for i in req.inputs
        for p in i.batch.parts
    ]
    rows_in = sum(i.batch.len for i in req.inputs)
    n_out = min(MAX_TASKS, max(1, math.ceil(nbytes / max(1, bytes_per_task))))
    # The updates pass through Spark as Arrow and are written back: PySpark's own type
    # mapping, not the persist source's read types (which widen some columns).
    spark_schema = arrow_to_spark(schema, read_types=False)
    # The outputs are owned by the driver's compactor, registered as a writer of the
    # shard (persist.keys): GC keeps them while it lives, even before they are applied.
    from persist.keys import part_name_prefix

    owner = client.compactor.writer_id(machine)
    prefix = f"{machine.shard_id}/c"
    name_prefix = part_name_prefix(owner, machine.now_ms())
    read_fn = _make_reader(blob_uri, schema, schemas)
    write_fn = _make_writer(blob_uri, schema, ks.names, vs.names, since, prefix, name_prefix)
    keys = list(ks.names) or list(vs.names)
    pieces_df = spark.createDataFrame([(p,) for p in pieces], "piece string").repartition(
        len(pieces)
    )
    updates = pieces_df.mapInArrow(read_fn, spark_schema)
    if keys:
        updates = updates.repartition(n_out, *[F.col(k) for k in keys])
    else:
        updates = updates.coalesce(1)
    results = updates.mapInArrow(write_fn, "task int, refs string").collect()
    ordered = sorted(results, key=lambda r: r["task"])
    from persist import PartRef

    parts: list[Any] = []
    runs: list[int] = []
    for r in ordered:
        refs = [
            dataclasses.replace(PartRef.from_json(d), schema_id=schemas[1])
            for d in json.loads(r["refs"])
        ]
        if not refs:
            continue
        if parts:
            runs.append(len(parts))
        parts.extend(refs)
    rows_out = sum(p.rows for p in parts)
    out = HollowBatch(desc, tuple(parts), rows_out, tuple(runs))
    applied = _apply(client, machine, out)
    return applied, rows_in, rows_out, sum(p.encoded_size_bytes for p in parts)


def _apply(client: Any, machine: Any, out: Any) -> bool:
    """Swap ``out`` into the trace by compare-and-set; delete its parts if it was not
    applied and the latest state does not reference them."""
    from persist import FueledMergeRes, PersistError

    res = FueledMergeRes(out)
    keys = [p.key for p in out.parts if p.key is not None]
    try:
        (result,) = machine.apply_merge_results([res])
    except PersistError as e:
        if not e.is_indeterminate():
            _delete(client, machine, keys, check=False)
        raise
    if not result.applied():
        _delete(client, machine, keys, check=True)
    return bool(result.applied())


def _delete(client: Any, machine: Any, keys: list[str], check: bool) -> None:
    """Delete ``keys``; with ``check``, only those the shard neither references nor
    retired as of one state version (none when that cannot be read consistently)."""
    from spark.persist_common import live_blob_keys

    protected: set[str] = set()
    if check:
        live = live_blob_keys(client, machine.shard_id)
        if live is None:
            return  # cannot prove any unreferenced: leave them to GC
        protected = live
    for k in keys:
        if k not in protected:
            client.blob.delete(k)


def _make_reader(blob_uri: str, schema: pa.Schema, schemas: Any = None) -> Any:
    def read_pieces(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

        from persist import HollowBatch, RetryingBlob, open_blob, read_batches

        target = to_arrow_schema(
            from_arrow_schema(schema, prefer_timestamp_ntz=False), timezone="UTC"
        )
        blob = RetryingBlob(open_blob(blob_uri))
        try:
            for rb in batches:
                for piece in rb.column(0).to_pylist():
                    hb = HollowBatch.from_json(json.loads(piece))
                    table = read_batches(blob, [hb], schema, max_workers=1, schemas=schemas)
                    table = pa.Table.from_arrays(
                        [c.cast(f.type) for c, f in zip(table.columns, target, strict=True)],
                        schema=target,
                    )
                    yield from table.to_batches(max_chunksize=64 * 1024)
        finally:
            blob.close()

    return read_pieces


def _make_writer(
    blob_uri: str,
    schema: pa.Schema,
    key_names: list[str],
    value_names: list[str],
    since: int | None,
    prefix: str,
    name_prefix: str,
) -> Any:
    def write_run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        from persist import RetryingBlob, open_blob
        from persist.parts import consolidate, write_parts

        ctx = TaskContext.get()
        task = ctx.partitionId() if ctx is not None else 0
        tables = [pa.Table.from_batches([rb]) for rb in batches if rb.num_rows]
        refs: list[dict[str, Any]] = []
        if tables:
            table = pa.concat_tables(tables)
            table = pa.Table.from_arrays(
                [table.column(f.name).cast(f.type) for f in schema], schema=schema
            )
            table = consolidate(table, key_names, value_names, since=since)
            blob = RetryingBlob(open_blob(blob_uri))
            try:
                parts = write_parts(
                    blob,
                    table,
                    prefix,
                    inline_max_bytes=0,
                    name_prefix=name_prefix,
                    key_names=key_names,
                )
            finally:
                blob.close()
            refs = [p.to_json() for p in parts]
        yield pa.RecordBatch.from_pydict(
            {"task": pa.array([task], pa.int32()), "refs": pa.array([json.dumps(refs)])}
        )

    return write_run


# --------------------------------------------------------------------- CLI
@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("shard")
@store_options
@click.option("--master", default=None, help="Spark master URL (default local[*]).")
@click.option(
    "--min-spark-bytes",
    type=int,
    default=DEFAULT_MIN_SPARK_BYTES,
    show_default=True,
    help="Merges with fewer input bytes run on the driver.",
)
@click.option("--bytes-per-task", type=int, default=DEFAULT_BYTES_PER_TASK, show_default=True)
@click.option("--gc", is_flag=True, help="Collect garbage afterwards.")
@click.option("--gc-grace-seconds", type=float, default=None)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve Prometheus /metrics on this port while the command runs.",
)
def main(
    shard: str,
    stash_url: str,
    blob_uri: str,
    master: str | None,
    min_spark_bytes: int,
    bytes_per_task: int,
    gc: bool,
    gc_grace_seconds: float | None,
    metrics_port: int | None,
) -> None:
    """Answer the outstanding merge requests of SHARD, large ones with Spark."""
    from persist.metrics import serve

    try:
        serve(metrics_port)
    except OSError as e:  # a busy port: one clear line, not a traceback
        raise click.ClickException(str(e)) from None
    from spark.jobs import absolute_blob_uri, absolute_stash_url
    from spark.session import build_session

    stash_url, blob_uri = absolute_stash_url(stash_url), absolute_blob_uri(blob_uri)
    from pyspark.sql import SparkSession

    already = SparkSession.getActiveSession()  # a caller's session is not ours to stop
    spark = build_session(master, "compact")
    try:
        report = compact_shard(
            spark,
            stash_url,
            blob_uri,
            shard,
            min_spark_bytes=min_spark_bytes,
            bytes_per_task=bytes_per_task,
            gc=gc,
            gc_grace_seconds=gc_grace_seconds,
        )
    finally:
        # This job built the session: stop it before the interpreter exits, or a
        # cluster (local-cluster, standalone) relaunches executors during shutdown.
        if already is None:
            spark.stop()
    click.echo(json.dumps(asdict(report), indent=2))


if __name__ == "__main__":
    main()
