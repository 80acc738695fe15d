"""The Postgres backend on a real server: jsonb text both ways, fencing (including a deposed
leader that keeps writing), readonly and savepoint modes as in Materialize's stash tests
(``src/stash/src/lib.rs``; with a role that may only SELECT, to show they never write the
live tables), and the epoch left untouched by both."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql
from sqlalchemy.engine import make_url

from stash import (
    Antichain,
    AppendLowerMismatch,
    FenceError,
    ReadOnlyError,
    Stash,
    StashError,
)
from stash.codec import canonical_json
from stash.postgres import canonical_text
from tests.stash.conftest_helpers import tick
from tests.support.dbutil import migrate_to_head
from tests.support.pgserver import PostgresServer

pytestmark = pytest.mark.postgres

A = Antichain.from_elem


@pytest.fixture
def pg(postgres_url: str) -> str:
    """A fresh migrated database; its URL."""
    migrate_to_head(postgres_url)
    return postgres_url


@pytest.fixture
def opened(pg: str) -> Iterator[Callable[..., Stash]]:
    """``opened(**kw)`` opens a handle on the test's database; all closed afterwards."""
    handles: list[Stash] = []

    def _open(url: str | None = None, **kw: Any) -> Stash:
        s = Stash.open(url or pg, **kw)
        handles.append(s)
        return s

    yield _open
    for s in handles:
        s.close()


def dbname(url: str) -> str:
    name = make_url(url).database
    assert name
    return name


def fence_row(server: PostgresServer, url: str) -> tuple[int, bytes]:
    with server.connect(dbname(url)) as conn:
        row = conn.execute("SELECT epoch, nonce FROM fence").fetchone()
    assert row is not None
    return int(row[0]), bytes(row[1])


@pytest.fixture
def select_only_url(pg: str, postgres_server: PostgresServer) -> Iterator[str]:
    """The URL of a role that may only read the stash tables (and make temp tables)."""
    db = dbname(pg)
    role = f"reader_{secrets.token_hex(4)}"
    password = secrets.token_urlsafe(16)
    with postgres_server.connect(db) as conn:
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                sql.Identifier(role), sql.Literal(password)
            )
        )
        conn.execute(
            sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA public TO {}").format(
                sql.Identifier(role)
            )
        )
    url = make_url(pg).set(username=role, password=password)
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        postgres_server.terminate_backends(db)
        with postgres_server.connect(db) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


# --------------------------------------------------------------------- jsonb


def test_values_are_jsonb_readable_with_plain_sql(opened, postgres_server, pg) -> None:  # type: ignore[no-untyped-def]
    s = opened(fenced=False)
    c = s.collection("people", key="int")
    tick(s, c, [(1, {"name": "Ada", "langs": ["en", "fr"]}, 1)])
    with postgres_server.connect(dbname(pg)) as conn:
        row = conn.execute(
            "SELECT pg_typeof(value)::text, value->>'name', value->'langs'->>1, key::text"
            " FROM stash_entries WHERE collection = 'people'"
        ).fetchone()
    assert row == ("jsonb", "Ada", "fr", "1")


def test_jsonb_text_comes_back_canonical(opened, postgres_server, pg) -> None:  # type: ignore[no-untyped-def]
    """Rows written by plain SQL with any spacing and key order read back as the codec's
    canonical text, so they consolidate with rows the stash wrote."""
    s = opened(fenced=False)
    c = s.collection("c")
    value = {"bb": [1, 2.5, "x y"], "a": {"z": None, "y": True}, "é": '\n"\\'}
    tick(s, c, [("k", value, 1)])
    cid = c.id
    with postgres_server.connect(dbname(pg)) as conn:
        conn.execute(
            "INSERT INTO data VALUES (%s, '\"k\"'::jsonb,"
            ' \'{ "é": "\\n\\"\\\\",  "a": {"y": true, "z": null}, "bb": [1, 2.50, "x y"]}\''
            "::jsonb, 0, 1)",
            (cid,),
        )
    assert s.peek(c) == [("k", value, 2)]
    assert s.iter(c) == [(("k", value), 0, 2)]
    s.consolidate(c)
    with postgres_server.connect(dbname(pg)) as conn:
        n = conn.execute("SELECT count(*) FROM data").fetchone()
    assert n == (1,)


