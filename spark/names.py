"""Column names and blob paths as data where they reach Spark: quoted names, escaped
glob patterns.

Spark parses a column name given as a string: ``a.b`` is field ``b`` of a struct ``a``
and a backtick starts a quoted part. A name quoted with backticks (a backtick inside
doubled, as Spark's SQL quotes identifiers) is taken literally. Spark's file sources glob
the paths they are given (Hadoop's ``GlobPattern``): ``[``, ``]``, ``{``, ``}``, ``*``,
``?`` and ``\\`` are pattern characters unless escaped with a backslash. And Spark
resolves column names case-insensitively by default (``spark.sql.caseSensitive``), so two
columns ``v`` and ``V`` are one name to it.

Invariants: :func:`col` of any name is the column of exactly that name;
:func:`literal_path` of a path globs to exactly that path.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

__all__ = ["case_clash", "col", "literal_path", "quote"]

_GLOB = re.compile(r"([\\\[\]{}*?])")


def quote(name: str) -> str:
    """``name`` as a quoted Spark identifier: ```a.b``` for ``a.b``, a backtick
    doubled."""
    return "`" + name.replace("`", "``") + "`"


def col(name: str) -> Any:
    """The Spark ``Column`` named exactly ``name`` (``pyspark.sql.functions.col`` of the
    quoted name)."""
    from pyspark.sql import functions as F

    return F.col(quote(name))


def literal_path(path: str) -> str:
    """``path`` with Hadoop's glob characters escaped, so a file source reads that one
    path (``file:///data/b[1]/p`` -> ``file:///data/b\\[1\\]/p``)."""
    return _GLOB.sub(r"\\\1", path)


def case_clash(names: Iterable[str]) -> tuple[str, str] | None:
    """Two of ``names`` that differ only in case (one name to a case-insensitive Spark
    session), or ``None``."""
    seen: dict[str, str] = {}
    for n in names:
        other = seen.setdefault(n.lower(), n)
        if other != n:
            return other, n
    return None
