"""A retention setting that is not one ``Stash.set_retention`` writes (the collection
``stash.retention`` is an ordinary collection: anyone may write it) makes a write of the
collection it names fail with a ``StashError`` naming both collections and the rule,
committing nothing; it used to escape as ``AttributeError`` / ``ValueError``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stash import Stash, StashError, TypedCollection
from tests.support.dbutil import backend_url


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
@pytest.mark.parametrize(
    "setting",
    ["garbage", [1], {"keep_times": "x"}, {"keep_times": True}, {"keep_for_ms": [5]}],
    ids=["str", "list", "str-count", "bool-count", "list-ms"],
)
def test_a_malformed_setting_is_a_stash_error_naming_it(
    request: pytest.FixtureRequest, tmp_path: Path, backend: str, setting: Any
) -> None:
    with Stash.open(backend_url(request, backend, tmp_path)) as s:
        TypedCollection("stash.retention", key="str").upsert_key(s, "orders", setting)
        orders = TypedCollection("orders", key="str", value="int")
        with pytest.raises(
            StashError, match=r"retention setting of collection orders.*stash\.retention"
        ):
            orders.upsert_key(s, "a", 1)
        c = orders.get(s)
        with pytest.raises(StashError, match="retention setting of collection orders"):
            c.make_batch(s)
        assert orders.peek_one(s) == {}
        s.set_retention(c, keep_times=2)  # a good setting replaces it
        orders.upsert_key(s, "a", 1)
        assert orders.peek_one(s) == {"a": 1}