@pytest.mark.parametrize(
    "text",
    ['"a\\u0001\\n\\"é"', "-12", "0", "true", "null", '{"b": 1, "aa": [1, 2]}', "0.00000015", "[]"],
)
def test_canonical_text_of_jsonb_renderings(text: str) -> None:
    import json

    assert canonical_text(text) == canonical_json(json.loads(text))


def _big_whole(x: float) -> bool:
    return x.is_integer() and abs(x) >= 2**53


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: not _big_whole(x))
    | st.text(
        alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
        max_size=8,
    ),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.text(
                alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                max_size=5,
            ),
            inner,
            max_size=3,
        )
    ),
    max_leaves=8,
)


def test_json_round_trip_property(opened) -> None:  # type: ignore[no-untyped-def]
    s = opened(fenced=False)
    c = s.collection("rt", key="int")
    counter = iter(range(10**6))

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(json_values)
    def check(value: Any) -> None:
        k = next(counter)
        s.update(c, (k, value), s.upper(c).as_option() or 0, 1)
        s.seal(c, A(s.upper(c).as_option() + 1))  # type: ignore[operator]
        got = s.peek_key_one(c, k)
        assert got == value
        # What is read back is canonical: encoding it again gives the same text.
        assert canonical_json(got) == canonical_json(value)

    check()


def test_big_whole_float_round_trips(opened) -> None:  # type: ignore[no-untyped-def]
    s = opened(fenced=False)
    c = s.collection("f")
    tick(s, c, [("k", 4.676280215831621e16, 1)])
    assert s.peek_key_one(c, "k") == 4.676280215831621e16


def _positional(
    statement: str, names: list[str], keep_numbers: bool = False
) -> tuple[str, list[str]]:
    """``statement`` with its named placeholders, text (``%(n)s``) and binary
    (``%(n)b``), turned into ``$i`` for ``PREPARE``, and the names it uses in order.
    ``$i`` counts the used names, or (``keep_numbers``) all of ``names``."""
    used = [n for n in names if f"%({n})s" in statement or f"%({n})b" in statement]
    for i, n in enumerate(names if keep_numbers else used):
        statement = statement.replace(f"%({n})s", f"${i + 1}").replace(f"%({n})b", f"${i + 1}")
    assert "%(" not in statement, statement  # every placeholder was rewritten
    return statement, used


def test_generic_plan_of_the_append_statement_has_no_array_scan(
    opened, postgres_server, pg
) -> None:  # type: ignore[no-untyped-def]
    """The append statement runs with generic plans (the session default the stash sets).
    A ``key = ANY($array)`` row filter would then scan the array once per row: a 10,000
    entry append took minutes that way.  The key set must be a join, never such a filter."""
    import re

    from stash.postgres import _FLUSH_SQL

    s = opened(fenced=False)
    c = s.collection("c", key="int", value="int")
    tick(s, c, [(i, i, 1) for i in range(50)])
    names = ["c", "u", "su", "s", "ss", "cs", "ks", "vs", "ts", "ds", "ck"]
    types = [
        "int",
        "int8",
        "bool",
        "int8",
        "bool",
        "int8",
        "text[]",
        "text[]",
        "int8[]",
        "int8[]",
        "text[]",
    ]
    with postgres_server.connect(dbname(pg)) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        for key, statement in _FLUSH_SQL.items():
            q, used_names = _positional(statement, names, keep_numbers=True)
            used = [types[names.index(n)] for n in used_names]
            name = f"flush_{key[0]}_{key[1]}"
            conn.execute(f"PREPARE {name}({', '.join(types)}) AS {q}")
            args = "1, 2, true, 1, true, 1, ARRAY['1'], ARRAY['1'], ARRAY[1]::int8[], ARRAY[1]::int8[], ARRAY['1']"
            plan = "\n".join(r[0] for r in conn.execute(f"EXPLAIN EXECUTE {name}({args})"))
            filters = [ln for ln in plan.splitlines() if "Filter:" in ln]
            assert not any(re.search(r"= ANY", ln) for ln in filters), (key, plan)
            assert used  # every variant takes parameters


