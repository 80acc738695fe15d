"""The table ``commit_times(collection_id, time, committed_at)``: the wall clock (Unix
milliseconds) at which a time of a collection was committed, recorded for collections
whose retention is by duration (``Stash.set_retention(c, keep_for=...)``), so their
since can follow ``now - keep_for`` (``stash/retention.py``).  Rows of times before the
since are deleted as the since passes them.  The same table on SQLite and Postgres.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "commit_times",
        sa.Column(
            "collection_id",
            sa.Integer,
            sa.ForeignKey("collections.collection_id"),
            nullable=False,
        ),
        sa.Column("time", sa.BigInteger, nullable=False),
        sa.Column("committed_at", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("collection_id", "time"),
    )


def downgrade() -> None:
    op.drop_table("commit_times")
