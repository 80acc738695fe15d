"""Protects: a Postgres password is never shown, whatever characters it holds.

A real Postgres role whose password holds odd characters, used through
every entry point (Stash.open, reprs, PersistClient, both CLIs, DEBUG logs), right and
wrong: the password must never be shown."""

from __future__ import annotations

import logging
from urllib.parse import quote

import pytest
from click.testing import CliRunner
from sqlalchemy.engine import make_url

from persist import MemoryBlob, PersistClient
from persist.cli import main as persist_main
from stash import Stash
from stash.cli import main as stash_main

pytestmark = pytest.mark.adversarial

PASSWORDS = ["Zq9 sp ace", "Zq9'quo\"te", "/Zq9slash", "Zq9#hash", "Zq9@at", "Zq9ä ö", "Zq9?q"]


@pytest.mark.postgres
def test_odd_passwords_never_shown(postgres_url: str, caplog: pytest.LogCaptureFixture) -> None:
    import psycopg
    from psycopg import sql

    from tests.support.dbutil import migrate_to_head

    migrate_to_head(postgres_url)
    u = make_url(postgres_url)
    admin = u.set(drivername="postgresql").render_as_string(hide_password=False)
    caplog.set_level(logging.DEBUG)
    shown: list[str] = []
    leaks: list[tuple[str, str]] = []
    blob = MemoryBlob()  # one store for the shard every role opens
    for i, pw in enumerate(PASSWORDS):
        role = f"pwsweep{i}"
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(
                sql.SQL("CREATE ROLE {} LOGIN SUPERUSER PASSWORD {}").format(
                    sql.Identifier(role), sql.Literal(pw)
                )
            )
        good = u.set(username=role, password=pw).render_as_string(hide_password=False)
        bad = u.set(username=role, password=pw + "x").render_as_string(hide_password=False)
        down = u.set(username=role, password=pw, port=1).render_as_string(hide_password=False)
        raw = f"postgresql+psycopg://{role}:{pw}@{u.host}:{u.port}/{u.database}"
        texts: list[str] = []
        with Stash.open(good, fenced=True) as s:  # fenced: logs "took leader epoch"
            texts.append(repr(s))
            c = PersistClient(s, blob, compaction="off")
            texts.append(repr(c))
            c.open("sh", *_schemas())
            c.close()
        for url in (bad, down, raw):
            try:
                with Stash.open(url) as s:
                    texts.append(repr(s))
            except Exception as e:  # noqa: BLE001 - any failure must be clean
                texts += [str(e), repr(e)]
        for url in (good, bad, down, raw):
            for args in (["collections", url], ["peek", url, "nope"]):
                r = CliRunner().invoke(stash_main, args)
                texts.append(r.output)
                if r.exception is not None and not isinstance(r.exception, SystemExit):
                    texts.append(repr(r.exception))
            for args in (["shards"], ["inspect", "nope"], ["inspect", "sh", "--json"]):
                r = CliRunner().invoke(
                    persist_main, ["--stash", url, "--blob", "memory://", "-v", *args]
                )
                texts.append(r.output)
                if r.exception is not None and not isinstance(r.exception, SystemExit):
                    texts.append(repr(r.exception))
        texts.append(caplog.text)
        caplog.clear()
        for t in texts:
            for secret in {pw, quote(pw, safe=""), quote(pw), "Zq9"}:
                if secret in t:
                    leaks.append((pw, t[:300]))
        shown += texts
    assert not leaks, leaks


def _schemas():  # type: ignore[no-untyped-def]
    import pyarrow as pa

    return pa.schema([("k", pa.string())]), pa.schema([("v", pa.int64())])
