"""``spark.daemon``: the Python worker daemon that imports the project's modules before
it forks (``spark.python.daemon.module``)."""

from __future__ import annotations

import subprocess
import sys

from spark.daemon import PRELOAD, preload


def test_every_preloaded_module_imports() -> None:
    assert preload() == []
    assert set(PRELOAD) <= set(sys.modules)


def test_preloading_starts_no_thread() -> None:
    """Forking after the imports is only safe if they started no thread."""
    code = (
        "import threading; from spark.daemon import preload; "
        "assert preload() == []; print(threading.active_count())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "1"
