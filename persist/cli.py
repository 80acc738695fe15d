"""The ``persist`` command line: list shards, inspect one, compact it, collect its
garbage, check it, drop it, print its rows, query shards with SQL.

``persist --stash URL --blob URI [--metrics-port P [--metrics-addr A]] shards | inspect
SHARD | compact SHARD | gc SHARD | fsck SHARD | drop SHARD | cat SHARD [--as-of T]
[--limit N] | sql QUERY [--as-of T] [--max-expanded-rows N]`` (``--stash``/``--blob``
also from ``PERSIST_STASH``/``PERSIST_BLOB``).  ``cat`` and ``sql`` read consolidated
snapshots through reader leases (seqno holds, so GC cannot delete a part they are
reading), which needs a writable stash.  ``sql`` runs DuckDB with each shard named in the
query registered as an Arrow table of its rows (one row per unit of multiplicity), every
shard read at one time (``--as-of T``, or the latest time all of them have:
:meth:`persist.PersistClient.snapshot_many`), so a cross-shard transaction is wholly
visible or wholly absent.  ``SHARD`` is a shard *name*; a shard id is given as
``id:<shard id>`` (names and ids never mix: a name shaped like an id is a name).  Output
is a readable table (rich) or JSON with ``--json``.

Invariants kept here: reads other than ``cat``/``sql`` open the stash readonly; the SQL
query, parsing included, runs only on a private DuckDB connection whose external access
(files, network) is off and locked, so it reaches nothing but the registered shards and
answers alike for files that exist and files that do not; a shard whose multiplicities
would add more than ``--max-expanded-rows`` rows is refused by name, never half-built;
``--json`` is strict JSON, one object per line (non-finite floats as the strings
``"NaN"``, ``"Infinity"``, ``"-Infinity"``); URLs are never printed with credentials
(:func:`stash.redact`); errors (a ``/metrics`` port that cannot be bound included) are
printed as one ``error:`` line and exit with code 1; ``fsck`` exits with code 2 when it
finds damage; tables are rendered by :func:`stash.cli.print_table`, so no stored text
reaches the terminal as a control sequence or as rich markup.  ``/metrics`` is served on
all interfaces by default (``--metrics-addr 0.0.0.0``, the Prometheus convention, so a
scraper on another host reaches it); ``--metrics-addr 127.0.0.1`` keeps it local.
"""

from __future__ import annotations

import decimal
import json
import logging
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn

import click
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist import metrics as persist_metrics
from persist.client import PersistClient
from persist.errors import InvalidUsage, PersistError
from persist.fsck import fsck as fsck_shard
from persist.gc import collect_garbage
from persist.state import ShardState
from stash import Stash, StashError, redact
from stash.cli import print_table, printable

if TYPE_CHECKING:
    import duckdb


@contextmanager
def _client(ctx: click.Context, readonly: bool) -> Iterator[PersistClient]:
    url, blob = ctx.obj["stash"], ctx.obj["blob"]
    s = Stash.open(url, mode="readonly" if readonly else "writable", fenced=False)
    c = PersistClient(s, blob, compaction="off")
    try:
        yield c
    finally:
        c.close()
        s.close()


def _fail(message: str) -> NoReturn:
    """Print ``error: message`` as one line (credentials redacted, control characters
    escaped) and exit with code 1."""
    click.echo(printable(redact(f"error: {message}"), backslashes=False), err=True)
    sys.exit(1)


def _guard(fn: Callable[[], None]) -> None:
    try:
        fn()
    except (PersistError, StashError) as e:
        _fail(str(e))


