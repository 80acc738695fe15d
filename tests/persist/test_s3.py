"""Persist on an S3-compatible server (moto with authentication, see
``tests/support/s3_fixtures.py``):
a shard's whole life (appends, compaction, GC, fsck, reopen) on ``s3://``; credentials from
the environment only and refused when wrong; the empty "directory marker" objects S3
clients leave behind are ignored by ``list_keys``, GC and fsck."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pyarrow as pa
import pytest

from persist import BlobError, PersistClient, collect_garbage, fsck, open_blob
from stash import Stash
from tests.support.s3_fixtures import BUCKET, S3Server

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string())])


def upd(k: int, v: str, t: int, d: int = 1) -> tuple[tuple[tuple[int], tuple[str]], int, int]:
    return ((k,), (v,)), t, d


@pytest.fixture
def stash() -> Iterator[Stash]:
    s = Stash.open("memory://", fenced=False)
    yield s
    s.close()


def test_shard_lifecycle_on_s3(stash: Stash, s3_blob_uri: str) -> None:
    """Appends (inline and blob parts), compaction, GC and fsck on S3; a second client
    on the same URI reads the same rows."""
    c = PersistClient(stash, s3_blob_uri, compaction="inline", inline_max_bytes=64)
    w, r = c.open("s3shard", KS, VS)
    for t in range(12):
        w.compare_and_append([upd(t, "x" * 50, t), upd(100 + t, "y", t)], t, t + 1)
    w.compare_and_append([upd(3, "x" * 50, 12, -1)], 12, 13)
    r.downgrade_since(12)
    c.compactor.compact_once("s3shard")
    st = c.inspect("s3shard")
    st.trace.validate()
    w.expire()
    r.heartbeat()
    report = collect_garbage(c, "s3shard", grace_seconds=0)
    listed = {k for k, _ in c.raw_blob.list_keys(st.shard_id + "/")}
    assert listed == c.inspect("s3shard").referenced_blob_keys() and listed
    assert report.deleted_retired or report.deleted_abandoned
    assert fsck(c, "s3shard").ok
    snap = r.snapshot(12)
    assert sorted(snap.column("k").to_pylist()) == sorted(
        [t for t in range(12) if t != 3] + [100 + t for t in range(12)]
    )
    c2 = PersistClient(stash, s3_blob_uri, compaction="off")
    assert c2.open_reader("s3shard", KS, VS).snapshot(12).num_rows == snap.num_rows
    c2.close()
    c.close()


def test_directory_markers_are_ignored_by_gc_and_fsck(
    stash: Stash, s3_server: S3Server, s3_blob_uri: str
) -> None:
    """Empty objects whose key ends in '/' (what S3 consoles, some clients and pyarrow
    itself leave after deletes) are not keys: GC neither counts nor deletes them, fsck
    reports no damage and no unrecognized key."""
    c = PersistClient(stash, s3_blob_uri, compaction="inline", inline_max_bytes=0)
    w, r = c.open("markers", KS, VS)
    for t in range(4):
        w.compare_and_append([upd(t, "v", t)], t, t + 1)
    sid = c.shard_id("markers")
    prefix = s3_blob_uri.split("?")[0].removeprefix(f"s3://{BUCKET}/")
    part_dirs = {k.rsplit("/", 1)[0] for k in c.inspect("markers").referenced_blob_keys()}
    markers = [f"{prefix}/{sid}/", f"{prefix}/{sid}/empty-dir/"] + [
        f"{prefix}/{d}/" for d in part_dirs
    ]
    s3 = s3_server.boto3_client()
    for m in markers:
        s3.put_object(Bucket=BUCKET, Key=m, Body=b"")
    listed = c.raw_blob.list_keys(sid + "/")
    assert listed and all(not k.endswith("/") and size > 0 for k, size in listed)
    damage = fsck(c, "markers")
    assert damage.ok and not damage.unrecognized and not damage.orphans, damage.to_json()
    w.expire()
    r.downgrade_since(3)
    c.compactor.compact_once("markers")
    r.heartbeat()
    report = collect_garbage(c, "markers", grace_seconds=0)
    assert not report.unrecognized and not report.failed
    assert fsck(c, "markers").ok
    remaining = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]}
    assert set(markers) <= remaining  # GC never touched them
    assert r.snapshot(3).num_rows == 4
    c.close()


def test_drop_leaves_no_object_under_the_shard_prefix(
    stash: Stash, s3_server: S3Server, s3_blob_uri: str
) -> None:
    """``finalize_shard`` on S3 deletes the shard's parts and the empty "directory
    marker" objects ``pyarrow.fs`` leaves when a directory's last file goes (and any an
    S3 client left there), so nothing stays under the shard's prefix; other shards'
    objects and a key under the prefix that is not persist's are kept."""
    c = PersistClient(stash, s3_blob_uri, compaction="inline", inline_max_bytes=0)
    w, _r = c.open("dropped", KS, VS)
    for t in range(3):
        w.compare_and_append([upd(t, "v", t)], t, t + 1)
    kept_w, kept_r = c.open("kept", KS, VS)
    kept_w.compare_and_append([upd(1, "k", 0)], 0, 1)
    sid, kept_sid = c.shard_id("dropped"), c.shard_id("kept")
    prefix = s3_blob_uri.split("?")[0].removeprefix(f"s3://{BUCKET}/")
    s3 = s3_server.boto3_client()
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{sid}/console-made-dir/", Body=b"")

    def objects(under: str) -> list[str]:
        listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/{under}")
        return sorted(o["Key"] for o in listed.get("Contents", []))

    assert objects(f"{sid}/")
    assert c.finalize_shard("dropped") > 0
    assert objects(f"{sid}/") == []
    assert objects(f"{kept_sid}/") and kept_r.snapshot(0).num_rows == 1
    # A key under the prefix that persist did not write is kept (and its directory).
    c.raw_blob.set(f"{sid}/notes.txt", b"mine")
    c.finalize_shard(f"id:{sid}")
    assert objects(f"{sid}/") == [f"{prefix}/{sid}/notes.txt"]
    c.close()


