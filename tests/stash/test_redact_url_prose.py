"""Protects: ``redact`` hides secrets in a line that starts with a URL and keeps no
secret in the prose after it.

The attack: stash.url.redact on text that begins with a URL (d1aaaeb parses such
text with SQLAlchemy's make_url).  make_url reads everything after ``?`` as the query,
so the last query value swallows the prose that follows the URL; every query value of a
non-database URL (and a secret one of a database URL) is hidden by replacing
``=<value>`` in the text: the rest of the line is replaced by ``***``.  Before d1aaaeb
the same line kept its prose ('s3://***@bucket/p?region=*** timed out after 30s ...').
"""

from __future__ import annotations

import pytest

from stash.url import redact

pytestmark = pytest.mark.adversarial


@pytest.mark.parametrize(
    "text, prose",
    [
        (
            "s3://AKIA@bucket/p?region=eu-west-1 timed out after 30s (attempt 2 of 3)",
            "timed out after 30s (attempt 2 of 3)",
        ),
    ],
)
def test_prose_after_a_url_with_a_query_is_kept(text: str, prose: str) -> None:
    out = redact(text)
    assert "pw@" not in out and "AKIA" not in out
    assert out.endswith(prose), f"the prose after the URL was swallowed: {out!r}"


def test_a_secret_named_value_runs_to_the_end_of_the_text() -> None:
    """The one trade-off kept: after a parameter named as a secret (password, passfile,
    ...) the grammar's value runs to the end of the text, and a secret may hold spaces
    (``?password=hunter 2xyz`` opens the stash with that password), so the rest of such
    a line is hidden with it rather than risk showing part of a password."""
    out = redact("postgresql://u:pw@host/db?passfile=/x failed: see note")
    assert out == "postgresql://u:***@host/db?passfile=***", out
    assert redact("sqlite:///x?password=hunter 2xyz") == "sqlite:///x?password=***"
