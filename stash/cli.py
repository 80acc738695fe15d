"""The ``stash`` command line: migrate, list collections, peek, iter, consolidate,
backup, restore, export, import.

``stash [--stash URL] migrate [URL] | collections [URL] | peek [URL] NAME | iter [URL]
NAME | consolidate [URL] NAME | backup [URL] FILE | restore [URL] FILE | export [URL]
FILE | import [URL] FILE``: the URL is the argument, else ``--stash`` (before or after
the subcommand), else ``STASH_URL``.  Output is a readable table (rich) or, with
``--json``, one JSON object per line (the stored JSON of keys and values, never a Python
repr).  Invariants kept here: no command fences the leader (every handle is opened
``fenced=False``; the read commands readonly); only ``migrate``, ``restore`` and
``backup`` (its FILE) create a database (the others
open the stash readonly first, so a mistyped SQLite path is refused, not created); URLs
are shown with every credential hidden (:func:`stash.url.redact`); user errors are
printed as ``error: what is wrong — what to do`` (:func:`fail`, the style the
``persist`` CLI shares; never a traceback) and exit with code 1; stored text (keys, values, collection names) reaches the
terminal inert: control characters are shown escaped as ``repr`` shows them and rich
markup in it is never interpreted (:func:`printable`, :func:`print_table`),
while ``--json`` prints the exact values.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import difflib
import json
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import click
from click.core import ParameterSource
from rich import filesize
from rich.console import Console
from rich.table import Table
from rich.text import Text

from stash.base import Stash
from stash.codec import to_json
from stash.errors import MigrationRequired, StashError
from stash.sql import first_line
from stash.url import parse_url, redact

console = Console()


def printable(text: str, *, backslashes: bool = True) -> str:
    """``text`` with every character that is not printable (control characters such as
    ESC, CR, BEL; line and paragraph separators) written as ``repr`` writes it
    (``"\\x1b"``, ``"\\n"``), and, unless ``backslashes`` is false, every backslash
    doubled as ``repr`` doubles it (so two different strings never look the same).
    Showing the result on a terminal can neither move the cursor, clear the screen nor
    set the window title."""
    if text.isprintable() and not (backslashes and "\\" in text):
        return text
    return "".join(
        "\\\\" if c == "\\" and backslashes else (c if c.isprintable() else repr(c)[1:-1])
        for c in text
    )


def print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    """Print a rich table on stdout with inert text: the title and every cell are
    :class:`rich.text.Text` (so never parsed as rich markup); ``str`` cells and the
    title are made :func:`printable`; numbers, dates and times are shown as they are
    (unquoted; a column holding only numbers is right-aligned); byte counts (a column
    named ``bytes``, ``*_bytes`` or ``bytes_*``, or a ``field``/``value`` row so named)
    are humanized (``1.5 MB``; ``--json`` keeps them exact); other cells are shown as
    JSON (``json.dumps`` escapes control characters and non-ASCII itself)."""
    table = Table(title=Text(printable(title)))
    fieldrows = columns[:2] == ["field", "value"]
    for i, c in enumerate(columns):
        values = [r[i] for r in rows if i < len(r) and r[i] is not None]
        numeric = bool(values) and all(_is_number(v) for v in values)
        table.add_column(Text(printable(c)), justify="right" if numeric else "left")
    for r in rows:
        cells = []
        for i, v in enumerate(r):
            name = str(r[0]) if fieldrows and i == 1 else (columns[i] if i < len(columns) else "")
            if _is_bytes_name(name) and _is_number(v) and not isinstance(v, float):
                cells.append(Text(filesize.decimal(int(v))))
            else:
                cells.append(Text(printable(v) if isinstance(v, str) else _cell(v)))
        table.add_row(*cells)
    console.print(table)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, decimal.Decimal)) and not isinstance(v, bool)


def _is_bytes_name(name: str) -> bool:
    n = name.lower()
    return n == "bytes" or n.endswith("_bytes") or n.startswith("bytes_")


class CliError(Exception):
    """A user error a CLI reports as ``error: what — todo`` (then ``detail``'s lines),
    with exit code 1 (:func:`fail`)."""

    def __init__(self, what: str, todo: str | None = None, detail: str | None = None) -> None:
        super().__init__(what)
        self.what, self.todo, self.detail = what, todo, detail


def fail(what: str, todo: str | None = None, detail: str | None = None) -> NoReturn:
    """Print ``error: what — todo`` as one line on stderr (credentials redacted,
    control characters escaped), then ``detail``'s lines (each escaped alike), and exit
    with code 1.  The one error style of the ``stash`` and ``persist`` CLIs."""
    line = f"error: {what}" + (f" — {todo}" if todo else "")
    click.echo(printable(redact(line), backslashes=False), err=True)
    for extra in (detail or "").splitlines():
        click.echo(printable(redact(extra), backslashes=False), err=True)
    sys.exit(1)


class CliGroup(click.Group):
    """A click group whose own errors (a missing argument, an unknown option, a bad
    value) are printed in the style of :func:`fail`: ``error: <click's message> — see
    'COMMAND --help'``, exit code 2 as click gives them (1 for an abort), without
    click's usage block."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except click.exceptions.NoArgsIsHelpError as e:  # bare command: its help
            click.echo(e.format_message(), err=True)
            sys.exit(e.exit_code)
        except click.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else self.name
            line = f"error: {e.format_message()} — see '{where} --help'"
            click.echo(printable(redact(line), backslashes=False), err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            line = f"error: {e.format_message()}"
            click.echo(printable(redact(line), backslashes=False), err=True)
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("error: aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


F = TypeVar("F", bound=Callable[..., Any])


def _remember(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """Record an option's value and where it came from (command line or environment)
    for :func:`shared_value`; ``ctx.meta`` is shared by the group and its subcommand."""
    if value is not None:
        assert param.name is not None
        seen = ctx.meta.setdefault("cli.shared", {}).setdefault(param.name, [])
        seen.append((value, ctx.get_parameter_source(param.name)))


def shared_option(
    flag: str, dest: str, envvar: str, help: str, metavar: str = "URL"
) -> Callable[[F], F]:
    """An option accepted on a group and on each of its subcommands alike (decorate
    both), read from ``envvar`` when not given and shown with it in ``--help``.  It is
    never required by click, so ``--help`` works without it; read it with
    :func:`shared_value`."""
    return click.option(
        flag,
        dest,
        envvar=envvar,
        show_envvar=True,
        metavar=metavar,
        expose_value=False,
        callback=_remember,
        help=f"{help}; before or after the subcommand.",
    )


def shared_value(ctx: click.Context, dest: str, flag: str) -> str | None:
    """The value of a :func:`shared_option`: given on the command line (before or
    after the subcommand) it wins over the environment; ``None`` if neither has it.

    Raises:
        CliError: given before and after the subcommand with different values.
    """
    given: list[tuple[str, ParameterSource | None]] = ctx.meta.get("cli.shared", {}).get(dest, [])
    typed = {v for v, src in given if src is ParameterSource.COMMANDLINE}
    if len(typed) > 1:
        raise CliError(
            f"{flag} is given twice with different values",
            "give it once, before or after the subcommand",
        )
    if typed:
        return typed.pop()
    return given[-1][0] if given else None


def jsonable(v: Any) -> Any:
    """``v`` as the JSON the stash stores for it: records as objects of their fields,
    tuples as arrays, bytes as standard base64 (never a Python repr).

    Raises:
        TypeError: ``v`` holds something that is not JSON.
    """
    if isinstance(v, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(v)).decode("ascii")
    out = to_json(v)
    json.dumps(out)  # raises TypeError for anything else
    return out


def _show(rows: list[dict[str, Any]], columns: list[str], as_json: bool, title: str) -> None:
    """A table, or with ``as_json`` one JSON object per line (strict JSON: the stored
    values, never Python reprs)."""
    if as_json:
        for r in rows:
            line = json.dumps({k: jsonable(v) for k, v in r.items()}, sort_keys=True)
            click.echo(line)
        return
    print_table(title, columns, [[r[c] for c in columns] for r in rows])


def _cell(v: Any) -> str:
    """A cell: text as it is, numbers, dates and times unquoted, others as JSON."""
    if isinstance(v, str):
        return v
    if _is_number(v):
        return str(v)
    if isinstance(v, (datetime.datetime, datetime.date, datetime.time)):
        return v.isoformat()
    try:
        return json.dumps(jsonable(v), sort_keys=True)
    except TypeError:
        return repr(v)


STASH_ENV = "STASH_URL"
"""The environment variable of ``--stash`` (``migrations/env.py`` reads it too)."""


def stash_option(f: F) -> F:
    """``--stash URL`` (or ``STASH_URL``) on the group and on every subcommand."""
    return shared_option(
        "--stash",
        "stash_url",
        STASH_ENV,
        "Stash URL (memory://, sqlite:///path, postgresql+psycopg://...) when the URL "
        "argument is left out",
    )(f)


def _url(url: str | None) -> str:
    """The stash URL: the ``URL`` argument, else ``--stash`` (before or after the
    subcommand), else ``STASH_URL``.

    Raises:
        CliError: none of them gives one; ``--stash`` twice with different values.
    """
    if url is not None:
        return url
    found = shared_value(click.get_current_context(), "stash_url", "--stash")
    if found is None:
        raise CliError(
            "no stash URL given",
            f"pass it as the URL argument or with --stash URL, or set {STASH_ENV}",
        )
    return found


def _url_and_name(args: tuple[str, ...]) -> tuple[str, str]:
    """``(URL, NAME)`` of the arguments ``[URL] NAME`` (the URL as :func:`_url` when
    only NAME is given).

    Raises:
        CliError: more than two arguments, or no URL anywhere.
    """
    if len(args) > 2:
        raise CliError(
            f"expected [URL] NAME, got {len(args)} arguments",
            "quote a collection name that has spaces",
        )
    return (_url(None), args[0]) if len(args) == 1 else (_url(args[0]), args[1])


def _open(url: str, readonly: bool = True) -> Stash:
    """The stash at ``url``; nothing is created (it is opened readonly first, which
    refuses a missing SQLite file, before any writable open).

    Raises:
        CliError: the stash cannot be opened (asking whether the URL is right).
        MigrationRequired: its schema is behind (the message says what to run).
    """
    try:
        s = Stash.open(url, mode="readonly", fenced=False)
        if not readonly:  # it exists: reopen it for writing
            s.close()
            s = Stash.open(url, mode="writable", fenced=False)
    except MigrationRequired:
        raise
    except StashError as e:
        raise CliError(e.message, "is the stash URL right?") from None
    return s


def _guard(fn: Callable[[], None]) -> None:
    """Run ``fn``; a user error ends the command with :func:`fail`."""
    try:
        fn()
    except CliError as e:
        fail(e.what, e.todo, e.detail)
    except StashError as e:
        fail(e.message)


@click.group(cls=CliGroup)
@stash_option
@click.option("-v", "--verbose", is_flag=True, help="Log at INFO level.")
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve Prometheus /metrics on this port while the command runs.",
)
def main(verbose: bool, metrics_port: int | None) -> None:
    """Inspect and maintain a stash (memory://, sqlite:///path, postgresql+psycopg://...).

    Every command takes the stash URL as its URL argument or from --stash (before or
    after the subcommand) or STASH_URL.  Only migrate creates a database."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING)
    if metrics_port is not None:
        from prometheus_client import start_http_server

        try:
            start_http_server(metrics_port)  # stash_* families (stash.metrics)
        except OSError as e:  # the port is taken: one error line, not a traceback
            fail(
                f"cannot serve /metrics on 0.0.0.0:{metrics_port}: {e.strerror}",
                "choose another --metrics-port",
            )


@main.command()
@stash_option
@click.argument("url", required=False)
@click.option("--revision", default="head", show_default=True)
def migrate(url: str | None, revision: str) -> None:
    """Bring the database at URL to the alembic head (or REVISION), creating it if
    missing."""

    def run() -> None:
        from stash.migrate import migration_engine, upgrade

        u = parse_url(_url(url))
        if u.get_backend_name() == "postgresql":
            u = u.set(drivername="postgresql+psycopg")
        engine = migration_engine(u)
        try:
            upgrade(engine, revision)
        except Exception as e:  # noqa: BLE001 - report any driver error as one line
            raise CliError(
                redact(f"migrate {redact(u)}: {type(e).__name__}: {first_line(e)}", url=u),
                "is the URL right, and the server up?",
            ) from None
        finally:
            engine.dispose()
        click.echo(printable(f"{redact(u)} is at {revision}", backslashes=False))

    _guard(run)


@main.command("collections")
@stash_option
@click.argument("url", required=False)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option(
    "--all",
    "show_all",
    is_flag=True,
    help="Also the collections persist and the stash keep for themselves (persist.*, stash.*).",
)
def collections_cmd(url: str | None, as_json: bool, show_all: bool) -> None:
    """List the collections with their since, upper and codecs (the collections of
    persist's and the stash's own bookkeeping only with --all)."""

    def run() -> None:
        where = _url(url)
        with _open(where) as s:
            rows = [
                {
                    "name": name,
                    "id": c.id,
                    "since": str(s.since(c)),
                    "upper": str(s.upper(c)),
                    "key_codec": str(c.codec_names[0]),
                    "value_codec": str(c.codec_names[1]),
                }
                for name, c in s.collections().items()
                if show_all or not name.startswith(INTERNAL_PREFIXES)
            ]
        _show(
            rows,
            ["name", "id", "since", "upper", "key_codec", "value_codec"],
            as_json,
            f"collections of {redact(where)}",
        )

    _guard(run)


def _coll(s: Stash, name: str) -> Any:
    """The collection ``name``.

    Raises:
        CliError: no such collection, offering the close names (``difflib``).
    """
    found = s.collections()
    if name not in found:
        close = difflib.get_close_matches(name, list(found), n=3)
        raise CliError(
            f"collection {name!r} does not exist",
            f"did you mean {' or '.join(map(repr, close))}?"
            if close
            else "`stash collections` lists them",
        )
    return found[name]


#: Name prefixes of the collections persist (``persist.*``: consensus, registry) and the
#: stash (``stash.*``: retention) keep for themselves; ``collections`` lists them only
#: with ``--all``.
INTERNAL_PREFIXES = ("persist.", "stash.")

URL_NAME = click.argument("url_name", nargs=-1, required=True, metavar="[URL] NAME")
"""The arguments ``[URL] NAME`` of the commands on one collection (:func:`_url_and_name`)."""


@main.command()
@stash_option
@URL_NAME
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def peek(url_name: tuple[str, ...], as_json: bool) -> None:
    """Show the sealed contents of collection NAME as (key, value, diff)."""

    def run() -> None:
        url, name = _url_and_name(url_name)
        with _open(url) as s:
            c = _coll(s, name)
            rows = [{"key": k, "value": v, "diff": d} for k, v, d in s.peek(c)]
        _show(rows, ["key", "value", "diff"], as_json, f"peek {name}")

    _guard(run)


@main.command("iter")
@stash_option
@URL_NAME
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def iter_cmd(url_name: tuple[str, ...], as_json: bool) -> None:
    """Show every entry of collection NAME as (key, value, time, diff)."""

    def run() -> None:
        url, name = _url_and_name(url_name)
        with _open(url) as s:
            c = _coll(s, name)
            rows = [{"key": k, "value": v, "time": t, "diff": d} for (k, v), t, d in s.iter(c)]
        _show(rows, ["key", "value", "time", "diff"], as_json, f"iter {name}")

    _guard(run)


@main.command()
@stash_option
@URL_NAME
def consolidate(url_name: tuple[str, ...]) -> None:
    """Physically consolidate collection NAME up to its since."""

    def run() -> None:
        url, name = _url_and_name(url_name)
        with _open(url, readonly=False) as s:
            s.consolidate(_coll(s, name))
        click.echo(printable(f"consolidated {name}", backslashes=False))

    _guard(run)


URL_FILE = click.argument("url_file", nargs=-1, required=True, metavar="[URL] FILE")
"""The arguments ``[URL] FILE`` of backup, restore, export and import."""


@main.command()
@stash_option
@URL_FILE
def backup(url_file: tuple[str, ...]) -> None:
    """Write a consistent snapshot of the stash to FILE, a new SQLite stash file
    (SQLite's online backup API for a SQLite stash; one read transaction otherwise).
    Never fences the leader: writers go on while it runs."""

    def run() -> None:
        from stash import ops

        url, file = _url_and_name(url_file)
        _open(url).close()  # it exists (a mistyped URL is refused, not created)
        ops.backup(url, file)
        click.echo(printable(f"backed up {redact(url)} to {file}", backslashes=False))

    _guard(run)


@main.command()
@stash_option
@URL_FILE
@click.option(
    "--replace", is_flag=True, help="Replace a SQLite stash that holds collections or logs."
)
def restore(url_file: tuple[str, ...], replace: bool) -> None:
    """Bring the backup FILE into the stash at URL: a SQLite stash is replaced by it
    (with --replace if it holds collections or logs), any other must hold none of its
    collections and logs.  Does not fence the leader."""

    def run() -> None:
        from stash import ops

        url, file = _url_and_name(url_file)
        ops.restore(file, url, replace=replace)
        click.echo(printable(f"restored {file} into {redact(url)}", backslashes=False))

    _guard(run)


@main.command("export")
@stash_option
@URL_FILE
def export_cmd(url_file: tuple[str, ...]) -> None:
    """Write a consistent snapshot of the stash to FILE ("-": stdout) as JSON lines: a
    header object per collection, then one object per stored row and one per entry of
    each compare-and-set log (persist's shard versions)."""

    def run() -> None:
        from stash import ops

        url, file = _url_and_name(url_file)
        with _open(url) as s:
            if file == "-":
                ops.export(s, sys.stdout)
                return
            with open(file, "x", encoding="utf-8") as out:
                n = ops.export(s, out)
        click.echo(
            printable(f"exported {n} rows and log entries to {file}", backslashes=False),
            err=True,
        )

    _guard(run)


@main.command("import")
@stash_option
@URL_FILE
def import_cmd(url_file: tuple[str, ...]) -> None:
    """Create the collections and logs of a JSON-lines export FILE ("-": stdin) in the
    stash, in one transaction (it must hold none of them).  Does not fence the leader."""

    def run() -> None:
        from stash import ops

        url, file = _url_and_name(url_file)
        with _open(url, readonly=False) as s:
            if file == "-":
                n = ops.import_(s, sys.stdin)
            else:
                with open(file, encoding="utf-8") as f:
                    n = ops.import_(s, f)
        click.echo(printable(f"imported {n} rows and log entries", backslashes=False), err=True)

    _guard(run)


if __name__ == "__main__":  # pragma: no cover
    main()
