"""Tests of persist.blob: the Blob contract on every implementation, key validation (nothing
escapes the root), atomic writes and permissions of FileBlob, open_blob URIs and credential
redaction, and the fault injector UnreliableBlob."""

from __future__ import annotations

import os
import random
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist.blob import (
    ArrowFsBlob,
    Blob,
    FileBlob,
    MemoryBlob,
    UnreliableBlob,
    open_blob,
    redact_uri,
    validate_key,
)
from persist.errors import BlobError, InvalidKey, InvalidUsage

# ----------------------------------------------------------------- fixtures


def _file(tmp: Path) -> Blob:
    return FileBlob(tmp / "file-root")


def _memory(tmp: Path) -> Blob:
    return MemoryBlob()


def _arrow_local(tmp: Path) -> Blob:
    return ArrowFsBlob(pafs.LocalFileSystem(), str(tmp / "arrow-root"))


def _arrow_subtree(tmp: Path) -> Blob:
    (tmp / "sub").mkdir(parents=True)
    return ArrowFsBlob(pafs.SubTreeFileSystem(str(tmp / "sub"), pafs.LocalFileSystem()), "r")


def _arrow_mock(tmp: Path) -> Blob:
    return open_blob("mock:///bucket/prefix")


MAKERS: dict[str, Callable[[Path], Blob]] = {
    "file": _file,
    "memory": _memory,
    "arrow-local": _arrow_local,
    "arrow-subtree": _arrow_subtree,
    "arrow-mock": _arrow_mock,
}


@pytest.fixture(params=[*sorted(MAKERS), "s3"])
def blob(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Blob]:
    """Every implementation, and an ArrowFsBlob on the moto S3 server (``s3``)."""
    if request.param == "s3":
        b = open_blob(request.getfixturevalue("s3_blob_uri"))
    else:
        b = MAKERS[request.param](tmp_path)
    yield b
    b.close()


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# ----------------------------------------------------------- the contract


def test_get_missing_is_none(blob: Blob) -> None:
    assert blob.get("nothing/here") is None
    assert blob.list_keys() == []


def test_set_get_overwrite_delete(blob: Blob) -> None:
    blob.set("shard/a.parquet", b"one")
    assert blob.get("shard/a.parquet") == b"one"
    blob.set("shard/a.parquet", b"two, longer")
    assert blob.get("shard/a.parquet") == b"two, longer"
    blob.set("shard/empty", b"")
    assert blob.get("shard/empty") == b""
    blob.delete("shard/a.parquet")
    assert blob.get("shard/a.parquet") is None
    blob.delete("shard/a.parquet")  # idempotent
    blob.delete("never/was")
    assert blob.list_keys() == [("shard/empty", 0)]


def test_list_keys_sizes_and_prefixes(blob: Blob) -> None:
    data = {
        "s1/p/x.parquet": b"12345",
        "s1/p/y.parquet": b"1",
        "s1/q": b"22",
        "s10/z": b"333",
        "top": b"4444",
    }
    for k, v in data.items():
        blob.set(k, v)
    assert blob.list_keys() == sorted((k, len(v)) for k, v in data.items())
    assert blob.list_keys("s1/") == [("s1/p/x.parquet", 5), ("s1/p/y.parquet", 1), ("s1/q", 2)]
    assert [k for k, _ in blob.list_keys("s1")] == [
        "s1/p/x.parquet",
        "s1/p/y.parquet",
        "s1/q",
        "s10/z",
    ]
    assert [k for k, _ in blob.list_keys("s1/p/x")] == ["s1/p/x.parquet"]
    assert blob.list_keys("nope/") == []
    assert blob.list_keys("s1/p/x.parquet") == [("s1/p/x.parquet", 5)]


def test_metrics_count_calls(blob: Blob) -> None:
    blob.set("a", b"xyz")
    blob.get("a")
    blob.get("missing")
    blob.delete("a")
    m = blob.metrics.snapshot()
    assert (m.sets, m.set_bytes, m.gets, m.get_bytes, m.deletes) == (1, 3, 2, 3, 1)


