"""``persist retention --duration`` takes every unit it names: ``ms`` was read as
minutes followed by a stray ``s`` (so ``500ms`` was refused), and a duration beyond
``timedelta``'s range escaped as ``OverflowError`` instead of the usage error."""

from __future__ import annotations

import datetime as dt

import click
import pytest

from persist.cli import parse_duration


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("500ms", dt.timedelta(milliseconds=500)),
        ("1m30s", dt.timedelta(seconds=90)),
        ("2m", dt.timedelta(minutes=2)),
        ("1s250ms", dt.timedelta(seconds=1.25)),
        ("1d12h", dt.timedelta(days=1.5)),
    ],
)
def test_units(text: str, want: dt.timedelta) -> None:
    parsed = parse_duration(text)  # a parsed setting, not a measured time
    assert parsed == want


@pytest.mark.parametrize("text", ["10000000000d", "99999999999999999999w", "5x", "-1d", ""])
def test_bad_durations_are_usage_errors(text: str) -> None:
    with pytest.raises(click.BadParameter):
        parse_duration(text)