def summary(st: ShardState, retired: int = 0) -> dict[str, Any]:
    """The numbers ``inspect`` shows: frontiers, batches, parts, rows, bytes, leases,
    retired parts waiting for GC."""
    batches = st.batches()
    parts = [p for b in batches for p in b.parts]
    return {
        "name": st.name,
        "shard_id": st.shard_id,
        "seqno": st.seqno,
        "since": st.since.to_json(),
        "upper": st.upper.to_json(),
        "batches": len(batches),
        "parts": len(parts),
        "inline_parts": sum(1 for p in parts if p.inline is not None),
        "rows": sum(b.len for b in batches),
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


@click.group()
@click.option(
    "--stash",
    "stash_url",
    envvar="PERSIST_STASH",
    required=True,
    help="Stash URL holding consensus (sqlite:///path, postgresql+psycopg://...).",
)
@click.option(
    "--blob",
    "blob_uri",
    envvar="PERSIST_BLOB",
    required=True,
    help="Blob store URI (file:///path, s3://bucket/prefix, ...).",
)
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
@click.pass_context
def main(
    ctx: click.Context,
    stash_url: str,
    blob_uri: str,
    verbose: bool,
    metrics_port: int | None,
    metrics_addr: str,
) -> None:
    """Inspect and maintain persist shards."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING)
    try:
        persist_metrics.serve(metrics_port, addr=metrics_addr)
    except OSError as e:  # the port is taken, the address is not ours, ...
        _fail(str(e))
    ctx.obj = {"stash": stash_url, "blob": blob_uri}


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def shards(ctx: click.Context, as_json: bool) -> None:
    """List the shards with their frontiers and sizes."""

    def run() -> None:
        with _client(ctx, readonly=True) as c:
            names = c.shards()
            out = [
                summary(c.machine(sid).fetch(), len(c.consensus.retired(sid)))
                for sid in names.values()
            ]
        if as_json:
            click.echo(json.dumps(out, sort_keys=True))
            return
        _table(
            "shards",
            ["name", "shard_id", "seqno", "since", "upper", "batches", "rows", "bytes"],
            [
                [
                    s["name"],
                    s["shard_id"],
                    s["seqno"],
                    _fmt(s["since"]),
                    _fmt(s["upper"]),
                    s["batches"],
                    s["rows"],
                    s["bytes"],
                ]
                for s in out
            ],
        )

    _guard(run)


@main.command()
@click.argument("shard")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (summary and batches).")
@click.option("--state", "full_state", is_flag=True, help="With --json: the whole state.")
@click.pass_context
def inspect(ctx: click.Context, shard: str, as_json: bool, full_state: bool) -> None:
    """Show a shard (a name, or id:<shard id>): since, upper, seqno, batches, parts, rows,
    bytes, and its schema history (each value schema version and its parts)."""

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
                "rows": b.len,
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
            ["lower", "upper", "since", "rows", "parts", "inline", "bytes"],
            [
                [
                    _fmt(b["lower"]),
                    _fmt(b["upper"]),
                    _fmt(b["since"]),
                    b["rows"],
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
@click.argument("shard")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def compact(ctx: click.Context, shard: str, as_json: bool) -> None:
    """Answer every outstanding merge request of a shard."""

    def run() -> None:
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
        if not r.ok:
            code[0] = 2

    _guard(run)
    if code[0]:
        sys.exit(code[0])


@main.command()
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


def _readable_as_of(c: PersistClient, shard: str, as_of: int | None) -> int:
    """``as_of``, or the latest readable time (``upper - 1``, at least the since).

    Raises:
        InvalidUsage: the shard has no readable time yet (its upper is its since), or
            it was finalized (dropped).
    """
    st = c.inspect(shard)
    st.check_not_finalized()
    if as_of is not None:
        return as_of
    upper, since = st.upper.as_option(), st.since.as_option()
    if upper is None:  # closed: every time up to the since is readable
        if since is None:
            raise InvalidUsage(f"shard {shard!r} is closed and compacted away: nothing to read")
        return since
    if since is not None and upper <= since:
        raise InvalidUsage(
            f"shard {shard!r} has no readable time yet (since {since}, upper {upper})"
        )
    return upper - 1


def _consolidated(c: PersistClient, shard: str, as_of: int | None) -> tuple[int, pa.Table]:
    """The shard's consolidated snapshot at ``as_of`` (default: the latest readable
    time), read through a reader lease (its seqno hold keeps GC off the parts)."""
    t = _readable_as_of(c, shard, as_of)
    st = c.inspect(shard)
    with c.open_reader(shard, st.key_schema, st.value_schema) as r:
        return t, r.snapshot(t)


MAX_EXPANDED_ROWS = 10_000_000
"""Default of ``persist sql --max-expanded-rows``: how many rows expanding a shard's
multiplicities above 1 may add to its consolidated snapshot."""


def _as_rows(table: pa.Table, shard: str, max_expanded_rows: int = MAX_EXPANDED_ROWS) -> pa.Table:
    """A consolidated snapshot as a relation: one row per unit of multiplicity (a row
    with ``_diff`` 3 appears three times), without ``_time``/``_diff``.

    Args:
        table: a consolidated snapshot (key and value columns, ``_time``, ``_diff``).
        shard: its name, for messages.
        max_expanded_rows: at most this many rows may be added by the expansion
            (``sum(_diff) - rows``); the relation is built in memory, so a multiplicity
            like ``2**50`` is refused rather than exhausting memory.

    Raises:
        InvalidUsage: a negative multiplicity (the shard is not a collection at this
            time: more retractions than insertions), naming the shard and the count;
            an expansion adding more than ``max_expanded_rows`` rows, naming the shard,
            its consolidated and expanded row counts, the limit and ways around it.
    """
    diffs = table.column("_diff")
    negative = pc.sum(pc.less(diffs, 0)).as_py() or 0
    if negative:
        raise InvalidUsage(
            f"shard {shard!r} has {negative} row(s) with a negative multiplicity at this "
            "time (more retractions than insertions): it is not a relation SQL can query"
        )
    data = table.drop_columns(["_time", "_diff"])
    if pc.all(pc.equal(diffs, 1)).as_py() in (True, None):
        return data
    # Summed as 38-digit decimals: exact where int64 would wrap (2**62 + 2**62).
    total = int(pc.sum(diffs.cast(pa.decimal128(38, 0))).as_py())
    if total - len(table) > max_expanded_rows:
        raise InvalidUsage(
            f"persist sql: shard {shard!r} holds {len(table)} consolidated row(s) that "
            f"stand for {total} rows (multiplicities above 1); expanding them to one row "
            f"per unit of multiplicity would add {total - len(table)} rows, over the limit "
            f"of {max_expanded_rows} (--max-expanded-rows); see the rows with their _diff "
            f"with `persist cat {shard}`, or raise the limit"
        )
    counts = diffs.to_numpy()
    return data.take(pa.array(np.repeat(np.arange(len(counts)), counts)))


def _json_value(v: Any) -> Any:
    """``v`` with every non-finite float, at any depth, replaced by the string
    ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (JSON has no such numbers; the strings
    are the ones Spark's and Jackson's JSON use, and Python's ``float()`` reads them)."""
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, dict):
        return {k: _json_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    return v


def _json_default(v: Any) -> Any:
    """JSON of values ``json`` lacks: integral decimals (DuckDB's ``sum`` of integers is
    a 128-bit integer, which Arrow carries as a decimal) as ints, the rest as text."""
    if isinstance(v, decimal.Decimal) and v == v.to_integral_value():
        return int(v)
    return str(v)


def _json_line(row: dict[str, Any]) -> str:
    """One row as strict JSON (RFC 8259: no ``NaN``/``Infinity`` tokens, see
    :func:`_json_value`; other values as :func:`_json_default`), keys sorted."""
    return json.dumps(_json_value(row), sort_keys=True, default=_json_default, allow_nan=False)


@main.command()
@click.argument("shard")
@click.option("--as-of", "as_of", type=int, default=None, help="Time to read (default upper-1).")
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
    ctx: click.Context, shard: str, as_of: int | None, limit: int | None, as_json: bool
) -> None:
    """Print a shard's consolidated rows as of a time (keys, values, _diff), sorted.

    Takes a reader lease for the read (so the stash must be writable)."""

    def run() -> None:
        with _client(ctx, readonly=False) as c:
            t, snap = _consolidated(c, shard, as_of)
        if limit is not None:
            snap = snap.slice(0, limit)
        snap = snap.drop_columns(["_time"])
        if as_json:
            for row in snap.to_pylist():
                click.echo(_json_line(row))
            return
        _table(
            f"{shard} as of {t}",
            snap.column_names,
            [list(r.values()) for r in snap.to_pylist()],
        )

    _guard(run)


