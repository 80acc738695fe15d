"""Protects: Spark source option errors and reprs never show a stash password.

The rule: no repr or error message shows a credential; every text quoting a URL
passes through ``stash.redact``.  These build the Spark sources' option handling
directly (no SparkSession needed).
"""

from __future__ import annotations

import pytest

from spark.jobs.flights import Config
from spark.persist_common import ShardTarget
from spark.persist_source import catalog_options
from spark.stash_source import ReadOptions, StashDataSource

pytestmark = pytest.mark.adversarial

SECRET = "Sup3r-Secret-pw"
URL1 = f"postgresql+psycopg://app:{SECRET}@db1/stash"
URL2 = f"postgresql+psycopg://app:{SECRET}@db2/stash"


def test_stash_source_conflicting_url_options_hide_the_password() -> None:
    src = StashDataSource({"url": URL1, "stash": URL2, "collection": "c"})
    with pytest.raises(Exception) as e:
        src._settings()
    assert "name different stashes" in str(e.value)
    assert SECRET not in str(e.value), str(e.value)


def test_persist_catalog_options_given_twice_hide_the_password() -> None:
    opts = {"stash": URL1, "option.stash": URL2, "blob": "memory://", "shard": "x"}
    with pytest.raises(Exception) as e:
        catalog_options(opts)
    assert "given twice" in str(e.value)
    assert SECRET not in str(e.value), str(e.value)


def test_shard_target_repr_hides_the_password() -> None:
    # ShardTarget is pickled into every read/write plan (ReadSettings, WriteSettings,
    # PreparedWrite) whose dataclass reprs embed it.
    t = ShardTarget(URL1, "memory://", "x")
    assert SECRET not in repr(t), repr(t)


def test_settings_reprs_hide_the_password() -> None:
    # The stash source's picklable read settings and the flights job's config.
    blob = f"s3://AKIAEXAMPLEKEY:{SECRET}@bucket/p"
    for obj in (ReadOptions(URL1, "c"), Config(URL1, blob), ShardTarget(URL1, blob, "x")):
        shown = repr(obj)
        assert SECRET not in shown and "AKIAEXAMPLEKEY" not in shown, shown
        assert "***" in shown and type(obj).__name__ in shown
