"""Protects: ``Stash.subscribe`` reads its collections as ``with_transaction`` does, and
refuses anything else with a clear error.

``with_transaction`` takes ``TypedCollection`` objects, so an application wrote
``stash.subscribe([jobs], as_of)`` with one and got ``AttributeError: 'TypedCollection'
object has no attribute 'id'``; a single handle gave ``TypeError: 'StashCollection'
object is not iterable``. Now a ``TypedCollection`` subscribes by its handle, and a
single collection, a name or a mapping is refused naming what was given."""

from __future__ import annotations

from typing import Any

import pytest

from stash import Stash, StashError, TypedCollection
from stash.feed import Change, Progress

pytestmark = pytest.mark.adversarial

JOBS = TypedCollection("jobs", key="str", value="str")


def test_typed_collections_subscribe_by_their_handle() -> None:
    with Stash.open("memory://feed-collections-arg", fenced=False) as s:
        JOBS.upsert_key(s, "job-1", "queued")
        events = list(s.subscribe([JOBS], 0, idle_timeout=0.05))
        assert events == [
            Change("jobs", "job-1", "queued", 0, 1),
            Progress("jobs", 1),
        ]
        assert list(s.subscribe((JOBS.get(s),), 0, idle_timeout=0.05)) == events


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (lambda s: JOBS, "got one TypedCollection 'jobs': write \\[collection\\]"),
        (lambda s: JOBS.get(s), "got one StashCollection 'jobs': write \\[collection\\]"),
        (lambda s: "jobs", "got a str"),
        (lambda s: {"jobs": 1}, "got a dict"),
        (lambda s: [1], "StashCollection or TypedCollection objects, got a int"),
    ],
)
def test_other_collections_arguments_are_refused_clearly(given: Any, message: str) -> None:
    with Stash.open("memory://feed-collections-arg-bad", fenced=False) as s:
        JOBS.upsert_key(s, "job-1", "queued")
        with pytest.raises(StashError, match=message):
            list(s.subscribe(given(s), 0, idle_timeout=0.05))
