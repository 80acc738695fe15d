"""Build a local (or cluster) SparkSession configured for this project's data sources.

Invariants kept here:

* the Python that runs the driver also runs the Python workers (``spark.pyspark.python``
  is ``sys.executable``), so every worker imports the same ``stash``, ``persist`` and
  ``spark`` packages as the driver;
* Arrow is on for pandas conversions and Python data sources, filter pushdown to Python
  data sources is on (``spark.sql.python.filterPushdown.enabled``: the ``persist``
  reader implements ``pushFilters`` when read with ``pushdown=true``), the UI and
  console progress bars are off, and Spark logs only warnings and errors;
* the session returned has the ``stash`` and ``persist`` data sources registered
  (:func:`spark.formats.register`, re-exported as ``spark.register``);
* the session time zone (``spark.sql.session.timeZone``) is ``UTC`` unless ``conf``
  sets another: Spark's default is the JVM's local zone, which would make the same job
  show ``timestamp`` values (instants) differently on different machines. It changes
  only how instants are displayed and parsed; the ``persist`` source keeps instants
  and ``timestamp_ntz`` wall-clock values whatever the zone.

Defaults are sized for a small machine (2 cores, 24 GiB): ``local[*]``, 4 shuffle
partitions, a 4 GiB driver heap. A cluster is used by passing its master URL
(``spark://host:7077``, ``yarn``, ``k8s://...``) as ``master``; under ``spark-submit``
the master given there wins unless ``master`` is passed explicitly.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from spark.formats import register

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DEFAULT_MASTER = "local[*]"
"""The embedded default: every local core."""


def build_session(
    master: str | None = None,
    app_name: str = "stashpersist",
    *,
    shuffle_partitions: int = 4,
    driver_memory: str = "4g",
    conf: Mapping[str, str] | None = None,
    log_level: str = "ERROR",
) -> SparkSession:
    """Return a SparkSession (created or reused) with the stash/persist sources registered.

    Args:
        master: Spark master URL; ``None`` keeps the one given to ``spark-submit`` or
            falls back to ``local[*]``.
        app_name: application name shown by the cluster manager.
        shuffle_partitions: ``spark.sql.shuffle.partitions`` (small: the data is small).
        driver_memory: JVM heap of the driver, e.g. ``"4g"`` (only effective when this
            call starts the JVM).
        conf: extra Spark settings, applied last (e.g.
            ``{"spark.sql.session.timeZone": "America/New_York"}`` replaces the ``UTC``
            session time zone this function sets by default).
        log_level: Spark's log level (``"ERROR"``, ``"WARN"``, ``"INFO"``).

    Raises:
        pyspark.errors.PySparkRuntimeError: Java could not be started (missing or too
            old; PySpark 4 needs Java 17 or newer).
    """
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    submitted = "SPARK_ENV_LOADED" in os.environ or "PYSPARK_GATEWAY_PORT" in os.environ
    if master is not None:
        builder = builder.master(master)
    elif not submitted:
        builder = builder.master(DEFAULT_MASTER)
    settings = {
        "spark.pyspark.python": os.environ["PYSPARK_PYTHON"],
        "spark.driver.memory": driver_memory,
        "spark.sql.shuffle.partitions": str(shuffle_partitions),
        "spark.default.parallelism": str(shuffle_partitions),
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.sql.execution.arrow.pyspark.fallback.enabled": "false",
        # The persist source's reader takes filters with pushdown=true (pushFilters);
        # Spark refuses to plan a read of such a reader while this is off.
        "spark.sql.python.filterPushdown.enabled": "true",
        "spark.sql.session.timeZone": "UTC",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.log.level": log_level,
        "spark.sql.adaptive.enabled": "true",
        "spark.driver.extraJavaOptions": "-Dio.netty.tryReflectionSetAccessible=true",
    }
    settings.update(conf or {})
    for key, value in settings.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel(log_level)

    register(session)
    return session
