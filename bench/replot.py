"""Redraw the ratio plots (``docs/img/bench-*-ratios.png``) from the figures tables of
``docs/benchmarks.md``, without running the benches.

The report (:mod:`bench.report`) draws its plots from the results files of a run; those
live in ``var/bench-results/``, which is not kept in git. When the plotting changes but
the figures must not (a rerun on the shared VM would change them), this rebuilds each
bench's ratio records from the tables the report wrote (markdown-it-py parses them) and
draws them with :func:`bench.report._plot_ratios`. Only what the plot needs is
recovered: name, value, goal, verdict, definition and units. The tables show values
with 3 significant digits, so a redrawn bar can differ from the original by that
rounding, never more.

Run: ``python -m bench.replot [--report docs/benchmarks.md]``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click
from markdown_it import MarkdownIt

from bench.report import DOCS, IMG, _plot_ratios

_IMAGE = re.compile(r"bench-(?P<bench>[a-z0-9_-]+)-ratios\.png$")
_NUMBER = re.compile(r"-?[0-9][0-9,]*\.?[0-9]*(?:e[-+]?[0-9]+)?")


def _number(text: str) -> float:
    m = _NUMBER.search(text)
    if m is None:
        raise ValueError(f"no number in {text!r}")
    return float(m.group(0).replace(",", ""))


def _record(row: dict[str, str]) -> dict[str, Any] | None:
    """A ratio record from one row of a figures table (None for other rows: absolute
    figures have no reference, or a value that is not a ratio)."""
    value = row["value"].split(" (")[0]
    if not row.get("reference (median)") or not value.endswith("x"):
        return None
    goal = None
    if row["goal"]:
        op, target = row["goal"].split(" ", 1)
        goal = {"op": op, "value": _number(target)}
    verdict = row["verdict"].strip("*").lower() or None
    return {
        "kind": "ratio",
        "name": row["figure"],
        "value": _number(value),
        "goal": goal,
        "verdict": verdict,
        "goal_met": None if goal is None else verdict == "met",
        "definition": row["definition"],
        "subject_unit": row["subject (median)"].rsplit(" ", 1)[-1],
        "reference_unit": row["reference (median)"].rsplit(" ", 1)[-1],
    }


def figure_rows(text: str) -> dict[str, dict[str, str]]:
    """Every row of the report's figures tables, by figure name (its cells by column:
    ``value``, ``goal``, ``verdict``, ``subject (median)``, ...)."""
    return {
        row["figure"]: row
        for bench in benches_from_report(text, keep_rows=True)
        for row in bench["rows"]
    }


def benches_from_report(text: str, *, keep_rows: bool = False) -> list[dict[str, Any]]:
    """The benches of a report, each ``{"bench", "title", "records"}`` (and ``"rows"``,
    its figures tables' rows, when ``keep_rows``), in order."""
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    benches: list[dict[str, Any]] = []
    title = ""
    header: list[str] = []
    row: list[str] = []
    rows: list[dict[str, str]] = []
    in_head = False
    for i, tok in enumerate(tokens):
        if tok.type == "heading_open" and tok.tag == "h2":
            title = tokens[i + 1].content
            rows = []
        elif tok.type == "thead_open":
            in_head, header = True, []
        elif tok.type == "thead_close":
            in_head = False
        elif tok.type == "tr_open":
            row = []
        elif tok.type == "inline" and tokens[i - 1].type in ("th_open", "td_open"):
            (header if in_head else row).append(tok.content)
        elif tok.type == "tr_close" and not in_head and header[:2] == ["figure", "value"]:
            rows.append(dict(zip(header, row, strict=True)))
        elif tok.type == "inline":
            for child in tok.children or []:
                m = (
                    _IMAGE.search(str(child.attrs.get("src", "")))
                    if child.type == "image"
                    else None
                )
                if m:
                    records = [r for r in map(_record, rows) if r is not None]
                    bench = {"bench": m.group("bench"), "title": title, "records": records}
                    if keep_rows:
                        bench["rows"] = rows
                    benches.append(bench)
    return benches


@click.command()
@click.option(
    "--report",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=DOCS / "benchmarks.md",
    show_default=True,
)
def main(report: Path) -> None:
    """Redraw docs/img/bench-*-ratios.png from the tables of the report."""
    for bench in benches_from_report(report.read_text(encoding="utf-8")):
        path = IMG / f"bench-{bench['bench']}-ratios.png"
        if _plot_ratios(bench, path):
            click.echo(f"{path.relative_to(DOCS.parent)}: {len(bench['records'])} ratios")


if __name__ == "__main__":
    main()
