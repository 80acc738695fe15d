"""One stash handle shared between threads ("a handle is safe to share between
threads": ``stash/base.py``), on every backend and on ``Memory(inner)`` over each.

Writer threads each own a collection and a set of keys of a shared collection; reader
threads read everything while they write.  Checked against a model:

* a writer's appends to its own collection never fail with ``AppendLowerMismatch`` (no
  other writer touches it, so a mismatch could only come from a stale read);
* after a writer's call returns, its next reads see it (read your writes: values and
  upper);
* a lost race on the shared collection is real (the upper did move past the lower read)
  and a retry succeeds within a bounded number of attempts;
* readers never see a key with several values or a multiplicity other than 1, and never
  see a writer's value go backwards;
* the final contents equal the model.

Counts are bounded (no time limits), so the test is quick on every backend.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from stash import AppendLowerMismatch, Stash, StashError, TypedCollection
from tests.reliability.campaign import record

WRITERS = 3
READERS = 2
ROUNDS = 12
READS = 25
MAX_ATTEMPTS = 400

SHARED = TypedCollection[str, int]("shared", key="str", value="int")


def _own(w: int) -> TypedCollection[str, int]:
    return TypedCollection(f"own{w}", key="str", value="int")


def _writer(s: Stash, w: int, start: threading.Barrier, errors: list[str], ids: list[int]) -> None:
    own = _own(w)
    c = own.get(s)
    start.wait()
    try:
        # Every thread creates the same new collection at once: one collection results.
        ids.append(s.collection("late", key="str", value="int").id)
        for i in range(ROUNDS):
            # Own collection: only this thread writes it, so no mismatch is legitimate.
            own.upsert_key(s, "k", i)
            upper = s.upper(c).as_option()
            b = c.make_batch(s)
            c.append_to_batch(b, f"a{i}", i, 1)
            s.append([b])
            after = s.upper(c).as_option()
            assert upper is not None and after is not None
            if after <= upper:
                errors.append(f"writer {w}: upper {after} after its append, was {upper}")
            got = own.peek_key_one(s, "k")
            if got != i:
                errors.append(f"writer {w}: read {got!r} right after writing {i}")
            # Shared collection: lost races are real; retry them.
            for _attempt in range(MAX_ATTEMPTS):
                before = SHARED.upper(s)
                try:
                    SHARED.upsert_key(s, f"w{w}", i)
                    break
                except AppendLowerMismatch as e:
                    if not before <= e.current or e.current == e.expected:
                        errors.append(f"writer {w}: spurious mismatch {e} (upper was {before})")
            else:
                errors.append(f"writer {w}: {MAX_ATTEMPTS} lost races in a row")
            got = SHARED.peek_key_one(s, f"w{w}")
            if got != i:
                errors.append(f"writer {w}: shared read {got!r} right after writing {i}")
    except AppendLowerMismatch as e:
        errors.append(f"writer {w}: mismatch on its own collection: {e}")
    except Exception as e:  # noqa: BLE001 - reported to the main thread
        errors.append(f"writer {w}: {type(e).__name__}: {e}")


def _reader(s: Stash, r: int, start: threading.Barrier, errors: list[str], ids: list[int]) -> None:
    seen: dict[tuple[str, str], int] = {}
    start.wait()
    try:
        ids.append(s.collection("late", key="str", value="int").id)
        for _ in range(READS):
            for name in ["shared", *(f"own{w}" for w in range(WRITERS))]:
                c = s.collection(name, key="str", value="int")
                try:
                    one = s.peek_one(c)
                except StashError as e:
                    if "not less than upper" in str(e):
                        continue  # nothing sealed yet
                    raise
                for k, v in one.items():
                    if k.startswith("a"):
                        continue
                    if v < seen.get((name, k), -1):
                        errors.append(
                            f"reader {r}: {name}[{k}] went back from {seen[(name, k)]} to {v}"
                        )
                    seen[(name, k)] = v
                entries = s.iter(c)
                keys = [k for (k, _), _, _ in entries]
                if len(keys) != len(set(keys)) or any(d != 1 for _, _, d in entries):
                    errors.append(f"reader {r}: {name} iterates as {entries}")
                if name != "shared":
                    s.peek_key_one(c, "k")
    except Exception as e:  # noqa: BLE001 - reported to the main thread
        errors.append(f"reader {r}: {type(e).__name__}: {e}")


@pytest.mark.parametrize("mode", ["writable", "savepoint"])
def test_one_handle_shared_by_writer_and_reader_threads(
    open_any: Any, any_backend: str, mode: str
) -> None:
    if mode == "savepoint":
        open_any().close()  # the store exists (an SQLite file is created by a writable open)
    s = open_any(mode=mode)
    SHARED.get(s)
    for w in range(WRITERS):
        _own(w).get(s)
    errors: list[str] = []
    ids: list[int] = []
    start = threading.Barrier(WRITERS + READERS)
    threads = [
        threading.Thread(target=_writer, args=(s, w, start, errors, ids)) for w in range(WRITERS)
    ] + [threading.Thread(target=_reader, args=(s, r, start, errors, ids)) for r in range(READERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(ids) == WRITERS + READERS and len(set(ids)) == 1
    last = ROUNDS - 1
    assert SHARED.peek_one(s) == {f"w{w}": last for w in range(WRITERS)}
    for w in range(WRITERS):
        want = {"k": last, **{f"a{i}": i for i in range(ROUNDS)}}
        assert _own(w).peek_one(s) == want
    if mode == "savepoint":
        return  # nothing was committed
    # A fresh handle (no cache) agrees.
    fresh = open_any(mode="readonly")
    assert fresh.peek_one(fresh.collection("shared", key="str", value="int")) == SHARED.peek_one(s)
    record(
        f"threads sharing one handle: stash on {any_backend}",
        runs=1,
        faults=0,
        acknowledged=WRITERS * ROUNDS * 3,  # per round: own upsert, own append, shared upsert
        lost=0,
        duplicated=0,
        partial=0,
        unclear=0,
        threads=WRITERS + READERS,
    )


class _PausingStash(Stash):
    """Delegates to ``inner``; a read transaction of thread ``pause_in`` stops right after
    reading a collection's rows until ``go`` is set (``reached`` tells it got there)."""

    def __init__(self, inner: Stash) -> None:
        super().__init__(inner.mode, inner.fenced)
        self.inner = inner
        self.pause_in: threading.Thread | None = None
        self.reached = threading.Event()
        self.go = threading.Event()

    def _txn(self, write: bool) -> Any:  # pragma: no cover - _run is used
        raise NotImplementedError

    def _run(self, write: bool, fn: Any) -> Any:
        return self.inner._run(write, lambda tx: fn(tx if write else _PausingTxn(self, tx)))

    def _close(self) -> None:
        self.inner.close()


