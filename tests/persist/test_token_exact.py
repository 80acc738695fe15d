"""An idempotency token names one append exactly: its bounds and its contents.

The defect: the token's fingerprint was only the append's shape (row count and diff
sum; for batches, their parts' checksums), so a token reused on a different append of
the same shape, or on any second empty append, was taken as "already landed" and the
call returned success writing nothing.  A reuse is refused (``InvalidUsage``), nothing
committed; a real retry, from this handle or from another process's client, is still
recognised."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persist import FileBlob, InvalidUsage, PersistClient
from persist.fingerprint import updates_fingerprint
from stash import Antichain, Stash

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])
TOKEN = "caller-token-0001"


def ac(t: int) -> Antichain:
    return Antichain.from_elem(t)


def upd(k: str, v: int, t: int, d: int = 1) -> Any:
    return ((k,), (v,)), t, d


def contents(table: pa.Table) -> Counter[tuple[str, int, int]]:
    out: Counter[tuple[str, int, int]] = Counter()
    for r in table.to_pylist():
        out[(r["k"], r["v"], r["_time"])] += r["_diff"]
    return +out


@pytest.fixture
def clients(tmp_path: Path) -> Iterator[tuple[PersistClient, PersistClient]]:
    """Two clients on one SQLite stash file and blob directory (two processes' view)."""
    made = []
    for _ in range(2):
        s = Stash.open(f"sqlite:///{tmp_path / 'stash.db'}", fenced=False)
        c = PersistClient(s, FileBlob(tmp_path / "blob"), compaction="off", inline_max_bytes=0)
        made.append((c, s))
    yield made[0][0], made[1][0]
    for c, s in made:
        c.close()
        s.close()


def test_a_token_reused_on_an_append_of_the_same_shape_is_refused(clients: Any) -> None:
    c1, c2 = clients
    w, r = c1.open("shape", KS, VS)
    w.compare_and_append([upd("a", 1, 0)], 0, 1, idempotency_token=TOKEN)
    w2, _ = c2.open("shape", KS, VS)  # another process's handle
    seqno = c1.inspect("shape").seqno
    with pytest.raises(InvalidUsage, match="names a different append"):
        w.compare_and_append([upd("b", 1, 1)], 1, 2, idempotency_token=TOKEN)
    with pytest.raises(InvalidUsage, match="names a different append"):
        w2.compare_and_append([upd("b", 1, 1)], 1, 2, idempotency_token=TOKEN)
    # The same updates at other bounds are another append too.
    with pytest.raises(InvalidUsage, match="names a different append"):
        w2.compare_and_append([upd("a", 1, 1)], 1, 2, idempotency_token=TOKEN)
    st_ = c1.inspect("shape")
    assert st_.upper == ac(1) and st_.seqno == seqno  # nothing committed
    # The real retry is recognised, from either process, and writes nothing again.
    w2.compare_and_append([upd("a", 1, 0)], 0, 1, idempotency_token=TOKEN)
    w.compare_and_append([upd("a", 1, 0)], 0, 1, idempotency_token=TOKEN)
    assert c1.inspect("shape").seqno == seqno
    assert contents(r.snapshot(0)) == Counter({("a", 1, 0): 1})


def test_a_token_reused_on_a_second_empty_append_is_refused(clients: Any) -> None:
    c1, _ = clients
    w, _r = c1.open("empty", KS, VS)
    w.compare_and_append([], 0, 1, idempotency_token=TOKEN)
    assert c1.inspect("empty").upper == ac(1)
    with pytest.raises(InvalidUsage, match="names a different append"):
        w.compare_and_append([], 1, 2, idempotency_token=TOKEN)
    assert c1.inspect("empty").upper == ac(1)
    w.compare_and_append([], 0, 1, idempotency_token=TOKEN)  # the retry


def test_a_token_reused_on_other_batches_of_the_same_content_is_refused(clients: Any) -> None:
    c1, c2 = clients
    w, r = c1.open("batches", KS, VS)
    w.compare_and_append_batch([w.batch([], 0, 1)], 0, 1, idempotency_token=TOKEN)
    with pytest.raises(InvalidUsage, match="names a different append"):
        w.compare_and_append_batch([w.batch([], 1, 2)], 1, 2, idempotency_token=TOKEN)
    assert c1.inspect("batches").upper == ac(1)
    b = w.batch([upd("a", 1, 1)], 1, 2)
    data = b.into_transmittable()
    token = "caller-token-0002"
    w.compare_and_append_batch([w.batch_from_transmittable(data)], 1, 2, idempotency_token=token)
    # A retry with another decoding of the same bytes, in another process: recognised.
    w2, _ = c2.open("batches", KS, VS)
    w2.compare_and_append_batch([w2.batch_from_transmittable(data)], 1, 2, idempotency_token=token)
    assert contents(r.snapshot(1)) == Counter({("a", 1, 1): 1})


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.text(max_size=3), st.none() | st.integers(-5, 5)), max_size=40),
    st.integers(0, 40),
    st.integers(0, 40),
)
def test_the_fingerprint_is_the_contents_not_the_layout(
    rows: list[tuple[str, int | None]], cut: int, start: int
) -> None:
    """Chunking and slicing do not change an append's fingerprint; other rows or other
    bounds do."""
    schema = pa.schema(
        [("k", pa.string()), ("v", pa.int64()), ("_time", pa.int64()), ("_diff", pa.int64())]
    )
    cols = [[k for k, _ in rows], [v for _, v in rows], [0] * len(rows), [1] * len(rows)]
    table = pa.table(cols, schema=schema)
    cut = min(cut, len(rows))
    chunked = pa.concat_tables([table.slice(0, cut), table.slice(cut)])
    padded = pa.table(
        [[*(["x"] * start), *c] if i == 0 else [*([7] * start), *c] for i, c in enumerate(cols)],
        schema=schema,
    ).slice(start)
    fp = updates_fingerprint(ac(0), ac(1), table)
    assert updates_fingerprint(ac(0), ac(1), chunked) == fp
    assert updates_fingerprint(ac(0), ac(1), padded) == fp
    if not rows:  # no chunk, or one empty chunk: the same empty append
        assert updates_fingerprint(ac(0), ac(1), table.slice(0, 0)) == fp
        assert updates_fingerprint(ac(0), ac(1), schema.empty_table()) == fp
    assert updates_fingerprint(ac(1), ac(2), table) != fp
    other = table.set_column(3, "_diff", pa.array([2] * len(rows), pa.int64()))
    assert (updates_fingerprint(ac(0), ac(1), other) == fp) == (not rows)


