"""Security campaign, persist side:

* shard names (and ids, and blob keys) that try to escape the blob root -- ``..``,
  absolute paths, NUL, backslashes, very long names, hidden names -- are refused by
  ``client.open`` (and every other entry point taking one) with an InvalidUsage naming
  the rule, register nothing, and create no file anywhere;
* the FileBlob's directories are ``0700`` and its files ``0600``, even under a permissive
  umask, after writes, compaction and GC;
* blob URIs carrying credentials (user info, query secrets) are refused (credentials come
  from the environment only), and the credentials never appear in reprs, error messages,
  logs or the ``persist`` command's output; neither does the stash password.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from persist import (
    FileBlob,
    InvalidKey,
    InvalidUsage,
    PersistClient,
    PersistError,
    collect_garbage,
    fsck,
    open_blob,
)
from persist.cli import main
from stash import Stash
from tests.reliability.campaign import record

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string())])

ESCAPES = [
    "..",
    "../escape",
    "../../../../tmp/escape",
    "a/../../escape",
    "/etc/passwd",
    "/tmp/escape",
    "a/b",
    "a\\..\\..\\escape",
    "..\\escape",
    "a\x00b",
    "\x00",
    "x" * 201,
    "y" * 5000,
    "",
    ".hidden",
    ".tmp-0123",
    "~root",
    "a b",
    "name\n",
    "file:///etc/passwd",
    "ｆｕｌｌｗｉｄｔｈ",
    "%2e%2e%2fescape",
]

BAD_KEYS = [
    "..",
    "../escape",
    "a/../../escape",
    "/etc/passwd",
    "a\\..\\escape",
    "a\x00b",
    "",
    ".hidden",
    "a/.tmp-0123",
    "a//b",
    "a/",
    "/",
    "a/./b",
    "z" * 256,
    "a/" * 600,
]


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_escaping_shard_names_are_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "blob"
    refused = 0
    with Stash.open(f"sqlite:///{tmp_path}/s.db", fenced=False) as stash:
        client = PersistClient(stash, FileBlob(root), compaction="off", inline_max_bytes=0)
        w, _ = client.open("legit", KS, VS)
        w.compare_and_append([(((1,), ("x" * 100,)), 0, 1)], 0, 1)
        shards_before, tree_before = client.shards(), _tree(tmp_path)
        for name in ESCAPES:
            for fn in (
                lambda n=name: client.open(n, KS, VS),
                lambda n=name: client.open_writer(n, KS, VS),
                lambda n=name: client.open_reader(n, KS, VS),
                lambda n=name: client.inspect(n),
                lambda n=name: collect_garbage(client, n, grace_seconds=0),
                lambda n=name: client.compactor.compact_once(n),
                lambda n=name: fsck(client, n),
                lambda n=name: client.machine(n),
            ):
                with pytest.raises(InvalidUsage) as e:
                    fn()
                msg = str(e.value)
                assert "shard" in msg and ("name" in msg or "id" in msg), msg
                assert "\x00" not in msg  # names are shown escaped
                refused += 1
        # Blob keys built from such names are refused before any I/O, too.
        for key in BAD_KEYS:
            for fn in (
                lambda k=key: client.raw_blob.set(k, b"x"),
                lambda k=key: client.raw_blob.get(k),
                lambda k=key: client.raw_blob.delete(k),
            ):
                with pytest.raises(InvalidKey):
                    fn()
                refused += 1
        assert client.shards() == shards_before
        assert _tree(tmp_path) == tree_before, "a refused name created files"
        assert not list(outside.iterdir())
        assert fsck(client, "legit").ok
        client.close()
    record(
        "security: persist shard names and blob keys escaping the blob root",
        runs=len(ESCAPES),
        faults=refused,
        acknowledged=0,
        lost=0,
        duplicated=0,
        partial=0,
        unclear=0,
    )


def _modes(root: Path) -> list[tuple[str, int]]:
    out = [(".", stat.S_IMODE(os.stat(root).st_mode))]
    for p in root.rglob("*"):
        out.append((str(p.relative_to(root)), stat.S_IMODE(os.lstat(p).st_mode)))
    return out


def test_blob_directory_is_user_only(tmp_path: Path) -> None:
    """Under umask 000: the blob root, every directory and every part file are the
    user's only, after appends, compaction and GC."""
    old = os.umask(0)
    try:
        root = tmp_path / "deep" / "blob"
        with Stash.open(f"sqlite:///{tmp_path}/s.db", fenced=False) as stash:
            client = PersistClient(stash, f"file://{root}", compaction="inline", inline_max_bytes=0)
            w, r = client.open("perm", KS, VS)
            for t in range(12):
                w.compare_and_append([(((t,), ("v" * 50,)), t, 1)], t, t + 1)
            r.downgrade_since(10)
            client.compactor.compact_once("perm")
            collect_garbage(client, "perm", grace_seconds=0)
            modes = _modes(root)
            client.close()
        assert len(modes) > 5
        bad = [(p, oct(m)) for p, m in modes if m & 0o077]
        assert not bad, f"group/other can access {bad[:5]}"
        files = [m for p, m in modes if (root / p).is_file()]
        assert files and all(m == 0o600 for m in files)
        assert stat.S_IMODE(os.stat(tmp_path / "deep").st_mode) & 0o077 == 0
    finally:
        os.umask(old)


