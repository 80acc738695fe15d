"""The import layers of the project: no circle anywhere, no import against the layer order.

Every module of the packages in :data:`PACKAGES` is parsed with :mod:`ast` (nothing is
imported) and every ``import`` / ``from ... import`` statement in it is collected: at
module level, inside functions and classes, under ``if TYPE_CHECKING:`` and in ``try``
blocks alike, relative imports resolved.  ``from pkg import name`` is an import of
``pkg.name`` if that is a module of the project, else of ``pkg``; ``import a.b.c`` is
an import of ``a.b.c`` (the packages above it are not counted: their ``__init__`` is
the package's public face, not a dependency of its own modules).  Imports of anything
outside :data:`PACKAGES` (the standard library, third-party packages, ``migrations``)
are ignored, and so are lookups by name at run time (``importlib.import_module`` of a
``"module.Class"`` string, as :mod:`stash.base` finds its backends).

The rules, declared as data below:

* :data:`PACKAGES` is an order: a package never imports one after it
  (``stash`` < ``persist`` < ``spark`` < ``bench``);
* :data:`TIERS` orders the modules of a package in tiers, lowest first; a module never
  imports a module of a higher tier of its package; modules of one tier may import each
  other as long as no circle forms; a module of a package with tiers that no tier names
  fails the test (place it);
* :data:`NO_SELF_INIT`: no module of these packages imports its own package's
  ``__init__`` (the public face imports the modules, never the other way round);
* no circle of imports anywhere, type-only and function-local imports included.  A
  circle is reported as the path it runs, ``a -> b -> c -> a``.

The persist tiers follow the layering of Materialize's persist-client
(``src/persist-client/src/internal/state.rs`` below ``machine.rs`` below ``write.rs`` /
``read.rs``), as ``docs/architecture.md`` describes it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: The project's packages, lowest first: a package never imports one after it.
PACKAGES: tuple[str, ...] = ("stash", "persist", "spark", "bench")

#: Packages none of whose modules may import the package's own ``__init__``.
NO_SELF_INIT: tuple[str, ...] = ("stash", "persist")

#: Per package, its tiers, lowest first: ``(tier name, module patterns)``.  A pattern
#: ``a.b`` matches the module ``a.b`` only; ``a.b.*`` matches ``a.b`` and every module
#: under it (``a.b.c``); any other pattern ending in ``*`` matches every module whose
#: name starts with what precedes the ``*`` (``persist.spine*``: ``persist.spine``,
#: ``persist.spine_merge``).  A package absent from this mapping is one tier.
TIERS: dict[str, list[tuple[str, list[str]]]] = {
    "stash": [
        ("errors and frontiers", ["stash.errors", "stash.antichain"]),
        (
            "rules, codecs, URLs, the primitive transaction, the schema",
            [
                "stash.canonical",
                "stash.record_codec",
                "stash.codec",
                "stash.consolidation",
                "stash.metrics",
                "stash.txn",
                "stash.schema",
                "stash.migrate",
                "stash.url",
                "stash.placement",
            ],
        ),
        ("collection handles and table transactions", ["stash.collection", "stash.table"]),
        (
            "the peek rules, the handle checks, retention, compare-and-set logs",
            ["stash.peek", "stash.checks", "stash.retention", "stash.logs"],
        ),
        ("transactions with one consistent read", ["stash.transaction"]),
        ("the Stash contract (backends looked up by name)", ["stash.base"]),
        (
            "typed collections, key ranges, change feed",
            [
                "stash.typed",
                "stash.keyed",
                "stash.ranges",
                "stash.feed",
                "stash.ops",
            ],
        ),
        (
            "backends, their primitive transactions and statements",
            ["stash.memory", "stash.sql", "stash.sql_txn", "stash.pg_statements"],
        ),
        (
            "SQL dialects (each imports stash.sql, never the reverse)",
            ["stash.sqlite", "stash.postgres"],
        ),
        ("entry points", ["stash.cli", "stash"]),
    ],
    "persist": [
        (
            "1 errors, ids, config, metrics",
            [
                "persist.errors",
                "persist.ids",
                "persist.config",
                "persist.metrics",
                "persist.tracked",
                "persist.closing",
            ],
        ),
        # The blob store sits below the data modules that write and read parts (as
        # Materialize keeps its blob code in the persist crate, below persist-client).
        ("1b blob", ["persist.blob", "persist.blob.*"]),
        (
            "2 data",
            [
                "persist.types",
                "persist.spine*",
                "persist.updates",
                "persist.encoding",
                "persist.decoding",
                "persist.consolidation",
                "persist.key_identity",
                "persist.casts",
                "persist.stats",
                "persist.keys",
                "persist.key_identity",
                "persist.exprs",
                "persist.filters",
                "persist.fingerprint",
                "persist.merge",
                "persist.schemacache",
                "persist.pool",
                "persist.parts",
                "persist.batch",
                "persist.lease",
                "persist.lease_state",
                "persist.landed",
                "persist.arrow_input",
                "persist.commit_note",
                "persist.progress",
                "persist.relation",
            ],
        ),
        (
            "3 state: the commands and their pure methods",
            [
                "persist.commands",
                "persist.state_base",
                "persist.state",
                "persist.state_codec",
                "persist.history_record",
                "persist.retention",
                "persist.store_identity",
            ],
        ),
        (
            "4 consensus",
            [
                "persist.retired_keys",
                "persist.shard_registry",
                "persist.log_text",
                "persist.consensus",
            ],
        ),
        ("5 machine", ["persist.machine", "persist.state_check"]),
        (
            "6 appended, fetch",
            ["persist.appended", "persist.fetch", "persist.rows_read", "persist.direct_plan"],
        ),
        ("7 context", ["persist.context"]),
        (
            "8 handles and maintenance",
            [
                "persist.handle",
                "persist.builder",
                "persist.batch_rules",
                "persist.idempotency",
                "persist.write_rows",
                "persist.write",
                "persist.rows",
                "persist.merge_plan",
                "persist.merge_into",
                "persist.read",
                "persist.compactor",
                "persist.optimize",
                "persist.version_read",
                "persist.gc",
                "persist.fsck",
                "persist.shards",
                "persist.maintenance",
            ],
        ),
        ("9 txn", ["persist.txn_rows", "persist.txn", "persist.txn_commit", "persist.snapshots"]),
        (
            "9b table",
            ["persist.history", "persist.duckdb_read", "persist.app_txn", "persist.table"],
        ),
        ("10 client, cli, public face", ["persist.client", "persist.cli*", "persist"]),
    ],
    "spark": [
        (
            "options and conversions",
            [
                "spark.options",
                "spark.names",
                "spark.arrow_spark",
                "spark.stash_convert",
                "spark.daemon",
            ],
        ),
        ("shared persist plumbing", ["spark.persist_common", "spark.persist_planning"]),
        (
            "data source parts",
            [
                "spark.persist_reader",
                "spark.persist_writer",
                "spark.persist_stream",
                "spark.persist_stream_writer",
            ],
        ),
        (
            "data sources and transactions",
            [
                "spark.persist_source",
                "spark.stash_source",
                "spark.persist_txn",
            ],
        ),
        ("format registration and sessions", ["spark.formats", "spark.session"]),
        ("the compaction job", ["spark.jobs", "spark.jobs.compact"]),
        (
            "the table and its row-level changes",
            [
                "spark.row_changes_driver",
                "spark.row_changes",
                "spark.merge",
                "spark.native_merge",
                "spark.native_plan",
                "spark.native_read",
                "spark.table_history",
                "spark.table",
            ],
        ),
        ("public face", ["spark"]),
        ("jobs", ["spark.jobs.*"]),
    ],
}


# --------------------------------------------------------------------- the graph
def module_name(root: Path, path: Path) -> str:
    """The dotted name of the module at ``path`` (``pkg/a/__init__.py`` -> ``pkg.a``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def find_modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Every module (``.py`` file) of ``packages`` under ``root``, by dotted name."""
    out: dict[str, Path] = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            out[module_name(root, path)] = path
    return out


def _resolve(name: str, known: Mapping[str, object]) -> str | None:
    """``name`` or the longest dotted prefix of it that is a known module."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, is_package: bool, source: str, known: Mapping[str, object]) -> set[str]:
    """The project modules ``module`` imports (every import statement anywhere in
    ``source``; see the module docstring for how names resolve).  Raises ``SyntaxError``
    on a file that does not parse."""
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name, known)
                if target is not None:
                    out.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                origin = ".".join([*base, *([node.module] if node.module else [])])
            else:
                origin = node.module or ""
            for alias in node.names:
                full = f"{origin}.{alias.name}" if origin else alias.name
                target = full if full in known else _resolve(origin, known)
                if target is not None:
                    out.add(target)
    out.discard(module)
    return out