def test_a_token_recorded_with_only_a_shape_cannot_be_taken_as_this_append() -> None:
    """A state written by an earlier version records a token alone or with the
    append's shape only (``r<rows>d<diff sum>``, ``b<digest>``): a retry against it
    cannot be checked, so it is refused, saying so, rather than acknowledged."""
    from persist.fingerprint import check_same_append
    from persist.state import TOKEN_SEP

    for old in ("r1d1", "b0123456789abcdef01234567"):
        with pytest.raises(InvalidUsage, match="earlier version"):
            check_same_append(f"{TOKEN}{TOKEN_SEP}{old}", TOKEN, "U" + "0" * 32)
    check_same_append(f"{TOKEN}{TOKEN_SEP}U{'0' * 32}", TOKEN, "U" + "0" * 32)
    with pytest.raises(InvalidUsage, match="earlier version"):  # the token alone
        check_same_append(TOKEN, TOKEN, "U" + "0" * 32)


@pytest.mark.parametrize("expirer", ["gc", "append"])
def test_a_retry_after_the_writer_was_expired_is_answered_landed(
    tmp_path: Path, expirer: str
) -> None:
    """A caller's token names no writer: once another process (clock ahead by more than
    the writer lease) expired the writer that appended with it, by GC or by its own
    transition, the shard's landed record of the token (kept apart from the writer,
    persist/landed.py) still answers a retry of that landed append: it returns without
    writing again (it raised an indeterminate error while the record lived with the
    writer)."""
    from persist import collect_garbage

    now = 1_700_000_000.0
    stash = Stash.open(f"sqlite:///{tmp_path / 's.db'}", fenced=False)
    blob = f"file://{tmp_path / 'b'}"
    kw: dict[str, Any] = {"compaction": "off", "writer_lease_seconds": 600.0}
    a = PersistClient(stash, blob, clock=lambda: now, **kw)
    b = PersistClient(stash, blob, clock=lambda: now + 601, **kw)
    try:
        w = a.open_writer("x", KS, VS)
        w.compare_and_append([upd("a", 1, 0)], 0, 1, idempotency_token=TOKEN)
        if expirer == "gc":
            collect_garbage(b, "x")
        else:
            b.open_writer("x", KS, VS).compare_and_append([upd("b", 2, 1)], 1, 2)
        w.compare_and_append([upd("a", 1, 0)], 0, 1, idempotency_token=TOKEN)
        r = b.open_reader("x", KS, VS)
        last = 0 if expirer == "gc" else 1
        rows = Counter((x["k"], x["v"], x["_diff"]) for x in r.snapshot(last).to_pylist())
        assert rows == Counter([("a", 1, 1)] + [("b", 2, 1)] * last)
    finally:
        a.close()
        b.close()
        stash.close()
