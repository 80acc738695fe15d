"""Shared pytest configuration: fixtures for a real PostgreSQL server, one local
SparkSession per test session and an S3-compatible server (moto) live in their own
modules, registered here."""

from __future__ import annotations

pytest_plugins = ["pg_fixtures", "spark_fixtures", "s3_fixtures"]
