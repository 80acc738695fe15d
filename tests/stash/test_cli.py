"""The `stash` console script: migrate, collections, peek, iter, consolidate; tables and
--json; errors as one line with exit code 1; passwords never printed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from stash import Antichain, Stash
from stash.cli import main


def _seed(url: str) -> None:
    with Stash.open(url) as s:
        c = s.collection("orders")
        s.update_many(c, [(("a", {"qty": 1}), 0, 1), (("a", {"qty": 1}), 1, 1), (("b", 2), 1, 1)])
        s.seal(c, Antichain.from_elem(2))
        s.compact(c, Antichain.from_elem(1))


def test_cli_commands(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    r = CliRunner()
    res = r.invoke(main, ["migrate", url])
    assert res.exit_code == 0, res.output
    _seed(url)
    res = r.invoke(main, ["collections", url, "--json"])
    assert res.exit_code == 0
    assert [json.loads(x) for x in res.output.splitlines()] == [
        {
            "id": 1,
            "key_codec": "json",
            "name": "orders",
            "since": "{1}",
            "upper": "{2}",
            "value_codec": "json",
        }
    ]
    res = r.invoke(main, ["peek", url, "orders", "--json"])
    assert [json.loads(x) for x in res.output.splitlines()] == [
        {"key": "a", "value": {"qty": 1}, "diff": 2},
        {"key": "b", "value": 2, "diff": 1},
    ]
    res = r.invoke(main, ["iter", url, "orders"])
    assert res.exit_code == 0 and "qty" in res.output and "time" in res.output
    res = r.invoke(main, ["consolidate", url, "orders"])
    assert res.exit_code == 0
    res = r.invoke(main, ["iter", url, "orders", "--json"])
    assert [json.loads(x) for x in res.output.splitlines()] == [
        {"key": "a", "value": {"qty": 1}, "time": 1, "diff": 2},
        {"key": "b", "value": 2, "time": 1, "diff": 1},
    ]


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    r = CliRunner()
    res = r.invoke(main, ["peek", f"sqlite:///{tmp_path}/missing.db", "x"])
    assert res.exit_code == 1
    assert res.output.strip().startswith("error: ")
    url = f"sqlite:///{tmp_path}/s.db"
    _seed(url)
    res = r.invoke(main, ["peek", url, "nope"])
    assert res.exit_code == 1 and "collection 'nope' does not exist" in res.output


def test_cli_hides_password(postgres_url: str) -> None:
    from sqlalchemy.engine import make_url

    u = make_url(postgres_url)
    bad = u.set(password="s3cret-pw", port=1).render_as_string(hide_password=False)
    res = CliRunner().invoke(main, ["collections", bad])
    assert res.exit_code == 1
    assert "s3cret-pw" not in res.output


def test_printable_escapes_as_repr_does() -> None:
    from stash.cli import printable

    assert printable("plain text, é, 数") == "plain text, é, 数"
    assert printable("a\x1b[2Jb\x07\r\n\t\u2028\u202e") == "a\\x1b[2Jb\\x07\\r\\n\\t\\u2028\\u202e"
    assert printable("C:\\dir") == "C:\\\\dir"  # unambiguous: a literal backslash doubles
    assert printable("C:\\dir\x1b", backslashes=False) == "C:\\dir\\x1b"
    for s in ("x\x1by", "\x00\x7f\x9b", "tab\there"):
        assert printable(s) == repr(s)[1:-1]


def test_cli_shows_markup_literally(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import stash.cli

    monkeypatch.setattr(stash.cli.console, "width", 300)
    url = f"sqlite:///{tmp_path}/s.db"
    name = "[link=https://evil.example]orders[/link] [bold]x[/bold]"
    with Stash.open(url) as s:
        c = s.collection(name)
        s.update(c, ("[red]k[/red]", "\x1b]0;title\x07"), 0, 1)
        s.seal(c, Antichain.from_elem(1))
    r = CliRunner()
    res = r.invoke(main, ["collections", url])
    assert res.exit_code == 0 and name in res.output
    res = r.invoke(main, ["iter", url, name])
    assert res.exit_code == 0
    assert "iter [link=https://evil.example]orders[/link]" in res.output  # the title
    assert "[red]k[/red]" in res.output
    assert "\\x1b]0;title\\x07" in res.output and "\x1b" not in res.output
    res = r.invoke(main, ["iter", url, name, "--json"])
    assert [json.loads(x) for x in res.output.splitlines()] == [
        {"key": "[red]k[/red]", "value": "\x1b]0;title\x07", "time": 0, "diff": 1}
    ]
