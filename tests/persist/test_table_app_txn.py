"""``Table.append(..., app_transaction=AppTransaction(app_id, version))``: Delta's
application transactions (:mod:`persist.app_txn`).  An append whose acknowledgement was
lost raises an indeterminate ``ConsensusError``; calling ``append`` again with the same
``(app_id, version)`` appends the rows only if they did not land, and returns the time
they were committed at: in the same client, from another client (another writer, no
shared memory) after the first one's lease ran out, and when two writers race with
one ``(app_id, version)``.  Without it the table had no way to retry an append: calling
``append`` again after an indeterminate error appended the rows twice."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist import (
    AppTransaction,
    ConsensusError,
    InvalidUsage,
    MemoryBlob,
    PersistClient,
    StaleAppVersion,
    Table,
    Txn,
)
from persist.app_txn import APP_TXN_COLLECTION_PREFIX, AppTxnLog
from stash import Stash
from tests.support.clock import Clock
from tests.support.dbutil import backend_url
from tests.support.procs import process_context
from tests.support.stash_faults import AckLostStash

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.string())])


def batch(*ks: int, v: str = "x") -> pa.Table:
    return pa.table({"k": list(ks), "v": [v] * len(ks)}, schema=SCHEMA)


def live(t: Table) -> Counter[tuple[int, str]]:
    return Counter((r["k"], r["v"]) for r in t.to_arrow().to_pylist())


@pytest.fixture
def quick_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transaction gives up resolving a lost acknowledgement at once."""
    monkeypatch.setattr(Txn, "resolve_attempts", 2)
    monkeypatch.setattr(Txn, "resolve_max_wait", 0.001)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def world(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[Clock, AckLostStash, PersistClient, Any]]:
    """A client over a stash that loses acknowledgements, and a way to open another
    client (its own stash handle, writer and caches) over the same database."""
    url = backend_url(request, str(request.param), tmp_path)
    clock, blob = Clock(), MemoryBlob()
    kw: dict[str, Any] = {
        "clock": clock,
        "writer_lease_seconds": 60,
        "compaction": "off",
        "consensus_retries": 1,
    }
    flaky = AckLostStash(Stash.open(url, fenced=False))
    c = PersistClient(flaky, blob, **kw)  # type: ignore[arg-type]
    opened: list[tuple[PersistClient, Stash]] = []

    def other() -> PersistClient:
        s = Stash.open(url, fenced=False)
        oc = PersistClient(s, blob, **kw)
        opened.append((oc, s))
        return oc

    yield clock, flaky, c, other
    for oc, s in opened:
        oc.close()
        s.close()
    c.close()
    flaky.inner.close()


def _lost(flaky: AckLostStash, t: Table, rows: pa.Table, app: AppTransaction) -> None:
    """``t.append(rows, app)`` lands, but its outcome stays unknown."""
    flaky.arm(reads=1000)
    with pytest.raises(ConsensusError) as e:
        t.append(rows, app_transaction=app)
    assert e.value.is_indeterminate()
    flaky.reads_to_fail = 0


@pytest.mark.usefixtures("quick_resolve")
def test_retry_after_an_indeterminate_append_appends_once(world: Any) -> None:
    _clock, flaky, c, _other = world
    t = c.create_table("t", SCHEMA, key=["k"])
    app = AppTransaction("job", 7)
    _lost(flaky, t, batch(1, 2), app)
    seqno = c.inspect("t").seqno
    assert t.append(batch(1, 2), app_transaction=app) == 0  # the time it landed at
    assert c.inspect("t").seqno == seqno  # nothing written again
    assert live(t) == Counter({(1, "x"): 1, (2, "x"): 1})
    assert t.transaction_version("job") == 7
    assert t.append(batch(3), app_transaction=AppTransaction("job", 8)) == 1
    assert live(t) == Counter({(1, "x"): 1, (2, "x"): 1, (3, "x"): 1})


@pytest.mark.usefixtures("quick_resolve")
def test_retry_from_another_client_after_the_lease_ran_out_appends_once(world: Any) -> None:
    clock, flaky, c, other = world
    t = c.create_table("t", SCHEMA, key=["k"])
    t.append(batch(0))
    app = AppTransaction("job", 3)
    _lost(flaky, t, batch(1, 2), app)
    clock.advance(3600)  # the first writer's lease ran out
    o = other().table("t")
    o.append(batch(9), app_transaction=AppTransaction("another job", 0))  # drops it
    assert o.append(batch(1, 2), app_transaction=app) == 1
    assert live(o) == Counter({(0, "x"): 1, (1, "x"): 1, (2, "x"): 1, (9, "x"): 1})
    assert o.transaction_version("job") == 3 and t.transaction_version("job") == 3


