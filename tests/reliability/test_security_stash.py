"""Security campaign, stash side (issue 7): bound parameters only (injection attempts are
stored as data), passwords never in reprs, logs, exceptions or CLI output, and the
embedded database readable by its owner only."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy.engine import make_url

from stash import Antichain, Stash, StashError
from stash.cli import main
from stash.url import safe_url

INJECTIONS = [
    "'; DROP TABLE data; --",
    'x" OR 1=1 --',
    "orders); DELETE FROM collections; --",
    "\\'; SELECT pg_sleep(10); --",
    "Robert'); DROP TABLE uppers;--",
]


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_injection_attempts_are_plain_data(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    from dbutil import backend_url

    url = backend_url(request, backend, tmp_path)
    with Stash.open(url) as s:
        for i, evil in enumerate(INJECTIONS):
            c = s.collection(evil)
            b = c.make_batch(s)
            c.append_to_batch(b, evil, {evil: evil}, 1)
            s.append([b])
            assert s.peek(c) == [(evil, {evil: evil}, 1)]
            assert s.peek_key_one(c, evil) == {evil: evil}
            assert len(s.collections()) == i + 1
        assert set(s.collections()) == set(INJECTIONS)


def test_sqlite_files_are_owner_only(tmp_path: Path) -> None:
    db = tmp_path / "sub" / "dir" / "stash.db"
    with Stash.open(f"sqlite:///{db}") as s:
        c = s.collection("c")
        s.update(c, ("k", "v"), 0, 1)
        s.seal(c, Antichain.from_elem(1))
        for p in db.parent.iterdir():
            mode = stat.S_IMODE(os.stat(p).st_mode)
            assert mode & 0o077 == 0, f"{p.name} has mode {oct(mode)}"
    assert stat.S_IMODE(os.stat(db.parent).st_mode) & 0o077 == 0


def test_password_never_shown(postgres_url: str, caplog: pytest.LogCaptureFixture) -> None:
    from dbutil import migrate_to_head

    migrate_to_head(postgres_url)
    u = make_url(postgres_url)
    secret = u.password
    assert secret
    caplog.set_level(logging.DEBUG)
    with Stash.open(postgres_url) as s:
        assert secret not in repr(s)
        s.collection("c")
    assert secret not in caplog.text
    wrong = u.set(password="hunter2-wrong").render_as_string(hide_password=False)
    with pytest.raises(StashError) as e:
        Stash.open(wrong)
    assert "hunter2-wrong" not in str(e.value) and "hunter2-wrong" not in repr(e.value)
    down = u.set(port=1).render_as_string(hide_password=False)
    with pytest.raises(StashError) as e:
        Stash.open(down)
    assert secret not in str(e.value)
    assert str(e.value).startswith("stash error: postgres: ")
    res = CliRunner().invoke(main, ["collections", down])
    assert res.exit_code == 1 and secret not in res.output
    assert secret not in safe_url(postgres_url)
    assert "***" in safe_url(postgres_url)
