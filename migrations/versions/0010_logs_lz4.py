"""On Postgres, the column ``logs.data`` is compressed with LZ4 instead of the default
pglz (``ALTER TABLE ... SET COMPRESSION lz4``, PostgreSQL 14 and later, when the server
was built with LZ4; otherwise nothing changes).  A log entry longer than the TOAST
threshold (about 2 KB: a rollup of a shard's whole state, or a diff carrying an inline
part) is compressed before it is written: pglz gives up on text that saves less than a
quarter (JSON holding base64 and hex), so such an entry went out of line uncompressed,
each chunk a TOAST row and index entry of its own; LZ4 takes any saving.  Measured with
``bench/bench_commit.py``'s WAL-by-source table: the Postgres WAL of a one-row persist
append falls by about 8% (the rollups' share by a third).  Only values written later are
compressed the new way; older ones read as before.  SQLite: nothing.

The downgrade sets the column back to the server's default compression.

Source of the idea: PostgreSQL's documentation of ``default_toast_compression`` and
``ALTER TABLE ... SET COMPRESSION``.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def _lz4_supported() -> bool:
    conn = op.get_bind()
    if conn.dialect.name != "postgresql" or conn.dialect.server_version_info < (14,):
        return False
    return bool(
        conn.execute(
            sa.text(
                "SELECT 'lz4' = ANY(enumvals) FROM pg_settings"
                " WHERE name = 'default_toast_compression'"
            )
        ).scalar()
    )


def upgrade() -> None:
    if _lz4_supported():
        op.execute("ALTER TABLE logs ALTER COLUMN data SET COMPRESSION lz4")


def downgrade() -> None:
    conn = op.get_bind()
    if conn.dialect.name == "postgresql" and conn.dialect.server_version_info >= (14,):
        op.execute("ALTER TABLE logs ALTER COLUMN data SET COMPRESSION DEFAULT")
