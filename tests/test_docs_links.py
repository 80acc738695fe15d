"""Every relative link of the README and of ``docs/`` leads somewhere: the file exists
and, for a link with a ``#fragment``, the file has a heading with that anchor (GitHub's
rule: lower case, punctuation other than ``-`` and ``_`` dropped, spaces to ``-``).
Links and headings are found with markdown-it-py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_PARSER = MarkdownIt("commonmark").enable("table")


def _anchor(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    tokens = _PARSER.parse(path.read_text(encoding="utf-8"))
    return {
        _anchor(tokens[i + 1].content) for i, tok in enumerate(tokens) if tok.type == "heading_open"
    }


def _links(path: Path) -> list[str]:
    out = []
    for tok in _PARSER.parse(path.read_text(encoding="utf-8")):
        for child in tok.children or []:
            if child.type in ("link_open", "image"):
                out.append(str(child.attrs.get("href") or child.attrs.get("src")))
    return out


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_relative_links_resolve(path: Path) -> None:
    broken = []
    for href in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", href):  # http:, https:, mailto:
            continue
        target, _, fragment = href.partition("#")
        file = (path.parent / target).resolve() if target else path
        if not file.exists():
            broken.append(f"{href} (no file {file.relative_to(ROOT)})")
        elif fragment and file.suffix == ".md" and fragment not in _anchors(file):
            broken.append(f"{href} (no heading #{fragment} in {file.relative_to(ROOT)})")
    assert not broken, f"{path.relative_to(ROOT)}: broken links: {broken}"