def test_wrong_credentials_are_refused(
    s3_server: S3Server, s3_blob_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server authenticates every request: a wrong secret, or an unknown key id, is
    refused on every operation, and the error shows neither secret."""
    good = open_blob(s3_blob_uri)
    good.set("shard/part", b"data")
    bad_secret = "wrong" + s3_server.secret_access_key[5:]
    for key_id, secret in (
        (s3_server.access_key_id, bad_secret),
        ("AKIANOSUCHUSER000000", s3_server.secret_access_key),
    ):
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
        bad = open_blob(s3_blob_uri)
        for op, args in (
            (bad.get, ("shard/part",)),
            (bad.set, ("shard/other", b"x")),
            (bad.list_keys, ("shard/",)),
            (bad.delete, ("shard/part",)),
        ):
            with pytest.raises(BlobError) as e:
                op(*args)  # type: ignore[operator]
            text = f"{e.value} {e.value!r} {bad!r}"
            assert secret not in text and s3_server.secret_access_key not in text
            low = str(e.value).lower()
            assert any(w in low for w in ("access_denied", "signature", "access key")), low
    monkeypatch.undo()
    assert good.get("shard/part") == b"data"  # nothing was written or deleted
    assert good.list_keys() == [("shard/part", 4)]


def test_credentials_never_in_reprs_or_logs(
    stash: Stash, s3_server: S3Server, s3_blob_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    c = PersistClient(stash, s3_blob_uri, compaction="inline", inline_max_bytes=0)
    w, r = c.open("quiet", KS, VS)
    w.compare_and_append([upd(1, "a", 0)], 0, 1)
    ours = [  # the moto server runs in this process and logs its requests: not ours
        rec.getMessage()
        for rec in caplog.records
        if rec.name.split(".")[0] in ("persist", "stash", "spark")
    ]
    shown = " ".join([repr(c), repr(c.blob), repr(w), repr(r), *ours, s3_blob_uri])
    assert s3_server.secret_access_key not in shown
    assert s3_server.access_key_id not in shown
    c.close()


def test_a_small_part_is_one_put_request(s3_blob_uri: str) -> None:
    """A part is uploaded with one PutObject, not a multipart upload's three requests
    (create, part, complete): a third of the S3 requests per append, and no unfinished
    multipart upload left by a writer killed mid-upload."""
    requests: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            requests.append(record.getMessage())

    handler = Collect()
    werkzeug = logging.getLogger("werkzeug")  # the moto server's request log
    old_level = werkzeug.level
    werkzeug.addHandler(handler)
    werkzeug.setLevel(logging.INFO)
    try:
        open_blob(s3_blob_uri).set("shard/b/part.parquet", b"x" * 10_000)
    finally:
        werkzeug.removeHandler(handler)
        werkzeug.setLevel(old_level)
    writes = [r for r in requests if '"PUT ' in r or '"POST ' in r]
    assert len(writes) == 1 and "?uploads" not in writes[0], writes


def test_a_missing_s3_server_fails_under_ci_and_skips_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without moto the fixture fails the test under CI (never a silent skip) and skips
    it elsewhere, naming the reason."""
    import sys

    from tests.support import s3_fixtures

    monkeypatch.setitem(sys.modules, "moto.server", None)  # import fails
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="required under CI"):
        s3_fixtures.require_s3_server()
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match="not CI, so skipped"):
        s3_fixtures.require_s3_server()


def test_an_s3_request_is_tried_at_most_three_times_by_the_sdk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A store opened from an ``s3://`` URI has the SDK retry a failing request 3 times
    (``S3FileSystem``'s own default), under persist's own ``RetryingBlob``: counted on a
    local server answering every request with a retryable 500.  Failed before: the
    filesystem ``FileSystem.from_uri`` makes has the AWS SDK's default strategy (31
    requests for one listing here; 6 s against a refused endpoint)."""
    import http.server
    import threading

    from persist.blob.arrowfs import ArrowFsBlob

    seen: list[str] = []

    class Failing(http.server.BaseHTTPRequestHandler):
        def _fail(self) -> None:
            seen.append(self.command)
            body = b"<Error><Code>InternalError</Code><Message>try again</Message></Error>"
            self.send_response(500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _fail

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    try:
        port = server.server_address[1]
        uri = f"s3://{BUCKET}/p?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
        blob = open_blob(uri)
        inner = getattr(blob, "inner", blob)
        assert isinstance(inner, ArrowFsBlob)
        with pytest.raises(BlobError):
            inner.list_keys("x/")
        assert len(seen) == 3, seen
    finally:
        server.shutdown()
