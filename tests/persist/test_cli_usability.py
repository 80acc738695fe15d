"""The ``persist`` CLI as a newcomer meets it: store options before or after the
subcommand, ``--help`` with no store and with its environment variables, read-only
commands that create nothing, errors of one style (``error: what — what to do``) that
point the right way, and output that does not mislead (a dropped shard marked, stored
updates named so, JSON in column order)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner, Result

from persist import PersistClient
from persist.cli import main
from stash import Stash

KS = pa.schema([("id", pa.int64())])
# Value columns deliberately not in alphabetical order.
VS = pa.schema([("zone", pa.string()), ("amount", pa.int64())])
NO_ENV: dict[str, str | None] = {"PERSIST_STASH": None, "PERSIST_BLOB": None}
READ_ONLY = [
    ["shards"],
    ["shards", "--json"],
    ["inspect", "orders"],
    ["cat", "orders"],
    ["sql", "SELECT * FROM orders"],
    ["fsck", "orders"],
]


def _store(tmp_path: Path) -> tuple[str, str]:
    """A SQLite stash and a file blob store with shard ``orders`` (two rows at time 0,
    upper 1, its part in the blob store) and shard ``gone`` (dropped)."""
    url, blob = f"sqlite:///{tmp_path}/s.db", f"file://{tmp_path}/blob"
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(s, blob, compaction="off", inline_max_bytes=0)
        for name in ("orders", "gone"):
            w = c.open_writer(name, KS, VS)
            w.compare_and_append([(((2,), ("b", 5)), 0, 1), (((1,), ("a", 6)), 0, 1)], 0, 1)
            w.expire()
        c.finalize_shard("gone")
        c.close()
    return url, blob


def _run(args: list[str], env: dict[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(main, args, env={**NO_ENV, **(env or {})})


@pytest.mark.parametrize("cmd", READ_ONLY, ids=lambda c: " ".join(c))
def test_store_options_go_before_or_after_the_subcommand(tmp_path: Path, cmd: list[str]) -> None:
    url, blob = _store(tmp_path)
    before = _run(["--stash", url, "--blob", blob, *cmd])
    after = _run([*cmd, "--stash", url, "--blob", blob])
    mixed = _run(["--blob", blob, *cmd, "--stash", url])
    env = _run(cmd, {"PERSIST_STASH": url, "PERSIST_BLOB": blob})
    assert before.exit_code == 0, before.output
    for res in (after, mixed, env):
        assert (res.exit_code, res.stdout) == (0, before.stdout), res.output


def test_a_store_option_on_the_command_line_wins_over_the_environment(tmp_path: Path) -> None:
    url, blob = _store(tmp_path)
    env = {"PERSIST_STASH": f"sqlite:///{tmp_path}/other.db", "PERSIST_BLOB": blob}
    for args in (["shards", "--stash", url], ["--stash", url, "shards"]):
        res = _run(args, env)
        assert res.exit_code == 0 and "orders" in res.stdout, res.output
    res = _run(["--stash", url, "shards", "--stash", f"sqlite:///{tmp_path}/x.db"], env)
    assert res.exit_code == 1
    assert res.stderr.strip() == (
        "error: --stash is given twice with different values — give it once, before or "
        "after the subcommand"
    )


def test_a_missing_store_option_says_where_it_goes(tmp_path: Path) -> None:
    url, _ = _store(tmp_path)
    res = _run(["cat", "orders", "--stash", url])
    assert res.exit_code == 1
    assert res.stderr.strip() == (
        "error: no --blob given — pass --blob before or after the subcommand, or set PERSIST_BLOB"
    )


def test_every_subcommand_help_works_without_a_store_and_names_the_env_vars() -> None:
    res = _run(["--help"])
    assert res.exit_code == 0, res.output
    assert "PERSIST_STASH" in res.stdout and "PERSIST_BLOB" in res.stdout
    assert set(main.commands) >= {"shards", "inspect", "cat", "sql", "fsck", "gc", "drop"}
    for name in main.commands:
        res = _run([name, "--help"])
        assert res.exit_code == 0, (name, res.output)
        assert "PERSIST_STASH" in res.stdout and "PERSIST_BLOB" in res.stdout, name


@pytest.mark.parametrize("cmd", READ_ONLY, ids=lambda c: " ".join(c))
def test_read_only_commands_create_no_blob_root(tmp_path: Path, cmd: list[str]) -> None:
    url, _ = _store(tmp_path)
    typo = tmp_path / "typo" / "blob"
    _run(["--stash", url, "--blob", f"file://{typo}", *cmd])
    assert not (tmp_path / "typo").exists()
    _run(["--stash", url, "--blob", str(typo), *cmd])  # a plain path alike
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize(
    "cmd", [*READ_ONLY, ["compact", "orders"], ["gc", "orders"], ["drop", "orders", "--yes"]]
)
def test_no_command_creates_a_stash(tmp_path: Path, cmd: list[str]) -> None:
    _, blob = _store(tmp_path)
    res = _run(["--stash", f"sqlite:///{tmp_path}/typo.db", "--blob", blob, *cmd])
    assert res.exit_code == 1
    assert not (tmp_path / "typo.db").exists()
    assert res.stderr.strip() == (
        f"error: sqlite stash file {tmp_path}/typo.db does not exist — is --stash right?"
    )


def test_a_missing_blob_root_asks_whether_blob_is_right(tmp_path: Path) -> None:
    """A shard records its blob store's identity: a client over another store (a typo
    in --blob, an empty root) is refused up front, naming both stores, by every command
    (it used to read inline data "fine" and fail on the first blob part)."""
    url, _ = _store(tmp_path)
    typo = f"file://{tmp_path}/blbo"
    (tmp_path / "empty").mkdir()
    for blob in (typo, f"file://{tmp_path}/empty"):
        for cmd in (["cat", "orders"], ["fsck", "orders"], ["inspect", "orders"]):
            res = _run(["--stash", url, "--blob", blob, *cmd])
            assert res.exit_code == 1 and "Traceback" not in res.output
            line = res.stderr.strip()
            assert line.startswith("error: shard 'orders' belongs to the blob store FileBlob("), (
                line
            )
            assert f"not to this client's blob store FileBlob('{blob[7:]}')" in line, line
            assert line.endswith("is the blob URI right? Nothing was written"), line


def test_cat_beyond_the_upper_says_the_upper_and_offers_wait(tmp_path: Path) -> None:
    url, blob = _store(tmp_path)
    base = ["--stash", url, "--blob", blob]
    res = _run([*base, "cat", "orders", "--as-of", "99"])
    assert res.exit_code == 1
    assert res.stderr.strip() == (
        "error: shard 'orders' cannot be read at time 99 yet: its upper is 1, so only "
        "times before 1 are complete — read at --as-of 0 or earlier, or add --wait "
        "SECONDS to wait until time 99 is complete"
    )
    assert "wait=True" not in res.output
    res = _run([*base, "cat", "orders", "--as-of", "99", "--wait", "0.05"])
    assert res.exit_code == 1
    assert res.stderr.startswith("error: shard 'orders': time 99 was not complete within 0.05 s")


def test_cat_wait_returns_once_another_process_writes_the_time(tmp_path: Path) -> None:
    url, blob = _store(tmp_path)

    def write_later() -> None:
        with Stash.open(url, fenced=False) as s:
            c = PersistClient(s, blob, compaction="off")
            w = c.open_writer("orders", KS, VS)
            for t in (1, 2, 3):
                w.compare_and_append([(((3,), ("c", t)), t, 1)], t, t + 1)
            w.expire()
            c.close()

    writer = threading.Timer(0.2, write_later)
    writer.start()
    res = _run(["--stash", url, "--blob", blob, "cat", "orders", "--as-of", "2", "--wait", "60"])
    writer.join()
    assert res.exit_code == 0, res.output
    rows = [
        json.loads(x)
        for x in _run(
            ["--stash", url, "--blob", blob, "cat", "orders", "--as-of", "2", "--json"]
        ).stdout.splitlines()
    ]
    assert [r["id"] for r in rows] == [1, 2, 3, 3]
    assert "orders as of 2" in res.stdout


def test_a_missing_shard_offers_close_names(tmp_path: Path) -> None:
    url, blob = _store(tmp_path)
    base = ["--stash", url, "--blob", blob]
    for cmd in (["cat", "ordrs"], ["inspect", "ordrs"], ["fsck", "ordrs"]):
        res = _run([*base, *cmd])
        assert res.exit_code == 1
        assert res.stderr.strip() == "error: no shard named 'ordrs' — did you mean 'orders'?"
    res = _run([*base, "cat", "zzz"])
    assert res.stderr.strip() == ("error: no shard named 'zzz' — `persist shards` lists the shards")


def test_sql_syntax_error_prints_real_lines(tmp_path: Path) -> None:
    url, blob = _store(tmp_path)
    res = _run(["--stash", url, "--blob", blob, "sql", "SELEC * FROM orders"])
    assert res.exit_code == 1
    lines = res.stderr.splitlines()
    assert lines[0] == "error: persist sql: cannot parse the query — fix the SQL"
    assert "\\n" not in res.stderr
    assert any(line.startswith("LINE 1: SELEC * FROM orders") for line in lines), lines
    assert any(set(line.strip()) == {"^"} for line in lines), lines  # the caret line


def test_errors_have_one_style(tmp_path: Path) -> None:
    """Every user error: one ``error: `` line first, exit code 1, no traceback."""
    url, blob = _store(tmp_path)
    base = ["--stash", url, "--blob", blob]
    for args in (
        [*base, "cat", "nope"],
        [*base, "cat", "gone"],
        [*base, "cat", "orders", "--as-of", "99"],
        [*base, "sql", "SELECT * FROM nothing_here"],
        ["--stash", "nosuch://x", "--blob", blob, "shards"],
        ["shards"],
    ):
        res = _run(args)
        assert res.exit_code == 1, (args, res.output)
        assert res.stderr.startswith("error: ") and "stash error:" not in res.stderr, res.stderr
        assert "Traceback" not in res.output


def test_shards_marks_a_dropped_shard_and_counts_updates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stash.cli

    monkeypatch.setattr(stash.cli.console, "width", 300)  # no column cut short
    url, blob = _store(tmp_path)
    res = _run(["--stash", url, "--blob", blob, "shards", "--json"])
    by_name = {s["name"]: s for s in json.loads(res.stdout)}
    assert by_name["gone"]["state"] == "finalized"
    assert by_name["orders"]["state"] == "live"
    assert by_name["orders"]["updates"] == 2 and "rows" not in by_name["orders"]
    # An update of a row is two stored updates.
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(s, blob, compaction="off")
        w = c.open_writer("orders", KS, VS)
        w.compare_and_append([(((1,), ("a", 6)), 1, -1), (((1,), ("a", 7)), 1, 1)], 1, 2)
        w.expire()
        c.close()
    res = _run(["--stash", url, "--blob", blob, "shards", "--json"])
    assert {s["name"]: s["updates"] for s in json.loads(res.stdout)}["orders"] == 4
    table = _run(["--stash", url, "--blob", blob, "shards"]).stdout
    header = next(line for line in table.splitlines() if "name" in line)
    assert "state" in header and "updates" in header and " rows " not in header
    gone = next(line for line in table.splitlines() if " gone " in line)
    assert "finalized" in gone and "{}" not in gone


def test_cat_json_keeps_the_column_order(tmp_path: Path) -> None:
    url, blob = _store(tmp_path)
    res = _run(["--stash", url, "--blob", blob, "cat", "orders", "--json"])
    rows = [json.loads(x) for x in res.stdout.splitlines()]
    assert [list(r) for r in rows] == [["id", "zone", "amount", "_diff"]] * 2
    res = _run(["--stash", url, "--blob", blob, "sql", "SELECT zone, id FROM orders", "--json"])
    assert [list(json.loads(x)) for x in res.stdout.splitlines()] == [["zone", "id"]] * 2


def test_console_script_end_to_end(tmp_path: Path) -> None:
    """A real process: options after the subcommand, env vars, a typo'd --blob."""
    url, blob = _store(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSIST_")}
    cmd = [sys.executable, "-m", "persist.cli"]
    out = subprocess.run(
        [*cmd, "cat", "orders", "--json", "--stash", url, "--blob", blob],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert [json.loads(x)["id"] for x in out.stdout.splitlines()] == [1, 2]
    out = subprocess.run(
        [*cmd, "shards"],
        env={**env, "PERSIST_STASH": url, "PERSIST_BLOB": f"{tmp_path}/typo"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0 and "orders" in out.stdout, out.stderr
    assert not (tmp_path / "typo").exists()


def test_sql_naming_no_shard_offers_close_names(tmp_path: Path) -> None:
    url, blob = _store(tmp_path)
    res = _run(["--stash", url, "--blob", blob, "sql", "SELECT * FROM ordrs"])
    assert res.exit_code == 1
    assert res.stderr.strip() == (
        "error: persist sql: the query names no shard (tables ['ordrs']) — did you mean 'orders'?"
    )


def test_file_blob_opened_without_create_makes_nothing_until_a_write(tmp_path: Path) -> None:
    from persist.blob import open_blob
    from persist.blob.file import FileBlob
    from persist.errors import BlobError

    root = tmp_path / "a" / "root"
    b = open_blob(f"file://{root}", create=False)
    assert isinstance(b, FileBlob) and not b.root_exists()
    assert b.get("s1/b/x") is None and b.list_keys("") == [] and b.find_symlinks() == []
    b.delete("s1/b/x")
    assert b.sweep_temporaries("s1/", 0) == 0
    assert not (tmp_path / "a").exists()
    b.set("s1/b/x", b"v")  # the first write makes the root (owner-only)
    assert b.get("s1/b/x") == b"v" and b.root_exists()
    assert (root.stat().st_mode & 0o777) == 0o700
    (tmp_path / "file").write_text("x")
    with pytest.raises(BlobError, match="not a directory"):
        FileBlob(tmp_path / "file", create=False)
    # The default still makes the root at once.
    FileBlob(tmp_path / "eager")
    assert (tmp_path / "eager").is_dir()


def test_click_usage_errors_have_the_same_style() -> None:
    """A missing argument, an unknown option, a bad value: ``error: ... — see
    '... --help'`` on one line, exit code 2, no usage block; in both CLIs."""
    from stash.cli import main as stash_main

    for cli, args, what in (
        (main, ["cat"], "Missing argument 'SHARD'."),
        (main, ["cat", "x", "--nope"], "No such option '--nope'."),
        (main, ["nope"], "No such command 'nope'."),
        (stash_main, ["peek"], "Missing argument '[URL] NAME'."),
    ):
        res = CliRunner().invoke(cli, args, env=NO_ENV, prog_name="prog")
        assert res.exit_code == 2, res.output
        sub = f" {args[0]}" if what.startswith("Missing") or "option" in what else ""
        assert res.stderr == f"error: {what} — see 'prog{sub} --help'\n", res.stderr


def test_a_consensus_error_does_not_repeat_the_stash_prefix() -> None:
    """The CLIs print ``error: consensus read failed: ...``, not ``... failed: stash
    error: ...``."""
    from persist.consensus import _wrap
    from stash import StashError

    assert str(_wrap(StashError("database is locked"), "read")) == (
        "consensus read failed: database is locked"
    )


def test_an_object_store_prefix_without_the_shard_asks_whether_blob_is_right(
    tmp_path: Path, s3_blob_uri: str
) -> None:
    """S3 (moto): the shard's parts under one prefix, ``--blob`` naming another."""
    url = f"sqlite:///{tmp_path}/s.db"
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(s, s3_blob_uri, compaction="off", inline_max_bytes=0)
        w = c.open_writer("orders", KS, VS)
        w.compare_and_append([(((1,), ("a", 6)), 0, 1)], 0, 1)
        w.expire()
        c.close()
    wrong = s3_blob_uri.replace("/t", "/typo-t", 1)
    assert wrong != s3_blob_uri
    res = _run(["--stash", url, "--blob", wrong, "cat", "orders"])
    assert res.exit_code == 1
    err = res.stderr.strip()
    assert err.startswith("error: shard 'orders' belongs to the blob store ArrowFsBlob('s3'"), err
    assert "/typo-t" in err and err.endswith("is the blob URI right? Nothing was written"), err
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in res.output
