"""The limits and peers the benchmarks compare against, behind one small interface.

A :class:`Contender` writes an Arrow table under a *tag* (a fresh name per round), reads it
back, and appends small tables one at a time. Implementations here:

* :class:`ParquetLimit`: ``pyarrow.parquet.write_table`` / ``read_table`` of one file (the
  limit: what writing and reading the same Arrow data as Parquet costs at all);
* :class:`DeltaPeer`: delta-rs (``deltalake.write_deltalake``, ``mode="append"`` for
  appends, ``DeltaTable(path).to_pyarrow_table()``);
* :class:`IcebergPeer`: pyiceberg with its SQL catalog on SQLite (``create_table``,
  ``Table.append``, ``scan().to_arrow()``);
* :class:`DuckDBPeer`: DuckDB ``COPY <arrow table> TO '<file>' (FORMAT parquet)`` and
  ``SELECT * FROM read_parquet(?)``.

The persist contender lives in :mod:`bench.bench_persist` (it needs the engine).

Invariants kept here:

* only ``write``, ``read`` and an appender's call are meant to be timed: creating catalogs,
  namespaces and empty tables happens in ``prepare`` / ``appender`` (untimed), the same for
  every contender;
* every contender receives the very same ``pyarrow.Table`` (see :mod:`bench.data`) and
  writes with its library's default settings (compression etc.), which the report states;
* all files live under the contender's own root directory; ``cleanup(tag)`` removes what a
  tag wrote, so a long run does not fill the disk.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "Appender",
    "Contender",
    "DeltaPeer",
    "DuckDBPeer",
    "IcebergPeer",
    "ParquetLimit",
    "dir_bytes",
    "validate_tag",
]

#: Appends one small table (its rows) to an already prepared table.
Appender = Callable[[pa.Table], None]


def validate_tag(tag: str) -> str:
    """Return ``tag`` if it is a safe name (letters, digits, ``_``, at most 64 characters).

    Raises:
        ValueError: otherwise (tags become file and table names).
    """
    if not tag or len(tag) > 64 or not all(c.isalnum() or c == "_" for c in tag):
        raise ValueError(f"bench tag must be 1-64 letters, digits or '_', got {tag!r}")
    return tag


def dir_bytes(path: Path) -> int:
    """Total size (bytes) of the files under ``path`` (a file's own size if a file)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += (Path(dirpath) / f).stat().st_size
            except OSError:
                pass
    return total


class Contender:
    """Base class: a system that writes, reads and appends Arrow tables under a root dir.

    Args:
        root: a directory owned by this contender (created).
    """

    name = "contender"
    #: what the report says about its write settings
    settings = ""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def prepare(self, tag: str, schema: pa.Schema) -> None:
        """Untimed setup before :meth:`write` of ``tag`` (default: nothing)."""
        validate_tag(tag)

    def write(self, tag: str, table: pa.Table) -> None:
        """Write ``table`` as the whole contents of ``tag`` (timed)."""
        raise NotImplementedError

    def read(self, tag: str) -> pa.Table:
        """Read back everything written under ``tag`` (timed)."""
        raise NotImplementedError

    def appender(self, tag: str, schema: pa.Schema) -> Appender:
        """Untimed: create an empty table ``tag``; return a function that appends a small
        table to it as one commit (each call timed by the caller).

        Raises:
            NotImplementedError: the contender has no append operation.
        """
        raise NotImplementedError(f"{self.name} has no append")

    def path(self, tag: str) -> Path:
        """Where ``tag`` lives on disk."""
        return self.root / validate_tag(tag)

    def size_bytes(self, tag: str) -> int:
        """Bytes on disk of what ``tag`` holds."""
        p = self.path(tag)
        return dir_bytes(p) if p.exists() else 0

    def cleanup(self, tag: str) -> None:
        """Delete what ``tag`` wrote."""
        p = self.path(tag)
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif p.exists():
            p.unlink()

    def close(self) -> None:
        """Release resources (default: nothing)."""


class ParquetLimit(Contender):
    """``pyarrow.parquet.write_table`` / ``read_table`` of one file per tag (the limit)."""

    name = "pyarrow.parquet"
    settings = "pyarrow.parquet defaults (snappy, dictionary, 1Mi-row row groups)"

    def path(self, tag: str) -> Path:
        return self.root / f"{validate_tag(tag)}.parquet"

    def write(self, tag: str, table: pa.Table) -> None:
        pq.write_table(table, self.path(tag))

    def read(self, tag: str) -> pa.Table:
        return pq.read_table(self.path(tag))

    def appender(self, tag: str, schema: pa.Schema) -> Appender:
        """One new Parquet file per appended table (``<tag>/<n>.parquet``): the cost of
        writing the bytes with no table format around them."""
        d = self.root / validate_tag(tag)
        d.mkdir(parents=True, exist_ok=True)
        counter = [0]

        def append(t: pa.Table) -> None:
            pq.write_table(t, d / f"{counter[0]:08d}.parquet")
            counter[0] += 1

        return append

    def size_bytes(self, tag: str) -> int:
        p = self.path(tag)
        d = self.root / tag
        return dir_bytes(p) if p.exists() else (dir_bytes(d) if d.exists() else 0)

    def cleanup(self, tag: str) -> None:
        self.path(tag).unlink(missing_ok=True)
        shutil.rmtree(self.root / tag, ignore_errors=True)


class DeltaPeer(Contender):
    """delta-rs: ``write_deltalake`` (a new table per tag, or ``mode="append"``),
    ``DeltaTable(path).to_pyarrow_table()``."""

    name = "delta-rs"
    settings = "deltalake.write_deltalake defaults"

    def write(self, tag: str, table: pa.Table) -> None:
        from deltalake import write_deltalake

        write_deltalake(str(self.path(tag)), table, mode="error")

    def read(self, tag: str) -> pa.Table:
        from deltalake import DeltaTable

        return DeltaTable(str(self.path(tag))).to_pyarrow_table()

    def appender(self, tag: str, schema: pa.Schema) -> Appender:
        from deltalake import write_deltalake

        path = str(self.path(tag))
        write_deltalake(path, schema.empty_table(), mode="error")

        def append(t: pa.Table) -> None:
            write_deltalake(path, t, mode="append")

        return append


class IcebergPeer(Contender):
    """pyiceberg with its SQL catalog on SQLite (``<root>/catalog.db``, warehouse under
    ``<root>/warehouse``): ``create_table`` (untimed), ``append``, ``scan().to_arrow()``."""

    name = "pyiceberg"
    settings = "pyiceberg defaults (Parquet, zstd), SqlCatalog on SQLite"
    namespace = "bench"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        from pyiceberg.catalog.sql import SqlCatalog

        self.catalog = SqlCatalog(
            "bench",
            uri=f"sqlite:///{self.root / 'catalog.db'}",
            warehouse=f"file://{self.root / 'warehouse'}",
        )
        try:
            self.catalog.create_namespace(self.namespace)
        except Exception as e:  # NamespaceAlreadyExistsError on reuse of the root
            if "exist" not in str(e).lower():
                raise
        self._tables: dict[str, object] = {}

    def _ident(self, tag: str) -> tuple[str, str]:
        return (self.namespace, validate_tag(tag))

    def prepare(self, tag: str, schema: pa.Schema) -> None:
        self._tables[tag] = self.catalog.create_table(self._ident(tag), schema=schema)

    def write(self, tag: str, table: pa.Table) -> None:
        t = self._tables.get(tag)
        if t is None:
            raise KeyError(f"iceberg table {tag!r} was not prepared")
        t.append(table)  # type: ignore[attr-defined]

    def read(self, tag: str) -> pa.Table:
        result: pa.Table = self.catalog.load_table(self._ident(tag)).scan().to_arrow()
        return result

    def appender(self, tag: str, schema: pa.Schema) -> Appender:
        t = self.catalog.create_table(self._ident(tag), schema=schema)

        def append(x: pa.Table) -> None:
            t.append(x)

        return append

    def path(self, tag: str) -> Path:
        return self.root / "warehouse" / self.namespace / validate_tag(tag)

    def cleanup(self, tag: str) -> None:
        try:
            self.catalog.drop_table(self._ident(tag))
        except Exception:  # already gone: nothing to clean in the catalog
            pass
        self._tables.pop(tag, None)
        super().cleanup(tag)


class DuckDBPeer(Contender):
    """DuckDB writing Parquet: ``COPY src TO '<root>/<tag>.parquet' (FORMAT parquet)``
    with the Arrow table registered as ``src``; reading with ``read_parquet(?)``."""

    name = "duckdb"
    settings = "DuckDB COPY ... (FORMAT parquet) defaults (snappy), all cores"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        import duckdb

        self.con = duckdb.connect()

    def path(self, tag: str) -> Path:
        return self.root / f"{validate_tag(tag)}.parquet"

    def write(self, tag: str, table: pa.Table) -> None:
        target = str(self.path(tag))
        # COPY takes no bound parameter for its target; the path is ours (a validated tag
        # under our root) and quoted as an SQL string literal.
        if "'" in target:
            raise ValueError(f"duckdb target path must not contain a quote: {target!r}")
        self.con.register("src", table)
        try:
            self.con.execute(f"COPY src TO '{target}' (FORMAT parquet)")
        finally:
            self.con.unregister("src")

    def read(self, tag: str) -> pa.Table:
        result: pa.Table = self.con.sql(
            "SELECT * FROM read_parquet(?)", params=[str(self.path(tag))]
        ).to_arrow_table()
        return result

    def close(self) -> None:
        self.con.close()
