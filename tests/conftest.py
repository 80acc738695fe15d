"""Shared pytest configuration: fixtures for a real PostgreSQL server, one local
SparkSession per test session and an S3-compatible server (moto) live in their own
modules, registered here, as do the run summary and the xdist ordering (long test files
start first on every worker).

Hypothesis: when ``CI`` is set, the ``ci`` profile draws each property's examples from
a seed derived from the test itself (``derandomize``), so a CI run is reproducible and
its verdict does not depend on the luck of the draw; local runs draw fresh examples each
time and keep exploring (a failure they find is added as an ``@example`` or fixed).

Every state version the tests make is checked against its full recomputation
(``PERSIST_CHECK_INCREMENTAL``, :mod:`persist.state_check`), as Materialize's debug builds
do; set it to ``0`` to measure without the checks."""

from __future__ import annotations

import os

# Before persist is imported (persist.state_check reads it once).
os.environ.setdefault("PERSIST_CHECK_INCREMENTAL", "1")

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

pytest_plugins = [
    "tests.support.pg_fixtures",
    "tests.support.spark_fixtures",
    "tests.support.s3_fixtures",
    "tests.support.run_summary",
    "tests.support.schedule",
]
