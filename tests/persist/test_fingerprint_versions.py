"""Appends recorded by the SHA-256 fingerprint (``V``) stay recognised under the XXH3 one.

The change: an append's updates are fingerprinted by XXH3-128 (``X``) instead of
SHA-256 (``V``, a fifteenth of the CPU on a large append).  A shard may hold records
made by the ``V`` version: a retry of such an append (its acknowledgement lost, the
client upgraded since) must still be taken as landed, writing nothing again, and the
token reused on other updates must still be refused.  Without the check against the
record's own version, the retry of a landed append was refused as "a different
append", and its caller, told nothing was written, would write it again under a fresh
token.

An append recorded by the ``V`` version is made here by the write path with
``updates_fingerprint`` giving ``V`` (what that version recorded: the ``V`` golden
values in ``test_fingerprint_values.py`` pin that it is computed the same way).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import xxhash

from persist import FileBlob, InvalidUsage, PersistClient, fingerprint
from persist import write as write_module
from persist.fingerprint import check_same_append, updates_fingerprint
from persist.lease_state import TOKEN_SEP
from stash import Antichain, Stash
from tests.persist.test_fingerprint_values import _golden, _many_rows

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])
TOKEN = "job-7-attempt-1"


def upd(k: str, v: int, t: int) -> Any:
    return ((k,), (v,)), t, 1


def contents(table: pa.Table) -> Counter[tuple[str, int]]:
    out: Counter[tuple[str, int]] = Counter()
    for r in table.to_pylist():
        out[(r["k"], r["v"])] += r["_diff"]
    return +out


def _sha256_version(e: Antichain, n: Antichain, t: pa.Table, version: str = "V") -> str:
    """``updates_fingerprint`` as the version before XXH3 computed it."""
    return updates_fingerprint(e, n, t, version)


@pytest.fixture
def client(tmp_path: Path) -> Iterator[PersistClient]:
    s = Stash.open(f"sqlite:///{tmp_path / 'stash.db'}", fenced=False)
    c = PersistClient(s, FileBlob(tmp_path / "blob"), compaction="off")
    yield c
    c.close()
    s.close()


def _recorded(c: PersistClient, shard: str) -> set[str]:
    return {rec.entry.partition(TOKEN_SEP)[2] for rec in c.inspect(shard).landed.values()}


class _Recorder:
    """A hash object keeping the bytes it is fed."""

    def __init__(self, data: bytes = b"") -> None:
        self.fed = bytearray(data)

    def update(self, data: Any) -> None:
        self.fed += bytes(data)

    def hexdigest(self) -> str:
        return "0" * 32


def test_both_versions_hash_the_same_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """``X`` and ``V`` are two digests of one stream of the values: XXH3-128 and the
    first 128 bits of SHA-256 of exactly the bytes fed for the golden tables (so the
    ``X`` golden values follow from the ``V`` ones, computed independently)."""
    e, n = Antichain.from_elem(5), Antichain.from_elem(7)
    recorders: list[_Recorder] = []

    def record(data: bytes = b"") -> _Recorder:
        recorders.append(_Recorder(data))
        return recorders[-1]

    monkeypatch.setitem(fingerprint._UPDATES_HASHES, "Z", record)
    for table in (_golden(), _golden().slice(1, 1), _many_rows()):
        want = {v: updates_fingerprint(e, n, table, v) for v in ("V", "X")}
        updates_fingerprint(e, n, table, "Z")
        stream = bytes(recorders.pop().fed)
        assert want["V"] == "V" + hashlib.sha256(stream).hexdigest()[:32]
        assert want["X"] == "X" + xxhash.xxh3_128(stream).hexdigest()


def test_an_unknown_version_is_refused() -> None:
    with pytest.raises(ValueError, match="no updates fingerprint of version 'Q'"):
        updates_fingerprint(Antichain.from_elem(0), Antichain.from_elem(1), _golden(), "Q")


def test_the_other_version_is_computed_only_for_a_record_of_it() -> None:
    """``earlier`` is called only for a record of the other updates version: never for
    an equal record, a batches record, a legacy one or a transaction's."""
    calls: list[str] = []

    def earlier(version: str) -> str:
        calls.append(version)
        return version + "1" * 32

    fp = "X" + "2" * 32
    check_same_append(f"t{TOKEN_SEP}{fp}", "t", fp, earlier)
    check_same_append(f"t{TOKEN_SEP}V{'1' * 32}", "t", fp, earlier)  # same append
    assert calls == ["V"]
    for other in ("B" + "1" * 32, "r1d1", "t17", "V" + "3" * 32):
        with pytest.raises(InvalidUsage):
            check_same_append(f"t{TOKEN_SEP}{other}", "t", fp, earlier)
    assert calls == ["V", "V"]
    # A batches append (no updates fingerprint) never takes a V record as its own.
    with pytest.raises(InvalidUsage, match="different append"):
        check_same_append(f"t{TOKEN_SEP}V{'1' * 32}", "t", "B" + "1" * 32, earlier)
    # Without ``earlier``, a record of the other version names another append.
    with pytest.raises(InvalidUsage, match="different append"):
        check_same_append(f"t{TOKEN_SEP}V{'1' * 32}", "t", fp)


