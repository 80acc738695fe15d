"""The state a process caches equals the state any other process decodes from the
stored versions.

A machine caches the version it committed (or caught up to) as objects, never read
back from the JSON texts it stored; every other process decodes those texts.  The two
must be equal: a full read (:meth:`persist.machine.ShardMachine.fetch`), a catch-up
(:meth:`~persist.machine.ShardMachine.refresh`) and the writer's own cache give one
state, or a comparison across them (a compaction result recognised as already applied,
a full compaction's prefix) goes wrong.  Canonical JSON sorts object keys: a part's
column statistics, an object by column, read back sorted by column name.

The test suite checks every version this way (:func:`persist.state_check.check_version`
decodes the stored texts); these tests show what a difference did before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import persist.consensus as consensus_mod
from persist import PersistClient, state_check
from persist.consensus import Consensus
from persist.machine import ShardMachine
from stash import IndeterminateError, Stash

KS = pa.schema([("k", pa.string())])
# Columns whose names are not in sorted order (so statistics in column order differ
# from the sorted order of their stored JSON object).
VS = pa.schema([("z", pa.int64()), ("a", pa.string())])


def _client(stash: Stash, tmp_path: Path) -> PersistClient:
    # Blob parts (inline_max_bytes=0): they carry column statistics.
    return PersistClient(
        stash,
        f"file://{tmp_path / 'blob'}",
        compaction="off",
        inline_max_bytes=0,
        gc_interval_seconds=None,
    )


def _append(w: Any, i: int) -> None:
    w.compare_and_append([(((f"k{i}",), (i, f"a{i}")), i, 1)], i, i + 1)


def test_a_writers_cached_state_equals_a_full_read(tmp_path: Path) -> None:
    """After its own appends (blob parts, with statistics) a writer's cached state, a
    catch-up of another client and a full read are one state.  Failed on the old code:
    the writer's parts kept their statistics in column order, a full read sorted them."""
    with Stash.open(f"sqlite:///{tmp_path / 's.db'}", fenced=False) as stash:
        a, b = _client(stash, tmp_path), _client(stash, tmp_path)
        try:
            w, _ = a.open("t", KS, VS)
            wb, _ = b.open("t", KS, VS)
            for i in range(3):
                _append(w, i)
            sid = w._machine.shard_id
            full = ShardMachine(Consensus(stash), sid).fetch()
            assert w._machine.state() == full
            assert wb._machine.refresh() == full
        finally:
            a.close()
            b.close()


def test_a_merge_result_whose_commit_was_indeterminate_is_recognised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compaction whose compare-and-set committed but whose outcome was unknown
    (the connection lost at COMMIT) catches up with the head, finds its own result
    there (reported applied, nothing failed) and caches what a full read gives.
    Failed on the old code: the cache mixed the batches as this process made them with
    those decoded from the stored diffs, unequal to a full read (statistics' order)."""
    with Stash.open(f"sqlite:///{tmp_path / 's.db'}", fenced=False) as stash:
        c = _client(stash, tmp_path)
        try:
            w, _ = c.open("t", KS, VS)
            for i in range(4):
                _append(w, i)
            m = w._machine
            assert m.state().trace.all_fueled_merge_reqs()
            orig = consensus_mod.logs.write
            lost: list[int] = []

            def commit_then_lose(s: Any, entries: Any, batches: Any = ()) -> None:
                entries = list(entries)
                orig(s, entries, batches)
                if not lost:
                    lost.append(1)
                    raise IndeterminateError("connection lost during COMMIT (injected)")

            monkeypatch.setattr(consensus_mod.logs, "write", commit_then_lose)
            monkeypatch.setattr(state_check, "ENABLED", True)
            report = c.compactor.compact_once("t")
            monkeypatch.undo()
            assert lost == [1]
            assert m.metrics["indeterminate"] == 1
            assert report.failed == 0 and report.not_applied == 0, report
            assert report.applied >= 1
            full = ShardMachine(Consensus(stash), m.shard_id).fetch()
            assert m.state() == full
            assert len(list(full.trace.batches())) < 4
        finally:
            c.close()
