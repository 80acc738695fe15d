"""Parts: writing and reading a run of parts through a blob store.

A run is a sorted updates table cut into parts of a target size (:func:`split_for_parts`),
each encoded (:mod:`persist.encoding`) and uploaded in parallel (:func:`write_parts`), or
kept inline in the shard's state when small; :func:`read_parts` fetches, verifies and
decodes them (:mod:`persist.decoding`), after the persist-client batch builder (Materialize's
``src/persist-client/src/batch.rs``: parts of a target size, inline writes). This module also
re-exports the names of
:mod:`persist.updates`, :mod:`persist.consolidation`, :mod:`persist.encoding` and
:mod:`persist.decoding`, which it was once made of.

Invariants kept here:

* the parts :func:`write_parts` returns, read in order, are exactly the input table; a
  run's parts are row slices of one sorted table, so they stay sorted; each blob part's
  ref carries the statistics of exactly its rows (:mod:`persist.stats`; inline parts
  have none: they cost no fetch to read);
* :func:`write_parts` returns (or raises) only after every upload it started has ended,
  so a failed write's clean-up never races one of its own uploads;
* :func:`read_parts` either decodes verified bytes or, for an inline part whose very
  ``bytes`` object this process encoded or already verified, returns the table cached for
  it, which is what decoding those bytes gives.
"""

import dataclasses
import math
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa

from persist.blob import Blob, validate_key
from persist.config import DEFAULT_TARGET_PART_BYTES
from persist.consolidation import _take, consolidate, consolidate_order
from persist.decoding import INLINE_CACHE, _part_name, decode_part
from persist.encoding import (
    EncodingPlan,
    encode_inline_part,
    encode_inline_part_stream,
    encode_part,
    encoding_plan,
    make_part_ref,
)
from persist.errors import BlobError, CorruptPart, InvalidUsage
from persist.merge import key_samples
from persist.pool import in_background, run_all, submit_io
from persist.stats import ColumnStats, table_stats
from persist.types import PartRef
from persist.updates import DIFF, TIME, SchemaHistory, to_updates_table, updates_schema

__all__ = [
    "DIFF",
    "TIME",
    "consolidate",
    "consolidate_order",
    "decode_part",
    "encode_inline_part",
    "encode_part",
    "make_part_ref",
    "read_parts",
    "split_for_parts",
    "to_updates_table",
    "updates_schema",
    "write_parts",
]

_MIB = 1024 * 1024
#: A table at least twice this size (in-memory bytes) is split into ``max_workers`` parts
#: so that they encode in parallel (pyarrow releases the GIL while encoding).
MIN_PARALLEL_PART_BYTES = 8 * _MIB
_INLINE_PROBE_BYTES = 256 * 1024
#: Tables of at most this many rows are encoded as Arrow IPC first, to test for inlining.
_INLINE_PROBE_ROWS = 256


