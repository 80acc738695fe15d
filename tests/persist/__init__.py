"""Tests of persist: shards, handles, compaction, GC, transactions, schema evolution."""
