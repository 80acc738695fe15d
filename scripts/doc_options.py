"""The meanings of the Spark sources' options, for the option tables of
``docs/guide/spark.md`` (built by ``scripts/gen_docs.py``).

Each table maps the option names a row documents (aliases together) to its meaning. The
generator checks the names against the tuples the sources check options against, so an
option added to a source without a row here, or a row for an option a source dropped,
fails ``tests/test_docs_generated.py``.
"""

from __future__ import annotations

PERSIST_READ: dict[tuple[str, ...], str] = {
    ("stash", "blob"): "the stash URL (consensus) and blob URI (parts); required",
    ("path", "shard"): 'the shard\'s name (`load("name")` gives `path`)',
    ("as_of",): """the time to read (default: the latest complete time, `upper - 1`; for a
        closed shard, upper `{}`, the latest time any update has, at least the since); it
        must be at or after the shard's since and before its upper""",
    ("consolidate",): """`full` (default): the snapshot, equal to
        `ReadHandle.snapshot(as_of)`: each distinct row once with its multiplicity in
        `_diff`, rows that cancel absent; the read is cut by key range with no shuffle, so
        all updates of a key meet in one task. `partition`: updates consolidated within
        each input partition only, so a row may appear in several partitions with partial
        diffs. `none`: the raw updates with times `<= as_of`. For both raw modes,
        `spark.persist_source.consolidated(df)` (summing `_diff` per distinct row) gives
        the snapshot""",
    ("expand",): """`true`: no diff column, each row repeated by its multiplicity (only
        with `consolidate=full`; a negative multiplicity raises)""",
    ("time_column",): """add a `bigint` column with the read time (`as_of`; the update's
        own time with `consolidate=none` and in streaming micro-batches after the
        first)""",
    ("diff_column",): "the name of the diff column (default `_diff`)",
    ("partition_bytes",): """with `consolidate=partition`/`none`, parts share an input
        partition up to this many encoded bytes (default 128 MiB); `1` gives one partition
        per part""",
    ("partitions",): """with `consolidate=full`, the number of key ranges (input
        partitions) to cut the read into (default: as many as the raw read's partitions);
        fewer come out when the parts' key samples cannot separate that many""",
    ("pushdown",): """`true`: take Spark's filters on key and value columns, skip parts by
        their statistics and apply the filters in the tasks, on a PySpark that plans each
        query afresh (not PySpark 4, see "Filters and projection"; default `false`)""",
    ("readonly",): """`true`: open the stash `readonly` and plan without a reader lease, so
        the read writes nothing (no state version); a GC by a writer during the job may
        delete a part it reads, and the job then fails naming the file (run it again).
        Batch reads only; `PersistTable.for_name(..., readonly=True)` sets it (default
        `false`)""",
}

PERSIST_WRITE: dict[tuple[str, ...], str] = {
    ("stash", "blob", "path", "shard"): "as for reads",
    ("key_columns",): """comma-separated key columns of a new shard (default: every column
        that is not a value, time or diff column); for an existing shard they must be its
        keys""",
    ("value_columns",): """comma-separated value columns (default: none, or every
        remaining column when only `key_columns` is given)""",
    ("time_column",): "an integer column giving each row's time",
    ("time",): "one time for every row (at or after the shard's upper)",
    ("diff_column",): """an integer column giving each row's diff (default: `_diff` if the
        DataFrame has it, else every diff is 1)""",
    ("upper",): "the shard's new upper (default: the largest time written + 1)",
    (
        "compaction",
    ): "`off` (default), `inline` or `background`: the committing client's compaction",
    ("unique_keys",): """`true`: refuse a write that inserts some key more than once (the
        positive diffs of its updates, over all tasks, sum to more than 1); checked over
        the whole write before it commits, not against rows already in the shard.
        Retracting and re-inserting a key in one write is allowed""",
    ("mergeSchema",): """`true`: evolve an existing shard's schema to take the DataFrame,
        as Delta Lake does: columns the shard lacks are added as nullable value columns,
        value columns the DataFrame holds in a wider type are widened. The new schema
        version is registered when the write is planned. Without it, extra columns raise
        naming them""",
}

STASH_READ: dict[tuple[str, ...], str] = {
    ("url", "stash"): "the stash URL; required",
    ("path", "collection"): "the collection's name",
    ("schema",): """a DDL schema to read with instead of the inferred one (or
        `.schema(ddl)`); names match the collection's columns as Spark resolves them
        (exactly, else ignoring case). A column takes only the JSON values its type holds
        exactly (a string column takes any value, non-strings as JSON text; numbers need
        a number, `date`/`timestamp`/`time` an ISO 8601 string (timestamps also epoch
        seconds), `binary` a string or bytes, `boolean` a boolean; no string is parsed as
        a number): anything else raises naming the column""",
    ("time_column",): "add the peek time as a `bigint` column",
    ("diff_column",): """add the multiplicity as a column (rows are then not repeated;
        negative multiplicities are shown instead of raising)""",
    (
        "flatten",
    ): "`false`: keep whole keys and values as JSON text in `key` / `value` (default `true`)",
    ("key_column", "value_column"): """names of the columns holding a whole (non-object)
        key / value (default `key` / `value`)""",
}
