"""Arrow types whose presence depends on the installed pyarrow, named once for the
tests that parametrize over them (a type the installed pyarrow lacks cannot be in any
shard, so there is no case to test, rather than a case skipped)."""

from __future__ import annotations

import pyarrow as pa

#: ``decimal32`` and ``decimal64`` (pyarrow >= 18; ``pa.types.is_decimal`` accepts them).
NARROW_DECIMALS: list[str] = [d for d in ("decimal32", "decimal64") if hasattr(pa, d)]
