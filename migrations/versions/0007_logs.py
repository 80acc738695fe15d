"""The table ``logs(name, seqno, rollup, data)``: compare-and-set logs
(``stash/logs.py``), each a sequence of entries named by a ``seqno``, written by one
conditional ``INSERT`` whose new seqno is the head's successor; ``rollup`` marks an
entry that holds a whole value (a reader starts from the latest one); and the view
``stash_logs(log, seqno, rollup, data)`` to read them with plain SQL.  The same table on
SQLite and Postgres (on Postgres in the stash's schema, ``stash/placement.py``).

Source of the idea: Materialize's ``consensus`` table (``src/persist/src/postgres.rs``).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "logs",
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("seqno", sa.BigInteger, nullable=False),
        sa.Column("rollup", sa.Boolean, nullable=False),
        sa.Column("data", sa.Text, nullable=False),
        sa.PrimaryKeyConstraint("name", "seqno"),
    )
    op.execute(
        "CREATE VIEW stash_logs AS "
        "SELECT name AS log, seqno, rollup, data FROM logs"
    )


def downgrade() -> None:
    op.execute("DROP VIEW stash_logs")
    op.drop_table("logs")
