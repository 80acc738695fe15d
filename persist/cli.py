"""The ``persist`` command line: list shards, inspect one, compact it, collect its
garbage, check it, drop it, print its rows, query shards with SQL.

``persist [--stash URL] [--blob URI] [--metrics-port P [--metrics-addr A]] shards |
inspect SHARD | history TABLE [--limit N] | retention TABLE [--duration D] | compact
SHARD [--full] | gc SHARD | fsck SHARD | drop SHARD | cat SHARD [--as-of T [--wait
SECONDS]] [--limit N] | sql QUERY [--as-of T] [--max-expanded-rows N]``.
``--stash`` and ``--blob`` go before or after the subcommand, or come from
``PERSIST_STASH`` / ``PERSIST_BLOB`` (:func:`store_options`).  ``cat`` and ``sql`` read
consolidated snapshots without a lease (:func:`persist.version_read.read_version`:
nothing is written, a part GC removed meanwhile is read from the newer version at the
same time), so a readonly stash will do (``cat --wait`` takes a reader lease while it
waits).  ``sql`` runs DuckDB with each shard
named in the query registered as an Arrow table of its rows (one row per unit of
multiplicity, :mod:`persist.cli_sql`), every shard read at one time (``--as-of T``, or
the latest time all of them have: :meth:`persist.PersistClient.snapshot_many`), so a
cross-shard transaction is wholly visible or wholly absent.  ``SHARD`` is a shard
*name*; a shard id is given as ``id:<shard id>`` (names and ids never mix: a name shaped
like an id is a name).  Output is a readable table (rich) or JSON with ``--json``.

Invariants kept here: no command creates a stash or a blob root (the stash is opened
readonly first, so a mistyped SQLite path is refused; a ``file://`` root is opened with
``create=False``); reads keep the stash readonly (but ``cat --wait``); the SQL
query, parsing included, runs only on a private DuckDB connection whose external access
(files, network) is off and locked, so it reaches nothing but the registered shards and
answers alike for files that exist and files that do not; a shard whose multiplicities
would add more than ``--max-expanded-rows`` rows is refused by name, never half-built;
``--json`` is strict JSON, one object per line, keys in column order (non-finite floats
as the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``); URLs are never printed with
credentials (:func:`stash.redact`); user errors (a ``/metrics`` port that cannot be
bound included) are printed as ``error: what is wrong — what to do`` (the same style as
the ``stash`` CLI; a DuckDB error's caret lines follow on lines of their own), never as
a traceback, and exit with code 1; ``fsck`` exits with code 2 when it finds damage;
tables are rendered by :func:`stash.cli.print_table`, so no stored text reaches the
terminal as a control sequence or as rich markup.  ``/metrics`` is served on all
interfaces by default (``--metrics-addr 0.0.0.0``, the Prometheus convention, so a
scraper on another host reaches it); ``--metrics-addr 127.0.0.1`` keeps it local.
"""

from __future__ import annotations

import datetime as dt
import difflib
import json
import logging
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click
import pyarrow as pa

from persist import metrics as persist_metrics
from persist.blob import open_blob
from persist.blob.file import FileBlob
from persist.cli_sql import (
    MAX_EXPANDED_ROWS,
    as_rows,
    first_line,
    json_line,
    locked_duckdb,
    rest_lines,
    shards_named,
)
from persist.client import PersistClient
from persist.errors import CorruptPart, InvalidUsage, PersistError, UnknownShard
from persist.fsck import fsck as fsck_shard
from persist.gc import collect_garbage
from persist.optimize import optimize
from persist.state import ShardState
from persist.version_read import read_version
from stash import Stash, StashError, redact
from stash.cli import (
    CliError,
    CliGroup,
    F,
    fail,
    print_table,
    printable,
    shared_option,
    shared_value,
)
from stash.errors import MigrationRequired

STORE_ENV = {"stash_url": "PERSIST_STASH", "blob_uri": "PERSIST_BLOB"}
"""The environment variables of the store options."""