def test_closed_blob_refuses_calls(blob: Blob) -> None:
    blob.close()
    with pytest.raises(BlobError, match="closed"):
        blob.get("a")
    with pytest.raises(BlobError, match="closed"):
        blob.set("a", b"")


def test_implementations_satisfy_protocol(tmp_path: Path) -> None:
    for make in MAKERS.values():
        assert isinstance(make(tmp_path / make.__name__), Blob)
    assert isinstance(UnreliableBlob(MemoryBlob()), Blob)


# ---------------------------------------------------------- key validation

BAD_KEYS = [
    "",
    "..",
    "../escape",
    "a/../../escape",
    "a/./b",
    "/etc/passwd",
    "a\\b",
    "..\\..\\x",
    "a\x00b",
    "a//b",
    "a/",
    ".hidden",
    "a/.tmp-123",
    "has space",
    "ü",
    "-leading-dash",
    "x" * 1025,
    "a/" + "y" * 256,
]


@pytest.mark.parametrize("key", BAD_KEYS, ids=lambda k: repr(k)[:30])
def test_bad_keys_are_rejected_everywhere(blob: Blob, key: str, tmp_path: Path) -> None:
    before = _tree(tmp_path)
    for call in (
        lambda: blob.get(key),
        lambda: blob.set(key, b"evil"),
        lambda: blob.delete(key),
    ):
        with pytest.raises(InvalidKey) as info:
            call()
        assert repr(key)[:50] in str(info.value) or "chars" in str(info.value)
    assert _tree(tmp_path) == before


def test_invalid_key_names_rule() -> None:
    with pytest.raises(InvalidKey, match=r"'\.\./x'.*segment '\.\.'"):
        validate_key("../x")
    with pytest.raises(InvalidKey, match="NUL"):
        validate_key("a\x00")
    with pytest.raises(InvalidKey, match="backslash"):
        validate_key("a\\b")
    with pytest.raises(InvalidKey, match="relative"):
        validate_key("/abs")
    with pytest.raises(InvalidKey, match="empty"):
        validate_key("")
    with pytest.raises(InvalidKey, match="1024"):
        validate_key("k" * 1025)
    with pytest.raises(InvalidKey, match="must be a str"):
        validate_key(b"bytes")  # type: ignore[arg-type]
    assert validate_key("s0a1b2/part-1_x=3.parquet") == "s0a1b2/part-1_x=3.parquet"


def test_invalid_prefix_is_rejected(blob: Blob) -> None:
    for prefix in ("../", "/abs", "a//", "a\x00"):
        with pytest.raises(InvalidKey):
            blob.list_keys(prefix)


_ROOT = Path("/nonexistent-root/blobs")


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab./\\\x00-_=é ~"), max_size=20) | st.text(max_size=12))
def test_valid_keys_never_escape_the_root(key: str) -> None:
    try:
        validate_key(key)
    except InvalidKey as e:
        assert "invalid blob key" in str(e)
        return
    resolved = Path(os.path.normpath(_ROOT.joinpath(*key.split("/"))))
    assert resolved.is_relative_to(_ROOT) and resolved != _ROOT
    assert ".." not in key.split("/")


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._=-]{0,8}", fullmatch=True), min_size=1, max_size=3
    )
)
def test_random_valid_keys_round_trip_in_file_blob(tmp_path: Path, segments: list[str]) -> None:
    b = FileBlob(tmp_path / "hyp")
    key = "/".join(segments)
    try:
        b.set(key, key.encode())
    except BlobError:
        # Only a prefix conflict (key a/b with a file a, or key a with keys a/...) may fail.
        root = tmp_path / "hyp"
        assert root.joinpath(*segments).is_dir() or any(
            root.joinpath(*segments[:i]).is_file() for i in range(1, len(segments))
        )
        assert b.get(key) is None
        return
    assert b.get(key) == key.encode()
    assert (key, len(key.encode())) in b.list_keys()
    assert all(
        p.resolve().is_relative_to((tmp_path / "hyp").resolve())
        for p in (tmp_path / "hyp").rglob("*")
    )