@pytest.mark.parametrize("rows", [1, 5000])
def test_a_retry_of_an_append_recorded_by_the_sha256_version_is_recognised(
    client: PersistClient, monkeypatch: pytest.MonkeyPatch, rows: int
) -> None:
    """The append landed under the ``V`` version (small: fingerprinted in the caller's
    thread; large: in the background); its retry under ``X`` writes nothing again, on
    the same or another handle; the token on other updates, or other bounds, is refused
    and commits nothing."""
    updates = [upd(f"k{i}", i, 0) for i in range(rows)]
    w, r = client.open("s", KS, VS)
    monkeypatch.setattr(write_module, "updates_fingerprint", _sha256_version)
    w.compare_and_append(updates, 0, 1, idempotency_token=TOKEN)
    monkeypatch.undo()
    assert {f[:1] for f in _recorded(client, "s")} == {"V"}
    w2, _ = client.open("s", KS, VS)
    seqno = client.inspect("s").seqno
    w.compare_and_append(updates, 0, 1, idempotency_token=TOKEN)
    w2.compare_and_append(updates, 0, 1, idempotency_token=TOKEN)
    assert client.inspect("s").seqno == seqno
    for other, lo, hi in ((updates[1:], 0, 1), ([upd("zz", 1, 1)], 1, 2), (updates, 0, 2)):
        with pytest.raises(InvalidUsage, match="names a different append"):
            w.compare_and_append(other, lo, hi, idempotency_token=TOKEN)
    assert client.inspect("s").seqno == seqno
    assert contents(r.snapshot(0)) == Counter({(f"k{i}", i): 1 for i in range(rows)})
    # A fresh append records the X version.
    w.compare_and_append([upd("new", 1, 1)], 1, 2, idempotency_token="job-8-attempt-1")
    assert {f[:1] for f in _recorded(client, "s")} == {"V", "X"}


def _race_old_version_landing(
    client: PersistClient, monkeypatch: pytest.MonkeyPatch, landing: list[Any]
) -> Any:
    """A writer whose token check is followed, before its commit, by an append of the
    ``V`` version landing with the same token: ``landing`` is that append's updates."""
    wa, _ = client.open("s", KS, VS)
    old, _ = client.open("s", KS, VS)  # a process of the version before
    checked = wa._token_landed

    def racing(token: str, fp: str, *earlier: Any) -> Any:
        out = checked(token, fp, *earlier)
        with monkeypatch.context() as m:
            m.setattr(write_module, "updates_fingerprint", _sha256_version)
            old.compare_and_append(landing, 0, 1, idempotency_token=token)
        return out

    wa._token_landed = racing  # type: ignore[method-assign]
    return wa


def test_a_retry_racing_its_landing_under_the_sha256_version_is_recognised(
    client: PersistClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The retry checks its token (not landed), then its earlier attempt lands, made by
    the ``V`` version, before the retry commits: the commit recognises the record as
    this append's (writing nothing, the rows once) instead of refusing its own
    append."""
    updates = [upd("a", 1, 0), upd("b", 2, 0)]
    wa = _race_old_version_landing(client, monkeypatch, updates)
    wa.compare_and_append(updates, 0, 1, idempotency_token=TOKEN)
    _, r = client.open("s", KS, VS)
    assert contents(r.snapshot(0)) == Counter({("a", 1): 1, ("b", 2): 1})
    assert {f[:1] for f in _recorded(client, "s")} == {"V"}


def test_a_token_reused_racing_another_append_of_the_sha256_version_is_refused(
    client: PersistClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same race, the ``V`` append holding other updates: refused (nothing of this
    append committed)."""
    wa = _race_old_version_landing(client, monkeypatch, [upd("b", 2, 0)])
    with pytest.raises(InvalidUsage, match="different append"):
        wa.compare_and_append([upd("a", 1, 0)], 0, 1, idempotency_token=TOKEN)
    _, r = client.open("s", KS, VS)
    assert contents(r.snapshot(0)) == Counter({("b", 2): 1})
