"""TEMPORARY stand-in (replaced by the r40rows branch's module at merge)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def _ident(col: pa.ChunkedArray) -> pa.ChunkedArray:
    t = col.type
    if pa.types.is_floating(t):
        c = pc.cast(col, pa.float64())
        vals = c.to_numpy(zero_copy_only=False).astype(np.float64) + 0.0
        vals[np.isnan(vals)] = np.nan
        bits = vals.view(np.int64)
        mask = pc.is_null(c).to_numpy(zero_copy_only=False)
        return pa.chunked_array([pa.array(bits, pa.int64(), mask=mask)])
    if pa.types.is_temporal(t):
        width = t.bit_width
        return pc.cast(col.view(pa.int64() if width == 64 else pa.int32()), pa.int64())
    if pa.types.is_dictionary(t):
        return pc.cast(col, t.value_type)
    return col


def identity_columns(table: pa.Table, key_names: Sequence[str]) -> pa.Table:
    return pa.table({f"__key{i}": _ident(table.column(k)) for i, k in enumerate(key_names)})