# ------------------------------------------------------------- FileBlob


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_file_blob_permissions_are_user_only(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        b = FileBlob(tmp_path / "root" / "nested")
        b.set("shard/deep/x.parquet", b"data")
    finally:
        os.umask(old)
    root = tmp_path / "root" / "nested"
    assert _mode(tmp_path / "root") == 0o700
    assert _mode(root) == 0o700
    assert _mode(root / "shard") == 0o700
    assert _mode(root / "shard" / "deep") == 0o700
    assert _mode(root / "shard" / "deep" / "x.parquet") == 0o600


def test_file_blob_existing_root_mode_untouched(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    FileBlob(root).set("k", b"v")
    assert _mode(root) == 0o755
    assert _mode(root / "k") == 0o600


def test_file_blob_root_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(BlobError, match="cannot create blob root|not a directory"):
        FileBlob(tmp_path / "f")


@pytest.mark.parametrize("fail_at", ["fsync", "replace"])
def test_file_blob_failed_write_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: str
) -> None:
    b = FileBlob(tmp_path / "r")
    b.set("k/old", b"previous")

    def boom(*args: object, **kwargs: object) -> None:
        raise OSError(5, "injected I/O error")

    monkeypatch.setattr(os, fail_at, boom)
    with pytest.raises(BlobError, match="blob set 'k/new' failed: injected"):
        b.set("k/new", b"x" * 100_000)
    with pytest.raises(BlobError):
        b.set("k/old", b"replacement")
    monkeypatch.undo()
    assert b.get("k/new") is None
    assert b.get("k/old") == b"previous"
    assert sorted(os.listdir(tmp_path / "r" / "k")) == ["old"]  # no temporary files
    assert b.list_keys() == [("k/old", 8)]


def test_file_blob_readers_never_see_partial_values(tmp_path: Path) -> None:
    b = FileBlob(tmp_path / "r", fsync=False)
    values = [bytes([i]) * (50_000 + 1000 * i) for i in range(8)]
    b.set("hot", values[0])
    stop = threading.Event()
    seen: list[bytes | None] = []

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(150):
            b.set("hot", rng.choice(values))

    def reader() -> None:
        while not stop.is_set():
            seen.append(b.get("hot"))

    writers = [threading.Thread(target=writer, args=(s,)) for s in range(2)]
    r = threading.Thread(target=reader)
    r.start()
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    r.join()
    assert seen
    assert all(v in values for v in seen)
    assert [k for k, _ in b.list_keys()] == ["hot"]


def test_file_blob_ignores_foreign_files(tmp_path: Path) -> None:
    root = tmp_path / "r"
    b = FileBlob(root)
    b.set("a/real", b"1")
    (root / "a" / ".tmp-leftover").write_bytes(b"partial")
    (root / "a" / "bad name").write_bytes(b"?")
    (root / "a" / ".hidden-dir").mkdir()
    (root / "a" / ".hidden-dir" / "x").write_bytes(b"?")
    assert b.list_keys() == [("a/real", 1)]


def _outside_tree(tmp_path: Path) -> Path:
    """A user's directory next to the blob root, with files whose names persist's GC
    would take for old parts (``2023-...``) and for temporaries (``.tmp-...``), all
    modified two hours ago."""
    docs = tmp_path / "docs"
    (docs / "b").mkdir(parents=True)
    old = time.time() - 7200
    for rel in ("2023-report.pdf", "b/2023-report.pdf", ".tmp-notes", "b/.tmp-draft"):
        (docs / rel).write_bytes(b"user data " + rel.encode())
        os.utime(docs / rel, (old, old))
    return docs


def _snapshot(d: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(d)): p.read_bytes() if p.is_file() else b"<dir>" for p in d.rglob("*")
    }