SECRET_USER = "AKIAIOSFODNN7EXAMPLE"
SECRET_PASS = "wJalrXUtnFEMIK7MDENGbPxRfiCYzzSecret"
SECRET_TOKEN = "FwoGZXIvYXdzEJr-session-token"


def _leaks(text: str) -> list[str]:
    return [s for s in (SECRET_USER, SECRET_PASS, SECRET_TOKEN) if s in text]


def test_blob_credentials_never_shown(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.DEBUG)
    # Credentials come from the environment; URIs carrying them are refused (below).
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", SECRET_USER)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_PASS)
    monkeypatch.setenv("AWS_SESSION_TOKEN", SECRET_TOKEN)
    s3 = "s3://bucket/prefix?endpoint_override=127.0.0.1:1&scheme=http"
    s3_with_secrets = (
        f"s3://{SECRET_USER}:{SECRET_PASS}@bucket/prefix?endpoint_override=127.0.0.1:1&scheme=http"
    )
    shown: list[str] = []
    # Opening works (no network yet): reprs are clean.
    blob = open_blob(s3)
    shown.append(repr(blob))
    with Stash.open(f"sqlite:///{tmp_path}/s.db", fenced=False) as stash:
        client = PersistClient(stash, s3, compaction="off")
        shown.append(repr(client))
        shown.append(repr(client.blob))
        client.close()
    # Malformed variants fail with clean messages.
    for bad in (
        s3_with_secrets,
        s3 + "&secret_key=" + SECRET_PASS,
        s3 + "&session_token=" + SECRET_TOKEN,
        s3 + "&not_an_option=" + SECRET_PASS,
        f"s3://{SECRET_USER}:{SECRET_PASS}@",
        f"memory://{SECRET_USER}:{SECRET_PASS}@x",
        f"file://{SECRET_USER}:{SECRET_PASS}@host/path",
        f"nosuchscheme://{SECRET_USER}:{SECRET_PASS}@host/p",
        f"s3://{SECRET_USER}:{SECRET_PASS}@bucket/p?endpoint_override=[::1",
    ):
        with pytest.raises(PersistError) as e:
            open_blob(bad)
        shown += [str(e.value), repr(e.value)]
        cause = e.value.__cause__ or e.value.__context__
        shown.append(repr(cause) if cause is not None else "")
    # The CLI, with the credentialed blob URI, on a stash that has a shard.
    db = tmp_path / "cli.db"
    with Stash.open(f"sqlite:///{db}", fenced=False) as stash:
        c = PersistClient(stash, "memory://", compaction="off")
        c.open("cli", KS, VS)
        c.close()
    runner = CliRunner()
    for args in (
        ["shards"],
        ["shards", "--json"],
        ["inspect", "cli"],
        ["inspect", "cli", "--json"],
        ["inspect", "../../etc/passwd"],
    ):
        res = runner.invoke(main, ["--stash", f"sqlite:///{db}", "--blob", s3, "-v", *args])
        shown.append(res.output)
        if args[0] == "shards":
            assert res.exit_code == 0 and "cli" in res.output, res.output
        if res.exception is not None and not isinstance(res.exception, SystemExit):
            shown.append(repr(res.exception))
    for bad_uri in (s3 + "&bad=" + SECRET_PASS, s3_with_secrets):
        for args in (["shards"], ["inspect", "cli"]):
            res = runner.invoke(main, ["--stash", f"sqlite:///{db}", "--blob", bad_uri, *args])
            assert res.exit_code == 1, res.output
            shown.append(res.output)
    shown += [caplog.text, capsys.readouterr().out, capsys.readouterr().err]
    leaked = [(i, _leaks(t)) for i, t in enumerate(shown) if _leaks(t)]
    assert not leaked, [(shown[i][:300], w) for i, w in leaked]
    record(
        "security: blob credentials in reprs, errors, logs, CLI output",
        runs=len(shown),
        faults=0,
        acknowledged=0,
        lost=0,
        duplicated=0,
        partial=0,
        unclear=len(leaked),
    )


