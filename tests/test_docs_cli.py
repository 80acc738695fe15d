"""The command-line examples of the README and the user guide run as written.

Every ```` ```console ```` block of ``README.md`` and ``docs/**/*.md`` is found with
markdown-it-py (the parser pytest-markdown-docs uses for the Python blocks) and each of
its ``$ command`` lines is run by bash in a temporary directory, with ``STASH`` and
``BLOB`` naming a store made for it (a SQLite stash holding the collection ``airlines``
and the shard ``orders``, a file blob) and ``stash`` / ``persist`` running this
checkout's code. A command must exit 0. (```` ```bash ```` blocks are illustrations
that need a cluster or a clone, e.g. ``spark-submit``, and are not run.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from markdown_it import MarkdownIt

from persist import PersistClient
from stash import Stash, TypedCollection

ROOT = Path(__file__).resolve().parent.parent


def _console_blocks() -> list[tuple[str, list[str]]]:
    parser = MarkdownIt("commonmark")
    blocks = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for token in parser.parse(path.read_text(encoding="utf-8")):
            if token.type == "fence" and token.info.split()[:1] == ["console"]:
                assert token.map is not None
                commands = [
                    line[2:] for line in token.content.splitlines() if line.startswith("$ ")
                ]
                blocks.append((f"{path.relative_to(ROOT)}:{token.map[0] + 1}", commands))
    return blocks


BLOCKS = _console_blocks()


@pytest.fixture
def store(tmp_path: Path) -> dict[str, str]:
    """A stash with the collection ``airlines`` and a blob with the shard ``orders``."""
    url, blob = f"sqlite:///{tmp_path / 'stash.db'}", (tmp_path / "blob").as_uri()
    with Stash.open(url) as s:
        TypedCollection("airlines", key="str", value="json").upsert(
            s, [("AA", {"name": "American"}), ("UA", {"name": "United"})]
        )
    client = PersistClient(Stash.open(url, fenced=False), blob)
    write, _ = client.open(
        "orders", pa.schema([("id", pa.int64())]), pa.schema([("qty", pa.int64())])
    )
    write.upsert(pa.table({"id": [1, 2, 3], "qty": [5, 7, 1]}))
    write.upsert(pa.table({"id": [2], "qty": [8]}))
    client.close()
    return {"STASH": url, "BLOB": blob}


def _shims(bin_dir: Path) -> None:
    """``stash`` and ``persist`` commands that run this checkout's ``main``."""
    bin_dir.mkdir()
    for name, module in (("stash", "stash.cli"), ("persist", "persist.cli")):
        shim = bin_dir / name
        shim.write_text(
            f'#!/bin/sh\nexec "{sys.executable}" -c '
            f'\'import sys; from {module} import main; sys.exit(main(prog_name="{name}"))\' "$@"\n'
        )
        shim.chmod(0o755)


def test_the_docs_have_console_examples() -> None:
    assert any(where.startswith("README.md") for where, _ in BLOCKS)
    assert any(where.startswith("docs/guide/cli.md") for where, _ in BLOCKS)


@pytest.mark.parametrize(("where", "commands"), BLOCKS, ids=[w for w, _ in BLOCKS])
def test_console_example_runs(
    where: str, commands: list[str], store: dict[str, str], tmp_path: Path
) -> None:
    assert commands, f"{where}: a console block without a `$ ` command"
    _shims(tmp_path / "bin")
    env = {
        **os.environ,
        **store,
        "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
    }
    env.pop("PERSIST_STASH", None)
    env.pop("PERSIST_BLOB", None)
    work = tmp_path / "work"
    work.mkdir()
    for command in commands:
        done = subprocess.run(
            ["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, (
            f"{where}: `{command}` exited {done.returncode}\n{done.stdout}\n{done.stderr}"
        )
        assert done.stdout.strip(), f"{where}: `{command}` printed nothing"