@pytest.mark.parametrize("link", ["shard", "shard/b"])
def test_file_blob_never_follows_a_symlinked_directory(tmp_path: Path, link: str) -> None:
    """A shard directory or a kind directory that is a symbolic link to a
    directory outside the root: set, get, delete, list_keys and the temporaries' sweep
    neither write, read, list nor delete anything through it, and name it."""
    docs = _outside_tree(tmp_path)
    before = _snapshot(docs)
    b = FileBlob(tmp_path / "root")
    b.set("other/b/1-x", b"kept")
    if link == "shard/b":
        (tmp_path / "root" / "shard").mkdir()
    os.symlink(docs, tmp_path / "root" / link)
    key_in_docs = "shard/b/2023-report.pdf"  # docs/b/... or docs/..., by where the link is
    calls: list[Callable[[], object]] = [
        lambda: b.set("shard/b/1700000000000-new.parquet", b"data"),
        lambda: b.set(key_in_docs, b"overwritten"),
        lambda: b.get(key_in_docs),
        lambda: b.delete(key_in_docs),
        lambda: b.list_keys("shard/"),
        lambda: b.list_keys("shard/b/2"),
        lambda: b.list_keys(""),
    ]
    if link == "shard":
        calls.append(lambda: b.delete("shard/2023-report.pdf"))
    for call in calls:
        with pytest.raises(BlobError, match=f"'{link}' .* is a symbolic link"):
            call()
    assert b.sweep_temporaries("shard/", 0) == 0
    assert b.sweep_temporaries("", 0) == 0
    assert _snapshot(docs) == before
    assert b.find_symlinks() == [link]
    assert b.find_symlinks("shard/") == [link]
    assert b.find_symlinks("other/") == []
    assert b.list_keys("other/") == [("other/b/1-x", 4)]
    assert (tmp_path / "root" / link).is_symlink()


def test_file_blob_refuses_a_symlinked_key(tmp_path: Path) -> None:
    docs = _outside_tree(tmp_path)
    before = _snapshot(docs)
    b = FileBlob(tmp_path / "root")
    b.set("s/b/real", b"1")
    os.symlink(docs / "2023-report.pdf", tmp_path / "root" / "s" / "b" / "2023-report.pdf")
    os.symlink(docs / "b", tmp_path / "root" / "s" / "b" / ".hidden-link")
    for call in (
        lambda: b.get("s/b/2023-report.pdf"),
        lambda: b.set("s/b/2023-report.pdf", b"x"),
        lambda: b.delete("s/b/2023-report.pdf"),
        lambda: b.list_keys("s/"),
    ):
        with pytest.raises(BlobError, match="'s/b/2023-report.pdf' .* is a symbolic link"):
            call()
    assert b.list_keys("s/b/r") == [("s/b/real", 1)]  # a link out of the prefix's range
    assert b.find_symlinks() == ["s/b/.hidden-link", "s/b/2023-report.pdf"]
    assert b.find_symlinks("s/b/2") == ["s/b/2023-report.pdf"]
    assert (tmp_path / "root" / "s" / "b" / "2023-report.pdf").is_symlink()
    assert _snapshot(docs) == before


def test_file_blob_symlinked_root_is_resolved_once(tmp_path: Path) -> None:
    """The root given may be a symbolic link: it is resolved at construction."""
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "alias")
    b = FileBlob(tmp_path / "alias")
    assert b.root == tmp_path / "real" and repr(b) == f"FileBlob({str(tmp_path / 'real')!r})"
    b.set("a/b", b"v")
    assert (tmp_path / "real" / "a" / "b").read_bytes() == b"v"
    assert b.list_keys() == [("a/b", 1)] and b.find_symlinks() == []


