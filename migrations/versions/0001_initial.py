"""The first stash schema: fence, collections, data, sinces, uppers, stash_entries.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from stash.schema import STASH_ENTRIES_VIEW, JsonText

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    fence = op.create_table(
        "fence",
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("nonce", sa.LargeBinary, nullable=False),
    )
    op.bulk_insert(fence, [{"epoch": 0, "nonce": b""}])
    op.create_table(
        "collections",
        sa.Column("collection_id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.Text, nullable=False, unique=True),
        sa.Column("key_codec", sa.Text, nullable=False),
        sa.Column("value_codec", sa.Text, nullable=False),
    )
    op.create_table(
        "data",
        sa.Column(
            "collection_id",
            sa.Integer,
            sa.ForeignKey("collections.collection_id"),
            nullable=False,
        ),
        sa.Column("key", JsonText, nullable=False),
        sa.Column("value", JsonText, nullable=False),
        sa.Column("time", sa.BigInteger, nullable=False),
        sa.Column("diff", sa.BigInteger, nullable=False),
    )
    op.create_index("data_collection_key", "data", ["collection_id", "key"])
    op.create_index("data_collection_time", "data", ["collection_id", "time"])
    for name, col in (("sinces", "since"), ("uppers", "upper")):
        op.create_table(
            name,
            sa.Column(
                "collection_id",
                sa.Integer,
                sa.ForeignKey("collections.collection_id"),
                primary_key=True,
                autoincrement=False,
            ),
            sa.Column(col, sa.BigInteger, nullable=True),
        )
    op.execute(STASH_ENTRIES_VIEW)


def downgrade() -> None:
    op.execute("DROP VIEW stash_entries")
    for name in ("uppers", "sinces", "data", "collections", "fence"):
        op.drop_table(name)
