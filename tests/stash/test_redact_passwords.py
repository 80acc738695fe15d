"""Protects: ``stash.url.redact`` leaves no password visible.

Checks of odd spellings of URLs and libpq strings."""

import pytest
from sqlalchemy.engine import URL

from stash.url import parse_url, redact

pytestmark = pytest.mark.adversarial

SECRET = "hunter 2xyz"


@pytest.mark.parametrize("password", ["hunter 2xyz", "hunter\t2xyz"])
def test_url_object_password_with_whitespace_is_hidden(password: str) -> None:
    # A SQLAlchemy URL whose password contains a space: render_as_string keeps the space
    # raw, so the text-level user-info regex (which stops at whitespace) misses it.
    u = URL.create("postgresql+psycopg", username="user", password=password, host="h", database="d")
    out = redact(u)
    assert "2xyz" not in out, out


def test_parsed_url_with_space_in_password_is_hidden() -> None:
    # parse_url accepts it (SQLAlchemy's grammar), so the stash would connect with it and
    # any message quoting the URL object would show it.
    u = parse_url("postgresql+psycopg://user:hunter 2xyz@host/db")
    assert u.password == SECRET
    assert "2xyz" not in redact(u)
    assert "2xyz" not in redact("postgresql+psycopg://user:hunter 2xyz@host/db")


def test_query_password_with_space_is_hidden() -> None:
    out = redact("sqlite:///x?password=hunter 2xyz")
    assert "2xyz" not in out, out


@pytest.mark.parametrize(
    "text",
    [
        "host=h password='hunter 2xyz' dbname=d",  # libpq conninfo, quoted value
        "host=h password = hunter2xyz dbname=d",  # libpq allows spaces around '='
        "{'password': 'hunter2xyz'}",  # a Python dict repr in an error message
        '{"password": "hunter2xyz"}',  # JSON
    ],
)
def test_conninfo_and_mapping_forms_are_hidden(text: str) -> None:
    out = redact(text)
    assert "2xyz" not in out, out


def test_url_object_plain_password_hidden() -> None:  # holds
    u = URL.create("postgresql+psycopg", username="u", password="p@ss:w/d#?x", host="[::1]")
    assert "p@ss" not in redact(u) and "w/d" not in redact(u)


@pytest.mark.parametrize("password", ["/secret9", "//secret9"])
def test_password_starting_with_slash_is_hidden(password: str) -> None:
    # _USERINFO_RE's (?!/) refuses a password beginning with '/', and urlsplit ends the
    # authority at that '/', so the password ends up in the "path"; SQLAlchemy (which
    # opens the stash) reads it as the password.
    url = f"postgresql+psycopg://user:{password}@host/db"
    assert parse_url(url).password == password
    out = redact(url)
    assert "secret9" not in out, out


def test_quoted_query_password_is_hidden() -> None:
    out = redact("postgresql+psycopg://user:x@host/db?password='a secret9'")
    assert "secret9" not in out, out


def test_url_argument_secret_starting_with_slash_removed_from_message() -> None:
    url = "postgresql+psycopg://user:/secret9@host/db"
    out = redact('password authentication failed: "/secret9"', url=url)
    assert "secret9" not in out, out


def test_url_argument_secret_with_space_removed_from_message() -> None:
    url = "postgresql+psycopg://user:hunter 2xyz@host/db"
    out = redact("driver said: hunter 2xyz rejected", url=url)
    assert "2xyz" not in out, out


QUESTION_PASSWORDS = ["pa?ss word", "pa?ss'q", 'pa?s"s', "p?w", "a?b=c d", "p/w?x y", "x?y#z w"]


@pytest.mark.parametrize("password", QUESTION_PASSWORDS)
def test_password_with_question_mark_is_accepted_and_hidden(password: str) -> None:
    """A password holding ``?`` (with a space or a quote, or alone) is read as
    SQLAlchemy reads it, and no message shows it (it was refused, and printed verbatim
    by the malformed-URL error, ``redact()`` and the CLI)."""
    import sqlalchemy as sa

    url = f"postgresql+psycopg://user:{password}@localhost:5432/db"
    assert parse_url(url) == sa.engine.make_url(url)  # what SQLAlchemy reads
    u = parse_url(url)
    assert (u.username, u.password, u.host, u.port, u.database) == (
        "user",
        password,
        "localhost",
        5432,
        "db",
    )
    shown = redact(url)
    assert shown == "postgresql+psycopg://user:***@localhost:5432/db"
    assert redact(f"{url}: connection refused") == f"{shown}: connection refused"
    assert password not in redact(u)


@pytest.mark.parametrize("password", ["s p?a@c:e", "x y?z'@q", "?"])
def test_odd_url_never_shows_its_password(password: str) -> None:
    """Unparseable (the first), or read by SQLAlchemy's first-``@`` rule (the second):
    the password is shown nowhere."""
    from stash import Stash, StashError

    url = f"postgresql+psycopg://user:{password}@localhost:5432/db"
    assert password not in redact(url)
    try:
        Stash.open(url, connect_timeout=2)
    except StashError as e:
        assert password not in str(e)


def test_cli_never_prints_a_question_mark_password() -> None:
    from click.testing import CliRunner

    from stash.cli import main

    for password in QUESTION_PASSWORDS + ["s p?a@c:e"]:
        url = f"postgresql+psycopg://user:{password}@127.0.0.1:1/db"
        r = CliRunner().invoke(main, ["collections", url])
        assert r.exit_code != 0
        assert password not in r.output, r.output