def test_file_blob_skips_and_refuses_special_files(tmp_path: Path) -> None:
    """A FIFO where a value would be: listing skips it, get and delete refuse it
    without blocking."""
    b = FileBlob(tmp_path / "root")
    b.set("s/real", b"1")
    os.mkfifo(tmp_path / "root" / "s" / "fifo")
    assert b.list_keys() == [("s/real", 1)]
    with pytest.raises(BlobError, match="not a regular file"):
        b.get("s/fifo")
    with pytest.raises(BlobError, match="not a regular file"):
        b.delete("s/fifo")
    assert stat.S_ISFIFO(os.lstat(tmp_path / "root" / "s" / "fifo").st_mode)


def test_file_blob_key_over_a_file_fails_cleanly(tmp_path: Path) -> None:
    b = FileBlob(tmp_path / "r")
    b.set("a", b"file")
    with pytest.raises(BlobError, match="blob set 'a/b' failed"):
        b.set("a/b", b"x")
    assert b.get("a/b") is None
    assert b.get("a") == b"file"


def test_file_blob_get_of_directory_is_none(tmp_path: Path) -> None:
    b = FileBlob(tmp_path / "r")
    b.set("dir/x", b"1")
    assert b.get("dir") is None


# ------------------------------------------------------------- ArrowFsBlob


def test_arrow_blob_on_object_store_needs_a_bucket() -> None:
    fs = pafs.S3FileSystem(region="us-east-1", endpoint_override="127.0.0.1:1", scheme="http")
    with pytest.raises(InvalidUsage, match="bucket"):
        ArrowFsBlob(fs, "")
    assert repr(ArrowFsBlob(fs, "/bucket/prefix/")) == "ArrowFsBlob('s3', 'bucket/prefix')"


def test_arrow_local_blob_writes_under_root(tmp_path: Path) -> None:
    b = ArrowFsBlob(pafs.LocalFileSystem(), str(tmp_path / "ar"))
    b.set("x/y.parquet", b"abc")
    assert (tmp_path / "ar" / "x" / "y.parquet").read_bytes() == b"abc"
    assert sorted(os.listdir(tmp_path / "ar" / "x")) == ["y.parquet"]


# ---------------------------------------------------------------- open_blob