def _data_rows_read(plan: dict[str, Any]) -> int:
    """Rows that the scans of table ``data`` in an ``EXPLAIN (ANALYZE, FORMAT JSON)`` plan
    produced, over all their loops."""
    n = 0
    if plan.get("Relation Name") == "data" and "Scan" in plan.get("Node Type", ""):
        n += int(plan.get("Actual Rows", 0)) * int(plan.get("Actual Loops", 0))
        n += int(plan.get("Rows Removed by Filter", 0))
        n += int(plan.get("Rows Removed by Index Recheck", 0))
    for child in plan.get("Plans", []):
        n += _data_rows_read(child)
    return n


def test_cached_plans_made_on_a_tiny_collection_stay_key_driven(
    opened, postgres_server, pg
) -> None:  # type: ignore[no-untyped-def]
    """The stash's statements are prepared with generic plans, made once per connection,
    often while the table is still tiny; on a tiny table the planner may prefer the
    (collection_id, time) index, i.e. reading every row of the collection.  Such a plan,
    kept while the collection grows, made every append O(collection) (1,260 appends/s
    fell to 390 within 8,000 entries).  Prepared on 5 rows and run on 3,000, the append of
    a new key and peek_key_one must read only a handful of rows."""
    import json

    from stash.pg_statements import _PEEK_KEY_SQL, _PEEK_KEYS_SQL
    from stash.postgres import _FLUSH_SQL

    s = opened(fenced=False)
    c = s.collection("c", key="int", value="int")
    tick(s, c, [(i, i, 1) for i in range(5)])
    append_sql = _FLUSH_SQL[(True, "keys")]
    names = ["c", "u", "su", "s", "ss", "cs", "ks", "vs", "ts", "ds", "ck", "k", "kk"]
    types = ["int", "int8", "bool", "int8", "bool", "int8"] + ["text[]"] * 2 + ["int8[]"] * 2
    types += ["text[]", "text", "text[]"]

    def positional(statement: str) -> tuple[str, list[str]]:
        return _positional(statement, names)

    with postgres_server.connect(dbname(pg)) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        statements = {
            "append": append_sql,
            # A new value of a stored key: its row, before the since, moves to the since
            # (deleted and rewritten), key by key too.
            "append_stored": append_sql,
            "peek_key": _PEEK_KEY_SQL.replace("%(ts)s", "%(cs)s"),
            # One key's candidate texts (stash.codec.key_texts) in one statement.
            "peek_keys": _PEEK_KEYS_SQL.replace("%(ts)s", "%(cs)s").replace("%(k)s", "%(kk)s"),
        }
        used: dict[str, list[str]] = {}
        for name, statement in statements.items():
            q, used[name] = positional(statement)
            argtypes = ", ".join(types[names.index(n)] for n in used[name])
            conn.execute(f"PREPARE {name}({argtypes}) AS {q}")
        upper = 1

        def execute(name: str, explain: bool) -> dict[str, Any]:
            key = "2999"
            values: dict[str, Any] = {
                "c": c.id,
                "u": upper + 1,
                "su": True,
                "s": upper,
                "ss": True,
                "cs": upper,
                "ks": [str(10**6)],
                "vs": [str(10**6)],
                "ts": [upper],
                "ds": [1],
                "ck": [str(10**6)],
                "k": key,
                "kk": [key, "3001"],
            }
            if name == "append_stored":
                values.update(ks=[key], vs=["-1"], ck=[key])
            args = sql.SQL(", ").join(sql.Literal(values[n]) for n in used[name])
            prefix = "EXPLAIN (ANALYZE, FORMAT JSON) " if explain else ""
            with conn.transaction(force_rollback=True):
                cur = conn.execute(
                    sql.SQL("{}EXECUTE {}({})").format(sql.SQL(prefix), sql.Identifier(name), args)
                )
                row = cur.fetchone() if explain else None
            return {} if row is None else dict(row[0][0]["Plan"])

        for name in statements:  # the generic plans are made (and cached) now
            execute(name, explain=False)
        for i in range(5, 3000, 500):
            tick(s, c, [(j, j, 1) for j in range(i, min(i + 500, 3000))])
        upper = s.upper(c).as_option()
        assert upper is not None
        for name in statements:
            plan = execute(name, explain=True)
            assert _data_rows_read(plan) <= 10, (name, json.dumps(plan, indent=1))


