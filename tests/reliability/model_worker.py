"""One process of the multi-process lifecycle model (``test_lifecycle_processes.py``).

:func:`serve` runs in a ``multiprocessing`` process (spawn) and answers the model's
commands over a :class:`multiprocessing.connection.Connection`.  It holds one
:class:`persist.PersistClient` on a shared stash (a SQLite file or Postgres) and a shared
``file://`` blob store (both named by the ``reset`` command), with a clock of its own: every command carries the time this
process's clock reads while it runs (the model's time plus this process's skew), so the
processes' clocks disagree by exactly the skews the model drew.

The consensus seam, :class:`PausingStash`, wraps the stash the client's consensus
(:class:`persist.consensus.Consensus`) appends through: when armed, the ``n``-th stash
``append`` of the command (every state version, registration and transaction is one
``append``) stops *after* persist computed the state version and *before* it reaches the
stash, tells the model (``("paused",)``) and waits for ``("release",)``.  The model runs
other processes' operations meanwhile: that is the delay between computing a state and
its commit landing (a SQLite busy-wait, a slow network).  It can also lose the
acknowledgement of the next append (committed, then :class:`stash.IndeterminateError`).

Messages: ``("run", op, now, kwargs)`` runs ``op_<op>`` in a thread (so a ``release``
can arrive while it is paused) and answers ``("done", result)`` or ``("error", names,
message, indeterminate, token)`` (``names``: the exception's class and base class names);
``("release",)`` resumes a paused append; ``("stop",)`` ends the process.  No command runs
longer than :data:`STEP_TIMEOUT` seconds on a thread join or a pause: a deadlock is
reported as an error named ``Deadlock``, never a hang.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from persist import LeaseExpired, PersistClient, UpperMismatch, collect_garbage
from stash import Antichain, IndeterminateError, Stash

KS = pa.schema([("k", pa.int64())])
STEP_TIMEOUT = 60.0
#: How long the threads of one ``threads`` command may take together (a few dozen
#: small commits; far more means they wait on each other).
THREADS_TIMEOUT = 30.0


def value_schema(cols: list[str]) -> pa.Schema:
    """The value schema of a column list: ``a`` (string), then added int64 columns."""
    return pa.schema([("a", pa.string())] + [(c, pa.int64()) for c in cols if c != "a"])


def row_values(cols: list[str], seed: int) -> tuple[Any, ...]:
    """The values a write of ``seed`` puts in ``cols`` (``a`` = ``"v<seed>"``, the added
    columns ``seed``)."""
    return tuple(f"v{seed}" if c == "a" else seed for c in cols)


class Deadlock(Exception):
    """A thread of a command (or a paused append) did not finish within the timeout."""


class PausingStash:
    """A stash wrapper: the consensus seam of the model (see the module docstring).

    ``arm(n, on_pause)`` holds the ``n``-th ``append`` (0-based) from now: ``on_pause()``
    is called, then it waits for :meth:`release`.  ``lose_next_ack()`` makes the next
    ``append`` commit and then raise :class:`stash.IndeterminateError`.  Everything else
    is delegated to the wrapped stash.
    """

    def __init__(self, inner: Stash) -> None:
        self.inner = inner
        self._pause_at: int | None = None
        self._seen = 0
        self._on_pause: Callable[[], None] | None = None
        self._released = threading.Event()
        self._lose_ack = False
        self.lost_acks = 0

    def arm(self, n: int, on_pause: Callable[[], None]) -> None:
        self._pause_at, self._seen, self._on_pause = n, 0, on_pause
        self._released.clear()

    def disarm(self) -> None:
        self._pause_at = None

    def release(self) -> None:
        self._released.set()

    def lose_next_ack(self) -> None:
        self._lose_ack = True

    def append(self, batches: Any) -> None:
        if self._pause_at is not None:
            i, self._seen = self._seen, self._seen + 1
            if i == self._pause_at:
                self._pause_at = None
                assert self._on_pause is not None
                self._on_pause()
                if not self._released.wait(STEP_TIMEOUT):
                    raise Deadlock("a paused stash append was never released")
        self.inner.append(batches)
        if self._lose_ack:
            self._lose_ack = False
            self.lost_acks += 1
            raise IndeterminateError("injected: connection lost during COMMIT")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Worker:
    """The state of one model process: its client, its clock, its writer and the columns
    it knows the shard's value schema to have."""

    def __init__(self, conn: Any, idx: int) -> None:
        self.conn = conn
        self.idx = idx
        self.url = self.blob = ""
        self.send_lock = threading.Lock()
        self.raw: Stash | None = None
        self.stash: Any = None
        self.now = 0.0
        self.client: PersistClient | None = None
        self.kw: dict[str, Any] = {}
        self.shard = ""
        self.cols: list[str] = ["a"]
        self.w: Any = None
        self.last: tuple[Any, list[Any], int, int, str] | None = None

    # ------------------------------------------------------------------ plumbing
    def clock(self) -> float:
        return self.now

    def send(self, msg: tuple[Any, ...]) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def run(self, op: str, now: float, kwargs: dict[str, Any]) -> None:
        self.now = now
        try:
            pause_at = kwargs.pop("pause_at", None)
            if pause_at is not None:
                self.stash.arm(pause_at, lambda: self.send(("paused",)))
            if kwargs.pop("lose_ack", False):
                self.stash.lose_next_ack()
            try:
                result = getattr(self, f"op_{op}")(**kwargs)
            finally:
                self.stash.disarm()
            self.send(("done", result))
        except Exception as e:  # reported to the model, which judges it
            names = [c.__name__ for c in type(e).__mro__]
            indet = bool(getattr(e, "is_indeterminate", lambda: False)())
            tok = getattr(e, "idempotency_token", None)
            msg = f"{e}\n{traceback.format_exc(limit=6)}"
            self.send(("error", names, msg, indet, tok))

    @property
    def c(self) -> PersistClient:
        assert self.client is not None
        return self.client

    def writer(self) -> Any:
        """This process's writer (a new one once its lease ran out)."""
        if self.w is not None:
            try:
                self.w.heartbeat()
            except LeaseExpired:
                self.w = None
        if self.w is None:
            self.w = self.c.open_writer(self.shard, KS, value_schema(self.cols))
        return self.w

    def rows(self, ks: list[int], seeds: list[int]) -> list[Any]:
        return [((k,), row_values(self.cols, s)) for k, s in zip(ks, seeds, strict=True)]

    # ------------------------------------------------------------------ commands
    def op_reset(self, url: str, blob: str, shard: str, kw: dict[str, Any]) -> None:
        """Start an example: a new client on ``url`` (the stash) and ``blob``, for
        ``shard``, knowing only the column ``a``."""
        if self.client is not None:
            self.client.close()
            self.client = None
        if url != self.url:
            if self.raw is not None:
                self.raw.close()
            self.raw = Stash.open(url, fenced=False)
            self.stash = PausingStash(self.raw)
            self.url = url
        self.blob, self.kw = blob, kw
        self.client = PersistClient(self.stash, self.blob, clock=self.clock, **kw)  # type: ignore[arg-type]
        self.shard, self.cols, self.w, self.last = shard, ["a"], None, None

    def op_close(self) -> None:
        """Close the client and the stash (before the test's database goes away)."""
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.raw is not None:
            self.raw.close()
        self.raw, self.stash, self.url = None, None, ""

    def op_append(
        self, ks: list[int], seeds: list[int], lower: int, token: str | None, diff: int = 1
    ) -> list[str]:
        """``compare_and_append`` of one row per ``ks`` at ``[lower, lower + 1)``;
        returns the columns written."""
        w = self.writer()
        upd = [(kv, lower, diff) for kv in self.rows(ks, seeds)]
        self.last = (w, upd, lower, lower + 1, token or "")
        w.compare_and_append(upd, lower, lower + 1, idempotency_token=token)
        return list(self.cols)

    def op_retry_last(self) -> list[str] | None:
        """The last append again, by the same writer, with the same token (None if it
        had no token of the caller's: nothing to retry with)."""
        assert self.last is not None
        w, upd, lo, up, token = self.last
        if not token:
            return None
        w.compare_and_append(upd, lo, up, idempotency_token=token)
        return list(self.cols)

    def op_retry_token(self, token: str) -> list[str]:
        """The last append again with the token its indeterminate error carried."""
        assert self.last is not None
        w, upd, lo, up, _ = self.last
        self.last = (w, upd, lo, up, token)
        w.compare_and_append(upd, lo, up, idempotency_token=token)
        return list(self.cols)

    def op_transmit_twice(self, k: int, seed: int, lower: int) -> dict[str, Any]:
        """One batch transmitted, decoded twice, the copies appended at ``[lower, lower
        + 1)`` and ``[lower + 1, lower + 2)``: the columns written and the second
        copy's outcome (None if it was acknowledged, else the error)."""
        w = self.writer()
        b = w.batch([(kv, lower, 1) for kv in self.rows([k], [seed])], lower, lower + 1)
        data = b.into_transmittable()
        one, two = w.batch_from_transmittable(data), w.batch_from_transmittable(data)
        w.compare_and_append_batch([one], lower, lower + 1)
        second: str | None = None
        two.rewrite_ts(Antichain.from_elem(lower + 1), Antichain.from_elem(lower + 2))
        try:
            w.compare_and_append_batch([two], lower + 1, lower + 2)
        except Exception as e:
            second = f"{type(e).__name__}: {e}"
        return {"cols": list(self.cols), "second": second}

    def op_gc(self) -> int:
        r = collect_garbage(self.c, self.shard)
        return len(r.deleted_abandoned) + len(r.deleted_retired)

    def op_compact(self) -> None:
        self.c.compactor.compact_once(self.shard)

    def op_heartbeat(self) -> None:
        self.writer()

    def op_refresh(self) -> list[str]:
        """Learn the shard's newest value schema (a fresh state read)."""
        st = self.c.inspect(self.shard)
        self.cols = list(st.value_schema.names)
        self.w = None
        return self.cols

    def op_evolve(self, col: str) -> list[str]:
        """Open a writer with this process's columns plus ``col`` (an added column)."""
        cols = [*self.cols, col]
        self.w = self.c.open_writer(self.shard, KS, value_schema(cols))
        self.cols = cols
        return cols

    def op_txn(self, ks: list[int], seeds: list[int], cols: list[str]) -> int:
        """One transaction writing rows with the columns ``cols`` (the shard's newest, as
        the model knows it; this process's cached state may be older)."""
        return self._txn(self.c, ks, seeds, cols)

    @staticmethod
    def _table(ks: list[int], seeds: list[int], cols: list[str]) -> pa.Table:
        vs = value_schema(cols)
        arrays = [pa.array(ks, pa.int64())]
        for c in cols:
            arrays.append(pa.array([row_values([c], s)[0] for s in seeds], vs.field(c).type))
        return pa.Table.from_arrays(arrays, schema=pa.schema(list(KS) + list(vs)))

    def _txn(self, client: PersistClient, ks: list[int], seeds: list[int], cols: list[str]) -> int:
        with client.begin() as txn:
            txn.write(self.shard, self._table(ks, seeds, cols))
            return txn.commit()

    def op_side_touch(self, side: str) -> None:
        """Read the side shard's state (this process caches that version)."""
        self.c.inspect(side)

    def op_side_advance(self, side: str, to: int) -> None:
        """Move the side shard's upper to at least ``to`` (an empty append)."""
        w = self.c.open_writer(side, KS, value_schema(["a"]))
        u = self.c.inspect(side).upper.as_option()
        assert u is not None
        if u < to:
            w.compare_and_append([], u, to)

    def op_txn_two(
        self, ks: list[int], seeds: list[int], cols: list[str], side: str, at: int
    ) -> dict[str, Any]:
        """A transaction writing the model's shard and the side shard, committed at
        ``at``; on :class:`persist.TxnUpperMismatch`, committed again at its
        ``retry_ts()`` (which must then succeed, barring another race)."""
        from persist import TxnUpperMismatch

        with self.c.begin() as txn:
            txn.write(self.shard, self._table(ks, seeds, cols))
            txn.write(side, self._table(ks, seeds, ["a"]))
            try:
                return {"ts": txn.commit_at(at), "retried": False}
            except TxnUpperMismatch as e:
                rt = e.retry_ts()
                assert rt is not None
                return {"ts": txn.commit_at(rt), "retried": True}

    def op_snapshot_many(self, as_of: int) -> list[dict[str, Any]]:
        t = self.c.snapshot_many({self.shard: as_of})[self.shard]
        return t.drop_columns([c for c in ("_time",) if c in t.column_names]).to_pylist()

    def op_threads(self, n: int, cols: list[str]) -> dict[str, Any]:
        """Threads sharing one client (a new one, with background compaction): two
        appending with ``compare_and_append`` (retrying lost upper races), two running
        transactions, one taking snapshots, for ``n`` operations each.  Returns the
        acknowledged writes ``[(time, k, seed, columns)]`` and the snapshots taken."""
        kw = dict(self.kw, compaction="background")
        client = PersistClient(self.stash, self.blob, clock=self.clock, **kw)
        acked: list[tuple[int, int, int, list[str]]] = []
        errors: list[str] = []
        lock = threading.Lock()
        base = 1_000_000 * (self.idx + 1) + int(self.now) % 1000 * 1000

        def appender(j: int) -> None:
            w = client.open_writer(self.shard, KS, value_schema(cols))
            u = client.inspect(self.shard).upper.as_option()
            assert u is not None
            for i in range(n):
                seed = base + 100 * j + i
                while True:
                    try:
                        w.compare_and_append([(((j,), row_values(cols, seed)), u, 1)], u, u + 1)
                        with lock:
                            acked.append((u, j, seed, cols))
                        u += 1
                        break
                    except UpperMismatch as e:
                        cur = e.current.as_option()
                        assert cur is not None
                        u = cur

        def transactor(j: int) -> None:
            for i in range(n):
                seed = base + 100 * j + i
                ts = self._txn(client, [j], [seed], cols)
                with lock:
                    acked.append((ts, j, seed, cols))

        def reader() -> None:
            r = client.open_reader(self.shard, KS, value_schema(cols))
            for _ in range(n):
                u = client.inspect(self.shard).upper.as_option()
                assert u is not None
                if u > 0:
                    r.snapshot(u - 1)
            r.expire()

        def guarded(fn: Callable[[int], None], j: int) -> Callable[[], None]:
            def go() -> None:
                try:
                    fn(j)
                except Exception as e:
                    with lock:
                        errors.append(f"{type(e).__name__}: {e}")

            return go

        threads = [threading.Thread(target=guarded(appender, j), daemon=True) for j in (10, 11)]
        threads += [threading.Thread(target=guarded(transactor, j), daemon=True) for j in (20, 21)]
        threads.append(threading.Thread(target=guarded(lambda _j: reader(), 0), daemon=True))
        for t in threads:
            t.start()
        deadline = time.monotonic() + THREADS_TIMEOUT
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            stuck = sum(t.is_alive() for t in threads)
            raise Deadlock(
                f"{stuck} of {len(threads)} threads sharing one client still running after "
                f"{THREADS_TIMEOUT} s (acknowledged so far: {len(acked)}; errors: {errors})"
            )
        if not client.compactor.wait_idle(THREADS_TIMEOUT):
            raise Deadlock("the background compactor did not become idle")
        client.close()
        return {"acked": acked, "errors": errors}


def serve(conn: Any, idx: int) -> None:
    """The process's main loop (see the module docstring)."""
    w = Worker(conn, idx)
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        if msg[0] == "release":
            w.stash.release()
            continue
        _, op, now, kwargs = msg
        threading.Thread(target=w.run, args=(op, now, kwargs), daemon=True).start()
    if w.client is not None:
        w.client.close()
    if w.raw is not None:
        w.raw.close()