def store_options(f: F) -> F:
    """``--stash`` and ``--blob`` (from ``PERSIST_STASH`` / ``PERSIST_BLOB`` when not
    given), accepted on the group and on every subcommand, so that ``persist --stash U
    cat S`` and ``persist cat S --stash U`` mean the same (:func:`stash.cli.shared_option`).
    Click does not require them, so ``--help`` works with no store; :func:`_store` asks
    for a missing one."""
    f = shared_option(
        "--blob",
        "blob_uri",
        STORE_ENV["blob_uri"],
        "Blob store URI (file:///path, s3://bucket/prefix, ...)",
        metavar="URI",
    )(f)
    return shared_option(
        "--stash",
        "stash_url",
        STORE_ENV["stash_url"],
        "Stash URL holding consensus (sqlite:///path, postgresql+psycopg://...)",
    )(f)


def _store(ctx: click.Context) -> tuple[str, str]:
    """The ``(stash URL, blob URI)`` of this invocation: an option given on the command
    line (before or after the subcommand) wins over the environment.

    Raises:
        CliError: an option is missing everywhere, or given before and after the
            subcommand with different values.
    """
    out: list[str] = []
    for name, flag in (("stash_url", "--stash"), ("blob_uri", "--blob")):
        value = shared_value(ctx, name, flag)
        if value is None:
            raise CliError(
                f"no {flag} given",
                f"pass {flag} before or after the subcommand, or set {STORE_ENV[name]}",
            )
        out.append(value)
    return out[0], out[1]


@contextmanager
def _client(ctx: click.Context, readonly: bool) -> Iterator[PersistClient]:
    """A client on this invocation's store.  Nothing is created: the stash must exist
    (it is first opened readonly, so a mistyped SQLite path is not made into a new
    database) and a ``file://`` blob root is opened with ``create=False`` (a missing root
    reads as empty, and only a write would create it)."""
    url, uri = _store(ctx)
    try:
        s = Stash.open(url, mode="readonly", fenced=False)
        if not readonly:  # it exists: now open it for the leases and writes
            s.close()
            s = Stash.open(url, mode="writable", fenced=False)
    except MigrationRequired:
        raise
    except StashError as e:
        raise CliError(e.message, "is --stash right?") from None
    try:
        blob = open_blob(uri, create=False)
    except PersistError:
        s.close()
        raise
    c = PersistClient(s, blob, compaction="off")
    ctx.meta["persist.blob"] = (uri, blob)
    try:
        yield c
    except CorruptPart as e:
        hint = _blob_hint(ctx, e.key) if e.missing else None
        if hint is None:
            raise
        raise CliError(str(e), hint) from None
    finally:
        c.close()
        blob.close()
        s.close()


def _message(e: Exception) -> str:
    return e.message if isinstance(e, StashError) else str(e)


def _blob_hint(ctx: click.Context, key: str) -> str | None:
    """When the part ``key`` is missing and the blob store holds no key of its shard at
    all, the question to ask (is ``--blob`` right?), naming the redacted URI; else
    ``None``.  Call it while the client is open."""
    found = ctx.meta.get("persist.blob")
    if found is None or "/" not in key:
        return None
    uri, blob = found
    try:
        if blob.list_keys(key.split("/", 1)[0] + "/"):
            return None
    except PersistError:
        return None
    where = (
        "does not exist"
        if isinstance(blob, FileBlob) and not blob.root_exists()
        else "holds no part of this shard"
    )
    return f"the blob store {redact(uri)} {where}: is --blob right?"


def _guard(fn: Callable[[], None]) -> None:
    try:
        fn()
    except CliError as e:
        fail(e.what, e.todo, e.detail)
    except UnknownShard as e:
        fail(str(e), None if e.close else "`persist shards` lists the shards")
    except (PersistError, StashError) as e:
        fail(_message(e))


def summary(st: ShardState, retired: int = 0) -> dict[str, Any]:
    """The numbers ``inspect`` and ``shards`` show: state (:func:`shard_state`),
    frontiers, batches, parts, stored updates (rows of the parts, not consolidated),
    bytes, leases, retired parts waiting for GC."""
    batches = st.batches()
    parts = [p for b in batches for p in b.parts]
    return {
        "name": st.name,
        "state": shard_state(st),
        "shard_id": st.shard_id,
        "seqno": st.seqno,
        "since": st.since.to_json(),
        "upper": st.upper.to_json(),
        "batches": len(batches),
        "parts": len(parts),
        "inline_parts": sum(1 for p in parts if p.inline is not None),
        "updates": sum(b.len for b in batches),
        "bytes": sum(p.encoded_size_bytes for p in parts),
        "inline_bytes": st.inline_bytes(),
        "readers": len(st.readers),
        "writers": len(st.writers),
        "retired": retired,
        "merges_outstanding": len(st.trace.all_fueled_merge_reqs()),
        "key_schema": [f"{f.name}: {f.type}" for f in st.key_schema],
        "value_schema": [f"{f.name}: {f.type}" for f in st.value_schema],
    }


