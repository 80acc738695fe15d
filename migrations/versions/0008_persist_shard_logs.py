"""Persist's shard versions move from stash collections to compare-and-set logs: each
collection ``persist.shard.<id>`` (a rollup of entries, keyed by entry name, and one
``diff/<seqno>`` entry per later version: ``persist/consensus.py`` before this revision)
becomes the log of the same name in the table ``logs`` (``stash/logs.py``): one rollup
row at the rollup's seqno holding the entries as one JSON object, and one row per diff
after it.  The collection (its rows, frontiers and commit times) is removed.  Only the
live rows are converted (the rows as the collection's consolidation leaves them); a
collection whose live rows are not a rollup and diffs (an entry of multiplicity other
than 1, no ``meta.seqno``) stops the migration, naming it, with nothing changed.

The downgrade turns each such log back into its collection (the rollup's entries at the
rollup's seqno, one diff entry per later row, since at the rollup, upper after the
head).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-29
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from alembic import op

from stash.codec import canonical_json

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

PREFIX = "persist.shard."
DIFF_PREFIX = "diff/"


def _canonical(value: Any) -> str:
    """The canonical JSON text of a value, as the stash writes it."""
    return canonical_json(value)


def _corrupt(name: str, what: str) -> RuntimeError:
    return RuntimeError(
        f"cannot move collection {name} to a log: {what}; repair or remove it and migrate again"
    )


def upgrade() -> None:
    conn = op.get_bind()
    pg = conn.dialect.name == "postgresql"
    colls = conn.execute(sa.text("SELECT collection_id, name FROM collections")).all()
    text = "::text" if pg else ""
    for cid, name in colls:
        if not str(name).startswith(PREFIX):
            continue
        rows = conn.execute(
            sa.text(
                f"SELECT key{text}, value{text}, sum(diff) FROM data WHERE collection_id = :c"
                " GROUP BY key, value HAVING sum(diff) <> 0"
            ),
            {"c": cid},
        ).all()
        entries: dict[str, Any] = {}
        diffs: dict[int, Any] = {}
        for k_text, v_text, n in rows:
            if pg:  # jsonb renders objects and decimals its own way
                from stash.postgres import canonical_text  # only Postgres needs psycopg

                k_text, v_text = canonical_text(k_text), canonical_text(v_text)
            key, value = json.loads(k_text), json.loads(v_text)
            if n != 1 or not isinstance(key, str) or key in entries:
                raise _corrupt(name, f"entry {key!r} has multiplicity {n} or several values")
            if key.startswith(DIFF_PREFIX):
                seqno = value.get("seqno") if isinstance(value, dict) else None
                if not isinstance(seqno, int) or key != f"{DIFF_PREFIX}{seqno:020d}":
                    raise _corrupt(name, f"diff entry {key!r} is malformed")
                diffs[seqno] = value
            else:
                entries[key] = value
        if entries or diffs:
            meta = entries.get("meta")
            base = meta.get("seqno") if isinstance(meta, dict) else None
            if not isinstance(base, int) or isinstance(base, bool):
                raise _corrupt(name, "its rollup has no meta.seqno")
            out = [{"n": name, "s": base, "r": True, "d": _canonical(entries)}]
            out += [
                {"n": name, "s": s, "r": False, "d": _canonical(diffs[s])} for s in sorted(diffs)
            ]
            conn.execute(
                sa.text("INSERT INTO logs (name, seqno, rollup, data) VALUES (:n, :s, :r, :d)"),
                out,
            )
        for table in ("data", "sinces", "uppers", "commit_times"):
            conn.execute(
                sa.text(f"DELETE FROM {table} WHERE collection_id = :c"),  # noqa: S608 - constant
                {"c": cid},
            )
        conn.execute(sa.text("DELETE FROM collections WHERE collection_id = :c"), {"c": cid})


def downgrade() -> None:
    conn = op.get_bind()
    pg = conn.dialect.name == "postgresql"
    kcol, vcol = ("CAST(:k AS jsonb)", "CAST(:v AS jsonb)") if pg else (":k", ":v")
    names = [
        str(n)
        for (n,) in conn.execute(sa.text("SELECT DISTINCT name FROM logs")).all()
        if str(n).startswith(PREFIX)
    ]
    for name in names:
        rows = conn.execute(
            sa.text(
                "SELECT seqno, rollup, data FROM logs WHERE name = :n AND seqno >= coalesce("
                "(SELECT max(seqno) FROM logs WHERE name = :n AND rollup), 0) ORDER BY seqno"
            ),
            {"n": name},
        ).all()
        conn.execute(
            sa.text(
                "INSERT INTO collections (name, key_codec, value_codec) VALUES (:n, 'str', 'json')"
            ),
            {"n": name},
        )
        cid = conn.execute(
            sa.text("SELECT collection_id FROM collections WHERE name = :n"), {"n": name}
        ).scalar_one()
        base, head = int(rows[0][0]), int(rows[-1][0])
        data = [
            {"c": cid, "k": _canonical(k), "v": _canonical(v), "t": base}
            for k, v in json.loads(rows[0][2]).items()
        ]
        data += [
            {"c": cid, "k": _canonical(f"{DIFF_PREFIX}{int(s):020d}"), "v": d, "t": int(s)}
            for s, _r, d in rows[1:]
        ]
        if data:
            conn.execute(
                sa.text(
                    "INSERT INTO data (collection_id, key, value, time, diff)"
                    f" VALUES (:c, {kcol}, {vcol}, :t, 1)"
                ),
                data,
            )
        conn.execute(
            sa.text("INSERT INTO sinces (collection_id, since) VALUES (:c, :s)"),
            {"c": cid, "s": base},
        )
        conn.execute(
            sa.text("INSERT INTO uppers (collection_id, upper) VALUES (:c, :u)"),
            {"c": cid, "u": head + 1},
        )
        conn.execute(sa.text("DELETE FROM logs WHERE name = :n"), {"n": name})
