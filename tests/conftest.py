"""Shared pytest configuration: fixtures for a real PostgreSQL server and one local
SparkSession per test session live in their own modules, registered here."""

from __future__ import annotations

pytest_plugins = ["pg_fixtures", "spark_fixtures"]