def schema_history(st: ShardState) -> list[dict[str, Any]]:
    """The shard's value schema versions for ``inspect``: id,
    columns (``"name: type"``, `` not null`` where so) and how many parts record it."""
    counts: dict[int, int] = {}
    for b in st.batches():
        for p in b.parts:
            counts[p.schema_id] = counts.get(p.schema_id, 0) + 1
    return [
        {
            "id": i,
            "value_schema": [f"{f.name}: {f.type}{'' if f.nullable else ' not null'}" for f in v],
            "parts": counts.get(i, 0),
        }
        for i, v in enumerate(st.schema_history)
    ]


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    print_table(title, columns, rows)


def _fmt(frontier: Any) -> str:
    return "{" + ",".join(map(str, frontier)) + "}"


@click.group(cls=CliGroup)
@store_options
@click.option("-v", "--verbose", is_flag=True, help="Log at INFO level.")
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve Prometheus /metrics on this port while the command runs.",
)
@click.option(
    "--metrics-addr",
    default="0.0.0.0",
    show_default=True,
    help="Address to serve /metrics on (all interfaces by default, so Prometheus can "
    "scrape from another host; 127.0.0.1 keeps it local).",
)
def main(verbose: bool, metrics_port: int | None, metrics_addr: str) -> None:
    """Inspect and maintain persist shards.

    The store options --stash and --blob go before or after the subcommand
    (or come from PERSIST_STASH / PERSIST_BLOB).  No command creates a stash or a
    blob root."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING)
    try:
        persist_metrics.serve(metrics_port, addr=metrics_addr)
    except OSError as e:  # the port is taken, the address is not ours, ...
        fail(str(e), "choose another --metrics-port or --metrics-addr")


def _listed_state(c: PersistClient, shard_id: str) -> ShardState:
    """A shard's latest state read from consensus without the blob store check."""
    h = c.consensus.head(shard_id)
    if h is None:
        raise PersistError(f"shard {shard_id} has no state in consensus")
    return ShardState.from_entries(h.data)


def shard_state(st: ShardState) -> str:
    """``"finalized"`` (dropped: a tombstone), ``"closed"`` (its upper is the empty
    antichain: no more writes) or ``"live"``."""
    if st.tombstone:
        return "finalized"
    return "closed" if st.upper.as_option() is None else "live"


@main.command()
@store_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def shards(ctx: click.Context, as_json: bool) -> None:
    """List the shards: state (live, closed, finalized), frontiers and sizes.

    The updates column counts stored updates (rows of the parts, before
    consolidation: changing a row stores a retraction and an insertion), not live
    rows, which would need every part read: persist sql 'SELECT count(*) FROM
    SHARD' counts those.  A finalized (dropped) shard shows no frontiers or sizes."""

    def run() -> None:
        with _client(ctx, readonly=True) as c:
            names = c.shards()
            # Listed from consensus alone: a shard of another blob store is listed too
            # (every other command refuses it, naming both stores).
            out = [
                summary(_listed_state(c, sid), len(c.consensus.retired(sid)))
                for sid in names.values()
            ]
        if as_json:
            click.echo(json.dumps(out, sort_keys=True))
            return
        _table(
            "shards",
            ["name", "state", "shard_id", "seqno", "since", "upper", "batches", "updates", "bytes"],
            [
                [s["name"], s["state"], s["shard_id"], s["seqno"]]
                + (
                    ["-"] * 5
                    if s["state"] == "finalized"
                    else [
                        _fmt(s["since"]),
                        _fmt(s["upper"]),
                        s["batches"],
                        s["updates"],
                        s["bytes"],
                    ]
                )
                for s in out
            ],
        )

    _guard(run)


