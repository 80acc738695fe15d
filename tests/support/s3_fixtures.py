"""Pytest fixtures giving tests an S3-compatible object store (load with `pytest_plugins`).

Fixtures:

- `s3_server` (session): one moto server (`moto.server.ThreadedMotoServer`) on
  127.0.0.1 at a free port per pytest process, with one bucket (:data:`BUCKET`) and an
  IAM user whose access key the fixture puts in the environment
  (`AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`, `AWS_DEFAULT_REGION`); request
  authentication is then switched on, so a wrong key or secret is refused like on S3.
  The previous values of those variables come back at the end of the session.
- `s3_blob_uri` (function): `s3://BUCKET/PREFIX?endpoint_override=127.0.0.1:PORT&scheme=http`
  with a prefix of its own per test (an empty store).

Invariants:

- Never a silent skip: when moto cannot be imported or the server does not start, the
  fixture fails the test under `CI` (see `pg_fixtures.in_ci`) and skips it otherwise.
- Credentials live in the environment only, never in a URI (persist refuses URIs that
  carry them); child processes (crash campaign children, Spark executors) inherit them.
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import count
from typing import Any, NoReturn

import pytest

from tests.support.pg_fixtures import in_ci

__all__ = ["BUCKET", "S3Server", "require_s3_server", "s3_blob_uri", "s3_server"]

#: The bucket every test shares (each test has its own prefix).
BUCKET = "persist-test"
_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_SESSION_TOKEN")
_prefixes = count(1)


def _unavailable(reason: str) -> NoReturn:
    """Fail under CI, skip otherwise; never returns."""
    if in_ci():
        pytest.fail(f"the S3 test server is required under CI but unavailable: {reason}")
    pytest.skip(f"S3 test server unavailable (not CI, so skipped): {reason}")


@dataclass
class S3Server:
    """A running moto server: `endpoint` (`http://127.0.0.1:PORT`), `host_port`
    (`127.0.0.1:PORT`), the IAM user's `access_key_id`/`secret_access_key` (also in the
    environment while the session runs), and the moto server object (`server`)."""

    endpoint: str
    host_port: str
    access_key_id: str
    secret_access_key: str
    server: Any

    def __repr__(self) -> str:
        return f"S3Server({self.endpoint!r}, bucket={BUCKET!r})"

    def uri(self, prefix: str) -> str:
        """The blob URI of ``prefix`` in the test bucket (no credentials in it)."""
        return f"s3://{BUCKET}/{prefix}?endpoint_override={self.host_port}&scheme=http"

    def boto3_client(self) -> Any:
        """A boto3 S3 client with the fixture's credentials (to plant objects)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
        )


def require_s3_server() -> S3Server:
    """Start a moto server with a bucket, an IAM user and authentication on; the caller
    stops it (``server.server.stop()``). Fails (CI) or skips when it cannot start."""
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError as e:
        _unavailable(f"moto[server] or boto3 is not installed: {e}")
    try:
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        # Authentication is off until the reset below: bootstrap the user and bucket.
        boot = {
            "endpoint_url": endpoint,
            "region_name": "us-east-1",
            "aws_access_key_id": "bootstrap",
            "aws_secret_access_key": "bootstrap",
        }
        iam = boto3.client("iam", **boot)
        iam.create_user(UserName="persist-tests")
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
        }
        iam.put_user_policy(
            UserName="persist-tests", PolicyName="s3", PolicyDocument=json.dumps(policy)
        )
        key = iam.create_access_key(UserName="persist-tests")["AccessKey"]
        boto3.client("s3", **boot).create_bucket(Bucket=BUCKET)
        req = urllib.request.Request(
            f"{endpoint}/moto-api/reset-auth",
            data=b"0",
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()
    except Exception as e:  # the server or its bootstrap failed
        _unavailable(f"moto server did not start: {type(e).__name__}: {e}")
    return S3Server(
        endpoint=endpoint,
        host_port=f"{host}:{port}",
        access_key_id=key["AccessKeyId"],
        secret_access_key=key["SecretAccessKey"],
        server=server,
    )


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One authenticated moto S3 server per test session (see the module docstring)."""
    server = require_s3_server()
    saved = {name: os.environ.get(name) for name in _ENV}
    os.environ["AWS_ACCESS_KEY_ID"] = server.access_key_id
    os.environ["AWS_SECRET_ACCESS_KEY"] = server.secret_access_key
    os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
    os.environ.pop("AWS_SESSION_TOKEN", None)
    try:
        yield server
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.server.stop()


@pytest.fixture
def s3_blob_uri(s3_server: S3Server) -> str:
    """A blob URI of an empty prefix of its own in the test bucket."""
    return s3_server.uri(f"t{os.getpid()}-{next(_prefixes)}")
