"""The ``persist`` CLI's operator surface (``persist/cli.py``): ``--metrics-port`` and
``--metrics-addr`` errors are one-line ``error:`` messages, and ``--json`` output is
strict JSON (no ``NaN`` tokens)."""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path

import pyarrow as pa
from click.testing import CliRunner

from persist import PersistClient
from persist.cli import main
from stash import Stash


def test_metrics_port_in_use_is_a_clean_cli_error(tmp_path: Path) -> None:
    """``persist --metrics-port P`` with P taken exits 1 with ``error: cannot serve
    /metrics on ...`` (it was an uncaught ``OSError`` with a traceback); so does an
    address this host does not have."""
    url = f"sqlite:///{tmp_path}/s.db"
    Stash.open(url, fenced=False).close()
    r = CliRunner()
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        res = r.invoke(
            main, ["--metrics-port", str(port), "--stash", url, "--blob", "memory://", "shards"]
        )
    assert res.exit_code == 1, (res.output, res.exception)
    assert isinstance(res.exception, SystemExit), f"uncaught: {res.exception!r}"
    assert res.output.startswith("error: ") and "cannot serve /metrics on 0.0.0.0:" in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): never an address of this host.
    args = ["--metrics-port", "0", "--metrics-addr", "192.0.2.1"]
    res = r.invoke(main, [*args, "--stash", url, "--blob", "memory://", "shards"])
    assert res.exit_code == 1 and "cannot serve /metrics on 192.0.2.1:0" in res.output, (
        res.output,
        res.exception,
    )


def test_stash_cli_metrics_port_in_use_is_a_clean_cli_error(tmp_path: Path) -> None:
    """The ``stash`` CLI's ``--metrics-port`` had the same uncaught ``OSError``."""
    from stash.cli import main as stash_main

    url = f"sqlite:///{tmp_path}/s.db"
    Stash.open(url, fenced=False).close()
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        res = CliRunner().invoke(stash_main, ["--metrics-port", str(port), "collections", url])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.exception
    assert res.output == (
        f"error: cannot serve /metrics on 0.0.0.0:{port}: {_in_use()} — choose another "
        "--metrics-port\n"
    )


def _in_use() -> str:
    import errno
    import os

    return os.strerror(errno.EADDRINUSE)


def test_cat_and_sql_json_is_strict_json_for_nan_and_infinities(tmp_path: Path) -> None:
    """``--json`` promises one JSON object per line; NaN and the infinities were printed
    as the bare tokens ``NaN``/``Infinity``, which strict parsers (jq, JavaScript, Go)
    reject.  They are the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``, also
    nested in lists and structs."""
    url, blob = f"sqlite:///{tmp_path}/s.db", f"file://{tmp_path}/blob"
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(s, blob)
        w = c.open_writer("t", pa.schema([("id", pa.int64())]), pa.schema([("v", pa.float64())]))
        nan, inf = float("nan"), float("inf")
        w.compare_and_append(
            [(((1,), (nan,)), 0, 1), (((2,), (-inf,)), 0, 1), (((3,), (0.25,)), 0, 1)], 0, 1
        )
        c.close()

    def strict(token: str) -> object:
        raise ValueError(f"not JSON: {token}")

    base = ["--stash", url, "--blob", blob]
    r = CliRunner()
    res = r.invoke(main, [*base, "cat", "t", "--json"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line, parse_constant=strict) for line in res.output.splitlines()]
    assert [(x["id"], x["v"]) for x in rows] == [(1, "NaN"), (2, "-Infinity"), (3, 0.25)]
    assert math.isnan(float(rows[0]["v"])) and float(rows[1]["v"]) == -math.inf
    q = "SELECT id, v, [v, -v, 1.5] AS l, {'w': v} AS st FROM t ORDER BY id"
    res = r.invoke(main, [*base, "sql", q, "--json"])
    assert res.exit_code == 0, res.output
    got = [json.loads(line, parse_constant=strict) for line in res.output.splitlines()]
    assert got == [
        {"id": 1, "v": "NaN", "l": ["NaN", "NaN", 1.5], "st": {"w": "NaN"}},
        {"id": 2, "v": "-Infinity", "l": ["-Infinity", "Infinity", 1.5], "st": {"w": "-Infinity"}},
        {"id": 3, "v": 0.25, "l": [0.25, -0.25, 1.5], "st": {"w": 0.25}},
    ]


def test_job_metrics_port_in_use_is_a_clean_cli_error(tmp_path: Path) -> None:
    """The Spark jobs' ``--metrics-port`` on a busy port: one ``Error:`` line (click's
    form), exit 1, no traceback, before any Spark session is built."""
    from spark.jobs.compact import main as compact_main
    from spark.jobs.flights import main as flights_main

    url, blob = f"sqlite:///{tmp_path}/s.db", f"file://{tmp_path}/blob"
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = str(s.getsockname()[1])
        runs = [
            CliRunner().invoke(
                flights_main, ["--metrics-port", port, "--stash", url, "--blob", blob]
            ),
            CliRunner().invoke(
                compact_main, ["--metrics-port", port, "--stash", url, "--blob", blob, "x"]
            ),
        ]
    for res in runs:
        assert res.exit_code == 1, (res.output, res.exception)
        assert f"cannot serve /metrics on 0.0.0.0:{port}" in res.output
        assert "Traceback" not in res.output