class _PausingTxn:
    def __init__(self, stash: _PausingStash, tx: Any) -> None:
        self.stash = stash
        self.tx = tx

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tx, name)

    def rows(self, cid: int, key: str | None = None) -> Any:
        out = self.tx.rows(cid, key)
        if threading.current_thread() is self.stash.pause_in:
            self.stash.reached.set()
            assert self.stash.go.wait(60)
        return out


def test_a_fill_read_before_a_write_is_never_installed(tmp_path: Any) -> None:
    """The interleaving behind the stale cache, made deterministic: a reader's cache fill
    reads the rows, a write commits and invalidates, then the reader would install what
    it read.  Afterwards every read must see the write."""
    from stash import Memory

    inner = _PausingStash(Stash.open(f"sqlite:///{tmp_path}/s.db"))
    m = Memory(inner)
    assert m.caching
    tc: TypedCollection[str, int] = TypedCollection("c", key="str", value="int")
    tc.upsert_key(m, "k", 1)
    c = tc.get(m)
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(m.peek_key_one(c, "k")))
    inner.pause_in = reader
    reader.start()
    assert inner.reached.wait(60)  # the reader has read the rows, not yet cached them
    tc.upsert_key(m, "k", 2)
    upper = m.upper(c)
    inner.go.set()
    reader.join()
    assert got == [1]  # it read before the write: the old value is a correct answer
    assert m.upper(c) == upper
    assert m.peek_key_one(c, "k") == 2
    assert m.peek_one(c) == {"k": 2}
    tc.upsert_key(m, "k", 3)  # the upper it reads is current: no AppendLowerMismatch
    assert tc.peek_key_one(m, "k") == 3
    m.close()


def test_upsert_key_from_threads_sharing_one_handle_never_races_itself(open_any: Any) -> None:
    """Threads calling ``TypedCollection.upsert_key`` on distinct keys through one handle
    (no other writer) never fail: the read-then-append helpers of one handle run one at
    a time.  On SQLite and ``Memory(sqlite)`` some failed with ``AppendLowerMismatch``."""
    s = open_any()
    tc: TypedCollection[str, int] = TypedCollection("thr", key="str", value="int")
    errs: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(20):
                tc.upsert_key(s, f"{i}-{j}", j)
        except Exception as e:  # noqa: BLE001 - reported to the main thread
            errs.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errs, errs[:2]
    assert tc.peek_one(s) == {f"{i}-{j}": j for i in range(6) for j in range(20)}
