"""A command's clone of the leases and landed records reports the keys it changed, so
encoding a version looks at those only (:mod:`persist.tracked`).

* any sequence of ``dict`` mutations leaves every key whose value is not the origin's
  (by identity) in ``changed`` (hypothesis, against the origin itself as the model);
* encoding a one-append version does not walk the shard's 256 landed records (the old
  encoder compared every record of both versions), and still gives the full encoding
  (:mod:`persist.state_check`, on for the test suite, compares it on every version).
"""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

import persist.state_codec as state_codec
from persist import PersistClient
from persist.landed import TOKENS_KEPT
from persist.tracked import TrackedDict, changed_keys
from stash import Stash

KEYS = st.sampled_from("abcdef")
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("set"), KEYS, st.integers(0, 3)),
        st.tuples(st.just("del"), KEYS),
        st.tuples(st.just("pop"), KEYS),
        st.tuples(st.just("popitem")),
        st.tuples(st.just("setdefault"), KEYS, st.integers(0, 3)),
        st.tuples(st.just("update"), st.dictionaries(KEYS, st.integers(0, 3), max_size=3)),
        st.tuples(st.just("ior"), st.dictionaries(KEYS, st.integers(0, 3), max_size=3)),
        st.tuples(st.just("clear")),
    ),
    max_size=12,
)


def _apply(d: dict[str, Any], op: tuple[Any, ...]) -> None:
    kind = op[0]
    if kind == "set":
        d[op[1]] = [op[2]]  # a fresh object: identity tells it from the origin's
    elif kind == "del":
        if op[1] in d:
            del d[op[1]]
    elif kind == "pop":
        d.pop(op[1], None)
    elif kind == "popitem":
        if d:
            d.popitem()
    elif kind == "setdefault":
        d.setdefault(op[1], [op[2]])
    elif kind == "update":
        d.update({k: [v] for k, v in op[1].items()})
    elif kind == "ior":
        d |= {k: [v] for k, v in op[1].items()}
    elif kind == "clear":
        d.clear()


@given(origin=st.dictionaries(KEYS, st.integers(0, 3)), ops=OPS)
def test_every_changed_key_is_noted(origin: dict[str, int], ops: list[tuple[Any, ...]]) -> None:
    base = {k: [v] for k, v in origin.items()}
    tracked: TrackedDict[str, Any] = TrackedDict(base)
    plain = dict(base)
    for op in ops:
        _apply(tracked, op)
        _apply(plain, op)
    assert dict(tracked) == plain
    differ = {k for k in base.keys() | tracked.keys() if base.get(k) is not tracked.get(k)}
    assert differ <= tracked.changed
    assert differ <= set(changed_keys(base, tracked))


def test_changed_keys_of_an_unrelated_copy_is_every_key() -> None:
    old = {"a": 1, "b": 2}
    assert set(changed_keys(old, {"b": 2, "c": 3})) == {"a", "b", "c"}
    other = TrackedDict(dict(old))  # copied from another dict than ``old``
    assert set(changed_keys(old, other)) == {"a", "b"}


def test_copies_and_pickles_as_a_plain_dict() -> None:
    t: TrackedDict[str, int] = TrackedDict({"a": 1})
    t["b"] = 2
    for c in (copy.copy(t), copy.deepcopy(t), pickle.loads(pickle.dumps(t))):
        assert type(c) is dict and c == {"a": 1, "b": 2}


class _Unwalkable(dict[str, Any]):
    """Landed records whose full walk fails the test."""

    def items(self) -> Any:
        raise AssertionError("encoding the version walked every landed record")


def test_a_one_append_version_does_not_walk_the_landed_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stash = Stash.open(f"sqlite:///{tmp_path}/s.db", mode="writable", fenced=False)
    client = PersistClient(stash, f"file://{tmp_path}/blob", compaction="off")
    try:
        schema = pa.schema([("k", pa.int64())])
        write, read = client.open("landed", schema, pa.schema([]))
        for i in range(TOKENS_KEPT + 4):
            write.append(pa.table({"k": [i], "_time": [i], "_diff": [1]}), i, i + 1)
        machine = write._machine
        cached = machine._cache
        assert cached is not None and len(cached.state.landed) == TOKENS_KEPT
        # The cached version's records can no longer be walked: only the clone's
        # record of changes may be consulted.
        object.__setattr__(cached.state, "landed", _Unwalkable(cached.state.landed))
        seen: list[set[str]] = []
        orig = state_codec.to_entries_delta

        def spy(old: Any, old_entries: Any, new: Any) -> tuple[dict[str, Any], set[str]]:
            data, touched = orig(old, old_entries, new)
            seen.append(touched)
            return data, touched

        monkeypatch.setattr(state_codec, "to_entries_delta", spy)
        n = TOKENS_KEPT + 4
        write.append(pa.table({"k": [n], "_time": [n], "_diff": [1]}), n, n + 1)
        monkeypatch.undo()
        (touched,) = seen
        # The new record in, the oldest pruned: two landed entries.
        assert sum(1 for k in touched if k.startswith("landed/")) == 2
        assert len(machine.state().landed) == TOKENS_KEPT
        write.expire()
        read.expire()
    finally:
        client.close()
        stash.close()