def test_open_blob_file_uris(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    b = open_blob(f"file://{tmp_path}/a")
    assert isinstance(b, FileBlob) and b.root == tmp_path / "a"
    b = open_blob(f"file://localhost{tmp_path}/b%20c")
    assert isinstance(b, FileBlob) and b.root == tmp_path / "b c"
    b = open_blob(str(tmp_path / "plain"))
    assert isinstance(b, FileBlob) and b.root == tmp_path / "plain"
    monkeypatch.chdir(tmp_path)
    b = open_blob("relative/dir")
    assert isinstance(b, FileBlob) and b.root == tmp_path / "relative" / "dir"
    assert isinstance(open_blob(tmp_path / "pathlike"), FileBlob)


def test_open_blob_memory() -> None:
    a, b = open_blob("memory://"), open_blob("memory://")
    a.set("k", b"1")
    assert b.get("k") is None  # fresh stores
    n1, n2 = open_blob("memory://shared-test"), open_blob("memory://shared-test")
    n1.set("k", b"2")
    assert n2.get("k") == b"2"
    assert repr(n1) == "MemoryBlob('shared-test')"


def test_open_blob_pyarrow_uri() -> None:
    b = open_blob("mock:///root/sub")
    assert isinstance(b, ArrowFsBlob)
    b.set("a/b", b"v")
    assert b.get("a/b") == b"v"
    assert repr(b) == "ArrowFsBlob('mock', 'root/sub')"


@pytest.mark.parametrize(
    "uri",
    [
        "",
        " file:///x",
        "memory://a/b",
        "memory://bad name",
        "memory://u:p@x",
        "file://otherhost/x",
        "file://",
        "file:///x?q=1",
        "1abc://x",
        "nosuchscheme://bucket/x",
        "a\x00b",
    ],
)
def test_open_blob_rejects_malformed_uris(uri: str) -> None:
    with pytest.raises(InvalidUsage):
        open_blob(uri)


@pytest.mark.parametrize(
    "uri",
    [
        "nosuchscheme://AKIAEXAMPLE:s3cr3tPassw0rd@host/p",
        "hdfs://someone:s3cr3tPassw0rd@localhost:1/p",
        "nosuchscheme://host/p?secret_key=s3cr3tPassw0rd&region=x",
        "nosuchscheme://AKIAEXAMPLE:s3cr3t%2FPassw0rd@host/p",
    ],
)
def test_credentials_never_leak_from_open_blob_errors(uri: str) -> None:
    with pytest.raises(InvalidUsage) as info:
        open_blob(uri)
    e = info.value
    text = f"{e} {e!r} {e.args}"
    for secret in ("s3cr3tPassw0rd", "s3cr3t%2FPassw0rd", "s3cr3t/Passw0rd", "AKIAEXAMPLE"):
        assert secret not in text
    assert e.__cause__ is None and e.__context__ is None


@pytest.mark.parametrize(
    "uri",
    [
        "s3://AKIAEXAMPLE:s3cr3tPassw0rd@bucket/prefix?endpoint_override=127.0.0.1:1&scheme=http",
        "s3://AKIAEXAMPLE@bucket/prefix",
        "s3://bucket/prefix?secret_key=s3cr3tPassw0rd&access_key=AKIAEXAMPLE",
        "s3://bucket/prefix?session_token=s3cr3tPassw0rd",
        "gs://AKIAEXAMPLE:s3cr3tPassw0rd@bucket/prefix",
    ],
)
def test_open_blob_refuses_credentials_in_the_uri(uri: str) -> None:
    """Credentials come from the environment only: a URI carrying them is refused with
    a message naming the rule, and showing none of them."""
    with pytest.raises(InvalidUsage, match="credentials come from the environment only") as e:
        open_blob(uri)
    text = f"{e.value} {e.value!r}"
    assert "s3cr3t" not in text and "AKIA" not in text
    assert e.value.__cause__ is None and e.value.__context__ is None


def test_arrow_blob_repr_without_credentials() -> None:
    b = open_blob("s3://bucket/prefix?region=us-east-1&endpoint_override=127.0.0.1:1&scheme=http")
    assert repr(b) == "ArrowFsBlob('s3', 'bucket/prefix')"


def test_redact_uri() -> None:
    assert redact_uri("s3://key:secret@bucket/p?secret_key=x&region=y") == (
        "s3://***@bucket/p?secret_key=***&region=***"
    )
    assert redact_uri("file:///a/b") == "file:///a/b"


# ----------------------------------------------------------- UnreliableBlob


def test_unreliable_blob_faults_switch_and_unavailability() -> None:
    inner = MemoryBlob()
    u = UnreliableBlob(inner, fail_probability=1.0, seed=1)
    with pytest.raises(BlobError, match="injected fault"):
        u.get("k")
    with pytest.raises(InvalidKey):
        u.set("../k", b"")  # keys are validated before any fault
    u.faults(False)
    u.set("k", b"v")
    assert u.get("k") == b"v"
    assert u.list_keys() == [("k", 1)]
    u.make_unavailable()
    with pytest.raises(BlobError, match="unavailable"):
        u.get("k")
    u.make_available()
    assert u.get("k") == b"v"
    assert u.faults_injected == 2
    assert u.metrics is inner.metrics


def test_unreliable_blob_put_that_fails_after_writing() -> None:
    inner = MemoryBlob()
    u = UnreliableBlob(inner, fail_probability=1.0, after_write_probability=1.0, seed=3)
    with pytest.raises(BlobError, match="after the write"):
        u.set("k", b"written anyway")
    assert inner.get("k") == b"written anyway"
    with pytest.raises(BlobError, match="after the write"):
        u.delete("k")
    assert inner.get("k") is None


def test_unreliable_blob_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError):
        UnreliableBlob(MemoryBlob(), fail_probability=1.5)
    with pytest.raises(ValueError):
        UnreliableBlob(MemoryBlob(), slow_seconds=-1)