def test_updates_of_stored_keys_are_planned_afresh(opened, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A batch that retracts (updates stored keys) deletes and rewrites rows; its
    statement is never run from a cached generic plan (see the test above), while
    appends of new keys are."""
    from stash.postgres import PgTxn

    calls: list[tuple[str, bool | None]] = []
    real = PgTxn._exec

    def spy(self: PgTxn, statement: str, params: Any = None, prepare: bool | None = None) -> Any:
        calls.append((statement, prepare))
        return real(self, statement, params, prepare)

    s = opened(fenced=False)
    c = s.collection("c", key="int", value="int")
    monkeypatch.setattr(PgTxn, "_exec", spy)
    tick(s, c, [(1, 1, 1)])
    tick(s, c, [(1, 1, -1), (1, 2, 1)])
    flushes = [p for q, p in calls if q.startswith("WITH c_new")]
    assert flushes == [None, False]
    assert s.peek_key_one(c, 1) == 2


def test_lone_surrogate_is_a_clear_stash_error(opened) -> None:  # type: ignore[no-untyped-def]
    s = opened(fenced=False)
    c = s.collection("c", key="str", value="str")
    with pytest.raises(StashError, match="surrogate"):
        s.update(c, ("k", "\ud800"), 0, 1)
    assert s.iter(c) == []


# ------------------------------------------------------------------- fencing


def test_second_fenced_handle_fences_the_first(opened, postgres_server, pg) -> None:  # type: ignore[no-untyped-def]
    old = opened(fenced=True)
    c = old.collection("c")
    tick(old, c, [("a", 1, 1)])
    epoch_before, _ = fence_row(postgres_server, pg)
    new = opened(fenced=True)
    assert fence_row(postgres_server, pg)[0] == epoch_before + 1
    attempts: list[Callable[[], object]] = [
        lambda: tick(old, c, [("b", 2, 1)]),
        lambda: old.update(c, ("u", 0), 5, 1),
        lambda: old.seal(c, A(7)),
        lambda: old.compact(c, A(1)),
        lambda: old.consolidate(c),
        lambda: old.collection("created-after-fence"),
        lambda: old.peek(c),
        lambda: old.upper(c),
        old.confirm_leadership,
    ]
    for attempt in attempts:
        with pytest.raises(StashError) as e:
            attempt()
        assert e.value.is_unrecoverable(), e.value
        assert isinstance(e.value, FenceError)
        assert "fenced" in str(e.value)
    r = opened(mode="readonly")
    rc = r.collection("c")
    assert r.peek(rc) == [("a", 1, 1)]
    assert r.upper(rc) == A(1) and r.since(rc) == A(0)
    assert "created-after-fence" not in r.collections()
    new.confirm_leadership()
    tick(new, new.collection("c"), [("n", 3, 1)])
    assert r.peek(rc) == [("a", 1, 1), ("n", 3, 1)]


def test_deposed_leader_writing_in_a_loop_writes_nothing_after_the_fence(opened, pg) -> None:  # type: ignore[no-untyped-def]
    """Two threads of the old leader append as fast as they can, before, during and for
    a while after a new leader opens.  What they were told succeeded is visible; what
    failed is not; nothing they started after the new leader's open returned succeeded."""
    old = opened(fenced=True)
    c = old.collection("c", key="str", value="int")
    tick(old, c, [("seed", 0, 1)])
    stop = threading.Event()
    fenced_at: list[float] = []
    log: list[tuple[str, float, str]] = []  # key, start time, outcome
    lock = threading.Lock()

    def writer(tid: int) -> None:
        i = 0
        while not stop.is_set():
            key = f"t{tid}-{i}"
            i += 1
            start = time.monotonic()
            try:
                b = c.make_batch(old)
                c.append_to_batch(b, key, i, 1)
                old.append([b])
                outcome = "ok"
            except AppendLowerMismatch:
                outcome = "mismatch"
            except StashError as e:
                outcome = "fenced" if e.is_unrecoverable() else f"error: {e}"
            with lock:
                log.append((key, start, outcome))
                fenced_n = sum(
                    1 for _, t, o in log if o == "fenced" and fenced_at and t > fenced_at[0]
                )
            if fenced_n >= 40:
                stop.set()

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while sum(1 for _, _, o in list(log) if o == "ok") < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    new = opened(fenced=True)
    fenced_at.append(time.monotonic())
    for t in threads:
        t.join(timeout=30)
    stop.set()
    assert not any(t.is_alive() for t in threads)

    outcomes = {o.split(":")[0] for _, _, o in log}
    assert outcomes <= {"ok", "mismatch", "fenced"}, outcomes
    ok = {k for k, _, o in log if o == "ok"}
    assert len(ok) >= 10
    after = [(k, o) for k, t, o in log if t > fenced_at[0]]
    assert len(after) >= 40 and all(o == "fenced" for _, o in after)
    nc = new.collection("c", key="str", value="int")
    visible = {k for k, _, _ in new.peek(nc)} - {"seed"}
    assert visible == ok
    assert new.upper(nc) == A(1 + len(ok))


def test_fencing_waits_for_an_old_leader_transaction_in_flight(opened) -> None:  # type: ignore[no-untyped-def]
    """An old-leader append has checked the fence and written, but not committed, when a
    new leader opens.  The new leader's open must wait for it (the fence row is held
    FOR SHARE), so its first read includes that append; without the lock the open would
    finish first and the old append would land behind the new leader's back."""
    old = opened(fenced=True)
    c = old.collection("c", key="int", value="int")
    tick(old, c, [(0, 0, 1)])
    written, go = threading.Event(), threading.Event()
    outcome: list[object] = []

    def old_append() -> None:
        def fn(tx: Any) -> None:
            tx.lock([c.id])  # checks the fence and locks the collection
            tx.insert(c.id, [("1", "1", 1, 1)])
            tx.set_upper(c.id, 2)
            tx.finish()  # the writes reach the server
            written.set()
            go.wait(timeout=30)

        try:
            old._run(True, fn)
            outcome.append("ok")
        except StashError as e:
            outcome.append(e)

    first_read: list[object] = []

    def new_leader() -> None:
        new = opened(fenced=True)
        nc = new.collection("c", key="int", value="int")
        first_read.append(new.peek(nc))

    t_old = threading.Thread(target=old_append)
    t_old.start()
    assert written.wait(timeout=30)
    t_new = threading.Thread(target=new_leader)
    t_new.start()
    t_new.join(timeout=1.0)  # enough for an open that does not wait
    go.set()
    t_old.join(timeout=30)
    t_new.join(timeout=30)
    assert outcome == ["ok"]
    assert first_read == [[(0, 0, 1), (1, 1, 1)]]
    with pytest.raises(FenceError):
        old.confirm_leadership()


def test_unfenced_handles_neither_fence_nor_get_fenced(opened, postgres_server, pg) -> None:  # type: ignore[no-untyped-def]
    leader = opened(fenced=True)
    epoch = fence_row(postgres_server, pg)
    optimistic = opened(fenced=False)
    assert fence_row(postgres_server, pg) == epoch
    c = optimistic.collection("c")
    tick(optimistic, c, [("a", 1, 1)])
    opened(fenced=True)  # fences the leader, not the optimistic handle
    tick(optimistic, c, [("b", 2, 1)])
    with pytest.raises(FenceError):
        leader.confirm_leadership()


# --------------------------------------------------------------------- modes


def test_readonly_mode_never_writes(opened, postgres_server, pg, select_only_url) -> None:  # type: ignore[no-untyped-def]
    w = opened(fenced=True)
    c = w.collection("c")
    tick(w, c, [("k", "v", 1)])
    epoch = fence_row(postgres_server, pg)
    # A role that may only SELECT can do everything a readonly handle does.
    r = opened(select_only_url, mode="readonly")
    rc = r.collection("c")
    assert r.peek(rc) == [("k", "v", 1)]
    assert r.iter(rc) == [(("k", "v"), 0, 1)]
    assert r.upper(rc) == A(1)
    assert set(r.collections()) == {"c"}
    mutations: list[Callable[[], object]] = [
        lambda: r.update(rc, ("x", 1), 5, 1),
        lambda: r.seal(rc, A(9)),
        lambda: r.compact(rc, A(1)),
        lambda: r.consolidate(rc),
        lambda: r.append([rc.make_batch(r)]),
        lambda: r.collection("new"),
    ]
    for m in mutations:
        with pytest.raises(StashError) as e:
            m()
        assert "readonly" in str(e.value)
    with pytest.raises(ReadOnlyError):
        r.seal(rc, A(9))
    assert fence_row(postgres_server, pg) == epoch
    w.confirm_leadership()
    assert w.peek(c) == [("k", "v", 1)]
    assert w.upper(c) == A(1)


def test_savepoint_mode_sees_its_writes_others_see_nothing(
    opened, postgres_server, pg, select_only_url
) -> None:  # type: ignore[no-untyped-def]
    w = opened(fenced=True)
    c = w.collection("c")
    tick(w, c, [("k", "v", 1)])
    epoch = fence_row(postgres_server, pg)
    # Through a role that may only SELECT: a savepoint handle never writes a live table.
    sp = opened(select_only_url, mode="savepoint")
    sc = sp.collection("c")
    tick(sp, sc, [("k", "v", -1), ("k2", "v2", 1)])
    new = sp.collection("brand-new", key="int", value="int")
    sp.update(new, (1, 10), 0, 1)
    sp.seal(new, A(3))
    sp.compact(new, A(2))
    sp.consolidate(new)
    assert sp.peek(sc) == [("k2", "v2", 1)]
    assert sp.peek_one(new) == {1: 10}
    assert sp.iter(new) == [((1, 10), 2, 1)]
    # A failing operation inside the savepoint leaves the savepoint's state as it was.
    stale = sc.make_batch(sp)
    tick(sp, sc, [("k3", "v3", 1)])
    with pytest.raises(AppendLowerMismatch):
        sp.append([stale])
    assert sp.peek(sc) == [("k2", "v2", 1), ("k3", "v3", 1)]

    # The live stash neither sees the savepoint's writes nor waits for its row locks.
    done = threading.Event()

    def live_append() -> None:
        tick(w, c, [("live", "x", 1)])
        done.set()

    t = threading.Thread(target=live_append)
    t.start()
    t.join(timeout=30)
    assert done.is_set(), "a live append waited on the savepoint handle"
    w.confirm_leadership()
    assert w.peek(c) == [("k", "v", 1), ("live", "x", 1)]
    assert "brand-new" not in w.collections()
    assert sp.peek(sc) == [("k2", "v2", 1), ("k3", "v3", 1)]  # its own snapshot
    sp.close()
    fresh = opened(mode="readonly")
    assert fresh.peek(fresh.collection("c")) == [("k", "v", 1), ("live", "x", 1)]
    assert set(fresh.collections()) == {"c"}
    assert fence_row(postgres_server, pg) == epoch
    with postgres_server.connect(dbname(pg)) as conn:
        temps = conn.execute("SELECT count(*) FROM pg_class WHERE relpersistence = 't'").fetchone()
    assert temps == (0,)


def test_two_savepoint_handles_are_independent(opened) -> None:  # type: ignore[no-untyped-def]
    w = opened(fenced=False)
    c = w.collection("c", key="int", value="int")
    tick(w, c, [(1, 1, 1)])
    a = opened(mode="savepoint")
    b = opened(mode="savepoint")
    ac, bc = a.collection("c", key="int", value="int"), b.collection("c", key="int", value="int")
    tick(a, ac, [(2, 2, 1)])
    tick(b, bc, [(3, 3, 1)])
    assert a.peek_one(ac) == {1: 1, 2: 2}
    assert b.peek_one(bc) == {1: 1, 3: 3}
    assert w.peek_one(c) == {1: 1}


def test_password_not_in_repr_or_errors(opened, pg) -> None:  # type: ignore[no-untyped-def]
    password = make_url(pg).password
    assert password
    s = opened()
    assert password not in repr(s)
    bad = make_url(pg).set(password="wrong-" + password).render_as_string(hide_password=False)
    with pytest.raises(StashError) as e:
        Stash.open(bad)
    assert str(e.value).startswith("stash error: postgres: ")
    assert password not in str(e.value) and "wrong-" not in str(e.value)
    assert "password authentication failed" in str(e.value)


def test_open_behind_head_names_revision_and_command(postgres_url: str) -> None:
    with pytest.raises(StashError) as e:
        Stash.open(postgres_url)
    msg = str(e.value)
    assert "none (empty database)" in msg and "stash migrate" in msg
    password = make_url(postgres_url).password
    assert password and password not in msg


def test_psycopg_driver_is_what_runs() -> None:
    # The backend talks to psycopg 3 directly (see stash.postgres); guard the assumption.
    assert psycopg.__version__.startswith("3.")


class _AfterData(dict):  # type: ignore[type-arg]
    """``TABLE_COLUMNS`` whose iteration runs ``hook`` once the data table was copied."""

    def __init__(self, base: dict[str, Any], hook: Callable[[], None]) -> None:
        super().__init__(base)
        self.hook = hook

    def items(self) -> Iterator[tuple[str, Any]]:  # type: ignore[override]
        for name, cols in super().items():
            yield name, cols
            if name == "data":
                self.hook()


def test_savepoint_copy_is_one_snapshot(opened, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """An append that commits while a savepoint handle copies the tables is either wholly
    in the copy or wholly out of it (the copy read each table at its own time, and its
    upper claimed an entry its data did not hold)."""
    import stash.postgres as pg_mod

    live = opened(fenced=False)
    c = live.collection("c")
    tick(live, c, [("a", 1, 1)])

    monkeypatch.setattr(
        pg_mod,
        "TABLE_COLUMNS",
        _AfterData(pg_mod.TABLE_COLUMNS, lambda: tick(live, c, [("b", 2, 1)])),
    )
    sp = opened(mode="savepoint", fenced=False)
    spc = sp.collection("c")
    assert live.peek_one(c) == {"a": 1, "b": 2}
    assert sp.peek_one(spc) == {"a": 1}
    assert sp.upper(spc) == live.upper(c).__class__.from_elem(1)
