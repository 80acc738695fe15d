"""Postgres gets an ordered index of key texts for key ranges (``Stash.peek_range``):
``data_collection_key_text`` on ``(collection_id, left(key::text, 1024) COLLATE "C")``.
The hash index of revision 0003 finds one key but has no order; this one holds the
first 1024 characters of each key's text, in code point order, so a range or prefix
scan walks it in key order (longer keys are ordered by their whole text after it; a
btree entry holds at most 2704 bytes, so the whole text cannot be indexed).  SQLite's
``data_collection_key`` on ``(collection_id, key)`` serves ranges already.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.create_index(
        "data_collection_key_text",
        "data",
        ["collection_id", sa.text('(left(key::text, 1024) COLLATE "C")')],
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.drop_index("data_collection_key_text", table_name="data")
