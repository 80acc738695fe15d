"""Pytest fixtures for Spark tests: one local SparkSession for the whole test session.

Loaded from ``tests/conftest.py`` with ``pytest_plugins = ["tests.support.spark_fixtures"]``.

Invariants:

* at most one SparkSession (``local[2]``) is started per pytest process, lazily, by the
  first test that asks for ``spark``; it is stopped at the end of the session;
* a missing Java is never a silent skip in CI: the fixture first runs
  ``scripts/ensure_java.sh`` (if present); if Java still cannot start, it fails the test
  when the ``CI`` environment variable is set, and skips it (with the reason) otherwise;
* ``spark_store`` gives each test its own SQLite stash file and local blob directory, as
  absolute URLs, so Spark's Python workers (other processes) see the same stores;
* the session's JVM runs with :data:`TEST_JVM_OPTIONS` (the C1 JIT only, the serial
  collector): how Java compiles and collects changes no result, and a test suite's many
  small queries never repay C2's compilations nor a parallel collector's threads on
  two cores (about a third less CPU for the session's JVM).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def _java_ok() -> bool:
    java = shutil.which("java")
    if java is None and os.environ.get("JAVA_HOME"):
        candidate = Path(os.environ["JAVA_HOME"]) / "bin" / "java"
        java = str(candidate) if candidate.exists() else None
    if java is None:
        return False
    try:
        subprocess.run([java, "-version"], capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def _ensure_java() -> str | None:
    """Return ``None`` when Java runs, else the reason it does not."""
    if _java_ok():
        return None
    script = REPO / "scripts" / "ensure_java.sh"
    if script.exists():
        try:
            subprocess.run(["bash", str(script)], capture_output=True, check=True, timeout=900)
        except (OSError, subprocess.SubprocessError) as e:
            return f"java is missing and {script} failed: {e}"
        if _java_ok():
            return None
        return f"java is still missing after {script}"
    return "java is missing (PySpark 4 needs Java 17+) and scripts/ensure_java.sh is absent"


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"Spark is required in CI: {reason}", pytrace=False)
    pytest.skip(f"Spark unavailable (not CI, so skipped): {reason}")


_SESSION: dict[str, Any] = {}

#: HotSpot flags for the JVMs tests start: the C1 JIT only (``-XX:TieredStopAtLevel=1``,
#: the usual setting for short-lived JVMs) and the serial collector (``-XX:+UseSerialGC``,
#: no GC threads competing for two cores). Jobs run in a subprocess get them through
#: ``JAVA_TOOL_OPTIONS`` (every JVM they start, executors included).
TEST_JVM_FLAGS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
#: The session's driver JVM options: ``spark.session.build_session``'s own, then the flags.
TEST_JVM_OPTIONS = f"-Dio.netty.tryReflectionSetAccessible=true {TEST_JVM_FLAGS}"


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """The test session's SparkSession (``local[2]``), with ``stash``/``persist`` registered."""
    if "error" in _SESSION:
        _unavailable(_SESSION["error"])
    reason = _ensure_java()
    if reason is not None:
        _SESSION["error"] = reason
        _unavailable(reason)
    try:
        from spark.session import build_session

        session = build_session(
            "local[2]",
            "stashpersist-tests",
            shuffle_partitions=2,
            driver_memory="2g",
            conf={
                "spark.python.worker.reuse": "true",
                "spark.driver.extraJavaOptions": TEST_JVM_OPTIONS,
            },
        )
    except Exception as e:  # Java present but the JVM did not start
        _SESSION["error"] = f"SparkSession could not start: {e}"
        _unavailable(_SESSION["error"])
    yield session
    session.stop()


@dataclass(frozen=True)
class SparkStore:
    """Per-test stores: ``stash_url`` (SQLite file) and ``blob_uri`` (local directory)."""

    stash_url: str
    blob_uri: str
    root: Path


@pytest.fixture
def spark_store(tmp_path: Path) -> SparkStore:
    """A fresh SQLite stash and file blob store under ``tmp_path`` (absolute URLs)."""
    blob = tmp_path / "blob"
    blob.mkdir()
    return SparkStore(
        stash_url=f"sqlite:///{tmp_path / 'stash.db'}",
        blob_uri=blob.as_uri(),
        root=tmp_path,
    )
