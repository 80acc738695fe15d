"""A transaction whose commit's outcome was left unknown is settled before it takes
another change.

The defect: after a commit attempt cut short once the stash had committed it, a
``write``, ``stash_append`` or ``stash_replace`` was taken, and the retried
``commit_at`` only learned that the first attempt had landed and returned its time: the
change added since was silently left out although the caller was told the transaction
committed.  Now the change is refused, naming the time the transaction landed at; when
the earlier attempt did not land, the change is taken and the commit goes on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pytest

from persist import InvalidUsage, MemoryBlob, PersistClient
from stash import Stash

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])


class CutShort:
    """A stash whose next armed ``append`` is cut short by ``KeyboardInterrupt``, after
    committing (``land``) or before."""

    def __init__(self, inner: Stash) -> None:
        self.inner = inner
        self.armed: bool | None = None  # None: not armed; True: land first

    def append(self, batches: Any) -> None:
        land, self.armed = self.armed, None
        if land is False:
            raise KeyboardInterrupt("cut short before the stash committed")
        self.inner.append(batches)
        if land:
            raise KeyboardInterrupt("cut short after the stash committed")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def row(k: str, v: int) -> pa.Table:
    return pa.table({"k": [k], "v": pa.array([v], pa.int64())})


CHANGES: dict[str, Callable[[Any, Stash], None]] = {
    "write": lambda txn, _s: txn.write("b", row("late", 9)),
    "stash_append": lambda txn, s: txn.stash_append(
        [s.collection("cat").make_batch(s)]  # type: ignore[attr-defined]
    ),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("landed", [True, False])
def test_a_change_after_an_unknown_outcome_is_refused_if_it_landed(
    change: str, landed: bool
) -> None:
    inner = Stash.open("memory://", fenced=False)
    inner.collection("cat")  # type: ignore[attr-defined]
    st = CutShort(inner)
    c = PersistClient(st, MemoryBlob(), compaction="off")  # type: ignore[arg-type]
    try:
        c.open("a", KS, VS)
        c.open("b", KS, VS)
        txn = c.begin()
        txn.write("a", row("x", 1))
        st.armed = landed
        with pytest.raises(KeyboardInterrupt):
            txn.commit_at(0)
        if landed:
            with pytest.raises(InvalidUsage, match="landed at 0"):
                CHANGES[change](txn, inner)
            assert txn.committed_ts == 0
            with pytest.raises(InvalidUsage, match="already committed at 0"):
                txn.commit_at(0)
        else:
            CHANGES[change](txn, inner)
            assert txn.commit_at(0) == 0
        a = c.open_reader("a", KS, VS).snapshot(0)
        assert a.column("k").to_pylist() == ["x"]
        late = change == "write" and not landed
        assert c.inspect("b").upper.as_option() == (1 if late else 0)
    finally:
        c.close()
        inner.close()
