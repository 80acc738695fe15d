"""The ``persist`` command line: list shards, inspect one, compact it, collect its
garbage, check it, drop it, print its rows, query shards with SQL.

``persist --stash URL --blob URI [--metrics-port P] shards | inspect SHARD | compact SHARD
| gc SHARD | fsck SHARD | drop SHARD | cat SHARD [--as-of T] [--limit N] | sql QUERY
[--as-of T]`` (``--stash``/``--blob`` also from ``PERSIST_STASH``/``PERSIST_BLOB``).
``cat`` and ``sql`` read consolidated snapshots through a reader lease (a seqno hold, so
GC cannot delete a part they are reading), which needs a writable stash; ``sql`` runs
DuckDB with each shard named in the query registered as an Arrow table of its rows.  ``SHARD`` is a shard *name*; a shard id is given as
``id:<shard id>`` (names and ids never mix: a name shaped like an id is a name).  Output
is a readable table (rich) or JSON with ``--json``.  Invariants kept here: reads other
than ``cat``/``sql`` open the stash readonly; URLs are never printed with credentials (:func:`stash.redact`); errors are
printed as one line and exit with code 1; ``fsck`` exits with code 2 when it finds
damage; tables are rendered by :func:`stash.cli.print_table`, so no stored text reaches
the terminal as a control sequence or as rich markup.
"""

from __future__ import annotations

import decimal
import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

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


def _guard(fn: Callable[[], None]) -> None:
    try:
        fn()
    except (PersistError, StashError) as e:
        click.echo(printable(redact(f"error: {e}"), backslashes=False), err=True)
        sys.exit(1)


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
    """The shard's value schema versions for ``inspect`` (DESIGN section 5.3): id,
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
@click.pass_context
def main(
    ctx: click.Context, stash_url: str, blob_uri: str, verbose: bool, metrics_port: int | None
) -> None:
    """Inspect and maintain persist shards."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING)
    persist_metrics.serve(metrics_port)
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
        InvalidUsage: the shard has no readable time yet (its upper is its since).
    """
    st = c.inspect(shard)
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


def _as_rows(table: pa.Table, shard: str) -> pa.Table:
    """A consolidated snapshot as a relation: one row per unit of multiplicity (a row
    with ``_diff`` 3 appears three times), without ``_time``/``_diff``.

    Raises:
        InvalidUsage: a negative multiplicity (the shard is not a collection at this
            time: more retractions than insertions), naming the shard and the count.
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
    counts = diffs.to_numpy()
    return data.take(pa.array(np.repeat(np.arange(len(counts)), counts)))


def _json_default(v: Any) -> Any:
    """JSON of values ``json`` lacks: integral decimals (DuckDB's ``sum`` of integers is
    a 128-bit integer, which Arrow carries as a decimal) as ints, the rest as text."""
    if isinstance(v, decimal.Decimal) and v == v.to_integral_value():
        return int(v)
    return str(v)


@main.command()
@click.argument("shard")
@click.option("--as-of", "as_of", type=int, default=None, help="Time to read (default upper-1).")
@click.option("--limit", type=click.IntRange(min=0), default=None, help="At most N rows.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
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
                click.echo(json.dumps(row, sort_keys=True, default=_json_default))
            return
        _table(
            f"{shard} as of {t}",
            snap.column_names,
            [list(r.values()) for r in snap.to_pylist()],
        )

    _guard(run)


@main.command()
@click.argument("query")
@click.option("--as-of", "as_of", type=int, default=None, help="Time to read every shard at.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_context
def sql(ctx: click.Context, query: str, as_of: int | None, as_json: bool) -> None:
    """Run a DuckDB SQL QUERY over shards: every shard named in it is a table of its
    consolidated rows as of --as-of (default: each shard's latest readable time), one row
    per unit of multiplicity, key and value columns only. The query reaches nothing
    else: DuckDB's external access (files, network) is off.

    Takes reader leases for the reads (so the stash must be writable)."""
    import duckdb

    def run() -> None:
        try:
            names = duckdb.get_table_names(query)
        except duckdb.Error as e:
            raise InvalidUsage(f"persist sql: cannot parse the query: {e}") from None
        with _client(ctx, readonly=False) as c:
            known = set(c.shards())
            wanted = sorted(n for n in names if n in known)
            if not wanted:
                raise InvalidUsage(
                    f"persist sql: the query names no shard (tables {sorted(names)}; "
                    f"shards {sorted(known)[:20]})"
                )
            tables = {n: _as_rows(_consolidated(c, n, as_of)[1], n) for n in wanted}
        con = duckdb.connect()
        try:
            for n, t in tables.items():
                con.register(n, t)
            # The query sees the shards and nothing else: no files, no network.
            con.execute("SET enable_external_access = false")
            con.execute("SET lock_configuration = true")
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
                click.echo(json.dumps(row, sort_keys=True, default=_json_default))
            return
        _table("persist sql", result.column_names, [list(r.values()) for r in result.to_pylist()])

    _guard(run)


if __name__ == "__main__":  # pragma: no cover
    main()
