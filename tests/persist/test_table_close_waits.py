"""``Table.close()`` waits for the writes in flight: an append that passed its open
check before ``close()`` was called either commits before ``close()`` returns or not at
all, never after (before, it committed after ``close()`` had returned: the writer's
expiry left a writer holding the append's batch to its lease)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pytest

from persist import AppTransaction, MemoryBlob, PersistClient, Table
from persist.txn import Txn
from stash import Stash

SCHEMA = pa.schema([pa.field("k", pa.int64(), False), ("v", pa.string())])
ROW = pa.table({"k": [7], "v": ["x"]}, schema=SCHEMA)

WRITES: dict[str, Callable[[Table], Any]] = {
    "append": lambda t: t.append(ROW),
    "append app": lambda t: t.append(ROW, app_transaction=AppTransaction("a", 1)),
}


@pytest.mark.parametrize("write", list(WRITES))
def test_close_returns_after_the_write_in_flight(
    write: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off")
    t0 = c.create_table("t", SCHEMA, key=["k"])
    t0.append(pa.table({"k": [1, 2], "v": ["a", "b"]}, schema=SCHEMA))
    t0.close()
    t = c.table("t")
    t.append(pa.table({"k": [3], "v": ["c"]}, schema=SCHEMA))  # its writer is open
    entered, release = threading.Event(), threading.Event()
    events: list[Any] = []
    errors: list[BaseException] = []
    for name in ("commit", "commit_at"):
        orig = getattr(Txn, name)

        def paused(self: Txn, *a: Any, _orig: Any = orig, **kw: Any) -> Any:
            entered.set()
            release.wait(60)
            out = _orig(self, *a, **kw)
            events.append("committed")
            return out

        monkeypatch.setattr(Txn, name, paused)

    def run_write() -> None:
        try:
            WRITES[write](t)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def run_close() -> None:
        t.close()
        events.append(("closed", c.inspect("t").seqno))

    a = threading.Thread(target=run_write)
    a.start()
    assert entered.wait(60), errors
    b = threading.Thread(target=run_close)
    b.start()
    b.join(0.5)  # time for a close that does not wait to return
    release.set()
    a.join(60)
    b.join(60)
    assert not a.is_alive() and not b.is_alive()
    assert not errors, errors
    assert events[0] == "committed" and events[-1][0] == "closed", events
    assert events[-1][1] == c.inspect("t").seqno  # nothing committed after close()
    c.close()
    s.close()


def test_close_from_inside_a_write_of_the_same_thread_does_not_wait() -> None:
    """A thread closing the table inside a call of its own (from a callback) does not
    wait for itself."""
    from persist.closing import CloseGate

    refused: list[str] = []
    gate = CloseGate(refused.append)
    with gate.entered("append"):
        gate.close()
    assert gate.closed
    with gate.entered("append"):
        pass
    assert refused == ["append"]
