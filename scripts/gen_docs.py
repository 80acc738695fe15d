"""Regenerate the parts of ``docs/guide/`` that are built from the code.

A generated part sits between two HTML comments in a Markdown file::

    <!-- BEGIN generated:NAME -->
    ...
    <!-- END generated:NAME -->

and is rebuilt from the code it describes, so it cannot drift from it:

* ``cli-persist``, ``cli-stash``: the ``--help`` of each ``persist`` / ``stash`` command,
  rendered by click itself at a fixed width;
* ``options-persist-read``, ``options-persist-write``, ``options-stash``: the option
  tables of the Spark sources; the option *names* come from the tuples the sources check
  options against (``spark.persist_common.READ_OPTIONS`` / ``WRITE_OPTIONS``,
  ``spark.stash_source.OPTIONS``) and their meanings from :mod:`scripts.doc_options`;
  an option without a meaning, or a meaning for an option the source does not take,
  raises;
* ``api``: the signature and docstring of each public callable of :data:`API`.

Usage: ``python scripts/gen_docs.py`` rewrites the files; ``--check`` rewrites nothing
and exits 1 naming every stale part (``tests/test_docs_generated.py`` runs the check).
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts import doc_options  # noqa: E402

WIDTH = 88
"""The width click wraps help text at (fixed, so the output does not depend on the
terminal the generator runs in)."""

MARKER = re.compile(
    r"(<!-- BEGIN generated:(?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- END generated:(?P=name) -->)",
    re.DOTALL,
)

API: list[tuple[str, list[str]]] = [
    (
        "stash",
        [
            "stash.Stash.open",
            "stash.Stash.collection",
            "stash.Stash.append",
            "stash.Stash.peek_one",
            "stash.Stash.with_transaction",
            "stash.TypedCollection",
            "stash.TypedCollection.table",
            "stash.TypedCollection.upsert",
            "stash.TypedCollection.migrate",
            "stash.TableTransaction",
            "stash.TableTransaction.commit",
            "stash.Memory",
        ],
    ),
    (
        "persist",
        [
            "persist.PersistClient",
            "persist.PersistClient.create_table",
            "persist.PersistClient.table",
            "persist.Table.append",
            "persist.AppTransaction",
            "persist.Table.transaction_version",
            "persist.Table.upsert",
            "persist.Table.delete",
            "persist.Table.update",
            "persist.Table.to_arrow",
            "persist.Table.to_duckdb",
            "persist.Table.history",
            "persist.Table.restore",
            "persist.Table.optimize",
            "persist.Table.set_retention",
            "persist.Table.vacuum",
            "persist.Table.details",
            "persist.PersistClient.open",
            "persist.PersistClient.begin",
            "persist.PersistClient.snapshot_many",
            "persist.PersistClient.finalize_shard",
            "persist.WriteHandle.compare_and_append",
            "persist.WriteHandle.upsert",
            "persist.WriteHandle.delete",
            "persist.WriteHandle.update",
            "persist.RowChanges",
            "persist.ReadHandle.snapshot",
            "persist.ReadHandle.snapshot_stream",
            "persist.ReadHandle.listen",
            "persist.Txn.write",
            "persist.Txn.commit",
            "persist.Txn.commit_at",
            "persist.fsck",
            "persist.collect_garbage",
        ],
    ),
    (
        "spark",
        [
            "spark.session.build_session",
            "spark.formats.register",
            "spark.persist_txn.persist_txn",
            "spark.persist_txn.PersistTxn.write",
            "spark.persist_txn.PersistTxn.upsert",
        ],
    ),
]
"""The public callables the API reference shows, by module: dotted paths, each an
attribute of an importable module."""


def _resolve(path: str) -> object:
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"cannot resolve {path!r}")


def _help(command: click.Command, name: str, parent: click.Context | None) -> str:
    ctx = click.Context(
        command, info_name=name, parent=parent, terminal_width=WIDTH, max_content_width=WIDTH
    )
    return command.get_help(ctx)


def _walk(command: click.Command, name: str, parent: click.Context | None) -> Iterator[str]:
    ctx = click.Context(
        command, info_name=name, parent=parent, terminal_width=WIDTH, max_content_width=WIDTH
    )
    yield f"### `{ctx.command_path}`\n\n```text\n{_help(command, name, parent)}\n```\n"
    if isinstance(command, click.Group):
        for sub in sorted(command.commands):
            yield from _walk(command.commands[sub], sub, ctx)


def cli_reference(module: str, name: str) -> str:
    """Every command's ``--help`` of the click group ``module.main``, as Markdown."""
    group = importlib.import_module(module).main
    return "\n".join(_walk(group, name, None))


def options_table(names: tuple[str, ...], meanings: dict[tuple[str, ...], str], what: str) -> str:
    """A Markdown table of ``meanings`` (rows keyed by the option names they document),
    checked against ``names``, the options the source accepts.

    Raises:
        ValueError: an accepted option has no row, or a row names an option that is not
            accepted (naming them and ``what``).
    """
    documented = {n for row in meanings for n in row}
    missing = sorted(set(names) - documented)
    extra = sorted(documented - set(names))
    if missing or extra:
        raise ValueError(
            f"the option table of {what} is out of step with the source: "
            f"undocumented {missing}, documented but not accepted {extra}; "
            "edit scripts/doc_options.py"
        )
    lines = ["| option | meaning |", "|---|---|"]
    for row, meaning in meanings.items():
        label = ", ".join(f"`{n}`" for n in row)
        lines.append(f"| {label} | {' '.join(meaning.split())} |")
    return "\n".join(lines) + "\n"


