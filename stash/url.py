"""Opening a stash from a URL: scheme dispatch, URL validation, and the one function that
hides credentials wherever a URL (or text that may carry one) is shown.

Invariants kept here: a malformed or unknown URL fails with a :class:`StashError` naming
the rule; no message, log line or repr of the stash or of persist shows a credential:
every one of them passes URLs (and error texts that may quote them) through
:func:`redact` (issue 19; :func:`safe_url` is the same function under its older name).
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

import sqlalchemy as sa
from sqlalchemy.engine import URL

from stash.errors import StashError

if TYPE_CHECKING:
    from stash.base import Mode, Stash

__all__ = ["open_url", "parse_url", "redact", "safe_url"]

#: What :func:`redact` puts in place of a hidden credential.
HIDDEN = "***"

# Schemes whose user name is an account name worth showing (the password is hidden);
# under any other scheme (s3, gs, hdfs, ...) the whole user info is a credential (an
# access key id and its secret) and is hidden, and so is every query value.
_DATABASE_SCHEMES = frozenset({"postgresql", "postgres", "sqlite", "mysql"})
# Query parameters (and libpq ``key=value`` options) whose value is a secret.
_SECRET_NAME = r"[\w.-]*(?:pass(?:word|wd|file)?|secret|token|credential|signature)[\w.-]*"
_SECRET_NAME_RE = re.compile(rf"(?i){_SECRET_NAME}")
# ``name=value`` of such a parameter anywhere in text (query strings, conninfo strings,
# Python reprs of keyword arguments, where the value may be quoted).
_SECRET_PARAM_RE = re.compile(rf"(?i)\b({_SECRET_NAME})=(['\"]?)([^&\s'\",)]+)\2")
# ``NAME: value`` as environment dumps and configuration errors print it (names that
# plainly hold a secret only, so that "tests passed: 5" stays readable).
_SECRET_COLON_RE = re.compile(
    r"(?i)\b([\w.-]*(?:password|passwd|secret|token|credential)[\w.-]*): ?(['\"]?)([^\s'\",)]+)\2"
)
# A URL inside text (a driver's or a library's message quoting it).
_URL_IN_TEXT_RE = re.compile(r"[A-Za-z][\w+.-]*://[^\s'\"<>]+")
# ``user:secret@`` anywhere in text, even where nothing parses as a URL: the secret runs
# to the last ``@`` of the word (an unescaped ``@`` in a password must not leave a tail).
_USERINFO_RE = re.compile(r"(?<![\w.+-])([^\s:/@'\"?#]*):(?!/)([^\s'\"]*)@")


def _redact_one_url(text: str) -> str | None:
    """``text`` rebuilt with its credentials hidden if it is one URL, else ``None``."""
    if "://" not in text or any(c.isspace() for c in text):
        return None
    try:
        parts = urlsplit(text)
    except ValueError:
        return None
    if not parts.scheme:
        return None
    database = parts.scheme.split("+", 1)[0].lower() in _DATABASE_SCHEMES
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, colon, _password = userinfo.partition(":")
        if not database:
            netloc = f"{HIDDEN}@{host}"
        elif colon:
            netloc = f"{user}:{HIDDEN}@{host}"
    items = []
    for item in parts.query.split("&") if parts.query else []:
        name, eq, val = item.partition("=")
        secret = (
            not database
            or _SECRET_NAME_RE.fullmatch(unquote(name)) is not None
            or _SECRET_PARAM_RE.search(unquote(val)) is not None  # options=-c password=...
        )
        items.append(f"{name}={HIDDEN}" if secret and (eq or not database) else item)
    query = "&".join(items)
    out = f"{parts.scheme}://{netloc}{parts.path}"
    if query or text.endswith("?"):
        out += "?" + query
    return out + (f"#{HIDDEN}" if parts.fragment else "")


def redact(value: object, *, url: object = None) -> str:
    """``value`` as text that is safe to show: every credential in it replaced by ``***``.

    This is the one redaction function of the stash and of persist (persist imports it):
    every repr, log line, CLI output and error message that shows a URL, or text that may
    quote one (a driver's error), passes it through here.

    * A URL (``str``, SQLAlchemy ``URL`` or path): the password of its user info (of a
      database URL: ``postgresql+psycopg://user:***@host/db``; of any other scheme the
      whole user info, where access key ids sit: ``s3://***@bucket/p``); the values of
      secret query parameters (``password``, ``sslpassword``, ``passfile`` and any name
      containing ``pass``, ``secret``, ``token``, ``credential`` or ``signature``) of a
      database URL, and every query value of any other scheme (S3 keys and tokens); a
      fragment.
    * Any text, parsed or not (``postgresql+psycopg:/user:secret@host`` lacks ``//``, a
      driver's message quotes a URL): anything looking like ``user:secret@`` loses its
      secret, and ``password=...``-like ``name=value`` pairs their value.
    * ``url``: if given, every secret ``url`` carries (password, user info of a non-database
      URL, query values) is also removed from ``value`` wherever it appears, even
      percent-decoded or alone (a library's error that quotes only the value).

    Args:
        value: the URL or text; other objects are shown as ``<TypeName>``.
        url: the URL whose secrets ``value`` may contain (optional).

    Returns:
        The redacted text (``value`` unchanged if it carries nothing secret).
    """
    if isinstance(value, URL):
        text = value.render_as_string(hide_password=False)
    elif isinstance(value, str):
        text = value
    elif isinstance(value, os.PathLike):
        text = os.fspath(value)
        text = text if isinstance(text, str) else repr(text)
    else:
        return f"<{type(value).__name__}>"
    if url is not None:
        for secret in _secrets_of(url):
            text = text.replace(secret, HIDDEN)
    # ``user:secret@`` first, before any URL parsing: a password holding a character
    # that ends a URL's authority (``#``, ``?``) would otherwise split the URL there and
    # leave the password outside the user info that parsing hides.
    text = _USERINFO_RE.sub(lambda m: f"{m.group(1)}:{HIDDEN}@", text)
    rebuilt = _redact_one_url(text)
    if rebuilt is not None:
        text = rebuilt
    else:  # every URL the text quotes
        text = _URL_IN_TEXT_RE.sub(lambda m: _redact_one_url(m.group(0)) or m.group(0), text)
    text = _USERINFO_RE.sub(lambda m: f"{m.group(1)}:{HIDDEN}@", text)
    text = _SECRET_PARAM_RE.sub(lambda m: f"{m.group(1)}={m.group(2)}{HIDDEN}{m.group(2)}", text)
    return _SECRET_COLON_RE.sub(lambda m: f"{m.group(1)}: {m.group(2)}{HIDDEN}{m.group(2)}", text)


def _secrets_of(url: object) -> list[str]:
    """The substrings of ``url`` that are secrets (as written and percent-decoded),
    longest first so that a secret containing another is replaced whole."""
    if isinstance(url, URL):
        url = url.render_as_string(hide_password=False)
    if not isinstance(url, str):
        return []
    out: list[str] = []
    try:
        parts = urlsplit(url)
    except ValueError:
        parts = None
    database = parts is not None and parts.scheme.split("+", 1)[0].lower() in _DATABASE_SCHEMES
    if parts is not None and "@" in parts.netloc:
        userinfo = parts.netloc.rpartition("@")[0]
        user, _, password = userinfo.partition(":")
        if password:
            out += [password, unquote(password)]
        if not database and len(user) >= 4:  # an access key id; short names stay readable
            out += [userinfo, user, unquote(user)]
    if parts is not None:
        for k, v in parse_qsl(parts.query, keep_blank_values=True):
            if v and len(v) >= 4 and (not database or _SECRET_NAME_RE.fullmatch(k)):
                out += [v, unquote(v)]
    for m in _USERINFO_RE.finditer(url):
        if m.group(2):
            out += [m.group(2), unquote(m.group(2))]
    for m in _SECRET_PARAM_RE.finditer(url):
        out += [m.group(3), unquote(m.group(3))]
    return sorted({s for s in out if s}, key=len, reverse=True)


def _escape_ats(url: str) -> str:
    """``url`` with every ``@`` that is not the user info's end percent-encoded.

    RFC 3986 ends the user info at the authority's *last* ``@`` and allows ``@`` in a
    query; SQLAlchemy's URL grammar takes the first ``@`` after a ``:``, so an unescaped
    ``@`` in a password (``user:pa@ss@host``, ``?password=pa@ss``) would turn the
    password's tail into the host name, which a connection error then shows."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    userinfo, at, host = parts.netloc.rpartition("@")
    if "@" not in userinfo and "@" not in parts.query:
        return url
    netloc = f"{userinfo.replace('@', '%40')}{at}{host}"
    return urlunsplit(
        (parts.scheme, netloc, parts.path, parts.query.replace("@", "%40"), parts.fragment)
    )


def parse_url(url: str) -> URL:
    """Parse a stash URL with SQLAlchemy's URL grammar (after percent-encoding any
    ``@`` that RFC 3986 does not read as the end of the user info).

    Raises:
        StashError: not a str, or not a URL of the form ``scheme://...``.
    """
    if not isinstance(url, str) or "://" not in url:
        raise StashError(
            f"malformed stash URL {redact(url)!r}: expected memory://, "
            "sqlite:///path or postgresql+psycopg://user@host/db"
        )
    try:
        return sa.engine.make_url(_escape_ats(url))
    except Exception:
        raise StashError(f"malformed stash URL {redact(url)!r}") from None


def open_url(url: str, *, mode: Mode, fenced: bool, **options: Any) -> Stash:
    """Open the stash behind ``url`` (see :meth:`stash.base.Stash.open`)."""
    u = parse_url(url)
    backend = u.get_backend_name()
    if backend == "memory":
        from stash.memory import MemoryStash

        name = (u.host or "") + (("/" + u.database) if u.database else "")
        return MemoryStash(name, mode=mode, fenced=fenced)
    if backend == "sqlite":
        from stash.sql import SqlStash

        if not u.database or u.database == ":memory:":
            raise StashError(
                "sqlite stash URL needs a file path (sqlite:///path/to/stash.db); "
                "use memory:// for an in-memory stash"
            )
        return SqlStash(u, mode=mode, fenced=fenced, **options)
    if backend == "postgresql":
        from stash.sql import SqlStash

        if u.get_driver_name() not in ("psycopg", "psycopg2", "") and u.drivername != "postgresql":
            raise StashError(
                f"unsupported postgres driver in {redact(u)!r}; use postgresql+psycopg"
            )
        return SqlStash(u.set(drivername="postgresql+psycopg"), mode=mode, fenced=fenced, **options)
    raise StashError(
        f"unknown stash URL scheme {u.drivername!r} in {redact(u)!r}: expected memory, "
        "sqlite or postgresql+psycopg"
    )


#: The older name of :func:`redact` (kept for callers written before issue 19).
safe_url = redact
