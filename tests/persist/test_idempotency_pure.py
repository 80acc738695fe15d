"""The resolution of an unknown outcome (:func:`persist.idempotency.apply_resolving`)
and the token checks, on plain functions: no machine, no consensus."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from persist.errors import ConsensusError, InvalidUsage, UpperMismatch
from persist.idempotency import apply_resolving, carrying_token, checked_token
from stash import Antichain

WID = "w" + "ab" * 16


def commands(*outcomes: object) -> tuple[list[int], Callable[[], object]]:
    """A command answering ``outcomes`` in turn (an exception is raised)."""
    calls: list[int] = []
    it = iter(outcomes)

    def apply() -> object:
        calls.append(1)
        out = next(it)
        if isinstance(out, BaseException):
            raise out
        return out

    return calls, apply


def lost() -> ConsensusError:
    return ConsensusError("commit acknowledgement lost", indeterminate=True)


def test_an_unknown_outcome_is_reapplied_until_known() -> None:
    calls, apply = commands(lost(), lost(), "landed")
    assert apply_resolving(apply, attempts=4, max_wait=0.001, shard_id="s") == "landed"
    assert len(calls) == 3


def test_a_known_failure_is_not_retried() -> None:
    mismatch = UpperMismatch(Antichain.from_elem(1), Antichain.from_elem(2))
    calls, apply = commands(mismatch)
    with pytest.raises(UpperMismatch):
        apply_resolving(apply, attempts=4, max_wait=0.001, shard_id="s")
    assert len(calls) == 1


def test_a_failure_after_an_unknown_outcome_stays_unknown() -> None:
    """Once an attempt was indeterminate, a later plain consensus failure must not be
    reported as a known failure: the first commit may have landed."""
    calls, apply = commands(lost(), ConsensusError("stash down"))
    with pytest.raises(ConsensusError) as info:
        apply_resolving(apply, attempts=2, max_wait=0.001, shard_id="s")
    assert info.value.is_indeterminate() and "shard s" in str(info.value)
    assert len(calls) == 2


def test_tokens_checked_and_carried() -> None:
    assert checked_token(None, WID).startswith(WID[1:17])
    assert checked_token("t" * 8, WID) == "t" * 8
    for bad in ("short", "x" * 129, "tab\there!"):
        with pytest.raises(InvalidUsage, match="idempotency_token must be"):
            checked_token(bad, WID)
    with pytest.raises(ConsensusError) as info, carrying_token("tok12345"):
        raise lost()
    assert info.value.idempotency_token == "tok12345"