def _locked_duckdb() -> duckdb.DuckDBPyConnection:
    """A private DuckDB connection that reaches nothing outside itself: external access
    (files, network, extensions) off and the configuration locked, so no statement can
    turn it back on.  Every use of the user's query (parsing it too) goes through it."""
    import duckdb

    con = duckdb.connect(":memory:")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def _shards_named(names: set[str] | list[str], known: set[str]) -> list[str]:
    """The shards a query's table ``names`` refer to.  DuckDB resolves table names
    without regard to case, so a name matches its shard exactly or, failing that, the
    one shard equal to it but for case (``FROM orders`` reads shard ``Orders``).

    Raises:
        InvalidUsage: the query refers to two shards whose names differ only in case
            (DuckDB cannot tell their tables apart).
    """
    by_fold: dict[str, list[str]] = {}
    for k in known:
        by_fold.setdefault(k.casefold(), []).append(k)
    wanted: set[str] = set()
    for n in names:
        if n in known:
            wanted.add(n)
        else:
            alike = by_fold.get(n.casefold(), [])
            if len(alike) == 1:
                wanted.add(alike[0])
    folded: dict[str, str] = {}
    for w in sorted(wanted):
        other = folded.setdefault(w.casefold(), w)
        if other != w:
            raise InvalidUsage(
                f"persist sql: shards {other!r} and {w!r} differ only in case, and DuckDB "
                "does not tell table names apart by case: query them separately"
            )
    return sorted(wanted)


@main.command()
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

    Takes reader leases for the reads (so the stash must be writable)."""
    import duckdb

    from persist.errors import SinceViolation

    def run() -> None:
        con = _locked_duckdb()
        try:
            try:
                names = con.get_table_names(query)
            except duckdb.ParserException as e:
                raise InvalidUsage(f"persist sql: cannot parse the query: {e}") from None
            except duckdb.Error as e:
                raise InvalidUsage(f"persist sql: {e}") from None
            with _client(ctx, readonly=False) as c:
                known = set(c.shards())
                wanted = _shards_named(names, known)
                if not wanted:
                    raise InvalidUsage(
                        f"persist sql: the query names no shard (tables {sorted(names)}; "
                        f"shards {sorted(known)[:20]})"
                    )
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
                con.register(n, _as_rows(snaps[n], n, max_expanded_rows))
            try:
                rel = con.sql(query)
                if rel is None:
                    raise InvalidUsage("persist sql: the statement is not a query (no rows)")
                result: pa.Table = rel.to_arrow_table()
            except duckdb.Error as e:
                raise InvalidUsage(f"persist sql: {e}") from None
        finally:
            con.close()
        if as_json:
            for row in result.to_pylist():
                click.echo(_json_line(row))
            return
        _table("persist sql", result.column_names, [list(r.values()) for r in result.to_pylist()])

    _guard(run)


if __name__ == "__main__":  # pragma: no cover
    main()