class _Leases(dict[str, Any]):
    """Leases whose full walk fails (``observe_commit`` swallows errors: the count then
    stays put)."""

    def items(self) -> Any:
        raise AssertionError("the metrics walked every lease")


def test_lease_expiries_are_counted_from_the_diff() -> None:
    from types import SimpleNamespace

    from prometheus_client import REGISTRY

    from persist import metrics
    from persist.lease_state import ReaderState, WriterState
    from stash import Antichain

    def sample(kind: str) -> float:
        v = REGISTRY.get_sample_value("persist_lease_expiries_total", {"kind": kind})
        return v or 0.0

    class _Trace:
        def num_hollow_batches(self) -> int:
            return 0

    def state(readers: dict[str, Any], writers: dict[str, Any]) -> Any:
        return SimpleNamespace(
            name="tracked-metrics",
            shard_id="s0",
            readers=readers,
            writers=writers,
            trace=_Trace(),
            inline_bytes=lambda: 0,
        )

    now = 10_000
    old = state(
        _Leases(
            r1=ReaderState(Antichain([0]), 0, 1),  # ran out
            r2=ReaderState(Antichain([0]), now, 1000),
        ),
        _Leases(w1=WriterState(0, 1), w2=WriterState(now, 1000)),
    )
    new = state(TrackedDict(old.readers), TrackedDict(old.writers))
    del new.readers["r1"]
    del new.writers["w1"]
    new.writers.pop("w2")  # dropped, but its lease had not run out
    before = sample("reader"), sample("writer")
    metrics.observe_commit(old, new, now)
    assert (sample("reader"), sample("writer")) == (before[0] + 1, before[1] + 1)


def test_versions_are_not_chained(tmp_path: Path) -> None:
    """Each version's records point at the version they were copied from; copying them
    again lets that one go (else a shard's every version stays in memory)."""
    stash = Stash.open(f"sqlite:///{tmp_path}/s.db", mode="writable", fenced=False)
    client = PersistClient(stash, f"file://{tmp_path}/blob", compaction="off")
    try:
        write, read = client.open("chain", pa.schema([("k", pa.int64())]), pa.schema([]))
        for i in range(20):
            write.append(pa.table({"k": [i], "_time": [i], "_diff": [1]}), i, i + 1)
        st = write._machine.state()
        for records in (st.landed, st.writers, st.readers):
            depth = 0
            x: Any = records
            while x is not None:
                depth += 1
                x = getattr(x, "origin", None)
            assert depth <= 2
        write.expire()
        read.expire()
    finally:
        client.close()
        stash.close()


@given(
    start=st.integers(0, TOKENS_KEPT + 3),
    tokens=st.lists(st.sampled_from(["t0", "t1", "t5", "new", "other"]), max_size=6),
)
def test_noting_notes_every_landed_record_changed(start: int, tokens: list[str]) -> None:
    """Records written through a Noting (a clone's landed records) leave every token
    whose record is not the origin's (by identity) noted, as a TrackedDict would."""
    from persist.landed import NO_HORIZON, record
    from persist.lease_state import TOKEN_SEP
    from persist.tracked import Noting, noted_keys

    origin: dict[str, Any] = {}
    horizon = NO_HORIZON
    for i in range(start):
        horizon = record(origin, horizon, f"t{i}{TOKEN_SEP}f", i, i)
    copy_ = origin.copy()
    notes: tuple[dict[str, Any], set[str]] = (origin, set())
    for n, tok in enumerate(tokens):
        horizon = record(Noting(copy_, notes[1]), horizon, f"{tok}{TOKEN_SEP}g", start + n, 0)  # type: ignore[arg-type]
    differ = {k for k in origin.keys() | copy_.keys() if origin.get(k) is not copy_.get(k)}
    assert differ <= notes[1]
    assert differ <= set(noted_keys(origin, copy_, notes))
    assert set(noted_keys({}, copy_, notes)) == set(copy_)  # another origin: every key
