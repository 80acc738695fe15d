"""The ``persist`` command line: list shards, inspect one, compact it, collect its
garbage, check it, drop it.

``persist --stash URL --blob URI shards | inspect SHARD | compact SHARD | gc SHARD |
fsck SHARD | drop SHARD`` (``--stash``/``--blob`` also from
``PERSIST_STASH``/``PERSIST_BLOB``).  ``SHARD`` is a shard *name*; a shard id is given as
``id:<shard id>`` (names and ids never mix: a name shaped like an id is a name).  Output
is a readable table (rich) or JSON with ``--json``.  Invariants kept here: reads open the
stash readonly; URLs are never printed with credentials (:func:`stash.redact`); errors are
printed as one line and exit with code 1; ``fsck`` exits with code 2 when it finds
damage; tables are rendered by :func:`stash.cli.print_table`, so no stored text reaches
the terminal as a control sequence or as rich markup.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from persist.client import PersistClient
from persist.errors import PersistError
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
@click.pass_context
def main(ctx: click.Context, stash_url: str, blob_uri: str, verbose: bool) -> None:
    """Inspect and maintain persist shards."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING)
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


if __name__ == "__main__":  # pragma: no cover
    main()
