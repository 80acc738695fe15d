"""A change feed of stash collections (``Stash.subscribe``) and the retention that keeps
their history readable (``Stash.set_retention``).

``subscribe(collections, as_of)`` yields, per collection, the contents as of ``as_of``
(unless ``snapshot=False``), then every committed change ``Change(collection, key,
value, time, diff)`` at each later sealed time, each time followed by a ``Progress(collection,
upper)``: every change of that collection at times ``< upper`` has been yielded.  To
resume after a restart, subscribe with ``as_of=upper - 1, snapshot=False``: the feed
continues exactly after the last progress.

Invariants kept here:

* each poll reads every subscribed collection in one read transaction; the changes of
  ``[emitted, upper)`` are read through the ``(collection_id, time)`` index and
  consolidated per ``(key, value, time)``, in time order; a change is yielded once;
* history is only readable while the since is at most the last time yielded
  (physical consolidation moves rows before the since to it): a read finding the since
  beyond that raises :class:`FeedCompacted` naming the collection, the time asked for
  and the since, never a wrong or partial feed;
* a collection's since follows its retention when one is set (``set_retention``:
  ``keep_times=N`` keeps the last ``N`` times readable, ``keep_times=None`` every time
  since the retention was set, ``keep_for=timedelta`` every time committed within that
  duration): ``make_batch``, the one-transaction typed writes and ``with_transaction``
  compact to the retained since instead of to the batch's time.  The setting is stored
  in the collection ``stash.retention`` (key: collection name), so every writer of
  every process follows it;
* Postgres wakes subscribers with ``LISTEN/NOTIFY`` (a trigger on ``uppers`` notifies
  channel ``stash_uppers`` with the collection id, ``migrations/versions/0005``); SQLite
  and memory poll.

Source of the idea: Materialize's ``SUBSCRIBE`` (a snapshot ``AS OF``, then updates with
progress) and persist's ``Listen`` (``src/persist-client/src/read.rs``), etcd's watch
with a revision to resume from.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import EllipsisType
from typing import Any, NamedTuple

from stash.antichain import Antichain
from stash.collection import StashCollection
from stash.errors import StashError
from stash.keyed import Target, upsert_key
from stash.placement import driver_url
from stash.retention import RETENTION_COLLECTION
from stash.txn import Txn

__all__ = ["Change", "FeedCompacted", "Progress", "set_retention", "subscribe"]

NOTIFY_CHANNEL = "stash_uppers"


class Change(NamedTuple):
    """One committed change: ``diff`` copies of ``(key, value)`` at ``time``."""

    collection: str
    key: Any
    value: Any
    time: int
    diff: int


class Progress(NamedTuple):
    """Every change of ``collection`` at times ``< upper`` has been yielded."""

    collection: str
    upper: int


class FeedCompacted(StashError):
    """The history a subscription asks for is compacted away (the since moved past it)."""


# ------------------------------------------------------------------ retention
def set_retention(
    stash: Any,
    collection: StashCollection[Any, Any],
    keep_times: int | None | EllipsisType = ...,
    keep_for: dt.timedelta | None = None,
) -> None:
    """Make the collection's since follow a retention instead of every append
    (``Stash.set_retention`` calls this; see :mod:`stash.retention`).

    ``keep_times=N`` keeps its last ``N`` times readable (with one append per time, its
    last ``N`` appends); ``keep_times=None`` keeps every time from now on.
    ``keep_for=timedelta`` keeps every time committed within that duration of the
    stash's wall clock (``Stash.clock``): the since becomes the newest time committed at
    or before ``now - keep_for`` (times committed before the setting count as older than
    any later one).  With both, the since keeps what either asks for.  A new setting
    replaces the previous one; the since never goes back.  ``make_batch``, the typed
    writes and ``with_transaction`` follow it; a batch built by hand keeps the
    ``compact`` it asks for.  Stored in the stash (collection ``stash.retention``), so
    writers of every process follow it.

    Raises:
        StashError: neither ``keep_times`` nor ``keep_for`` given; ``keep_times`` is
            not a positive int or ``None``; ``keep_for`` is not a positive
            ``timedelta``; ``keep_times=None`` (every time) with a ``keep_for``; a
            readonly stash.  Nothing is written then.
    """
    policy: dict[str, Any] = {}
    if keep_times is not ...:
        if keep_times is not None and (
            isinstance(keep_times, bool) or not isinstance(keep_times, int) or keep_times < 1
        ):
            raise StashError(f"keep_times must be a positive int or None, got {keep_times!r}")
        policy["keep_times"] = keep_times
    if keep_for is not None:
        if not isinstance(keep_for, dt.timedelta) or keep_for <= dt.timedelta(0):
            raise StashError(f"keep_for must be a positive datetime.timedelta, got {keep_for!r}")
        if keep_times is None:
            raise StashError(
                "set_retention: keep_times=None keeps every time already; give keep_for "
                "alone, or with a keep_times count"
            )
        policy["keep_for_ms"] = max(1, keep_for // dt.timedelta(milliseconds=1))
    if not policy:
        raise StashError("set_retention: give keep_times (a count of times) or keep_for")
    target = Target(RETENTION_COLLECTION, "str", "json")
    upsert_key(stash, target, collection.name, policy)


# ------------------------------------------------------------------ the feed
def _time_rows(tx: Txn, cid: int, lo: int, hi: int) -> list[tuple[str, str, int, int]]:
    """Rows of ``cid`` at times ``lo <= time < hi`` through the time index."""
    backend = getattr(getattr(tx, "stash", None), "backend", None)
    flush = getattr(tx, "_flush", None) or getattr(tx, "_write_buffered", None)
    if backend == "sqlite":
        if flush is not None:
            flush()
        cur = tx.dbc.execute(  # type: ignore[attr-defined]
            "SELECT key, value, time, diff FROM data WHERE collection_id = :c"
            " AND time >= :lo AND time < :hi",
            {"c": cid, "lo": lo, "hi": hi},
        )
    elif backend == "postgresql":
        from stash.ranges import _canonical  # jsonb::text made canonical

        if flush is not None:
            flush()
        cur = tx.cur.execute(  # type: ignore[attr-defined]
            "SELECT key::text, value::text, time, diff FROM data WHERE collection_id = %(c)s"
            " AND time >= %(lo)s AND time < %(hi)s",
            {"c": cid, "lo": lo, "hi": hi},
        )
        c = _canonical
        return [(c(k), c(v), int(t), int(d)) for k, v, t, d in cur.fetchall()]
    else:
        return [r for r in tx.rows(cid) if lo <= r[2] < hi]
    return [(str(k), str(v), int(t), int(d)) for k, v, t, d in cur.fetchall()]


def _compacted(name: str, at: int, since: int | None) -> FeedCompacted:
    return FeedCompacted(
        f"subscribe: collection {name} is compacted past time {at} (its since is "
        f"{Antichain.from_option(since)}); subscribe as of a time at or after the since, "
        "or set a retention (Stash.set_retention) that keeps the history"
    )


def subscribe(
    stash: Any,
    collections: Sequence[StashCollection[Any, Any]],
    as_of: int | Mapping[str, int],
    *,
    snapshot: bool = True,
    poll_interval: float = 0.2,
    idle_timeout: float | None = None,
) -> Iterator[Change | Progress]:
    """A change feed (``Stash.subscribe`` calls this): per collection, its contents as
    of ``as_of`` (times ``<= as_of``, at time ``as_of``; skipped with
    ``snapshot=False``), then each committed change at each later sealed time as
    ``Change(collection, key, value, time, diff)`` in time order, each sealed step
    followed by ``Progress(collection, upper)`` (every change at times ``< upper`` was
    yielded).  Resume from a progress ``upper`` with ``as_of=upper - 1,
    snapshot=False``.  Postgres wakes it with ``LISTEN/NOTIFY``; SQLite and memory poll
    every ``poll_interval`` seconds.  It runs until closed (``break``), or until nothing
    new arrived for ``idle_timeout`` seconds.

    Args:
        stash: the stash.
        collections: the collection handles.
        as_of: a time, or ``{collection name: time}``.

    Raises:
        FeedCompacted: the since of a collection passed the last time yielded (or
            ``as_of``): its history is compacted away (set a retention first).
        StashError: ``as_of`` is not sealed yet; a collection is given twice; a
            collection records other codecs than its handle's; an ``as_of`` mapping
            lacks a subscribed collection (names it does not subscribe are ignored);
            ``collections`` is not a sequence of collection handles or
            ``TypedCollection`` objects (as ``with_transaction`` reads them).
    """
    colls = _handles(stash, collections)
    names = [c.name for c in colls]
    if len(set(names)) != len(names):
        raise StashError("subscribe: a collection is given twice")
    if isinstance(as_of, Mapping):
        missing = [n for n in names if n not in as_of]
        if missing:
            raise StashError(
                f"subscribe: as_of gives no time for the subscribed collection(s) {missing} "
                f"(it names {sorted(str(n) for n in as_of)})"
            )
    start = {n: as_of[n] if isinstance(as_of, Mapping) else as_of for n in names}
    for n, t in start.items():
        if isinstance(t, bool) or not isinstance(t, int):
            raise StashError(f"subscribe: as_of of collection {n} must be an int, got {t!r}")
    emitted = {n: start[n] + 1 for n in names}  # every change before it is yielded
    listener = _Listener(stash)
    try:
        first = True
        idle_since = time.monotonic()
        while True:
            batch = _poll(stash, colls, start, emitted, first and snapshot)
            first = False
            moved = False
            for ev in batch:
                if isinstance(ev, Progress):
                    moved = True
                    emitted[ev.collection] = ev.upper
                yield ev
            if moved:
                idle_since = time.monotonic()
                continue
            if idle_timeout is not None and time.monotonic() - idle_since >= idle_timeout:
                return
            wait = poll_interval
            if idle_timeout is not None:
                wait = min(wait, max(0.0, idle_timeout - (time.monotonic() - idle_since)))
            listener.wait(wait)
    finally:
        listener.close()


def _handles(stash: Any, collections: Any) -> list[StashCollection[Any, Any]]:
    """The handles of ``collections``: ``StashCollection`` objects as they are, a
    ``TypedCollection`` (anything with ``get(stash)`` giving a handle) by its handle.

    Raises:
        StashError: ``collections`` is one collection rather than a sequence of them,
            or holds something else.
    """
    if isinstance(collections, StashCollection) or _typed(collections):
        raise StashError(
            f"subscribe: collections must be a sequence of collections, got one "
            f"{type(collections).__name__} {collections.name!r}: write [collection]"
        )
    if isinstance(collections, (str, bytes, Mapping)) or not isinstance(collections, Iterable):
        raise StashError(
            "subscribe: collections must be a sequence of collections, got a "
            f"{type(collections).__name__}"
        )
    out: list[StashCollection[Any, Any]] = []
    for c in collections:
        handle = c.get(stash) if _typed(c) else c
        if not isinstance(handle, StashCollection):
            raise StashError(
                "subscribe: collections must be StashCollection or TypedCollection "
                f"objects, got a {type(c).__name__}"
            )
        out.append(handle)
    return out


def _typed(c: Any) -> bool:
    """Whether ``c`` is a ``TypedCollection`` (not imported here: it imports this
    module's neighbours): a named object with ``get(stash)`` and codecs."""
    return (
        not isinstance(c, (StashCollection, Mapping))
        and callable(getattr(c, "get", None))
        and all(hasattr(c, a) for a in ("name", "key", "value"))
    )


def _poll(
    stash: Any,
    colls: list[StashCollection[Any, Any]],
    start: dict[str, int],
    emitted: dict[str, int],
    snapshot: bool,
) -> list[Change | Progress]:
    """The events of one read transaction over every collection."""

    def read(tx: Txn) -> list[tuple[StashCollection[Any, Any], list[Any], int | None]]:
        out = []
        for c in colls:
            since, upper = tx.frontiers(c.id)
            lo = emitted[c.name]
            if since is None or since > lo - 1:
                raise _compacted(c.name, lo - 1, since)
            rows: list[Any] = []
            if snapshot:
                at = start[c.name]
                if upper is not None and at >= upper:
                    raise StashError(
                        f"subscribe: as_of {at} of collection {c.name} is not sealed yet "
                        f"(its upper is {Antichain.from_option(upper)})"
                    )
                rows += [(k, v, at, d) for k, v, d in tx.peek_rows(c.id, at)]
            hi = upper if upper is not None else 2**63 - 1
            if hi > lo:
                rows += _time_rows(tx, c.id, lo, hi)
            out.append((c, rows, upper))
        return out

    events: list[Change | Progress] = []
    for c, rows, upper in stash._read(read, codecs=colls):
        sums: dict[tuple[int, str, str], int] = {}
        for k, v, t, d in rows:
            sums[(t, k, v)] = sums.get((t, k, v), 0) + d
        kc, vc = c.key_codec, c.value_codec
        for (t, k, v), d in sorted(sums.items(), key=lambda e: e[0][0]):
            if d:
                events.append(Change(c.name, kc.decode(k), vc.decode(v), t, d))
        new_upper = upper if upper is not None else 2**63 - 1
        if new_upper > emitted[c.name] or snapshot:
            events.append(Progress(c.name, max(new_upper, emitted[c.name])))
    return events


class _Listener:
    """Waits for a wake-up: a ``NOTIFY`` on Postgres (a connection of its own that
    ``LISTEN``s), else a sleep of the poll interval."""

    def __init__(self, stash: Any) -> None:
        self.conn: Any = None
        if getattr(stash, "backend", None) == "postgresql":
            try:
                import psycopg

                url = driver_url(stash.engine.url).set(drivername="postgresql")
                self.conn = psycopg.connect(
                    url.render_as_string(hide_password=False), autocommit=True
                )
                self.conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
            except Exception:  # noqa: BLE001 - no listener: poll instead
                self.conn = None

    def wait(self, seconds: float) -> None:
        if self.conn is None:
            time.sleep(seconds)
            return
        try:
            # Wakes on a notification or after ``seconds`` (the poll runs either way).
            for _ in self.conn.notifies(timeout=seconds, stop_after=1):
                pass
        except Exception:  # noqa: BLE001 - a lost listener: poll from now on
            self.close()
            time.sleep(seconds)

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            finally:
                self.conn = None