def test_unreliable_blob_is_reproducible() -> None:
    def outcomes(seed: int) -> list[bool]:
        u = UnreliableBlob(MemoryBlob(), fail_probability=0.5, seed=seed)
        out = []
        for i in range(50):
            try:
                u.set(f"k{i}", b"x")
                out.append(True)
            except BlobError:
                out.append(False)
        return out

    assert outcomes(7) == outcomes(7)
    assert True in outcomes(7) and False in outcomes(7)


def test_unreliable_file_blob_never_shows_partial_objects(tmp_path: Path) -> None:
    """Random faults (before and after writing, slow calls) over a FileBlob: every read
    sees None or one complete value that some set call was given; an acknowledged set is
    read back exactly; no temporary object is ever listed."""
    inner = FileBlob(tmp_path / "r", fsync=False)
    u = UnreliableBlob(inner, fail_probability=0.4, seed=11, slow_seconds=0.001)
    rng = random.Random(5)
    keys = [f"shard/p{i}.parquet" for i in range(5)]
    attempted: dict[str, set[bytes]] = {k: set() for k in keys}
    acknowledged: dict[str, bytes | None] = {k: None for k in keys}
    after_write_failures = 0
    for step in range(400):
        key = rng.choice(keys)
        op = rng.random()
        if op < 0.6:
            value = f"{key}:{step}:".encode() * rng.randint(1, 2000)
            attempted[key].add(value)
            try:
                u.set(key, value)
                acknowledged[key] = value
            except BlobError as e:
                after_write_failures += "after the write" in str(e)
                acknowledged[key] = None  # indeterminate
        elif op < 0.8:
            try:
                u.delete(key)
                acknowledged[key] = None
                attempted[key].clear()
            except BlobError:
                acknowledged[key] = None
        else:
            try:
                got = u.get(key)
            except BlobError:
                continue
            assert got is None or got in attempted[key]
        u.faults(False)
        current = u.get(key)
        assert current is None or current in attempted[key]
        if acknowledged[key] is not None:
            assert current == acknowledged[key]
        assert all(k in keys for k, _ in u.list_keys())
        u.faults(True)
    assert u.faults_injected > 50
    assert after_write_failures > 10
    for d in (tmp_path / "r").rglob("*"):
        assert not d.name.startswith(".tmp-")


# ----------------------------------------------------------- the store table


def test_every_exported_name_resolves() -> None:
    """``from persist.blob import X`` works for every X in ``__all__`` (stores are
    re-exported on first access), and an unknown name is an AttributeError."""
    import persist.blob as blob_pkg

    for name in blob_pkg.__all__:
        assert getattr(blob_pkg, name) is not None, name
    assert blob_pkg.FileBlob is FileBlob
    with pytest.raises(AttributeError, match="NoSuchBlob"):
        blob_pkg.NoSuchBlob  # noqa: B018


def test_open_blob_picks_the_store_of_the_scheme(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``open_blob`` builds the class :data:`persist.blob.BACKENDS` names for a scheme,
    imported by name, through its ``from_uri``; other schemes go to ``pyarrow.fs``."""
    import persist.blob as blob_pkg

    monkeypatch.setitem(blob_pkg.BACKENDS, "tmpmem", "persist.blob.memory:MemoryBlob")
    b = open_blob("tmpmem://shared-by-table")
    assert isinstance(b, MemoryBlob) and b.name == "shared-by-table"
    assert isinstance(open_blob(str(tmp_path / "p")), FileBlob)
    assert isinstance(open_blob(f"file://{tmp_path}/q"), FileBlob)
    assert isinstance(open_blob("mock:///bucket/x"), ArrowFsBlob)
