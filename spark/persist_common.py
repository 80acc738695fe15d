"""Options, settings and schema conversions shared by the ``persist`` Spark source's reader,
writer and stream reader.

Invariants kept here: every option name is checked against :data:`READ_OPTIONS` or
:data:`WRITE_OPTIONS` before it is used; settings objects are frozen and picklable (they
travel to Spark's Python workers); Arrow and Spark schemas convert both ways with the
same names and nullable fields.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql.types import StructField, StructType

from spark.options import check_names, parse_bool, redacted_repr

log = logging.getLogger(__name__)


TIME = "_time"
"""Name of the time column in persist parts and updates tables."""
DIFF = "_diff"
"""Name of the diff column in persist parts and updates tables."""

DEFAULT_PARTITION_BYTES = 128 * 1024 * 1024
"""Parts are grouped into one input partition up to this many Parquet bytes."""

HEARTBEAT_SECONDS = 10.0
"""How often a streaming read renews its lease while idle."""

COMMIT_ATTEMPTS = 50
"""How many times ``commit`` retries ``compare_and_append_batch`` after upper races."""


class PersistSourceError(ValueError):
    """The persist source was asked for something it cannot do (bad or missing option,
    unknown shard, a time before the shard's upper, a negative multiplicity to expand)."""


# ---------------------------------------------------------------- options
def _opt(options: Any, name: str) -> str | None:
    value = options.get(name)
    if value is None:
        return None
    value = str(value).strip()
    return value or None


def _opt_int(options: Any, name: str) -> int | None:
    raw = _opt(options, name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise PersistSourceError(f"option {name!r} must be an integer, got {raw!r}") from None


def _opt_list(options: Any, name: str) -> list[str] | None:
    raw = _opt(options, name)
    if raw is None:
        return None
    return [c.strip() for c in raw.split(",") if c.strip()]


def _truthy(options: Any, name: str) -> bool:
    return parse_bool(name, _opt(options, name), False, PersistSourceError)


READ_OPTIONS = (
    "stash",
    "blob",
    "path",
    "shard",
    "as_of",
    "time_column",
    "diff_column",
    "partition_bytes",
    "consolidate",
    "expand",
    "partitions",
    "pushdown",
    "readonly",
)
"""Every option a read (batch or streaming) of the persist source understands
(``readonly``: batch reads only)."""

WRITE_OPTIONS = (
    "stash",
    "blob",
    "path",
    "shard",
    "key_columns",
    "value_columns",
    "time_column",
    "time",
    "diff_column",
    "upper",
    "compaction",
    "unique_keys",
    "mergeSchema",
)
"""Every option a write to the persist source understands."""

READ_SHAPE_OPTIONS = ("consolidate", "expand", "partitions", "partition_bytes", "pushdown")
"""Read options a write accepts and ignores: they only shape what a read returns, and a
SQL view made with them (``CREATE TEMPORARY VIEW v USING persist OPTIONS (...)``) hands
them to ``INSERT INTO v`` too, which appends at the shard's upper as any write does.
``as_of`` is not among them: a view reading at a fixed time is read-only
(:func:`check_write_options`)."""


def check_write_options(options: Any) -> None:
    """Check a write's option names: :data:`WRITE_OPTIONS` and the ignored
    :data:`READ_SHAPE_OPTIONS`.

    Raises:
        PersistSourceError: ``as_of`` is given (a source read at a fixed time, such as a
            time-travel view, is read-only: the message names the option); an unknown
            option (suggesting the closest valid name).
    """
    given = {str(k).lower(): k for k in options}
    if "as_of" in given:
        shard = _opt(options, "shard") or _opt(options, "path") or "?"
        raise PersistSourceError(
            f"cannot write to shard {shard} through a source with option as_of="
            f"{_opt(options, given['as_of'])!r}: it reads the shard at that fixed time, so "
            "it is read-only (a time-travel view); write through a view or DataFrame "
            "writer without as_of (new rows land at the shard's upper)"
        )
    check_names(
        options,
        WRITE_OPTIONS + READ_SHAPE_OPTIONS,
        "writing a persist shard",
        PersistSourceError,
    )


CONSOLIDATE_MODES = ("full", "partition", "none")
"""Values of the read option ``consolidate`` (see the module docstring)."""


@dataclass(frozen=True)
class ShardTarget:
    """Where a shard lives: stash URL (consensus), blob URI (parts) and shard name."""

    stash_url: str
    blob_uri: str
    shard: str

    def __repr__(self) -> str:
        # Embedded in the reprs of the read and write plans: the URLs may hold secrets.
        return redacted_repr(self, "stash_url", "blob_uri")

    @classmethod
    def from_options(cls, options: Any) -> ShardTarget:
        """Read ``stash``, ``blob`` and ``path``/``shard`` from data source options.

        Raises:
            PersistSourceError: an option is missing.
        """
        stash_url = _opt(options, "stash")
        blob_uri = _opt(options, "blob")
        shard = _opt(options, "shard") or _opt(options, "path")
        missing = [
            n
            for n, v in (
                ("stash", stash_url),
                ("blob", blob_uri),
                ("shard (load/save path)", shard),
            )
            if v is None
        ]
        if missing:
            raise PersistSourceError(f"the persist source needs option(s): {', '.join(missing)}")
        assert stash_url is not None and blob_uri is not None and shard is not None
        return cls(stash_url, blob_uri, shard)


# ------------------------------------------------------------ persist glue
# Everything this module needs from persist beyond its documented handle API is here.


@contextlib.contextmanager
def persist_client(
    target: ShardTarget, *, readonly: bool = False, compaction: str = "off"
) -> Iterator[Any]:
    """A :class:`persist.PersistClient` on the target's stores, closed (with its stash)
    afterwards. ``compaction`` is the client's mode (``"off"``: merge requests stay in the
    trace for ``persist compact`` / :mod:`spark.jobs.compact`)."""
    from persist.client import PersistClient
    from stash import Stash

    stash = Stash.open(target.stash_url, mode="readonly" if readonly else "writable", fenced=False)
    try:
        client = PersistClient(stash, target.blob_uri, compaction=compaction)  # type: ignore[arg-type]
        try:
            yield client
        finally:
            client.close()
    finally:
        stash.close()


def open_read(client: Any, shard: str, key_schema: pa.Schema, value_schema: pa.Schema) -> Any:
    """What planning a read of ``shard`` lists its parts with: a leased reader
    (:meth:`persist.PersistClient.open_reader`, holding GC back while Spark reads the
    parts) on a writable stash; on a readonly one, a reader of the latest state version
    without a lease, writing nothing (:class:`persist.version_read.VersionReader`).
    Both are context managers with ``read_schemas``, ``snapshot_batches``, ``detach``
    and ``expire``."""
    if getattr(client.stash, "mode", "writable") == "readonly":
        from persist.version_read import VersionReader

        return VersionReader(client.inspect(shard))
    return client.open_reader(shard, key_schema, value_schema)


def registered_schemas(target: ShardTarget) -> tuple[pa.Schema, pa.Schema] | None:
    """The shard's registered ``(key_schema, value_schema)``, or ``None`` if no shard has
    that name yet."""
    from persist.errors import InvalidUsage
    from stash import StashError

    try:
        with persist_client(target, readonly=True) as client:
            state = client.inspect(target.shard)
    except (InvalidUsage, StashError) as e:
        if "no shard named" in str(e) or "does not exist" in str(e):
            return None
        raise
    return state.key_schema, state.value_schema


# -------------------------------------------------------------- the source
@dataclass(frozen=True)
class ReadSettings:
    """Parsed read options (picklable)."""

    target: ShardTarget
    key_schema: pa.Schema
    value_schema: pa.Schema
    as_of: int | None
    time_column: str | None
    diff_column: str | None
    partition_bytes: int
    consolidate: str
    expand: bool
    #: Key ranges of a consolidated read (``None``: as many as a raw read's partitions).
    partitions: int | None = None
    pushdown: bool = False
    #: Plan on a readonly stash: no reader lease, nothing written (option ``readonly``).
    readonly: bool = False

    @property
    def full(self) -> bool:
        """Whether one task reads every part (the consolidated read)."""
        return self.consolidate == "full"

    @property
    def data_columns(self) -> list[str]:
        return list(self.key_schema.names) + list(self.value_schema.names)


def _nullable(schema: pa.Schema) -> pa.Schema:
    return pa.schema([f.with_nullable(True) for f in schema])


def spark_to_arrow(schema: StructType) -> pa.Schema:
    """The Arrow schema (all fields nullable) Spark uses for ``schema``."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return _nullable(to_arrow_schema(schema, timezone="UTC"))


def arrow_to_spark(
    schema: pa.Schema, shard: str | None = None, *, read_types: bool = True
) -> StructType:
    """The Spark schema of an Arrow schema (fields nullable), each column in the Spark
    type it reads as (:func:`spark.arrow_spark.spark_read_type`: unsigned integers widen,
    temporal types keep microseconds); with ``read_types=False``, PySpark's own mapping
    of the Arrow types (for Arrow data passed through Spark as it is, which refuses the
    types PySpark does not map). A timestamp with a time zone is Spark's ``timestamp``
    (an instant), one without is ``timestamp_ntz`` (a wall-clock value), so that neither
    moves with the session time zone.

    Raises:
        PersistSourceError: a column has no Spark type holding its values (a
            ``decimal256`` of more than 38 digits), naming it and ``shard``.
    """
    from pyspark.sql.pandas.types import from_arrow_schema

    from spark.arrow_spark import UnreadableColumn, spark_read_schema

    readable = schema
    try:
        if read_types:
            readable = spark_read_schema(schema, "" if shard is None else f" of shard {shard}")
    except UnreadableColumn as e:
        raise PersistSourceError(str(e)) from None
    st = from_arrow_schema(readable, prefer_timestamp_ntz=True)
    return StructType([StructField(f.name, f.dataType, True) for f in st.fields])


LIVE_KEYS_ATTEMPTS = 5
"""How many times :func:`live_blob_keys` reads a shard whose state keeps changing."""


def live_blob_keys(client: Any, shard_id: str) -> set[str] | None:
    """The blob keys shard ``shard_id`` references or has retired, as of ONE state
    version: the state, then its retired collection, then the head seqno; the pair is
    kept only when the collection's upper is the state's ``retired_upper`` and the head
    is still the state's seqno (else all is read again).  A retired key may still be
    read by a reader holding an older version, so it is as live as a referenced one
    (persist-client's GC keeps retired blobs for its seqno holds in the same way).

    Args:
        client: a :class:`persist.PersistClient`.
        shard_id: the shard's id.

    Returns: the keys, or ``None`` when no consistent pair was read in
    :data:`LIVE_KEYS_ATTEMPTS` tries (the caller must then delete nothing).

    Raises:
        persist.PersistError, stash.StashError: reading the state failed.
    """
    machine = client.machine(shard_id)
    for _ in range(LIVE_KEYS_ATTEMPTS):
        st = machine.fetch()
        upper, retired = client.consensus.retired_entries(shard_id)
        if upper == st.retired_upper and client.consensus.head_seqno(shard_id) == st.seqno:
            return set(st.referenced_blob_keys()) | set(retired)
    return None
