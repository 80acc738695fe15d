"""A retention setting whose ``keep_for_ms`` is beyond a 64-bit integer (written to the
``stash.retention`` collection by hand: ``Stash.set_retention`` takes a ``timedelta``,
whose milliseconds always fit) makes a write of the collection it names fail with the
``StashError`` naming the setting and the rule, committing nothing, as other malformed
settings do (``test_retention_setting_checked.py``).  Before, SQLite raised a bare
``OverflowError`` from every write of the collection (its ``now - keep_for_ms`` is a
bound parameter of a ``commit_times`` query), while the memory stash took it."""

from __future__ import annotations

from pathlib import Path

import pytest

from stash import Stash, StashError, TypedCollection
from tests.support.dbutil import backend_url

pytest_plugins = ["tests.support.pg_fixtures"]


@pytest.mark.parametrize("backend", ["memory", "sqlite", "postgres"])
def test_a_keep_for_ms_beyond_64_bits_is_a_stash_error_naming_it(
    request: pytest.FixtureRequest, tmp_path: Path, backend: str
) -> None:
    with Stash.open(backend_url(request, backend, tmp_path)) as s:
        TypedCollection("stash.retention", key="str").upsert_key(
            s, "orders", {"keep_for_ms": 2**70}
        )
        orders = TypedCollection("orders", key="str", value="int")
        with pytest.raises(StashError, match=r"retention setting of collection orders"):
            orders.upsert_key(s, "a", 1)
        assert orders.peek_one(s) == {}
        # The largest accepted: every time is kept, on every backend.
        TypedCollection("stash.retention", key="str").upsert_key(
            s, "orders", {"keep_for_ms": 2**62}
        )
        orders.upsert_key(s, "a", 1)
        orders.upsert_key(s, "a", 2)
        assert orders.peek_one(s) == {"a": 2}
