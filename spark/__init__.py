"""PySpark 4 Python data sources over stash catalogs and persist shards, and Spark jobs.

``from spark import register; register(session)`` registers two formats:

* ``stash``: batch read of a stash collection (:mod:`spark.stash_source`);
* ``persist``: batch read, batch write and streaming read of a persist shard
  (:mod:`spark.persist_source`).

:class:`PersistTable` (:mod:`spark.table`) is a shard as a table, after delta-spark's
``DeltaTable``: ``to_df`` reads it through Spark's own Parquet reader where it can.

:func:`persist_txn` commits Spark writes to several shards plus catalog updates as one
transaction (:mod:`spark.persist_txn`).

Invariants: importing this package does not import pyspark (the data source modules are
imported lazily by :func:`register`), and ``register`` is idempotent.  The package is the
public face only: :func:`register` lives in :mod:`spark.formats`, which the package and
:mod:`spark.session` both import, so no module of ``spark`` imports the package back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spark.formats import register

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from spark.persist_txn import PersistTxn
    from spark.table import PersistTable

__all__ = ["PersistTable", "activate", "build_session", "persist_txn", "register"]


def __getattr__(name: str) -> object:
    """``spark.PersistTable`` (:class:`spark.table.PersistTable`), imported on first use
    so that importing the package does not import pyspark."""
    if name == "PersistTable":
        from spark.table import PersistTable

        return PersistTable
    raise AttributeError(f"module 'spark' has no attribute {name!r}")


def build_session(*args: object, **kwargs: object) -> SparkSession:
    """Shorthand for :func:`spark.session.build_session` (same arguments)."""
    from spark.session import build_session as _build

    return _build(*args, **kwargs)  # type: ignore[arg-type]


def persist_txn(session: SparkSession, stash_url: str, blob_uri: str) -> PersistTxn:
    """A driver-side transaction over persist shards and stash collections: see
    :func:`spark.persist_txn.persist_txn` (writes of several DataFrames and catalog
    upserts, committed at once when its ``with`` block ends)."""
    from spark.persist_txn import persist_txn as _txn

    return _txn(session, stash_url, blob_uri)


def activate(session: SparkSession) -> SparkSession:
    """Make ``session`` the JVM's active session in the calling thread; return it.

    Spark resolves Python data sources (``format("persist")``) through the active session,
    which the JVM keeps per thread: a Python thread other than the one that built the
    session must call this before reading or writing, or Spark reports
    ``DATA_SOURCE_NOT_FOUND``.
    """
    jvm = session.sparkContext._jvm
    assert jvm is not None
    jvm.org.apache.spark.sql.SparkSession.setActiveSession(session._jsparkSession)
    return session