def build_graph(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    """The import graph of ``packages``: module -> the project modules it imports."""
    modules = find_modules(root, packages)
    return {
        m: imports_of(m, p.name == "__init__.py", p.read_text(encoding="utf-8"), modules)
        for m, p in modules.items()
    }


# ------------------------------------------------------------------- the checks
def strong_components(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each sorted, in
    sorted order): Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    succ = {n: sorted(t for t in graph.get(n, ()) if t in graph) for n in graph}
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, int]] = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            if i < len(succ[node]):
                work.append((node, i + 1))
                nxt = succ[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                comp: list[str] = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    components.append(sorted(comp))
    return sorted(components)


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module, as a path
    ``[a, b, ..., a]``: a shortest circle through the component's first module (every
    module of a component lies on some circle; :func:`strong_components` names them)."""
    succ = {n: sorted(t for t in graph.get(n, ()) if t in graph) for n in graph}
    return [_cycle_in(comp, succ) for comp in strong_components(graph)]


def _cycle_in(comp: Sequence[str], succ: Mapping[str, Sequence[str]]) -> list[str]:
    """A shortest circle through the first module of ``comp`` (breadth-first)."""
    members = set(comp)
    start = comp[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt_frontier: list[str] = []
        for node in frontier:
            for nxt in succ[node]:
                if nxt not in members:
                    continue
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if nxt not in prev:
                    prev[nxt] = node
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    raise AssertionError(f"no circle through {start} in {comp}")  # pragma: no cover


def _matches(pattern: str, module: str) -> bool:
    """Whether ``module`` matches ``pattern`` (see :data:`TIERS`)."""
    if pattern.endswith(".*"):
        return module == pattern[:-2] or module.startswith(pattern[:-1])
    if pattern.endswith("*"):
        return module.startswith(pattern[:-1])
    return module == pattern


def tier_of(
    module: str, tiers: Mapping[str, Sequence[tuple[str, Sequence[str]]]]
) -> tuple[int, str] | None:
    """``(index, name)`` of the first tier of ``module``'s package with a pattern that
    matches it, or ``None``."""
    for i, (name, patterns) in enumerate(tiers.get(module.split(".")[0], ())):
        if any(_matches(p, module) for p in patterns):
            return i, name
    return None


def layer_violations(
    graph: Mapping[str, Iterable[str]],
    packages: Sequence[str],
    tiers: Mapping[str, Sequence[tuple[str, Sequence[str]]]],
    no_self_init: Iterable[str] = (),
) -> list[str]:
    """Every import against the declared order, one line each (sorted)."""
    out: list[str] = []
    rank = {p: i for i, p in enumerate(packages)}
    guarded = set(no_self_init)
    for module in sorted(graph):
        pkg = module.split(".")[0]
        mine = tier_of(module, tiers)
        if pkg in tiers and mine is None:
            out.append(f"{module}: in no tier of {pkg}; add it to TIERS")
        for target in sorted(graph[module]):
            tpkg = target.split(".")[0]
            if tpkg not in rank or pkg not in rank:
                continue
            if rank[tpkg] > rank[pkg]:
                out.append(f"{module} imports {target}: package {pkg} is below {tpkg}")
                continue
            if tpkg != pkg:
                continue
            if target == pkg and pkg in guarded:
                out.append(f"{module} imports its package's __init__ ({pkg})")
                continue
            theirs = tier_of(target, tiers)
            if mine is not None and theirs is not None and theirs[0] > mine[0]:
                out.append(
                    f"{module} (tier {mine[1]!r}) imports {target} (higher tier {theirs[1]!r})"
                )
    return out


def format_cycle(cycle: Sequence[str]) -> str:
    return " -> ".join(cycle)


def _report(graph: Mapping[str, Iterable[str]], package: str) -> list[str]:
    """Circles among ``package``'s modules and layer violations of its modules."""
    cycles = [
        f"circle: {format_cycle(c)} (its component: {', '.join(comp)})"
        for c, comp in zip(find_cycles(graph), strong_components(graph), strict=True)
        if c[0].split(".")[0] == package
    ]
    own = {m: graph[m] for m in graph if m.split(".")[0] == package}
    return cycles + layer_violations(own, PACKAGES, TIERS, NO_SELF_INIT)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return build_graph(ROOT, PACKAGES)


