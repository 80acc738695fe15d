"""Benchmarks (not tests): this project's stash, persist and Spark paths measured against
the limits (raw ``sqlite3``/psycopg, ``pyarrow.parquet``, ``df.write.parquet``) and the
peers (delta-rs, pyiceberg, DuckDB) on the same data, in the same run.

``python -m bench.run_all [--quick]`` (what ``make bench`` runs) executes every bench,
collects their JSON results under ``var/bench-results/`` and writes ``docs/benchmarks.md``
plus the plots in ``docs/img/`` (:mod:`bench.report`).

Invariants kept by every module here:

* every figure is a ratio measured in one run against a limit or a peer doing the same
  operation on the same Arrow data; absolute numbers are kept beside it, with the machine's
  description (:func:`bench.common.describe_machine`);
* contestants run in interleaved rounds (order rotated each round) and figures are medians
  over the rounds (:func:`bench.common.interleave`);
* a goal that is missed is recorded as missed, never dropped; a section that fails is
  recorded with its error, never silently skipped;
* nothing under ``bench/`` is imported by ``stash``, ``persist`` or ``spark``.
"""