def test_a_retry_that_did_not_land_appends(world: Any) -> None:
    """The first attempt failed definitely (nothing committed): the retry appends."""
    _clock, flaky, c, _other = world
    t = c.create_table("t", SCHEMA, key=["k"])
    app = AppTransaction("job", 1)
    assert t.transaction_version("job") is None
    with pytest.raises(InvalidUsage):
        t.append(pa.table({"k": [1], "nope": ["x"]}), app_transaction=app)
    assert t.append(batch(1), app_transaction=app) == 0
    assert live(t) == Counter({(1, "x"): 1})


def test_versions_at_or_below_the_committed_one_write_nothing(world: Any) -> None:
    _clock, _flaky, c, _other = world
    t = c.create_table("t", SCHEMA, key=["k"])
    assert t.append(batch(1), app_transaction=AppTransaction("job", 5)) == 0
    t.append(batch(2))
    seqno = c.inspect("t").seqno
    with pytest.raises(StaleAppVersion, match=r"'job' version 4 is below .* 5"):
        t.append(batch(3), app_transaction=AppTransaction("job", 4))
    with pytest.raises(InvalidUsage, match="other rows"):  # one version, other rows
        t.append(batch(3), app_transaction=AppTransaction("job", 5))
    assert t.append(batch(1), app_transaction=AppTransaction("job", 5)) == 0
    assert c.inspect("t").seqno == seqno
    # The rows are a multiset: a retry may make them in another order.
    assert t.append(batch(7, 8), app_transaction=AppTransaction("job", 6)) == 2
    assert t.append(batch(8, 7), app_transaction=AppTransaction("job", 6)) == 2
    with pytest.raises(InvalidUsage, match="other rows"):
        t.append(batch(7, 8, 8), app_transaction=AppTransaction("job", 6))
    seqno = c.inspect("t").seqno
    assert live(t) == Counter({(1, "x"): 1, (2, "x"): 1, (7, "x"): 1, (8, "x"): 1})
    # App ids are apart; history names the app transaction.
    assert t.append(batch(4), app_transaction=AppTransaction("other", 0)) == 3
    assert json.loads(t.history(1).column("parameters")[0].as_py()) == {
        "app_id": "other",
        "version": 0,
    }
    with pytest.raises(InvalidUsage, match="app_transaction must be"):
        t.append(batch(5), app_transaction=("job", 6))  # type: ignore[arg-type]
    with pytest.raises(InvalidUsage, match="version must be an int"):
        AppTransaction("job", -1)
    with pytest.raises(InvalidUsage, match="app_id must be"):
        AppTransaction("", 1)


