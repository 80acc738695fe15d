"""MERGE INTO a shard from Spark (``PersistTable.merge``): Delta Lake's clauses, with
conditions and values in Spark SQL (strings or ``Column``s), planned by persist.

One set of semantics: the merge is :func:`persist.merge_into.run_merge`, as
``WriteHandle.merge`` runs it (matching by key identity, the first clause that holds,
duplicate matches refused, safe casts, no write for an unchanged row, one commit planned
again on a lost race); only the evaluator differs.  :class:`SparkEvaluator` evaluates
the clauses' conditions and computed values with Spark on the source and live target
rows the plan joined (handed to Spark with ``createDataFrame``), and returns only the
chosen clause and the computed values: a retraction is the stored row as persist read
it, and a value given as a plain ``alias.column`` reference is taken from the Arrow
rows, so no stored value is rebuilt from what Spark converted (Spark keeps
microseconds).

The source DataFrame is collected to the driver as Arrow (``DataFrame.toArrow``), as a
``PersistTable.upsert`` of a shard Spark cannot hold exactly is: this path suits
sources that fit the driver.

Source of the idea: delta-spark's ``DeltaMergeBuilder`` (``DeltaTable.merge``), whose
clauses take SQL strings or Columns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from persist.errors import InvalidUsage
from persist.merge_into import MergeBuilder, MergeResult, check_spec, run_merge
from persist.merge_plan import CLAUSE, S_ROW, T_ROW, ClauseKind, Item, MergeSpec, out_of_scope

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["SparkEvaluator", "merge_builder", "source_arrow", "spark_evaluator"]

_ORDER = "__persist_merge_i"


def _column(expr: Any, what: str) -> Any:
    from pyspark.sql import Column
    from pyspark.sql import functions as F

    if isinstance(expr, str):
        return F.expr(expr)
    if isinstance(expr, Column):
        return expr
    raise InvalidUsage(f"merge: {what} must be a Spark SQL string or a Column, not {type(expr)}")


class SparkEvaluator:
    """:class:`persist.merge_plan.Evaluator` on a SparkSession: conditions and values
    are Spark SQL strings or ``Column``s over ``<source_alias>.<col>`` and
    ``<target_alias>.<col>``."""

    def __init__(
        self, spark: SparkSession, spec: MergeSpec, source: pa.Table, target: pa.Table
    ) -> None:
        self.spark = spark
        self.spec = spec
        self._source = source
        self._target = target
        self._frames: dict[str, DataFrame] = {}

    def _frame(self, side: str) -> DataFrame:
        if side not in self._frames:
            table = self._source if side == "s" else self._target
            alias = self.spec.source_alias if side == "s" else self.spec.target_alias
            try:
                df = self.spark.createDataFrame(table)
            except Exception as e:  # noqa: BLE001 - Spark raises many types here
                raise InvalidUsage(
                    f"merge: the {'source' if side == 's' else 'target'} rows cannot be "
                    f"handed to Spark to evaluate the clauses: {e}"
                ) from None
            self._frames[side] = df.alias(alias)
        return self._frames[side]

    def _joined(self, kind: ClauseKind, rows: pa.Table) -> DataFrame:
        from pyspark.sql import functions as F

        r = self.spark.createDataFrame(
            rows.append_column(_ORDER, pa.array(range(rows.num_rows), pa.int64()))
        ).alias("merge_rows")
        if kind != "not_matched_by_source":
            s = self._frame("s")
            r = r.join(s, F.col(f"merge_rows.`{S_ROW}`") == s[f"`{S_ROW}`"])
        if kind != "not_matched":
            t = self._frame("t")
            r = r.join(t, F.col(f"merge_rows.`{T_ROW}`") == t[f"`{T_ROW}`"])
        return r

    def evaluate(
        self,
        kind: ClauseKind,
        rows: pa.Table,
        conditions: Sequence[Item | None],
        values: Sequence[Item],
    ) -> pa.Table:
        from pyspark.errors import PySparkException
        from pyspark.sql import functions as F

        joined = self._joined(kind, rows)
        checked: list[tuple[Item, Any]] = []
        for item in [c for c in conditions if c is not None] + list(values):
            col = _column(item.expr, item.what)
            try:
                joined.select(col).schema  # noqa: B018 - analysis only, nothing runs
            except PySparkException as e:
                raise out_of_scope(self.spec, kind, item, str(e).splitlines()[0]) from None
            checked.append((item, col))
        cols = {id(item): col for item, col in checked}
        case: Any = None
        for i, c in enumerate(conditions):
            cond = F.lit(True) if c is None else cols[id(c)]
            case = F.when(cond, F.lit(i)) if case is None else case.when(cond, F.lit(i))
        clause = (F.lit(-1) if case is None else case.otherwise(F.lit(-1))).cast("long")
        out = joined.select(
            clause.alias(CLAUSE),
            *[cols[id(v)].alias(v.name) for v in values],
            F.col(f"merge_rows.`{_ORDER}`").alias(_ORDER),
        ).orderBy(_ORDER)
        try:
            table = out.toArrow()
        except PySparkException as e:
            raise InvalidUsage(
                f"merge: the clauses failed in Spark: {str(e).splitlines()[0]}; "
                "nothing was committed"
            ) from None
        return table.drop_columns([_ORDER])

    def close(self) -> None:
        self._frames.clear()


def spark_evaluator(spark: SparkSession) -> Callable[[MergeSpec, pa.Table, pa.Table], Any]:
    """The :data:`persist.merge_plan.EvaluatorFactory` of a :class:`SparkEvaluator`."""

    def factory(spec: MergeSpec, source: pa.Table, target: pa.Table) -> SparkEvaluator:
        return SparkEvaluator(spark, spec, source, target)

    return factory


def source_arrow(source: Any) -> pa.Table:
    """A merge source as Arrow: a Spark DataFrame collected (``toArrow``), or anything
    :func:`persist.merge_into.as_source` takes."""
    from pyspark.sql import DataFrame

    from persist.merge_into import as_source

    if isinstance(source, DataFrame):
        return source.toArrow()
    return as_source(source)


def merge_builder(
    table: Any,
    source: Any,
    on: Sequence[str] | None,
    source_alias: str,
    target_alias: str,
) -> MergeBuilder[MergeResult]:
    """The builder of ``PersistTable.merge``: ``table`` a :class:`spark.PersistTable`;
    clauses take Spark SQL strings or ``Column``s; ``execute()`` commits one change
    through a write handle of the table's shard (:func:`persist.merge_into.run_merge`)."""
    from pyspark.sql import Column

    src = source_arrow(source)
    ks, vs = table.schemas()
    keys = ks.names
    spec = check_spec(on, source_alias, target_alias, keys)
    data = pa.schema([*ks, *vs])

    def run(spec: MergeSpec) -> MergeResult:
        with table.client() as client, client.open_writer(table.shard, ks, vs) as w:
            return run_merge(w, src, spec, data, keys, evaluator=spark_evaluator(table.spark))

    return MergeBuilder(spec, run, accepts=(str, Column))
