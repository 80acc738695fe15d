"""Tests of the stash: every backend's contract, migrations, concurrency, redaction."""
