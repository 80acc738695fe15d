"""Reliability campaigns (crash, fault, concurrency and lifecycle models) and their
subprocess workers; ``campaign`` records each run's figures for ``report.py``."""
