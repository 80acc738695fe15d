"""The parts of the user guide built from the code (CLI help, Spark option tables, API
signatures; ``scripts/gen_docs.py``) are up to date: a change to a command, an option or
a public signature that was not followed by ``python scripts/gen_docs.py`` fails here."""

from __future__ import annotations

import pytest

from scripts import gen_docs


def test_generated_docs_are_current() -> None:
    stale = gen_docs.stale_files(write=False)
    assert not stale, (
        f"generated docs are stale: {[str(p.relative_to(gen_docs.ROOT)) for p in stale]}; "
        "run: python scripts/gen_docs.py"
    )


def test_an_undocumented_option_names_itself() -> None:
    with pytest.raises(ValueError, match=r"undocumented \['colour'\]"):
        gen_docs.options_table(("stash", "colour"), {("stash",): "the URL"}, "a test source")
