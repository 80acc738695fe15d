"""Campaign helpers. Sizes: short in `make test`, long with ``STASH_RELIABILITY=long``
(`make reliability`). Results of each campaign are appended as JSON lines to
``var/reliability/results.jsonl`` for ``docs/reliability.md``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

LONG = os.environ.get("STASH_RELIABILITY") == "long"
RESULTS = Path(__file__).resolve().parents[2] / "var" / "reliability" / "results.jsonl"


def runs(short: int, long: int) -> int:
    """How many runs a campaign does in this mode."""
    return long if LONG else short


def record(campaign: str, **figures: Any) -> None:
    """Append one campaign's figures (runs, faults, acknowledged, lost, duplicated,
    partial, unclear) to the results file."""
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    row = {"campaign": campaign, "mode": "long" if LONG else "short", "at": time.time(), **figures}
    with RESULTS.open("a") as f:
        f.write(json.dumps(row, sort_keys=True) + "\n")
