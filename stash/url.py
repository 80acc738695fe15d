"""Stash URLs: parsing (:func:`parse_url`), and the one function that hides credentials
wherever a URL (or text that may carry one) is shown (:func:`redact`).  Which backend
opens a URL is looked up by name in :data:`stash.base.BACKENDS`; this module imports
no other module of the stash but :mod:`stash.errors`.

Invariants kept here: a malformed URL fails with a :class:`StashError` naming the rule;
no message, log line or repr of the stash or of persist shows a credential:
every one of them passes URLs (and error texts that may quote them) through
:func:`redact` (:func:`safe_url` is the same function under its older name).
"""

from __future__ import annotations

import os
import re
from urllib.parse import parse_qsl, quote, quote_plus, unquote, urlsplit, urlunsplit

import sqlalchemy as sa
from sqlalchemy.engine import URL

from stash.errors import StashError

__all__ = ["parse_url", "redact", "safe_url"]

#: What :func:`redact` puts in place of a hidden credential.
HIDDEN = "***"

# Schemes whose user name is an account name worth showing (the password is hidden);
# under any other scheme (s3, gs, hdfs, ...) the whole user info is a credential (an
# access key id and its secret) and is hidden, and so is every query value.
_DATABASE_SCHEMES = frozenset({"postgresql", "postgres", "sqlite", "mysql"})
# Query parameters (and libpq ``key=value`` options) whose value is a secret.
_SECRET_NAME = r"[\w.-]*(?:pass(?:word|wd|file)?|secret|token|credential|signature)[\w.-]*"
_SECRET_NAME_RE = re.compile(rf"(?i){_SECRET_NAME}")
# A value as text quotes it: single- or double-quoted (whitespace allowed inside, a
# backslash escaping the next character, as libpq's conninfo does), or bare.
_QUOTED_OR_BARE = r"""(?:'((?:[^'\\]|\\.)*)'|"((?:[^"\\]|\\.)*)"|([^&\s'",)]+))"""
# ``name=value`` of such a parameter anywhere in text (query strings, conninfo strings,
# with or without spaces around ``=``, Python reprs of keyword arguments).
_SECRET_PARAM_RE = re.compile(rf"(?i)\b({_SECRET_NAME})(\s*=\s*){_QUOTED_OR_BARE}")
# ``NAME: value`` as environment dumps, configuration errors, dict reprs and JSON print
# it, the name perhaps quoted (names that plainly hold a secret only, so that "tests
# passed: 5" stays readable).
_SECRET_COLON_RE = re.compile(
    r"(?i)(['\"]?)\b([\w.-]*(?:password|passwd|secret|token|credential)[\w.-]*)\1"
    rf"(\s*:\s*){_QUOTED_OR_BARE}"
)
# A URL inside text (a driver's or a library's message quoting it).
_URL_IN_TEXT_RE = re.compile(r"[A-Za-z][\w+.-]*://[^\s'\"<>]+")
# ``user:secret@`` anywhere in text, even where nothing parses as a URL: the secret runs
# to the last ``@`` of the word (an unescaped ``@`` in a password must not leave a tail).
# A ``:`` followed by ``/`` is taken for a scheme's (``postgresql://``) ...
_USERINFO_RE = re.compile(r"(?<![\w.+-])([^\s:/@'\"?#]*):(?!/)([^\s'\"]*)@")
# ... except right after a URL's ``//``, where a secret may begin with ``/`` (SQLAlchemy
# reads ``user:/pw@host`` as the password ``/pw``, and ``urlsplit`` ends the authority
# before it).
_AUTHORITY_USERINFO_RE = re.compile(r"(?<=//)([^\s:/@'\"?#]*):([^\s'\"]*)@")
# Text that begins with a URL (``scheme://`` and something).
_LEADING_URL_RE = re.compile(r"[A-Za-z][\w+.-]*://\S")
# What a secret is rendered as inside a SQLAlchemy URL before it becomes :data:`HIDDEN`
# (the URL's renderer would percent-encode ``***`` itself).
_SENTINEL = "x0hidden0x"


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
    database = _is_database(parts.scheme)
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
        secret = _secret_query(database, unquote(name), (unquote(val),))
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
    * Text that begins with a URL is also parsed as :func:`parse_url` (and so
      ``Stash.open``) reads it, and the secrets it finds there are hidden whatever
      characters they hold (whitespace, quotes, brackets, a leading ``/``, ``?``); if
      no grammar reads it, everything from the user name's ``:`` to the text's last
      ``@`` is hidden.
    * Any text, parsed or not (``postgresql+psycopg:/user:secret@host`` lacks ``//``, a
      driver's message quotes a URL): anything looking like ``user:secret@`` loses its
      secret, ``password=...``-like ``name=value`` pairs their value (quoted or bare,
      spaces around ``=`` allowed, as libpq conninfo strings and Python reprs write
      them), and ``password: value`` their value (the name perhaps quoted: dict reprs,
      JSON).
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
        text = _render_redacted(value)
    elif isinstance(value, str):
        text = value
        if _LEADING_URL_RE.match(text):
            # The secrets as Stash.open would read them (SQLAlchemy's grammar accepts
            # whitespace, quotes and brackets in a password, where the text rules
            # below stop or urlsplit refuses the URL).
            parsed = _parse_quietly(text)
            if parsed is not None:
                text = _hide_parsed_secrets(text, parsed)
            else:  # no grammar reads it: hide up to its last "@" (over-hiding is safe)
                text = _hide_userinfo_to_last_at(text)
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
    text = _AUTHORITY_USERINFO_RE.sub(lambda m: f"{m.group(1)}:{HIDDEN}@", text)
    text = _USERINFO_RE.sub(lambda m: f"{m.group(1)}:{HIDDEN}@", text)
    rebuilt = _redact_one_url(text)
    if rebuilt is not None:
        text = rebuilt
    else:  # every URL the text quotes
        text = _URL_IN_TEXT_RE.sub(lambda m: _redact_one_url(m.group(0)) or m.group(0), text)
    text = _USERINFO_RE.sub(lambda m: f"{m.group(1)}:{HIDDEN}@", text)
    text = _SECRET_PARAM_RE.sub(lambda m: f"{m.group(1)}{m.group(2)}{_hidden_like(m)}", text)
    return _SECRET_COLON_RE.sub(
        lambda m: f"{m.group(1)}{m.group(2)}{m.group(1)}{m.group(3)}{_hidden_like(m)}", text
    )


def _hidden_like(m: re.Match[str]) -> str:
    """:data:`HIDDEN`, quoted as the value ``m`` matched (its last three groups are the
    single-quoted, double-quoted and bare forms of :data:`_QUOTED_OR_BARE`)."""
    n = m.re.groups
    if m.group(n - 2) is not None:
        return f"'{HIDDEN}'"
    if m.group(n - 1) is not None:
        return f'"{HIDDEN}"'
    return HIDDEN


def _matched_value(m: re.Match[str]) -> str:
    """The value ``m`` matched, without its quotes (see :func:`_hidden_like`)."""
    n = m.re.groups
    return next((v for v in (m.group(n - 2), m.group(n - 1), m.group(n)) if v is not None), "")


def _parse_quietly(text: str) -> URL | None:
    """``text`` parsed as :func:`parse_url` does, or ``None`` if it does not parse."""
    try:
        return _parse(text)
    except Exception:
        return None


def _parse(url: str) -> URL:
    """``url`` read by SQLAlchemy's URL grammar, after :func:`_escape_ats` unless the
    password holds a character that ends an RFC 3986 authority (``?``, ``/``, ``#``: the
    RFC reading of ``user:pa?ss@host`` is the host ``user`` with the port ``pa``, no
    port at all), in which case SQLAlchemy reads it as written; a URL the escaped form
    does not parse as is read by SQLAlchemy as written too (what SQLAlchemy accepts,
    the stash accepts).

    Raises:
        Exception: whatever SQLAlchemy's parser raises (its message may quote the URL).
    """
    if not _password_ends_authority(url):
        try:
            return sa.engine.make_url(_escape_ats(url))
        except Exception:
            pass
    return sa.engine.make_url(url)


def _password_ends_authority(url: str) -> bool:
    """Whether the RFC 3986 authority of ``url`` ends inside a password: it holds no
    ``@`` while the rest of the URL does, and what would be its port is not a number."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    if "@" in parts.netloc or "@" not in url.partition("://")[2]:
        return False
    _, colon, port = parts.netloc.rpartition(":")
    return bool(colon) and not port.isdigit() and "]" not in port


def _redact_unparsed(url: str) -> str:
    """A URL no grammar reads, shown safely: everything between the user name (the text
    up to the first ``:``, when it holds no ``/``) and the last ``@`` is hidden, and so
    is the whole user info if there is no such name; the query is hidden."""
    if "://" not in url:
        return HIDDEN
    scheme, _, rest = _hide_userinfo_to_last_at(url).partition("://")
    base, q, _ = rest.partition("?")
    return f"{scheme}://{base}" + (f"?{HIDDEN}" if q else "")


def _hide_userinfo_to_last_at(text: str) -> str:
    """``text`` (``scheme://...``) with everything between the user name (up to the
    first ``:``, if it holds no ``/`` nor whitespace) and the last ``@`` hidden (all of
    it without such a name): a password may hold any character, so no earlier ``@``,
    space or quote may end it."""
    scheme, _, rest = text.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not at:
        return text
    user, colon, _ = userinfo.partition(":")
    named = colon and user and "/" not in user and not any(c.isspace() for c in user)
    return f"{scheme}://{f'{user}:{HIDDEN}' if named else HIDDEN}@{host}"


def _is_database(drivername: str) -> bool:
    return drivername.split("+", 1)[0].lower() in _DATABASE_SCHEMES


def _secret_query(database: bool, name: str, values: tuple[str, ...]) -> bool:
    """Whether a query parameter's value is a secret (see :func:`redact`)."""
    return (
        not database
        or _SECRET_NAME_RE.fullmatch(name) is not None
        or any(_SECRET_PARAM_RE.search(v) is not None for v in values)  # options=-c password=
    )


def _spellings(value: str) -> list[str]:
    """``value`` as a URL may spell it: as is, percent-encoded, and as SQLAlchemy's
    ``render_as_string`` writes a user name or password (spaces and ``+`` kept raw,
    everything else that is not a letter, digit or ``_.-~`` encoded); longest first."""
    forms = {
        value,
        quote(value, safe=""),
        quote(value),
        quote_plus(value, safe=""),
        quote(value, safe=" +"),
    }
    return sorted(forms, key=len, reverse=True)


def _hide_parsed_secrets(text: str, u: URL) -> str:
    """``text`` (which begins with the URL ``u`` was parsed from) with ``u``'s secrets
    hidden where the URL spells them: the password between ``:`` and ``@`` (of a
    non-database URL, the whole user info) and the values of secret query parameters
    after their ``=``."""
    database = _is_database(u.drivername)
    start = text.find("://") + 3
    head, tail = text[:start], text[start:]
    if u.password:
        for pw in _spellings(str(u.password)):
            # The user name as SQLAlchemy's grammar reads it: up to the first ``:``.
            m = re.match(rf"(?s)([^:/]*):{re.escape(pw)}@", tail)
            if m is not None:
                shown = f"{m.group(1)}:{HIDDEN}@" if database else f"{HIDDEN}@"
                tail = shown + tail[m.end() :]
                break
    elif not database and u.username:
        for name in _spellings(u.username):
            if tail.startswith(f"{name}@"):
                tail = f"{HIDDEN}@{tail[len(name) + 1 :]}"
                break
    for k, v in u.query.items():
        values = v if isinstance(v, tuple) else (v,)
        if _secret_query(database, k, values):
            named = _SECRET_NAME_RE.fullmatch(k) is not None
            for x in values:
                if not named:
                    # Only a secret's own name makes a value run to the end of the text
                    # (the grammar reads everything after the last '?' as the query): a
                    # non-database URL's values are hidden, the message after them kept.
                    x = x.split(None, 1)[0] if x.strip() else x
                for spelled in _spellings(x) if x else []:
                    tail = tail.replace(f"={spelled}", f"={HIDDEN}")
    return head + tail


def _render_redacted(u: URL) -> str:
    """A SQLAlchemy URL rendered with its secrets hidden, taken from its parsed fields
    (whatever characters they hold): the password (of a non-database URL, the whole user
    info) and the values of secret query parameters."""
    database = _is_database(u.drivername)
    query: dict[str, str | tuple[str, ...]] = {}
    for k, v in u.query.items():
        values = v if isinstance(v, tuple) else (v,)
        query[k] = _SENTINEL if _secret_query(database, k, values) else v
    username, password = u.username, u.password
    if not database and username:
        username, password = _SENTINEL, None
    elif password is not None:
        password = _SENTINEL
    hidden = URL.create(
        u.drivername,
        username=username,
        password=password,
        host=u.host,
        port=u.port,
        database=u.database,
        query=query,
    )
    return hidden.render_as_string(hide_password=False).replace(_SENTINEL, HIDDEN)


def _secrets_of(url: object) -> list[str]:
    """The substrings of ``url`` that are secrets (as written and percent-decoded),
    longest first so that a secret containing another is replaced whole."""
    out: list[str] = []
    parsed = url if isinstance(url, URL) else _parse_quietly(url) if isinstance(url, str) else None
    if parsed is not None:  # the fields as the stash would connect with them
        database = _is_database(parsed.drivername)
        if parsed.password:
            out += [str(parsed.password), quote(str(parsed.password), safe="")]
        if not database and parsed.username and len(parsed.username) >= 4:
            out += [parsed.username, quote(parsed.username, safe="")]
        for k, v in parsed.query.items():
            values = v if isinstance(v, tuple) else (v,)
            if _secret_query(database, k, values):
                out += [x for x in values if len(x) >= 4]
    if isinstance(url, URL):
        url = url.render_as_string(hide_password=False)
    if not isinstance(url, str):
        return []
    if parsed is None and "@" in url.partition("://")[2]:
        # No grammar reads it: everything between the user name and the last ``@``.
        userinfo = url.partition("://")[2].rpartition("@")[0]
        user, colon, rest = userinfo.partition(":")
        out += [rest, unquote(rest)] if colon and "/" not in user else [userinfo]
    try:
        parts = urlsplit(url)
    except ValueError:
        parts = None
    database = parts is not None and _is_database(parts.scheme)
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
    for rx in (_AUTHORITY_USERINFO_RE, _USERINFO_RE):
        for m in rx.finditer(url):
            if m.group(2):
                out += [m.group(2), unquote(m.group(2))]
    for m in _SECRET_PARAM_RE.finditer(url):
        v = _matched_value(m)
        out += [v, unquote(v)]
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
    ``@`` that RFC 3986 does not read as the end of the user info; a password holding
    ``?``, ``/`` or ``#`` is read as SQLAlchemy reads it, see :func:`_parse`).

    Raises:
        StashError: not a str, or not a URL of the form ``scheme://...``.
    """
    if not isinstance(url, str) or "://" not in url:
        raise StashError(
            f"malformed stash URL {redact(url)!r}: expected memory://, "
            "sqlite:///path or postgresql+psycopg://user@host/db"
        )
    try:
        u = _parse(url)
    except Exception:
        u = None
    if u is None:
        # Raised outside the handler: the parser's own error quotes parts of the URL (a
        # password's included) and must not ride along as the context.
        raise StashError(f"malformed stash URL {_redact_unparsed(url)!r}")
    if u.get_backend_name() == "sqlite":
        _check_sqlite_query(url, u)
    return u


#: The query options SQLAlchemy's pysqlite dialect passes to ``sqlite3.connect``
#: (``sqlalchemy/dialects/sqlite/pysqlite.py``, ``create_connect_args``).
_SQLITE_DRIVER_OPTIONS = (
    "uri",
    "timeout",
    "isolation_level",
    "detect_types",
    "check_same_thread",
    "cached_statements",
)
#: ... and the stash's own (refused for SQLite by a message of their own:
#: ``stash.placement``).
_SQLITE_OPTIONS = frozenset([*_SQLITE_DRIVER_OPTIONS, "stash_schema", "stash_version_table"])


def _check_sqlite_query(text: str, u: URL) -> None:
    """Refuse a SQLite URL whose query (everything after the first ``?``, as SQLAlchemy
    reads it) holds an item that is not a known option: a raw ``?`` in the file's path
    (SQLAlchemy drops ``?b/s.db`` and ignores ``?x=1/s.db``, so another file, the path
    cut at the ``?``, would be opened); or a driver option whose value the driver cannot
    read (``timeout=abc``, or ``?timeout=5/s.db``: a path's ``?`` again), as SQLAlchemy's
    pysqlite dialect reads it (``create_connect_args``), before anything is created.
    With ``uri`` true (as SQLAlchemy reads it: ``true``, ``yes``, ``on``, ``1``, ...)
    the path is a SQLite URI and its other parameters are SQLite's (not checked).  The
    message shows an option's name, never its value."""
    if "?" not in text:
        return
    dialect = u.get_dialect()()
    for name in _SQLITE_DRIVER_OPTIONS:
        if name in u.query:
            try:
                dialect.create_connect_args(u.set(query={name: u.query[name]}))
            except (ValueError, TypeError):
                raise StashError(
                    f"sqlite stash URL {redact(text)!r}: option {name!r} has a value the "
                    "SQLite driver cannot read (given once; a number for timeout, "
                    "detect_types and cached_statements, true/false for uri and "
                    "check_same_thread); a '?' in the file's path must be "
                    "percent-encoded as %3F (urllib.parse.quote(path))"
                ) from None
    if sa.util.asbool(u.query.get("uri", False)):
        return
    for item in text.split("?", 1)[1].split("&"):
        name, eq, _ = item.partition("=")
        if not eq or name not in _SQLITE_OPTIONS:
            raise StashError(
                f"sqlite stash URL {redact(text)!r}: {name!r} after '?' is not an option "
                f"(name=value, one of {list(_SQLITE_DRIVER_OPTIONS)}); a '?' in the "
                "file's path must be percent-encoded as %3F (urllib.parse.quote(path))"
            )


#: The older name of :func:`redact` (kept for callers written before it was renamed).
safe_url = redact