# ----------------------------------------------------------------- the real tests
@pytest.mark.parametrize("package", ["stash", "spark", "bench"])
def test_layers(graph: dict[str, set[str]], package: str) -> None:
    problems = _report(graph, package)
    assert not problems, "\n".join(problems)


def test_persist_layers(graph: dict[str, set[str]]) -> None:
    problems = _report(graph, "persist")
    assert not problems, "\n".join(problems)


def test_no_circle_anywhere(graph: dict[str, set[str]]) -> None:
    cycles = find_cycles(graph)
    assert not cycles, "\n".join(format_cycle(c) for c in cycles)


def test_every_package_found(graph: dict[str, set[str]]) -> None:
    """The scan sees the modules it should (a wrong root would pass every check)."""
    for module in ("stash.base", "persist.state", "spark.session", "bench.common"):
        assert module in graph


# ------------------------------------------------- the lookups by name it cannot see
def test_backends_by_name_resolve() -> None:
    """Every backend and SQL dialect named as a string (the imports this test's parser
    does not see) resolves to a class of the right kind that opens URLs its own way."""
    from stash.base import BACKENDS, Stash, load_by_name
    from stash.sql import SQL_DIALECTS, _Ops

    for qualname in BACKENDS.values():
        cls = load_by_name(qualname)
        assert issubclass(cls, Stash), qualname
        assert cls._from_url.__func__ is not Stash._from_url.__func__, qualname
    for qualname in SQL_DIALECTS.values():
        assert issubclass(load_by_name(qualname), _Ops), qualname


