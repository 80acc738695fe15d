"""Every stash records its identity: ``fence.stash_id``, a random uuid (32 hex digits)
given to the database when this revision runs (so at creation for a new stash), never
changed afterwards.  Collection handles carry it, and ``append`` refuses a batch whose
handle came from another stash.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-26
"""

from __future__ import annotations

import uuid

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("fence", sa.Column("stash_id", sa.Text, nullable=True))
    op.execute(
        sa.text("UPDATE fence SET stash_id = :sid").bindparams(sid=uuid.uuid4().hex)
    )
    with op.batch_alter_table("fence") as batch:
        batch.alter_column("stash_id", existing_type=sa.Text, nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("fence") as batch:
        batch.drop_column("stash_id")
