"""Registering this project's Spark data source formats on a session.

Two formats: ``stash`` (batch read of a stash collection, :mod:`spark.stash_source`) and
``persist`` (batch read, batch write and streaming read of a persist shard,
:mod:`spark.persist_source`).

Invariants kept here: importing this module does not import pyspark (the data source
modules are imported when :func:`register` runs), and ``register`` is idempotent.  Both
:mod:`spark` (which re-exports :func:`register`) and :mod:`spark.session` import it; it
imports neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["register"]


def register(session: SparkSession) -> SparkSession:
    """Register the ``stash`` and ``persist`` formats on ``session``; return the session.

    Also turns on ``spark.sql.python.filterPushdown.enabled`` in the session: the
    ``persist`` reader implements ``pushFilters`` with ``pushdown=true`` (taking filters
    where PySpark plans each query afresh, see
    :func:`spark.persist_reader.spark_reuses_pushed_plans`), and PySpark refuses to read
    a source whose reader implements ``pushFilters`` while that setting is off.

    Registering twice is harmless (the later registration replaces the earlier one).
    """
    from spark.persist_source import PersistDataSource
    from spark.stash_source import StashDataSource

    session.conf.set("spark.sql.python.filterPushdown.enabled", "true")

    session.dataSource.register(StashDataSource)
    session.dataSource.register(PersistDataSource)
    return session