def test_two_writers_racing_with_one_version_append_once(
    world: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writer B reads the records before writer A commits the same (app_id, version):
    B's commit fails its lower check on the records, decides again on them, and
    returns A's time without appending; a writer of another app id racing the same way
    commits after deciding again, and one racing a plain append commits at a later
    time."""
    _clock, _flaky, c, other = world
    t = c.create_table("t", SCHEMA, key=["k"])
    b = other().table("t")
    app = AppTransaction("job", 1)
    read = AppTxnLog.read
    first: list[Any] = []

    def racing(self: AppTxnLog, app_id: str) -> Any:
        seen = read(self, app_id)
        if first:
            first.pop()()  # writer A commits between B's read and B's commit
        return seen

    monkeypatch.setattr(AppTxnLog, "read", racing)
    first.append(lambda: t.append(batch(1, 2), app_transaction=app))
    assert b.append(batch(1, 2), app_transaction=app) == 0
    assert live(t) == Counter({(1, "x"): 1, (2, "x"): 1})
    first.append(lambda: t.append(batch(4), app_transaction=AppTransaction("third", 1)))
    assert b.append(batch(3), app_transaction=AppTransaction("other", 1)) == 2
    assert t.transaction_version("other") == 1 and t.transaction_version("third") == 1
    assert live(t) == Counter({(1, "x"): 1, (2, "x"): 1, (3, "x"): 1, (4, "x"): 1})
    # A race on the shard alone (a plain append just before the commit): the commit
    # moves to a later time.
    commit_at = Txn.commit_at
    races: list[int] = []

    def racing_commit(self: Txn, ts: int) -> int:
        if not races:
            races.append(ts)
            t.append(batch(5))
        return commit_at(self, ts)

    monkeypatch.setattr(Txn, "commit_at", racing_commit)
    assert b.append(batch(6), app_transaction=AppTransaction("other", 2)) == 4
    assert races == [3]
    assert t.append(batch(6), app_transaction=AppTransaction("other", 2)) == 4  # recorded
    assert t.transaction_version("other") == 2
    assert live(t)[(6, "x")] == 1 and live(t)[(5, "x")] == 1


def test_an_empty_append_with_an_app_transaction_records_only_the_version(
    world: Any,
) -> None:
    _clock, _flaky, c, _other = world
    t = c.create_table("t", SCHEMA, key=["k"])
    t.append(batch(1))
    seqno = c.inspect("t").seqno
    assert t.append(batch(), app_transaction=AppTransaction("job", 2)) == 0
    assert t.append(batch(), app_transaction=AppTransaction("job", 2)) == 0
    assert c.inspect("t").seqno == seqno and t.history().num_rows == 2
    assert t.transaction_version("job") == 2
    with pytest.raises(StaleAppVersion):
        t.append(batch(2), app_transaction=AppTransaction("job", 1))


def test_garbage_in_the_records_is_named(world: Any) -> None:
    _clock, flaky, c, _other = world
    t = c.create_table("t", SCHEMA, key=["k"])
    t.append(batch(1), app_transaction=AppTransaction("job", 1))
    coll = flaky.inner.collection(APP_TXN_COLLECTION_PREFIX + t.shard_id, key="str", value="json")
    b = coll.make_batch(flaky.inner)
    coll.append_to_batch(b, "bad", {"version": "1"}, 1)
    flaky.inner.append([b])
    with pytest.raises(ConsensusError, match=r"app id 'bad' is .*int 'version' >= 0"):
        t.transaction_version("bad")


def test_transaction_version_on_a_readonly_stash(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'stash.db'}"
    blob = MemoryBlob()
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(s, blob, compaction="off")
        t = c.create_table("t", SCHEMA, key=["k"])
        c.create_table("u", SCHEMA, key=["k"])
        t.append(batch(1), app_transaction=AppTransaction("job", 4))
        c.close()
    with Stash.open(url, mode="readonly") as s:
        c = PersistClient(s, blob, compaction="off")
        assert c.table("t").transaction_version("job") == 4
        assert c.table("u").transaction_version("job") is None
        with pytest.raises(InvalidUsage):
            c.table("u").append(batch(1), app_transaction=AppTransaction("job", 1))
        c.close()


def _retry_in_a_process(url: str, blob: str, out: Any) -> None:
    """A fresh process's retry of ``("job", 3)``: its own stash handle, blob store,
    client and writer; it knows only the table's name and the app transaction."""
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(s, blob, compaction="off")
        t = c.table("t")
        out.put(t.append(batch(1, 2), app_transaction=AppTransaction("job", 3)))
        c.close()


@pytest.mark.usefixtures("quick_resolve")
def test_retry_from_another_process_appends_once(tmp_path: Path) -> None:
    url, blob = f"sqlite:///{tmp_path / 'stash.db'}", f"file://{tmp_path / 'blob'}"
    flaky = AckLostStash(Stash.open(url, fenced=False))
    c = PersistClient(flaky, blob, compaction="off", consensus_retries=1)  # type: ignore[arg-type]
    try:
        t = c.create_table("t", SCHEMA, key=["k"])
        t.append(batch(0))
        _lost(flaky, t, batch(1, 2), AppTransaction("job", 3))
        ctx = process_context()
        out = ctx.Queue()
        p = ctx.Process(target=_retry_in_a_process, args=(url, blob, out))
        p.start()
        p.join(120)
        assert p.exitcode == 0
        assert out.get(timeout=5) == 1  # the time the first attempt landed at
        assert live(t) == Counter({(0, "x"): 1, (1, "x"): 1, (2, "x"): 1})
    finally:
        c.close()
        flaky.inner.close()


def test_a_users_transaction_cannot_write_the_records(world: Any) -> None:
    """The records are persist's own: a user's ``Txn.stash_append`` of a batch for them
    (which could forge a version and so skip a later append) is refused, writes nothing,
    and the table still records its own."""
    _clock, _flaky, c, _other = world
    t = c.create_table("t", SCHEMA, key=["k"])
    t.append(batch(1), app_transaction=AppTransaction("job", 1))
    records = c.stash.collection(APP_TXN_COLLECTION_PREFIX + t.shard_id, key="str", value="json")
    forged = records.make_batch(c.stash)
    records.append_to_batch(forged, "job", {"version": 99}, 1)
    with c.begin() as txn, pytest.raises(InvalidUsage, match="persist's own collections"):
        txn.stash_append([forged])
    assert t.transaction_version("job") == 1
    assert t.append(batch(2), app_transaction=AppTransaction("job", 2)) == 1
