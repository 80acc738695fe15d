"""The benchmark report's ratio plot (``bench.report._plot_ratios``) says what it shows:
"within noise" bars have their own colour and legend entry, and a peak-memory ratio is
drawn as the ratio it is, on an axis of its own, never inverted onto the speed axis
(a memory ratio of 0.11x once showed as a ~9x speed bar)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import pytest
from matplotlib.colors import to_hex
from matplotlib.figure import Figure

from bench import replot, report

matplotlib.use("Agg")


def _ratio(
    name: str, value: float, goal: float | None, verdict: str | None, **extra: Any
) -> dict[str, Any]:
    return {
        "kind": "ratio",
        "name": name,
        "value": value,
        "goal": None if goal is None else {"op": extra.pop("op", ">="), "value": goal},
        "verdict": verdict,
        "goal_met": None if verdict is None else verdict == "met",
        "definition": extra.pop("definition", "reference time / subject time (higher is better)"),
        **extra,
    }


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[Figure]:
    figures: list[Figure] = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figures.append(self))
    return figures


def test_within_noise_and_memory_ratios(drawn: list[Figure], tmp_path: Path) -> None:
    bench = {
        "bench": "persist",
        "title": "Persist",
        "records": [
            _ratio("write vs write_table", 0.9, 0.8, "met"),
            _ratio("write vs delta-rs", 0.998, 1.0, "within noise"),
            _ratio("write vs pyiceberg", 0.7, 1.0, "missed"),
            _ratio(
                "peak memory: snapshot_stream vs read_table",
                0.11,
                1.5,
                "met",
                op="<=",
                definition="ratio of peak bytes (lower is better)",
                subject_unit="bytes",
                reference_unit="bytes",
            ),
        ],
    }
    assert report._plot_ratios(bench, tmp_path / "p.png")
    (fig,) = drawn
    panels = [ax for ax in fig.axes if ax.patches]
    assert len(panels) == 2  # speed, and memory on its own axis
    speed, memory = panels
    assert [t.get_text() for t in memory.get_yticklabels()] == [
        "peak memory: snapshot_stream vs read_table"
    ]
    assert memory.patches[0].get_width() == pytest.approx(0.11)  # not 1 / 0.11
    assert "memory" in memory.get_xlabel() and "speed" in speed.get_xlabel()
    colours = [to_hex(p.get_facecolor()) for p in speed.patches]
    assert len(set(colours)) == 3  # met, within noise, missed: three colours
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any("within noise" in label for label in labels)
    assert any("missed" in label for label in labels)


def test_replot_reads_the_records_back_from_the_report() -> None:
    text = (
        "## Persist\n\n"
        "| figure | value | goal | verdict | subject (median) | reference (median) | definition |\n"
        "|---|---|---|---|---|---|---|\n"
        "| a vs b | 0.998x (0.95x to 1.07x) | >= 1 | within noise | a: 145.7 ms | b: 144.9 ms | "
        "b time / a time (higher is better) |\n"
        "| mem | 0.11x | <= 1.5 | met | a: 143,716,975 bytes | b: 1,309,708,987 bytes | x |\n"
        "| rate | 625 appends/s | >= 300 | met | a: 625 appends/s |  | y |\n\n"
        "![ratios of persist](img/bench-persist-ratios.png)\n"
    )
    (bench,) = replot.benches_from_report(text)
    assert bench["bench"] == "persist"
    assert [(r["name"], r["value"], r["verdict"]) for r in bench["records"]] == [
        ("a vs b", 0.998, "within noise"),
        ("mem", 0.11, "met"),
    ]
    assert report._is_memory(bench["records"][1]) and not report._is_memory(bench["records"][0])
