"""The ``stash`` command line: migrate, list collections, peek, iter, consolidate.

Output is a readable table (rich) or JSON with ``--json``.  Invariants kept here: URLs
are shown with every credential hidden (:func:`stash.url.redact`); errors are printed as
one line and exit with code 1; stored text (keys, values, collection names) reaches the
terminal inert: control characters are shown escaped as ``repr`` shows them and rich
markup in it is never interpreted (:func:`printable`, :func:`print_table`),
while ``--json`` prints the exact values.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from stash.base import Stash
from stash.errors import StashError
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
    title are made :func:`printable`, other cells are shown as JSON (``json.dumps``
    escapes control characters and non-ASCII itself)."""
    table = Table(title=Text(printable(title)))
    for c in columns:
        table.add_column(Text(printable(c)))
    for r in rows:
        table.add_row(*[Text(printable(v) if isinstance(v, str) else _cell(v)) for v in r])
    console.print(table)


def _fail(e: Exception) -> None:
    click.echo(printable(redact(str(e)), backslashes=False), err=True)
    sys.exit(1)


def _open(url: str, readonly: bool = True) -> Stash:
    return Stash.open(url, mode="readonly" if readonly else "writable", fenced=False)


def _show(rows: list[dict[str, Any]], columns: list[str], as_json: bool, title: str) -> None:
    if as_json:
        click.echo(json.dumps(rows, sort_keys=True, default=str))
        return
    print_table(title, columns, [[r[c] for c in columns] for r in rows])


def _cell(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)


def _guard(fn: Callable[[], None]) -> None:
    try:
        fn()
    except StashError as e:
        _fail(e)


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Log at INFO level.")
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve Prometheus /metrics on this port while the command runs.",
)
def main(verbose: bool, metrics_port: int | None) -> None:
    """Inspect and maintain a stash (memory://, sqlite:///path, postgresql+psycopg://...)."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING)
    if metrics_port is not None:
        from prometheus_client import start_http_server

        try:
            start_http_server(metrics_port)  # stash_* families (stash.metrics)
        except OSError as e:  # the port is taken: one error line, not a traceback
            click.echo(
                f"error: cannot serve /metrics on 0.0.0.0:{metrics_port}: {e.strerror}", err=True
            )
            sys.exit(1)


@main.command()
@click.argument("url")
@click.option("--revision", default="head", show_default=True)
def migrate(url: str, revision: str) -> None:
    """Bring the database at URL to the alembic head (or REVISION)."""

    def run() -> None:
        import sqlalchemy as sa

        from stash.migrate import upgrade

        u = parse_url(url)
        if u.get_backend_name() == "postgresql":
            u = u.set(drivername="postgresql+psycopg")
        engine = sa.create_engine(u)
        try:
            upgrade(engine, revision)
        except Exception as e:  # noqa: BLE001 - report any driver error as one line
            raise StashError(
                redact(f"migrate {redact(u)}: {type(e).__name__}: {first_line(e)}", url=u)
            ) from None
        finally:
            engine.dispose()
        click.echo(printable(f"{redact(u)} is at {revision}", backslashes=False))

    _guard(run)


@main.command("collections")
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def collections_cmd(url: str, as_json: bool) -> None:
    """List the collections with their since, upper and codecs."""

    def run() -> None:
        with _open(url) as s:
            rows = [
                {
                    "name": name,
                    "id": c.id,
                    "since": str(s.since(c)),
                    "upper": str(s.upper(c)),
                    "key_codec": c.key_codec.name,
                    "value_codec": c.value_codec.name,
                }
                for name, c in s.collections().items()
            ]
        _show(
            rows,
            ["name", "id", "since", "upper", "key_codec", "value_codec"],
            as_json,
            f"collections of {redact(url)}",
        )

    _guard(run)


def _coll(s: Stash, name: str) -> Any:
    found = s.collections().get(name)
    if found is None:
        raise StashError(f"collection {name!r} does not exist")
    return found


@main.command()
@click.argument("url")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def peek(url: str, name: str, as_json: bool) -> None:
    """Show the sealed contents of collection NAME as (key, value, diff)."""

    def run() -> None:
        with _open(url) as s:
            c = _coll(s, name)
            rows = [{"key": k, "value": v, "diff": d} for k, v, d in s.peek(c)]
        _show(rows, ["key", "value", "diff"], as_json, f"peek {name}")

    _guard(run)


@main.command("iter")
@click.argument("url")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def iter_cmd(url: str, name: str, as_json: bool) -> None:
    """Show every entry of collection NAME as (key, value, time, diff)."""

    def run() -> None:
        with _open(url) as s:
            c = _coll(s, name)
            rows = [{"key": k, "value": v, "time": t, "diff": d} for (k, v), t, d in s.iter(c)]
        _show(rows, ["key", "value", "time", "diff"], as_json, f"iter {name}")

    _guard(run)


@main.command()
@click.argument("url")
@click.argument("name")
def consolidate(url: str, name: str) -> None:
    """Physically consolidate collection NAME up to its since."""

    def run() -> None:
        with _open(url, readonly=False) as s:
            s.consolidate(_coll(s, name))
        click.echo(f"consolidated {name}")

    _guard(run)


if __name__ == "__main__":  # pragma: no cover
    main()
