"""What a table accepts as rows: anything Arrow can take, as one ``pyarrow.Table``.

:func:`as_arrow_table` is the one conversion every :class:`~persist.table.Table` input
goes through (``append``, ``upsert``, ``merge`` sources): a ``pyarrow.Table``,
``RecordBatch`` or ``RecordBatchReader``, a pandas ``DataFrame`` (its index dropped), a
polars ``DataFrame``, or any object with ``__arrow_c_stream__`` (the Arrow PyCapsule
stream interface: DuckDB relations, polars, nanoarrow, ...).

Invariants kept here: the conversion never changes a value (types are conformed to the
table's schema afterwards, by :func:`persist.rows.conform_rows`, which refuses a value
that does not fit); anything else is refused with :class:`~persist.errors.InvalidUsage`
naming its type and what is accepted.

Source of the idea: delta-rs's ``write_deltalake`` and pyiceberg's ``Table.append``,
which take pandas, Arrow and (delta-rs) any ``__arrow_c_stream__`` object.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from persist.errors import InvalidUsage

__all__ = ["ACCEPTED", "as_arrow_table"]

#: What :func:`as_arrow_table` accepts, for messages.
ACCEPTED = (
    "a pyarrow Table, RecordBatch or RecordBatchReader, a pandas or polars DataFrame, "
    "or an object with __arrow_c_stream__"
)


def as_arrow_table(data: Any, what: str) -> pa.Table:
    """``data`` as a ``pyarrow.Table`` (its columns as they are; see the module
    docstring for what is accepted).

    Args:
        data: the rows.
        what: the operation, for messages (e.g. ``"append to table 'orders'"``).

    Raises:
        InvalidUsage: ``data`` is none of the accepted kinds, or its conversion failed
            (naming the type and Arrow's reason).
    """
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    try:
        if isinstance(data, pa.RecordBatchReader):
            return data.read_all()
        module = type(data).__module__.split(".", 1)[0]
        if module == "pandas" and type(data).__name__ == "DataFrame":
            return pa.Table.from_pandas(data, preserve_index=False)
        if hasattr(data, "__arrow_c_stream__"):
            return pa.RecordBatchReader.from_stream(data).read_all()
        if module == "polars" and hasattr(data, "to_arrow"):  # polars before the capsule
            out = data.to_arrow()
            if isinstance(out, pa.Table):
                return out
    except (pa.ArrowException, TypeError, ValueError) as e:
        raise InvalidUsage(
            f"{what}: could not convert the {type(data).__name__} to Arrow: {e}"
        ) from None
    raise InvalidUsage(f"{what}: takes {ACCEPTED}, not {type(data).__name__}")
