"""A version's cost follows what the command changed, not the state's size.

The state machine encodes only the entries a command touched
(:meth:`persist.state.ShardState.to_entries_delta`) and reads running counters of the
spine batches in place of passes over every batch; :mod:`persist.state_check` (enabled
for the whole test suite) checks every version against its full recomputation.  These
tests pin both: the checks are on and catch a wrong delta, and a one-row append on a
shard of hundreds of uncompacted batches touches a bounded number of entries.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import persist.state_codec as state_codec
from persist import PersistClient, state_check
from persist.history_record import _parts, parts_changed
from stash import Stash

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.string())])


def _client(tmp_path: Path, compaction: str = "off") -> tuple[Stash, PersistClient]:
    stash = Stash.open(f"sqlite:///{tmp_path}/s.db", mode="writable", fenced=False)
    return stash, PersistClient(stash, f"file://{tmp_path}/blob", compaction=compaction)


def _row(i: int) -> pa.Table:
    """One update of row ``i`` at time ``i``."""
    return pa.table({"k": [i], "v": [f"v{i}"], "_time": [i], "_diff": [1]})


def test_the_test_suite_checks_every_version() -> None:
    assert state_check.ENABLED


def test_a_one_row_append_touches_few_entries_however_many_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stash, client = _client(tmp_path)
    try:
        write, read = client.open("grow", SCHEMA, pa.schema([]))
        for i in range(300):
            write.append(_row(i), i, i + 1)
        st = write._machine.state()
        assert st.trace.num_hollow_batches() == 300
        seen: list[tuple[int, int]] = []
        orig = state_codec.to_entries_delta

        def spy(old: Any, old_entries: Any, new: Any) -> tuple[dict[str, Any], set[str]]:
            data, touched = orig(old, old_entries, new)
            seen.append((len(touched), len(data)))
            return data, touched

        monkeypatch.setattr(state_codec, "to_entries_delta", spy)
        for i in range(300, 340):
            write.append(_row(i), i, i + 1)
        assert seen
        # Entries: ~600 (a hollow and a spine entry per batch, at least); touched: the
        # new batch, the spine batches fueling merges rearranged, and the few other
        # components (meta, the writer, its landed record), a bounded number.
        assert min(n for _, n in seen) > 300
        assert sorted(t for t, _ in seen)[len(seen) // 2] < 40
        write.expire()
        read.expire()
    finally:
        client.close()
        stash.close()


def test_a_wrong_delta_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stash, client = _client(tmp_path)
    try:
        write, read = client.open("wrong", SCHEMA, pa.schema([]))
        write.append(_row(0), 0, 1)
        orig = state_codec.to_entries_delta

        def forgetful(old: Any, old_entries: Any, new: Any) -> tuple[dict[str, Any], set[str]]:
            data, touched = orig(old, old_entries, new)
            gone = next(k for k in data if k.startswith("trace/hollow_batches/"))
            del data[gone]
            return data, touched

        monkeypatch.setattr(state_codec, "to_entries_delta", forgetful)
        with pytest.raises(AssertionError, match="incremental entries differ"):
            write.append(_row(1), 1, 2)
        monkeypatch.undo()
    finally:
        client.close()
        stash.close()


def test_parts_changed_agrees_with_a_recount_through_merges(tmp_path: Path) -> None:
    """Merges answered inline replace hollow batches (parts removed and added)."""
    stash, client = _client(tmp_path, compaction="inline")
    try:
        write, read = client.open("merges", SCHEMA, pa.schema([]))
        machine = write._machine
        prev = machine.state()
        for i in range(40):
            write.append(_row(i), i, i + 1)
            st = machine.state()
            before, after = _parts(prev), _parts(st)
            added, removed = parts_changed(prev, st)
            assert sorted(added) == sorted(v for k, v in after.items() if k not in before)
            assert removed == sum(1 for k in before if k not in after)
            state_check.check_counters(st)
            prev = st
        assert st.trace.num_hollow_batches() < 40  # merges were applied
        write.expire()
        read.expire()
    finally:
        client.close()
        stash.close()