def split_for_parts(
    table: pa.Table, target_part_bytes: int, min_parts: int = 1, multiple_of: int = 1
) -> list[pa.Table]:
    """Row-slice ``table`` into parts of about ``target_part_bytes`` each.

    The size of a row is estimated as ``table.nbytes / num_rows`` (in-memory Arrow
    bytes, an upper bound of the encoded size for typical data); slices are zero-copy and
    their row counts differ by at most one. An empty table gives ``[]``.

    Args:
        table: the rows (in run order).
        target_part_bytes: wanted in-memory bytes per part (> 0).
        min_parts: split into at least this many parts (capped at the row count).
        multiple_of: when there is more than one part, round their number up to a
            multiple of this (the threads that encode them: all finish together instead
            of one encoding the last part alone).

    Raises:
        InvalidUsage: ``target_part_bytes``, ``min_parts`` or ``multiple_of`` is not
            positive.
    """
    if target_part_bytes <= 0:
        raise InvalidUsage(f"target_part_bytes must be > 0, got {target_part_bytes}")
    if min_parts <= 0:
        raise InvalidUsage(f"min_parts must be > 0, got {min_parts}")
    if multiple_of <= 0:
        raise InvalidUsage(f"multiple_of must be > 0, got {multiple_of}")
    n = table.num_rows
    if n == 0:
        return []
    per_row = table.nbytes / n
    rows_per = max(1, int(target_part_bytes // per_row)) if per_row > 0 else n
    count = max(min_parts, math.ceil(n / rows_per))
    if count > 1:
        count = math.ceil(count / multiple_of) * multiple_of
    count = min(count, n)
    base, extra = divmod(n, count)  # the first ``extra`` slices hold one row more
    pieces = []
    start = 0
    for i in range(count):
        rows = base + (1 if i < extra else 0)
        pieces.append(table.slice(start, rows))
        start += rows
    return pieces


class _Once:
    """Runs ``fn`` once, for whichever thread calls :meth:`run` first; the others wait
    for it.  If it raised, every call (that one included) raises: the first with the
    error itself, later ones with :class:`_UploadFailed`; the error stays in
    :attr:`error`."""

    def __init__(self, fn: Callable[[], None] | None) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        self._done = fn is None
        self.error: BaseException | None = None

    def run(self) -> None:
        if self._done:
            return
        with self._lock:
            if self.error is not None:
                raise _UploadFailed
            if self._done:
                return
            assert self._fn is not None
            try:
                self._fn()
            except BaseException as e:
                self.error = e
                raise
            self._done = True


class _UploadFailed(Exception):
    """Raised by an encoding task of :func:`write_parts` once an upload has failed."""


def write_parts(
    blob: Blob,
    table: pa.Table,
    key_prefix: str,
    target_part_bytes: int = DEFAULT_TARGET_PART_BYTES,
    inline_max_bytes: int = 4096,
    max_workers: int = 2,
    order: np.ndarray | None = None,
    name_prefix: str = "",
    before_upload: Callable[[], None] | None = None,
    key_names: Sequence[str] | None = None,
    schema: pa.Schema | None = None,
    plan: Callable[[], EncodingPlan] | None = None,
) -> list[PartRef]:
    """Encode ``table`` as Parquet parts and upload them; return their refs in order.

    ``before_upload``, if given, is called once before the first blob upload (never for
    a table kept inline): started in the shared pool once the table is known to go to
    blob parts, while they are gathered and encoded (or by the first encoding thread
    ready to upload, if no pool thread started it), and every upload waits for it; a
    writer registers itself there, so that GC knows the owner of every key it lists
    (:mod:`persist.keys`).  An error it raises is raised as is, with nothing uploaded.

    The table is written as given (consolidate it first for a sorted run), or, with
    ``order`` (an int64 numpy array of row positions, e.g. from
    :func:`consolidate_order`), as ``table.take(order)``: each part is then gathered
    by the thread that encodes it, so the whole reordered table never exists at once
    and gathering overlaps encoding. If its inline encoding
    (:func:`encode_inline_part`) is at most ``inline_max_bytes`` it becomes one inline
    part (no blob call; Materialize's ``src/persist-client/src/batch.rs``'s inline writes),
    without its schema message when ``table``'s schema equals ``schema`` exactly (give the
    shard's updates schema of the schema version the parts will record: their readers
    decode them with it). Otherwise it is split by
    :func:`split_for_parts` (at least ``max_workers`` parts when it holds at least
    ``2 * MIN_PARALLEL_PART_BYTES``, and a multiple of ``max_workers`` when several)
    and the parts are encoded by ``max_workers`` threads, each at key
    ``f"{key_prefix}/{name_prefix}{uuid}.parquet"``, and uploaded by the shared upload
    pool (:func:`persist.pool.submit_io`) while the next parts encode; at most
    ``2 * max_workers`` encoded parts wait for their upload at once. It returns after
    every upload ended. An empty table gives ``[]``.

    Several parts are encoded with one encoding plan (:func:`encoding_plan`) of the
    table's rows: ``plan()`` when given (a caller that started making it before it
    sorted the rows: the ``result`` of a :class:`persist.pool.Background`), else made by
    the first encoding thread to need it. ``plan`` is called at most once and only
    then; waiting for a plan made in the background is the caller's.

    With ``key_names`` (only for a table sorted by those columns, e.g. a consolidated
    run), each blob part's ref records its key samples (:func:`persist.merge.key_samples`),
    which key-range reads plan by (inline parts are sampled when planned), unless a sampled value
    cannot go into the shard state (a NUL character, or a string longer than
    :data:`MAX_SAMPLE_STRING_BYTES`): then it has none, and reads treat the part as one range.

    If an encoding or an upload fails, no further part is encoded, the keys already
    attempted are deleted best-effort once every upload has ended (an orphan left by a
    failing delete is garbage to GC; no reference to it exists) and the error is raised.

    Raises:
        InvalidKey: ``key_prefix`` does not make valid keys.
        InvalidUsage: bad sizes, or the table cannot be encoded.
        BlobError: an upload failed (its outcome is indeterminate for that key).
    """
    validate_key(f"{key_prefix}/{name_prefix}x.parquet")
    if inline_max_bytes < 0:
        raise InvalidUsage(f"inline_max_bytes must be >= 0, got {inline_max_bytes}")
    if max_workers < 1:
        raise InvalidUsage(f"max_workers must be >= 1, got {max_workers}")
    if order is not None and len(order) != table.num_rows:
        # A row subset or permutation: materialise the (rare) subset case.
        table, order = _take(table, order), None
    n = table.num_rows
    if n == 0:
        return []
    if order is not None and n <= _INLINE_PROBE_ROWS:
        table, order = _take(table, order), None  # a few rows: nothing to overlap
    if order is None and inline_max_bytes > 0 and n <= _INLINE_PROBE_ROWS:
        # Perhaps small enough to be kept inline: try (an IPC encoding of a few rows costs
        # tens of microseconds, less than measuring the table's ``nbytes``).
        small, stream = encode_inline_part_stream(table, schema)
        if len(small) <= inline_max_bytes:
            # No key samples for an inline part: planning samples its rows when it
            # needs them (persist.merge.part_key_samples).
            ref = make_part_ref(None, small, n, inline=True)
            INLINE_CACHE.put(ref, table, stream)
            return [ref]
    nbytes = table.nbytes
    min_parts = 1
    if max_workers > 1 and nbytes >= 2 * MIN_PARALLEL_PART_BYTES:
        min_parts = min(max_workers, nbytes // MIN_PARALLEL_PART_BYTES)
    if order is not None and (min_parts == 1 or nbytes <= _INLINE_PROBE_BYTES):
        table, order = _take(table, order), None  # one part: nothing to overlap
    pieces = split_for_parts(table, target_part_bytes, min_parts=min_parts, multiple_of=max_workers)
    whole: bytes | None = None
    if order is None and (len(pieces) == 1 or nbytes <= _INLINE_PROBE_BYTES):
        whole = encode_part(table)
        if len(pieces) > 1 and len(whole) <= target_part_bytes:
            pieces = [table]  # the whole encoding fits one part: reuse it
    keys = [f"{key_prefix}/{name_prefix}{uuid.uuid4().hex}.parquet" for _ in pieces]
    # The owner's registration (a consensus commit, durable: an fsync or a round trip)
    # starts in the shared pool now, while the parts are gathered and encoded; every
    # upload waits for it (the first encoding thread to reach its upload runs it, if no
    # pool thread has started it yet), and none is submitted once it failed.
    registration = _Once(before_upload)
    registering = None if before_upload is None else in_background(registration.run)
    # Row offsets of the pieces (slices of the table, or of ``order``).
    starts = [0]
    for p in pieces[:-1]:
        starts.append(starts[-1] + p.num_rows)

    # Encoded parts wait for the upload pool; at most this many at once (memory bound).
    in_flight = threading.BoundedSemaphore(2 * max_workers)
    uploads: list[Future[None]] = []
    upload_failed = threading.Event()

    def done(upload: Future[None]) -> None:
        if upload.exception() is not None:
            upload_failed.set()
        in_flight.release()

    # One encoding plan for every part of the run, made by the first encoding thread to
    # need it (the others wait for it) from a strided sample of ``table``: its rows are
    # the run's (``order`` only permutes them), read in their order at a fixed stride
    # (a sample gathered through ``order`` reads them at random: a third more time).
    plans: list[EncodingPlan] = []
    planning = threading.Lock()

    def plan_of_run() -> EncodingPlan:
        with planning:
            if not plans:
                plans.append(encoding_plan(table) if plan is None else plan())
            return plans[0]

    def encode(i: int) -> PartRef:
        if upload_failed.is_set():
            raise _UploadFailed
        piece = pieces[i]
        if order is not None:
            piece = _take(table, order[starts[i] : starts[i] + piece.num_rows])
        # Several parts: each one's statistics and key samples are found in the shared
        # pool while it encodes, by a core the other encoding threads leave idle (the
        # last part's encoding is what the write waits for).
        describing = (
            in_background(partial(_describe, piece, key_names)) if len(pieces) > 1 else None
        )
        try:
            if whole is not None and len(pieces) == 1:
                data = whole
            else:
                data = encode_part(piece, plan_of_run() if len(pieces) > 1 else None)
            registration.run()
            in_flight.acquire()
            try:
                upload = submit_io(blob.set, keys[i], data)
            except BaseException:
                in_flight.release()
                raise
            upload.add_done_callback(done)
            uploads.append(upload)
            # Its checksum is computed while it uploads (the last part's upload is a
            # write and an fsync that the whole write waits for).
            ref = make_part_ref(keys[i], data, piece.num_rows)
            stats, samples = (
                _describe(piece, key_names) if describing is None else describing.result()
            )
        except BaseException:
            if describing is not None:
                describing.wait()  # no work of this call goes on after it
            raise
        return dataclasses.replace(ref, stats=stats, key_samples=samples)

    tasks: list[Callable[[], PartRef]] = [partial(encode, i) for i in range(len(pieces))]
    results, error = run_all(tasks, max_workers)
    if registering is not None:
        registering.wait()  # ended (or never started) before anything is decided
    if registration.error is not None:
        error = registration.error  # raised as is; nothing was uploaded
    elif isinstance(error, _UploadFailed):
        error = None  # the failed upload's own error is found below
    for upload in uploads:  # every upload has ended before anything is cleaned up
        failure = upload.exception()
        if failure is not None and error is None:
            error = failure
    if error is not None:
        for key in keys if registration.error is None else ():
            try:
                blob.delete(key)
            except (BlobError, OSError):
                pass
        raise error
    return [r for r in results if r is not None]


def _describe(
    table: pa.Table, key_names: Sequence[str] | None
) -> tuple[tuple[ColumnStats, ...], Any]:
    """A part's statistics (:func:`persist.stats.table_stats`) and, with ``key_names``
    (``table`` sorted by them), its key samples (:func:`persist.merge.key_samples`), or
    ``None`` when a sampled value cannot go into the shard state (see
    :func:`_fits_state`)."""
    stats = table_stats(table)
    if key_names is None:
        return stats, None
    try:
        samples = key_samples(table, key_names)
    except UnicodeDecodeError:
        # A key string that is not UTF-8 (in parts written before writers refused
        # such strings, merged by compaction): no samples.
        return stats, None
    if not all(_fits_state(v) for row in samples for v in row):
        return stats, None  # no samples: key-range reads treat the part as one range
    return stats, samples


#: Longest string (UTF-8 bytes) a key sample keeps in the shard state.
MAX_SAMPLE_STRING_BYTES = 1024


def _fits_state(value: Any) -> bool:
    """Whether a key sample value may go into the shard state: no NUL character (the
    stash's JSON, as Postgres JSONB, cannot hold one) and strings of at most
    :data:`MAX_SAMPLE_STRING_BYTES` bytes (samples are copied into every state
    version)."""
    if isinstance(value, str):
        return "\x00" not in value and len(value.encode("utf-8")) <= MAX_SAMPLE_STRING_BYTES
    return True


def read_parts(
    blob: Blob,
    parts: Iterable[PartRef],
    columns: Sequence[str] | None = None,
    max_workers: int = 2,
    schema: pa.Schema | None = None,
    conform: tuple[SchemaHistory, int] | None = None,
) -> pa.Table:
    """Fetch, verify and decode ``parts`` (``max_workers`` threads); concatenate in order.

    Args:
        blob: the store holding the non-inline parts.
        parts: the refs, in run order.
        columns: read only these columns (``None``: all).
        max_workers: fetch/decode threads.
        schema: the expected schema (restricted to ``columns``); required to return an
            empty table when ``parts`` is empty; when given, every part's schema must
            equal it (else ``CorruptPart``).  With ``conform``, the view's schema.
        conform: ``(history, read schema id)``: each part is checked against the
            schema version it records (``PartRef.schema_id``) and conformed to the view
            of the read version (:meth:`persist.updates.SchemaHistory.conform`) before the
            parts are concatenated.

    Raises:
        CorruptPart: a part is missing from the blob store, fails its checksum, is not
            Parquet, or does not match ``schema``; the message names its key.
        BlobError: a fetch failed.
        InvalidUsage: no parts and no ``schema``.
        PersistError: a part names a schema id the history does not have.
        SchemaMismatch: a value does not fit an older reader's type.
    """
    refs = list(parts)
    whole = schema  # all the parts' columns: schema-less inline parts are read with it
    if schema is not None and columns is not None:
        schema = pa.schema([schema.field(c) for c in columns])
    if not refs:
        if schema is None:
            raise InvalidUsage("read_parts of no parts needs a schema for the empty result")
        return schema.empty_table()

    def fetch(ref: PartRef) -> pa.Table:
        if conform is None:
            return fetch_raw(ref, columns, schema, whole)
        history, dst = conform
        history.check_id(ref.schema_id, f"part {_part_name(ref)}")
        plan = history.plan(ref.schema_id, dst)
        src_cols = plan.source_columns(columns)
        src_schema = plan.source
        if src_cols is not None:
            src_schema = pa.schema([src_schema.field(c) for c in src_cols])
        return plan.apply(fetch_raw(ref, src_cols, src_schema, plan.source), columns)

    def fetch_raw(
        ref: PartRef,
        columns: Sequence[str] | None,
        schema: pa.Schema | None,
        whole: pa.Schema | None,
    ) -> pa.Table:
        cached = INLINE_CACHE.get(ref)
        if cached is not None:
            try:
                table = cached if columns is None else cached.select(list(columns))
            except KeyError:
                missing = [c for c in columns or () if c not in cached.column_names]
                raise CorruptPart(_part_name(ref), f"has no column(s) {missing}") from None
            if schema is not None and not table.schema.equals(schema):
                have = ", ".join(f"{f.name}: {f.type}" for f in table.schema)
                want = ", ".join(f"{f.name}: {f.type}" for f in schema)
                raise CorruptPart(_part_name(ref), f"schema ({have}) does not match ({want})")
            return table
        if ref.inline is not None:
            data = ref.inline
        else:
            assert ref.key is not None
            got = blob.get(ref.key)
            if got is None:
                raise CorruptPart(ref.key, "the part is missing from the blob store", missing=True)
            data = got
        table = decode_part(data, ref, columns, whole)
        if columns is None:
            INLINE_CACHE.put(ref, table)  # verified: its checksum matched
        if schema is not None and not table.schema.equals(schema):
            have = ", ".join(f"{f.name}: {f.type}" for f in table.schema)
            want = ", ".join(f"{f.name}: {f.type}" for f in schema)
            raise CorruptPart(_part_name(ref), f"schema ({have}) does not match ({want})")
        return table

    tasks: list[Callable[[], pa.Table]] = [partial(fetch, r) for r in refs]
    results, error = run_all(tasks, max_workers)
    if error is not None:
        raise error
    tables = [t for t in results if t is not None]
    if len(tables) == 1:
        return tables[0]
    try:
        return pa.concat_tables(tables)
    except pa.ArrowInvalid as e:
        raise CorruptPart(
            ",".join(_part_name(r) for r in refs[:3]), f"parts have different schemas: {e}"
        ) from None
