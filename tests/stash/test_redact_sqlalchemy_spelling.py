"""Protects: ``redact`` hides a password in the spelling SQLAlchemy renders.

redact must hide a password in the very spelling SQLAlchemy renders.

``URL.render_as_string(hide_password=False)`` (how a program, or our own tests, turns a
URL object into the text given to ``Stash.open`` / the CLIs) keeps a space in a
password raw but percent-encodes ``@ / : # ? %`` and non-ASCII characters.
``Stash.open`` accepts that text (it is SQLAlchemy's own grammar) and connects with the
password; ``redact`` must then hide it.  (Through a real server, ``stash collections
URL`` prints that URL in its table title: see
tests/stash/test_pg_password_hidden.py.)
"""

from __future__ import annotations

import pytest
from sqlalchemy.engine import URL

from stash.url import parse_url, redact

pytestmark = pytest.mark.adversarial

PASSWORDS = ["Zq9 x@y", "Zq9 x/y", "Zq9 x:y", "Zq9 \u00e4", "Zq9 x%y", "Zq9 x#y", "Zq9 x?y"]


def _rendered(pw: str) -> str:
    return URL.create(
        "postgresql+psycopg", username="app", password=pw, host="127.0.0.1", port=1, database="d"
    ).render_as_string(hide_password=False)


@pytest.mark.parametrize("pw", PASSWORDS)
def test_redact_hides_sqlalchemy_rendered_password(pw: str) -> None:
    text = _rendered(pw)
    assert parse_url(text).password == pw  # the stash would connect with it
    out = redact(text)
    assert "Zq9" not in out, out
