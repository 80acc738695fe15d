"""Postgres indexes a hash of each key instead of the key: ``data_collection_key_hash``
on ``(collection_id, jsonb_hash_extended(key, 0))`` replaces ``data_collection_key`` on
``(collection_id, key)``, whose btree entries cannot exceed 2704 bytes (a key of about
2.7 KB made the INSERT fail: "index row size ... exceeds btree version 4 maximum
2704").  Lookups probe the hash and then compare the key itself, so they find exactly
the rows whose key equals the one asked for (``jsonb_hash_extended`` is Postgres' own
hash of ``jsonb``, consistent with its equality, and immutable: the hash partitioning
of ``jsonb`` columns relies on it).  SQLite has no limit on the size of an index entry
and keeps its index on the key.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.create_index(
        "data_collection_key_hash",
        "data",
        ["collection_id", sa.text("jsonb_hash_extended(key, 0)")],
    )
    op.drop_index("data_collection_key", table_name="data")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    # Fails, as before this revision, if a key is too long for a btree entry.
    op.create_index("data_collection_key", "data", ["collection_id", "key"])
    op.drop_index("data_collection_key_hash", table_name="data")
