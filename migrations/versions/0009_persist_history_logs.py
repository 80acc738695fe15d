"""Persist's history records move from stash collections to compare-and-set logs: each
collection ``persist.history.<id>`` (one record per key, the version's seqno in 20
digits, appended at the record's index: ``persist/consensus.py`` before this revision)
becomes the log of the same name in the table ``logs`` (``stash/logs.py``): entry ``i``
is the ``i``-th record by key, as canonical JSON.  The collection (its rows, frontiers
and commit times) is removed.  A collection whose live rows are not one record per key
of multiplicity 1, as many as its upper, stops the migration, naming it, with nothing
changed.

The downgrade turns each such log back into its collection (record ``i`` at time ``i``
under its version's seqno, since at the last record, upper after it).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-29
"""

from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import op

from stash.codec import canonical_json

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

PREFIX = "persist.history."


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
        records: dict[str, str] = {}
        for k_text, v_text, n in rows:
            if pg:  # jsonb renders objects and decimals its own way
                from stash.postgres import canonical_text  # only Postgres needs psycopg

                k_text, v_text = canonical_text(k_text), canonical_text(v_text)
            key = json.loads(k_text)
            if n != 1 or not isinstance(key, str) or key in records:
                raise _corrupt(name, f"record {key!r} has multiplicity {n} or several values")
            records[key] = canonical_json(json.loads(v_text))
        upper = conn.execute(
            sa.text("SELECT upper FROM uppers WHERE collection_id = :c"), {"c": cid}
        ).scalar()
        if len(records) != (upper or 0):
            raise _corrupt(name, f"it holds {len(records)} records at upper {upper}")
        if records:
            conn.execute(
                sa.text("INSERT INTO logs (name, seqno, rollup, data) VALUES (:n, :s, :r, :d)"),
                [
                    {"n": name, "s": i, "r": False, "d": records[k]}
                    for i, k in enumerate(sorted(records))
                ],
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
            sa.text("SELECT seqno, data FROM logs WHERE name = :n ORDER BY seqno"), {"n": name}
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
        data = [
            {
                "c": cid,
                "k": canonical_json(f"{int(json.loads(d)['seqno']):020d}"),
                "v": d,
                "t": int(s),
            }
            for s, d in rows
        ]
        conn.execute(
            sa.text(
                "INSERT INTO data (collection_id, key, value, time, diff)"
                f" VALUES (:c, {kcol}, {vcol}, :t, 1)"
            ),
            data,
        )
        head = int(rows[-1][0])
        conn.execute(
            sa.text("INSERT INTO sinces (collection_id, since) VALUES (:c, :s)"),
            {"c": cid, "s": head},
        )
        conn.execute(
            sa.text("INSERT INTO uppers (collection_id, upper) VALUES (:c, :u)"),
            {"c": cid, "u": head + 1},
        )
        conn.execute(sa.text("DELETE FROM logs WHERE name = :n"), {"n": name})
