"""Code the tests share, never collected as tests: one settable :class:`Clock`
(``clock``), throwaway servers and their pytest fixtures (``pgserver``, ``pg_fixtures``,
``s3_fixtures``, ``spark_fixtures``, registered by ``tests/conftest.py``), database
helpers (``dbutil``), the stash fault injector (``stash_faults``) and the in-process
driver of the persist Spark source (``source_harness``)."""
