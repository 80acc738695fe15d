"""The stash's SQL schema, defined once as SQLAlchemy metadata (created only by alembic).

Tables: ``fence(epoch, nonce, stash_id)`` (one row: the leader epoch, and the stash's
identity: a uuid given at creation, never changed), ``collections``
(``collection_id``, unique ``name``, ``key_codec``, ``value_codec``), ``data``
(``collection_id, key, value, time, diff``, indexed on ``(collection_id, key)`` (on
Postgres ``(collection_id, jsonb_hash_extended(key, 0))``: any key length) and
``(collection_id, time)``, and on Postgres ``(collection_id, left(key::text, 1024)
COLLATE "C")`` for key ranges), ``sinces`` and ``uppers`` (one row per collection; NULL is the
empty frontier), ``commit_times`` (``collection_id, time, committed_at``: the wall clock,
Unix ms, a time was committed at; kept for retentions by duration), ``logs`` (``name,
seqno, rollup, data``, primary key ``(name, seqno)``: the compare-and-set logs of
:mod:`stash.logs`), and the views ``stash_entries(collection, key, value, time, diff)``
and ``stash_logs(log, seqno, rollup, data)``.

Invariants kept here: keys and values are canonical JSON: ``jsonb`` on Postgres, JSON
text on SQLite, so ``SELECT * FROM stash_entries`` is readable; ``SCHEMA_HEAD`` equals the
alembic head revision in ``migrations/versions`` (a test checks it); the tables are
created and changed only by those revisions, never by ``metadata.create_all``.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.types import TypeDecorator

SCHEMA_HEAD = "0010"

STASH_ENTRIES_VIEW = (
    "CREATE VIEW stash_entries AS "
    "SELECT c.name AS collection, d.key AS key, d.value AS value, d.time AS time, "
    "d.diff AS diff FROM data d JOIN collections c ON c.collection_id = d.collection_id"
)


class JsonText(TypeDecorator[str]):
    """Canonical JSON text in Python; ``jsonb`` on Postgres, ``TEXT`` elsewhere.

    On Postgres the text is sent with a ``::jsonb`` cast and read back as text re-rendered
    canonically by the backend (see :mod:`stash.sql`).
    """

    impl = sa.Text
    cache_ok = True

    def load_dialect_impl(self, dialect: sa.Dialect) -> sa.types.TypeEngine[Any]:
        if dialect.name == "postgresql":
            return dialect.type_descriptor(postgresql.JSONB())
        return dialect.type_descriptor(sa.Text())


metadata = sa.MetaData()

fence = sa.Table(
    "fence",
    metadata,
    sa.Column("epoch", sa.BigInteger, nullable=False),
    sa.Column("nonce", sa.LargeBinary, nullable=False),
    sa.Column("stash_id", sa.Text, nullable=False),
)

collections = sa.Table(
    "collections",
    metadata,
    sa.Column("collection_id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("name", sa.Text, nullable=False, unique=True),
    sa.Column("key_codec", sa.Text, nullable=False),
    sa.Column("value_codec", sa.Text, nullable=False),
)

data = sa.Table(
    "data",
    metadata,
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
    sa.Index("data_collection_time", "collection_id", "time"),
)
# A key is looked up through an index of (collection_id, key) on SQLite, of
# (collection_id, a hash of the key) on Postgres (a btree entry there holds at most 2704
# bytes: the key itself would limit keys to about 2.7 KB; lookups compare the key too).
sa.Index("data_collection_key", data.c.collection_id, data.c.key).ddl_if(dialect="sqlite")
sa.Index(
    "data_collection_key_hash",
    data.c.collection_id,
    sa.func.jsonb_hash_extended(data.c.key, sa.literal_column("0")),
).ddl_if(dialect="postgresql")
# Key ranges (stash.ranges) walk keys in code point order: SQLite's index above is in
# that order; on Postgres an index of the first 1024 characters of the key's text is.
sa.Index(
    "data_collection_key_text",
    data.c.collection_id,
    # Created with COLLATE "C" (migrations/versions/0004_key_text_index.py); SQLAlchemy's
    # reflection does not report an index expression's collation, so it is spelled
    # without one here, as alembic's autogenerate compares it.
    sa.text("left(key::text, 1024)"),
).ddl_if(dialect="postgresql")

sinces = sa.Table(
    "sinces",
    metadata,
    sa.Column(
        "collection_id",
        sa.Integer,
        sa.ForeignKey("collections.collection_id"),
        primary_key=True,
        autoincrement=False,
    ),
    sa.Column("since", sa.BigInteger, nullable=True),
)

uppers = sa.Table(
    "uppers",
    metadata,
    sa.Column(
        "collection_id",
        sa.Integer,
        sa.ForeignKey("collections.collection_id"),
        primary_key=True,
        autoincrement=False,
    ),
    sa.Column("upper", sa.BigInteger, nullable=True),
)

commit_times = sa.Table(
    "commit_times",
    metadata,
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

logs = sa.Table(
    "logs",
    metadata,
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("seqno", sa.BigInteger, nullable=False),
    sa.Column("rollup", sa.Boolean, nullable=False),
    sa.Column("data", sa.Text, nullable=False),
    sa.PrimaryKeyConstraint("name", "seqno"),
)

#: Views the revisions manage themselves (alembic's autogenerate leaves them alone).
VIEWS = ("stash_entries", "stash_logs")


def exists_on(item: object, dialect: str) -> bool:
    """Whether the schema item ``item`` exists on databases of ``dialect`` (``"sqlite"``,
    ``"postgresql"``): an index made with ``ddl_if(dialect=...)`` exists only there.
    Alembic's autogenerate does not read ``ddl_if``; its ``include_object`` hook asks this.
    """
    cond = getattr(item, "_ddl_if", None)
    return cond is None or cond.dialect in (None, dialect)
