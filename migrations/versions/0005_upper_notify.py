"""Postgres notifies channel ``stash_uppers`` (payload: the collection id) whenever a
collection's upper moves, so ``Stash.subscribe`` wakes on ``LISTEN`` instead of
polling (``stash/feed.py``).  The notification is sent at COMMIT, only for committed
changes; the trigger function and trigger live in the schema of the ``uppers`` table.
SQLite has no NOTIFY: its subscribers poll.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(
        "CREATE FUNCTION stash_notify_upper() RETURNS trigger LANGUAGE plpgsql AS $$"
        " BEGIN PERFORM pg_notify('stash_uppers', NEW.collection_id::text); RETURN NULL;"
        " END $$"
    )
    op.execute(
        "CREATE TRIGGER stash_uppers_notify AFTER UPDATE OF upper ON uppers FOR EACH ROW"
        " WHEN (NEW.upper IS DISTINCT FROM OLD.upper) EXECUTE FUNCTION stash_notify_upper()"
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP TRIGGER stash_uppers_notify ON uppers")
    op.execute("DROP FUNCTION stash_notify_upper()")