@main.command()
@store_options
@click.argument("shard")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (summary and batches).")
@click.option("--state", "full_state", is_flag=True, help="With --json: the whole state.")
@click.pass_context
def inspect(ctx: click.Context, shard: str, as_json: bool, full_state: bool) -> None:
    """Show a shard (a name, or id:<shard id>): state, since, upper, seqno, batches,
    parts, stored updates, bytes, and its schema history (each value schema version and its parts)."""

    def run() -> None:
        with _client(ctx, readonly=True) as c:
            st = c.inspect(shard)
            retired = len(c.consensus.retired(st.shard_id))
        s = summary(st, retired)
        batches = [
            {
                "lower": b.desc.lower.to_json(),
                "upper": b.desc.upper.to_json(),
                "since": b.desc.since.to_json(),
                "updates": b.len,
                "parts": len(b.parts),
                "bytes": sum(p.encoded_size_bytes for p in b.parts),
                "inline": sum(1 for p in b.parts if p.inline is not None),
            }
            for b in st.batches()
        ]
        schemas = schema_history(st)
        if as_json:
            doc: dict[str, Any] = {"summary": s, "batches": batches, "schemas": schemas}
            if full_state:
                doc["state"] = st.to_json()
            click.echo(json.dumps(doc, sort_keys=True))
            return
        _table(
            f"shard {s['name']} ({s['shard_id']})",
            ["field", "value"],
            [
                [
                    k,
                    _fmt(v)
                    if k in ("since", "upper")
                    else v
                    if isinstance(v, str)
                    else json.dumps(v),
                ]
                for k, v in s.items()
            ],
        )
        _table(
            "batches",
            ["lower", "upper", "since", "updates", "parts", "inline", "bytes"],
            [
                [
                    _fmt(b["lower"]),
                    _fmt(b["upper"]),
                    _fmt(b["since"]),
                    b["updates"],
                    b["parts"],
                    b["inline"],
                    b["bytes"],
                ]
                for b in batches
            ],
        )
        _table(
            "schema history",
            ["id", "value columns", "parts"],
            [[v["id"], ", ".join(v["value_schema"]), v["parts"]] for v in schemas],
        )

    _guard(run)


