"""Tests of the Spark data sources and jobs (local SparkSession, one local-cluster run)."""