SCALING_FIGURES: list[tuple[str, str, str]] = [
    (
        "stash appends/s, one collection, Postgres, 1 entry, fenced",
        "postgres: stash postgres appends/s vs raw postgres",
        "both",
    ),
    ("stash appends/s, SQLite", "sqlite: stash sqlite appends/s vs raw sqlite", "both"),
    (
        "persist one-row `compare_and_append`/s (SQLite stash, compactor running)",
        "persist one-row compare_and_append per second",
        "subject",
    ),
    (
        "persist write of 336,776 flights rows (one append)",
        "flights: persist write vs write_table",
        "subject",
    ),
    (
        "persist snapshot of lineitem SF1 (6 M rows)",
        "lineitem-sf1: persist snapshot vs read_table",
        "subject",
    ),
    ("persist write of lineitem SF1", "lineitem-sf1: persist write vs write_table", "subject"),
    (
        "batches after 10,000 one-row appends (compactor idle; bound 2·log2 n = 26.6)",
        "batches after 10,000 one-row appends (compactor idle)",
        "subject",
    ),
]
"""The rows of ``docs/scaling.md``'s measured figures: (what, the figure's name in
``docs/benchmarks.md``, which medians to show: the subject's, or both)."""


def scaling_measured() -> str:
    """The measured rows of the scaling plan, read from ``docs/benchmarks.md``'s tables
    (so the two documents always show the same figures).

    Raises:
        KeyError: a figure of :data:`SCALING_FIGURES` is not in the report (naming it).
    """
    from bench.replot import figure_rows

    report = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    rows = figure_rows(report)
    started = re.search(r"the first started (\S+?)T", report)
    lines = ["| figure | value | source |", "|---|---|---|"]
    for what, name, show in SCALING_FIGURES:
        if name not in rows:
            raise KeyError(f"figure {name!r} is not in docs/benchmarks.md")
        row = rows[name]
        value = row["subject (median)"].split(": ", 1)[-1]
        if show == "both" and row.get("reference (median)"):
            ref, ref_value = row["reference (median)"].split(": ", 1)
            value += f" ({ref}: {ref_value})"
        when = f", run of {started.group(1)}" if started else ""
        lines.append(f"| {what} | {value} | benchmarks.md{when} |")
    return "\n".join(lines) + "\n"


def _signature(obj: object) -> str:
    try:
        sig = str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""
    return re.sub(r" at 0x[0-9a-f]+", "", sig)


def api_reference() -> str:
    """The signature and docstring of every callable of :data:`API`, as Markdown."""
    out: list[str] = []
    for module, paths in API:
        out.append(f"## `{module}`\n")
        for path in paths:
            obj = _resolve(path)
            if inspect.isclass(obj):
                sig = _signature(obj.__init__)  # type: ignore[misc]
                sig = re.sub(r"^\(self,? ?", "(", sig)
                head = f"class {path}{sig}"
            else:
                head = f"{path}{_signature(obj)}"
                head = re.sub(r"\(self,? ?", "(", head, count=1)
            doc = inspect.getdoc(obj) or "(no docstring)"
            out.append(f"### `{path}`\n\n```text\n{head}\n\n{doc}\n```\n")
    return "\n".join(out)


GENERATORS: dict[str, Callable[[], str]] = {
    "cli-persist": lambda: cli_reference("persist.cli", "persist"),
    "cli-stash": lambda: cli_reference("stash.cli", "stash"),
    "options-persist-read": lambda: options_table(
        _resolve("spark.persist_common.READ_OPTIONS"),  # type: ignore[arg-type]
        doc_options.PERSIST_READ,
        "persist reads",
    ),
    "options-persist-write": lambda: options_table(
        _resolve("spark.persist_common.WRITE_OPTIONS"),  # type: ignore[arg-type]
        doc_options.PERSIST_WRITE,
        "persist writes",
    ),
    "options-stash": lambda: options_table(
        _resolve("spark.stash_source.OPTIONS"),  # type: ignore[arg-type]
        doc_options.STASH_READ,
        "stash reads",
    ),
    "api": api_reference,
    "scaling-measured": scaling_measured,
}


def regenerate(text: str, cache: dict[str, str]) -> str:
    """``text`` with every generated part rebuilt (unknown part names raise KeyError)."""

    def fill(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in cache:
            cache[name] = GENERATORS[name]()
        return f"{m.group(1)}{cache[name]}{m.group(4)}"

    return MARKER.sub(fill, text)


def stale_files(write: bool) -> list[Path]:
    """The Markdown files under ``docs/`` and the README whose generated parts differ
    from the code; rewritten when ``write``."""
    cache: dict[str, str] = {}
    stale = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        new = regenerate(text, cache)
        if new != text:
            stale.append(path)
            if write:
                path.write_text(new, encoding="utf-8")
    return stale


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = stale_files(write=not check)
    for path in stale:
        verb = "stale" if check else "rewrote"
        print(f"{verb}: {path.relative_to(ROOT)}")
    if check and stale:
        print("run: python scripts/gen_docs.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