def test_backends_imported_only_when_asked(tmp_path: Path) -> None:
    """``import stash`` imports no SQL dialect; opening a SQLite stash imports SQLite's
    dialect and not Postgres's (nor psycopg)."""
    url = f"sqlite:///{tmp_path / 'stash.db'}"
    code = (
        "import sys\n"
        "import stash, stash.sql\n"
        "names = ('stash.sqlite', 'stash.postgres', 'psycopg')\n"
        "print([n for n in names if n in sys.modules])\n"
        f"stash.Stash.open({url!r}).close()\n"
        "print([n for n in names if n in sys.modules])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    assert out[:2] == ["[]", "['stash.sqlite']"]


# ------------------------------------------------------------ the checker itself
SELF_TEST_PACKAGES = ("low", "high")
SELF_TEST_TIERS: dict[str, list[tuple[str, list[str]]]] = {
    "low": [("bottom", ["low.a", "low.b"]), ("top", ["low.c", "low"])],
}


def _graph_of(sources: Mapping[str, str]) -> dict[str, set[str]]:
    """The import graph of synthetic modules (name -> source; a name ending in
    ``.__init__`` is a package)."""
    names = {n.removesuffix(".__init__"): n.endswith(".__init__") for n in sources}
    return {
        n.removesuffix(".__init__"): imports_of(
            n.removesuffix(".__init__"), n.endswith(".__init__"), src, names
        )
        for n, src in sources.items()
    }


def test_checker_resolves_every_kind_of_import() -> None:
    g = _graph_of(
        {
            "low.__init__": "from low.a import X\n",
            "low.a": (
                "from typing import TYPE_CHECKING\n"
                "import os\n"
                "if TYPE_CHECKING:\n    from low.b import Y\n"
                "def f():\n    from . import c\n"
                "from low import VALUE\n"
            ),
            "low.b": "import low.c.sub\n",  # low.c.sub is unknown: its known prefix counts
            "low.c.__init__": "from ..b import g\nfrom . import d\n",
            "low.c.d": "",
        }
    )
    assert g["low"] == {"low.a"}
    assert g["low.a"] == {"low.b", "low.c", "low"}
    assert g["low.b"] == {"low.c"}
    assert g["low.c"] == {"low.b", "low.c.d"}


def test_checker_finds_a_circle() -> None:
    g = _graph_of(
        {
            "low.a": "from low.b import x\n",
            "low.b": "def f():\n    from low.c import y\n",
            "low.c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import low.a\n",
            "low.d": "import low.a\n",
        }
    )
    cycles = find_cycles(g)
    assert [format_cycle(c) for c in cycles] == ["low.a -> low.b -> low.c -> low.a"]


def test_checker_finds_layer_violations() -> None:
    g = _graph_of(
        {
            "low.__init__": "from low.c import C\n",
            "low.a": "from low.c import C\n",  # bottom imports top
            "low.b": "import high.x\n",  # low imports the higher package
            "low.c": "from low.a import A\n",  # top imports bottom: fine
            "low.d": "import low.a\n",  # in no tier
            "low.e": "",  # in no tier, imports nothing
            "high.__init__": "",
            "high.x": "from high import y\nimport low.c\n",  # high has no tiers: fine
        }
    )
    problems = layer_violations(g, SELF_TEST_PACKAGES, SELF_TEST_TIERS, ["low"])
    assert problems == [
        "low.a (tier 'bottom') imports low.c (higher tier 'top')",
        "low.b imports high.x: package low is below high",
        "low.d: in no tier of low; add it to TIERS",
        "low.e: in no tier of low; add it to TIERS",
    ]
    g2 = _graph_of({"low.__init__": "", "low.a": "from low import thing\n"})
    assert layer_violations(g2, SELF_TEST_PACKAGES, SELF_TEST_TIERS, ["low"]) == [
        "low.a imports its package's __init__ (low)"
    ]
    assert layer_violations(g2, SELF_TEST_PACKAGES, SELF_TEST_TIERS) == [
        "low.a (tier 'bottom') imports low (higher tier 'top')"
    ]
