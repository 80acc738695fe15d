"""The ``stash`` CLI as a newcomer meets it: the stash URL as an argument, as
``--stash`` before or after the subcommand, or from ``STASH_URL`` (shown in ``--help``);
commands other than ``migrate`` create nothing; errors in the style both CLIs share
(``error: what — what to do``, no ``stash error:`` prefix, no traceback); a missing
collection offers close names; ``peek_one``'s multiplicity error names the collection
and the key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from stash import Antichain, Stash, StashError
from stash.cli import main

NO_ENV: dict[str, str | None] = {"STASH_URL": None}
READS = [["collections"], ["peek", "orders"], ["iter", "orders"]]


def _seed(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path}/s.db"
    with Stash.open(url) as s:
        c = s.collection("orders")
        s.update_many(c, [(("a", 1), 0, 1), (("b", 2), 0, 1)])
        s.seal(c, Antichain.from_elem(1))
    return url


def _run(args: list[str], env: dict[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(main, args, env={**NO_ENV, **(env or {})})


@pytest.mark.parametrize("cmd", [*READS, ["consolidate", "orders"]], ids=" ".join)
def test_the_url_is_an_argument_or_stash_before_or_after_or_env(
    tmp_path: Path, cmd: list[str]
) -> None:
    url = _seed(tmp_path)
    positional = _run([cmd[0], url, *cmd[1:]])
    assert positional.exit_code == 0, positional.output
    for args, env in (
        (["--stash", url, *cmd], None),
        ([*cmd, "--stash", url], None),
        (cmd, {"STASH_URL": url}),
        ([cmd[0], url, *cmd[1:]], {"STASH_URL": f"sqlite:///{tmp_path}/other.db"}),
    ):
        res = _run(args, env)
        assert (res.exit_code, res.stdout) == (0, positional.stdout), (args, res.output)


def test_migrate_takes_the_url_from_stash_too(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/m.db"
    res = _run(["migrate", "--stash", url])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "m.db").exists()


def test_a_missing_url_says_where_it_goes_and_a_conflict_is_refused(tmp_path: Path) -> None:
    res = _run(["peek", "orders"])
    assert res.exit_code == 1
    assert res.stderr.strip() == (
        "error: no stash URL given — pass it as the URL argument or with --stash URL, or "
        "set STASH_URL"
    )
    url = _seed(tmp_path)
    res = _run(["--stash", url, "peek", "orders", "--stash", f"sqlite:///{tmp_path}/x.db"])
    assert res.exit_code == 1
    assert res.stderr.startswith("error: --stash is given twice with different values — ")
    res = _run(["peek", url, "orders", "extra"])
    assert res.exit_code == 1 and res.stderr.startswith("error: expected [URL] NAME, got 3")


def test_help_works_with_no_store_and_names_stash_url() -> None:
    res = _run(["--help"])
    assert res.exit_code == 0 and "STASH_URL" in res.stdout, res.output
    for name in main.commands:
        res = _run([name, "--help"])
        assert res.exit_code == 0, (name, res.output)
        assert "STASH_URL" in res.stdout, name


@pytest.mark.parametrize("cmd", [*READS, ["consolidate", "orders"]], ids=" ".join)
def test_no_command_but_migrate_creates_a_database(tmp_path: Path, cmd: list[str]) -> None:
    typo = tmp_path / "typo.db"
    res = _run([cmd[0], f"sqlite:///{typo}", *cmd[1:]])
    assert res.exit_code == 1
    assert not typo.exists()
    assert res.stderr.strip() == (
        f"error: sqlite stash file {typo} does not exist — is the stash URL right?"
    )


def test_errors_have_the_persist_cli_style(tmp_path: Path) -> None:
    url = _seed(tmp_path)
    for args in (
        ["peek", f"sqlite:///{tmp_path}/missing.db", "x"],
        ["peek", url, "nope"],
        ["collections", "nosuch://x"],
        ["migrate", "sqlite:////proc/no/such/dir/x.db"],
    ):
        res = _run(args)
        assert res.exit_code == 1, (args, res.output)
        assert res.stderr.startswith("error: ") and " — " in res.stderr, res.stderr
        assert "stash error" not in res.output and "Traceback" not in res.output


def test_a_missing_collection_offers_close_names(tmp_path: Path) -> None:
    url = _seed(tmp_path)
    res = _run(["peek", url, "ordrs"])
    assert res.stderr.strip() == (
        "error: collection 'ordrs' does not exist — did you mean 'orders'?"
    )
    res = _run(["iter", url, "zzz"])
    assert res.stderr.strip() == (
        "error: collection 'zzz' does not exist — `stash collections` lists them"
    )


def test_peek_one_multiplicity_error_names_the_collection_and_key(tmp_path: Path) -> None:
    """Running a README block twice writes every update twice."""
    with Stash.open(f"sqlite:///{tmp_path}/s.db") as s:
        c = s.collection("airlines")
        for t in (0, 1):
            s.update_many(c, [(("AA", "American"), t, 1), (("UA", "United"), t, 1)])
            s.seal(c, Antichain.from_elem(t + 1))
        with pytest.raises(StashError) as e:
            s.peek_one(c)
    msg = str(e.value)
    assert "collection 'airlines'" in msg and 'key "AA"' in msg and "multiplicity 2" in msg


def test_console_script_end_to_end(tmp_path: Path) -> None:
    url = _seed(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "STASH_URL"}
    out = subprocess.run(
        [sys.executable, "-m", "stash.cli", "peek", "orders", "--json"],
        env={**env, "STASH_URL": url},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert [json.loads(x) for x in out.stdout.splitlines()] == [
        {"key": "a", "value": 1, "diff": 1},
        {"key": "b", "value": 2, "diff": 1},
    ]
    out = subprocess.run(
        [sys.executable, "-m", "stash.cli", "collections", f"sqlite:///{tmp_path}/t.db"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 1 and out.stderr.startswith("error: sqlite stash file ")
    assert not (tmp_path / "t.db").exists()