@main.command()
@store_options
@click.argument("table")
@click.option("--limit", type=click.IntRange(min=0), default=None, help="Show the newest N.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (one object per line).")
@click.pass_context
def history(ctx: click.Context, table: str, limit: int | None, as_json: bool) -> None:
    """Show a table's history, newest first: version, logical time, commit timestamp
    (UTC), operation, parameters and metrics (persist.Table.history).  Reads only."""

    def run() -> None:
        with _client(ctx, readonly=True) as c:
            h = c.table(table).history(limit)
        rows = h.to_pylist()
        for r in rows:
            r["timestamp"] = r["timestamp"].isoformat()
        if as_json:
            for r in rows:
                r["parameters"] = json.loads(r["parameters"])
                r["metrics"] = json.loads(r["metrics"])
                click.echo(json.dumps(r))
        else:
            _table(f"history of {table}", h.column_names, [list(r.values()) for r in rows])

    _guard(run)


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|w|d|h|m|s)")  # ms before m
_UNIT_SECONDS = {"w": 604800.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def parse_duration(text: str) -> dt.timedelta:
    """``7d``, ``12h``, ``30m``, ``45s``, ``1w``, ``1d12h`` as a ``timedelta``.

    Raises:
        click.BadParameter: anything else.
    """
    t = text.strip().lower()
    pos, seconds = 0, 0.0
    for m in _DURATION.finditer(t):
        if m.start() != pos:
            break
        seconds += float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
        pos = m.end()
    if not t or pos != len(t):
        raise click.BadParameter(
            f"{text!r} is not a duration: write a number and a unit (w, d, h, m, s, ms), "
            "e.g. 7d or 1d12h"
        )
    try:
        return dt.timedelta(seconds=seconds)
    except OverflowError:
        raise click.BadParameter(f"{text!r} is longer than a duration can be") from None


@main.command()
@store_options
@click.argument("table")
@click.option("--duration", help="Keep this much history readable, e.g. 7d, 12h (none: clear).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def retention(ctx: click.Context, table: str, duration: str | None, as_json: bool) -> None:
    """Show or set a table's retention (persist.Table.set_retention): its since follows
    the newest time committed at or before now minus the duration."""
    span = None
    if duration is not None and duration.strip().lower() != "none":
        span = parse_duration(duration)

    def run() -> None:
        with _client(ctx, readonly=duration is None) as c:
            t = c.table(table)
            if duration is not None:
                t.set_retention(span)
            d = t.details()
        out = {"table": table, "retention_seconds": d["retention_seconds"], "since": d["since"]}
        if as_json:
            click.echo(json.dumps(out, sort_keys=True))
        else:
            _table(f"retention of {table}", ["field", "value"], [[k, v] for k, v in out.items()])

    _guard(run)


@main.command()
@store_options
@click.argument("shard")
@click.option(
    "--full",
    is_flag=True,
    help="Merge every batch into one, consolidated at the since (persist.Table.optimize).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def compact(ctx: click.Context, shard: str, full: bool, as_json: bool) -> None:
    """Answer every outstanding merge request of a shard (with --full: merge all its
    batches into one, consolidated at the since)."""

    def run() -> None:
        if full:
            with _client(ctx, readonly=False) as c:
                rep = optimize(c.context, c.compactor, c.machine(c.shard_id(shard))).to_dict()
            if as_json:
                click.echo(json.dumps(rep, sort_keys=True))
            else:
                rows = [[k, v] for k, v in rep.items()]
                _table(f"full compaction of {shard}", ["field", "value"], rows)
            return
        with _client(ctx, readonly=False) as c:
            r = c.compactor.compact_once(shard)
            after = summary(c.inspect(shard))
        out = {
            "applied": r.applied,
            "not_applied": r.not_applied,
            "failed": r.failed,
            "rows_in": r.rows_in,
            "rows_out": r.rows_out,
            "bytes_written": r.bytes_written,
            "batches_after": after["batches"],
        }
        if as_json:
            click.echo(json.dumps(out, sort_keys=True))
        else:
            _table(f"compaction of {shard}", ["field", "value"], [[k, v] for k, v in out.items()])
        if r.failed:
            sys.exit(1)

    _guard(run)


@main.command()
@store_options
@click.argument("shard")
@click.option(
    "--grace",
    "grace",
    type=float,
    default=3600.0,
    show_default=True,
    help="Seconds a blob must have been unreferenced before it is deleted.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def gc(ctx: click.Context, shard: str, grace: float, as_json: bool) -> None:
    """Delete a shard's unreferenced blobs older than the grace period; truncate its
    consensus versions."""

    def run() -> None:
        with _client(ctx, readonly=False) as c:
            r = collect_garbage(c, shard, grace_seconds=grace)
        out = {
            "shard_id": r.shard_id,
            "deleted_retired": len(r.deleted_retired),
            "deleted_abandoned": len(r.deleted_abandoned),
            "kept_recent": r.kept_recent,
            "kept_live_writer": r.kept_live_writer,
            "kept_held": r.kept_held,
            "unrecognized": len(r.unrecognized),
            "referenced": r.referenced,
            "failed": len(r.failed),
        }
        if as_json:
            click.echo(json.dumps(out, sort_keys=True))
        else:
            _table(f"gc of {shard}", ["field", "value"], [[k, v] for k, v in out.items()])

    _guard(run)


@main.command()
@store_options
@click.argument("shard")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def fsck(ctx: click.Context, shard: str, as_json: bool) -> None:
    """Check that every part a shard's state references exists with its recorded size
    and SHA-256; list orphans.  Exits with code 2 on damage."""
    code = [0]

    def run() -> None:
        with _client(ctx, readonly=True) as c:
            r = fsck_shard(c, shard)
            every_part_missing = r.missing and len(r.missing) == r.checked_parts
            hint = _blob_hint(ctx, r.missing[0]) if every_part_missing else None
        if as_json:
            click.echo(json.dumps(r.to_json(), sort_keys=True))
        else:
            _table(
                f"fsck of {r.name} ({r.shard_id}) at seqno {r.seqno}",
                ["field", "value"],
                [
                    ["ok", json.dumps(r.ok)],
                    ["checked_parts", r.checked_parts],
                    ["missing", len(r.missing)],
                    ["wrong_size", len(r.wrong_size)],
                    ["wrong_checksum", len(r.wrong_checksum)],
                    ["symlinks", len(r.symlinks)],
                    ["orphans", len(r.orphans)],
                    ["retired", r.retired],
                    ["unrecognized", len(r.unrecognized)],
                ],
            )
            for line in r.damage():
                click.echo(printable(f"damage: {line}", backslashes=False), err=True)
        if hint is not None:
            click.echo(
                printable(f"error: every part is missing — {hint}", backslashes=False), err=True
            )
        if not r.ok:
            code[0] = 2

    _guard(run)
    if code[0]:
        sys.exit(code[0])


@main.command()
@store_options
@click.argument("shard")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def drop(ctx: click.Context, shard: str, yes: bool, as_json: bool) -> None:
    """Finalize a shard: tombstone its state and delete its parts (irreversible)."""
    if not yes:
        click.confirm(
            printable(f"drop shard {shard} and delete all its data?", backslashes=False), abort=True
        )

    def run() -> None:
        with _client(ctx, readonly=False) as c:
            sid = c.shard_id(shard)
            n = c.finalize_shard(shard)
        out = {"shard_id": sid, "deleted_blobs": n, "tombstone": True}
        if as_json:
            click.echo(json.dumps(out, sort_keys=True))
        else:
            _table(f"drop of {shard}", ["field", "value"], [[k, v] for k, v in out.items()])

    _guard(run)


# ------------------------------------------------------------ cat and sql


def _readable_as_of(c: PersistClient, shard: str, as_of: int | None, waits: bool = False) -> int:
    """``as_of``, checked to be readable now (at or after the since, before the upper;
    the upper is not checked if the read ``waits`` for it), or by default the latest
    readable time (``upper - 1``, at least the since).

    Raises:
        InvalidUsage: the shard has no readable time yet (its upper is its since), or
            it was finalized (dropped).
        CliError: ``as_of`` is before the since (compacted away) or, unless ``waits``,
            at or beyond the upper (not yet written), saying what to pass instead.
    """
    st = c.inspect(shard)
    st.check_not_finalized()
    upper, since = st.upper.as_option(), st.since.as_option()
    if as_of is not None:
        if since is None or as_of < since:
            raise CliError(
                f"shard {shard!r} cannot be read at time {as_of}: its since is "
                f"{_fmt(st.since.to_json())}, and earlier times are compacted away",
                "nothing is readable any more (the shard is closed and compacted)"
                if since is None
                else f"read at --as-of {since} or later",
            )
        if upper is not None and as_of >= upper and not waits:
            raise CliError(
                f"shard {shard!r} cannot be read at time {as_of} yet: its upper is {upper}, "
                f"so only times before {upper} are complete",
                f"read at --as-of {upper - 1} or earlier, or add --wait SECONDS to wait "
                f"until time {as_of} is complete",
            )
        return as_of
    if upper is None:  # closed: every time up to the since is readable
        if since is None:
            raise InvalidUsage(f"shard {shard!r} is closed and compacted away: nothing to read")
        return since
    if since is not None and upper <= since:
        raise InvalidUsage(
            f"shard {shard!r} has no readable time yet (since {since}, upper {upper})"
        )
    return upper - 1


def _consolidated(
    c: PersistClient, shard: str, as_of: int | None, wait: float | None = None
) -> tuple[int, pa.Table]:
    """The shard's consolidated snapshot at ``as_of`` (default: the latest readable
    time), read without a lease (:func:`persist.version_read.read_version`); with
    ``wait`` (seconds), through a reader lease, waiting that long at most for ``as_of``
    to be complete.

    Raises:
        CliError: as :func:`_readable_as_of`, or the wait ran out.
    """
    t = _readable_as_of(c, shard, as_of, waits=wait is not None)
    st = c.inspect(shard)
    if wait is None:  # no lease: nothing is written (a readonly stash will do)
        return t, read_version(c.context, c.machine(st.shard_id), st, t)
    with c.open_reader(shard, st.key_schema, st.value_schema) as r:
        try:
            return t, r.snapshot(t, wait=wait is not None, timeout=wait)
        except TimeoutError:
            raise CliError(
                f"shard {shard!r}: time {t} was not complete within {wait} s (its upper "
                f"is now {_fmt(c.inspect(shard).upper.to_json())})",
                "wait longer, or read an earlier --as-of",
            ) from None


@main.command()
@store_options
@click.argument("shard")
@click.option("--as-of", "as_of", type=int, default=None, help="Time to read (default upper-1).")
@click.option(
    "--wait",
    type=click.FloatRange(min=0, max=1e8),
    default=None,
    metavar="SECONDS",
    help="If --as-of is not complete yet (at or beyond the upper), wait this long at most for it.",
)
@click.option("--limit", type=click.IntRange(min=0), default=None, help="At most N rows.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="One JSON object per line (strict JSON: NaN and infinities as the strings "
    '"NaN", "Infinity", "-Infinity").',
)
@click.pass_context
def cat(
    ctx: click.Context,
    shard: str,
    as_of: int | None,
    wait: float | None,
    limit: int | None,
    as_json: bool,
) -> None:
    """Print a shard's consolidated rows as of a time (keys, values, _diff), sorted.

    Writes nothing (a readonly stash will do), except with --wait, which takes a
    reader lease while it waits (so the stash must be writable)."""

    def run() -> None:
        with _client(ctx, readonly=wait is None) as c:
            t, snap = _consolidated(c, shard, as_of, wait)
        if limit is not None:
            snap = snap.slice(0, limit)
        snap = snap.drop_columns(["_time"])
        if as_json:
            for row in snap.to_pylist():
                click.echo(json_line(row))
            return
        _table(
            f"{shard} as of {t}",
            snap.column_names,
            [list(r.values()) for r in snap.to_pylist()],
        )

    _guard(run)


@main.command()
@store_options
@click.argument("query")
@click.option("--as-of", "as_of", type=int, default=None, help="Time to read every shard at.")
@click.option(
    "--max-expanded-rows",
    type=click.IntRange(min=0),
    default=MAX_EXPANDED_ROWS,
    show_default=True,
    help="Refuse a shard whose multiplicities above 1 would add more rows than this.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="One JSON object per line (strict JSON, as for cat).",
)
@click.pass_context
def sql(
    ctx: click.Context, query: str, as_of: int | None, max_expanded_rows: int, as_json: bool
) -> None:
    """Run a DuckDB SQL QUERY over shards: every shard named in it is a table of its
    consolidated rows, one row per unit of multiplicity, key and value columns only.
    All shards are read at one time: --as-of, or by default the latest time every one of
    them has (so a cross-shard transaction is wholly visible or wholly absent).  The
    query, parsing included, reaches nothing else: DuckDB's external access (files,
    network) is off and locked.  A shard whose multiplicities would expand to more than
    --max-expanded-rows extra rows is refused (see its _diff with ``persist cat``).

    Writes nothing: a readonly stash will do."""
    import duckdb

    from persist.errors import SinceViolation

    def run() -> None:
        con = locked_duckdb()
        try:
            try:
                names = con.get_table_names(query)
            except duckdb.ParserException as e:
                raise CliError(
                    "persist sql: cannot parse the query", "fix the SQL", str(e)
                ) from None
            except duckdb.Error as e:
                raise CliError(f"persist sql: {first_line(e)}", None, rest_lines(e)) from None
            with _client(ctx, readonly=True) as c:
                known = set(c.shards())
                wanted = shards_named(names, known)
                if not wanted:
                    close = sorted(
                        {m for n in names for m in difflib.get_close_matches(n, known, n=3)}
                    )
                    raise CliError(
                        f"persist sql: the query names no shard (tables {sorted(names)})",
                        f"did you mean {' or '.join(map(repr, close))}?"
                        if close
                        else f"the shards are {sorted(known)[:20]}",
                    )
                if as_of is not None:  # each shard can be read then
                    for n in wanted:
                        _readable_as_of(c, n, as_of)
                try:
                    # One time for all: a transaction is all or nothing across shards.
                    snaps = c.snapshot_many(dict.fromkeys(wanted, as_of))
                except SinceViolation as e:
                    if as_of is None:  # name the shard with no readable time yet
                        for n in wanted:
                            _readable_as_of(c, n, None)
                    raise InvalidUsage(
                        f"persist sql: cannot read shards {wanted} at one time: {e} (a "
                        "shard has no readable time yet, or --as-of is before its since)"
                    ) from None
            for n in wanted:
                con.register(n, as_rows(snaps[n], n, max_expanded_rows))
            try:
                rel = con.sql(query)
                if rel is None:
                    raise InvalidUsage("persist sql: the statement is not a query (no rows)")
                result: pa.Table = rel.to_arrow_table()
            except duckdb.Error as e:
                raise CliError(f"persist sql: {first_line(e)}", None, rest_lines(e)) from None
        finally:
            con.close()
        if as_json:
            for row in result.to_pylist():
                click.echo(json_line(row))
            return
        _table("persist sql", result.column_names, [list(r.values()) for r in result.to_pylist()])

    _guard(run)


if __name__ == "__main__":  # pragma: no cover
    main()