@pytest.mark.postgres
def test_stash_password_never_in_persist_cli(postgres_url: str, tmp_path: Path) -> None:
    from sqlalchemy.engine import make_url

    u = make_url(postgres_url)
    secret = u.password
    assert secret
    down = u.set(port=1).render_as_string(hide_password=False)
    res = CliRunner().invoke(main, ["--stash", down, "--blob", f"file://{tmp_path}/b", "shards"])
    assert res.exit_code == 1 and secret not in res.output
    assert "error:" in res.output


def _user_docs(tmp_path: Path) -> Path:
    """A user's directory outside the blob root holding files persist's GC would take
    for abandoned parts (``2023-report.pdf``: "created" in 1970) and for temporaries of
    interrupted uploads (``.tmp-*``), all last changed two hours ago."""
    docs = tmp_path / "docs"
    (docs / "b").mkdir(parents=True)
    old = time.time() - 7200
    for rel in ("2023-report.pdf", "b/2023-report.pdf", ".tmp-notes", "b/.tmp-draft"):
        (docs / rel).write_bytes(b"the user's " + rel.encode())
        os.utime(docs / rel, (old, old))
    return docs


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in d.rglob("*") if p.is_file()}


@pytest.mark.parametrize("where", ["shard", "kind"])
def test_symlinked_directories_under_the_blob_root_are_never_followed(
    tmp_path: Path, where: str
) -> None:
    """``<root>/<shard_id>`` or ``<root>/<shard_id>/b`` is a symbolic link to a
    user's directory.  Appends, reads, GC (default one-hour grace) and the temporaries'
    sweep through it fail with an error naming the link; the user's files outside the
    root are all still there, unchanged, and nothing new appears next to them."""
    docs = _user_docs(tmp_path)
    before = _files(docs)
    root = tmp_path / "blob"
    attempts = refused = 0
    errors: list[str] = []
    with Stash.open(f"sqlite:///{tmp_path}/s.db", fenced=False) as stash:
        client = PersistClient(stash, FileBlob(root), compaction="off", inline_max_bytes=0)
        w, r = client.open("victim", KS, VS)
        w.compare_and_append([(((1,), ("x" * 100,)), 0, 1)], 0, 1)
        sid = client.shard_id("victim")
        link = sid if where == "shard" else f"{sid}/b"
        # Move the shard's real files aside and put the link in their place.
        os.rename(root / link, tmp_path / "moved-aside")
        os.symlink(docs, root / link)
        fsck_view = client.raw_blob.find_symlinks(f"{sid}/")  # type: ignore[attr-defined]
        assert fsck_view == [link]
        for fn in (
            lambda: w.compare_and_append([(((2,), ("y" * 100,)), 1, 1)], 1, 2),
            lambda: r.snapshot(0),
            lambda: collect_garbage(client, "victim"),
            lambda: collect_garbage(client, "victim", grace_seconds=0),
            lambda: client.compactor.compact_once("victim"),
        ):
            attempts += 1
            try:
                fn()
            except PersistError as e:
                refused += 1
                errors.append(str(e))
        swept = client.raw_blob.sweep_temporaries(f"{sid}/", 0)  # type: ignore[attr-defined]
        client.close()
    # First: nothing outside the root was written, changed or deleted.
    assert _files(docs) == before, "a file outside the blob root was changed or deleted"
    assert swept == 0
    # Then: every refusal names the link.
    unclear = [m for m in errors if "symbolic link" not in m or link not in m]
    assert not unclear, unclear
    assert refused >= 3  # the append (it uploads) and both GC passes (they list)
    record(
        f"security: symlinked {where} directory under the blob root (append, read, GC, sweep)",
        runs=attempts,
        faults=refused,
        acknowledged=0,
        lost=0,
        duplicated=0,
        partial=0,
        unclear=0,
    )
