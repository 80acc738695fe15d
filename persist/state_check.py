"""Checks that a version computed incrementally equals the version computed in full.

The state machine (:mod:`persist.machine`) computes each version's entries from the
previous version's (:meth:`persist.state.ShardState.to_entries_delta`), compares only the
entries a command may have touched, and reads running counters in place of passes over
every batch (:class:`persist.spine_levels.SpineBatch`'s ``inline_bytes``, ``num_parts``
and ``part_index``; :func:`persist.history_record.parts_changed`).  When :data:`ENABLED`
(the environment variable ``PERSIST_CHECK_INCREMENTAL=1``, which the test suite sets),
:func:`check_version` recomputes each version in full and raises
:class:`AssertionError` naming the first difference.  Slow (a full pass per version);
never enabled in production.

A machine that catches up with the head by decoding only the entries of the diffs it
missed (:meth:`persist.state.ShardState.from_entries_delta`) is checked the same way by
:func:`check_catch_up`.

Invariant checked: the state decoded from the entries' stored texts (what every other
process reads) equals the state; the entries
and their texts equal the full encoding; every key whose text differs from the previous
version's is among the touched keys; the running counters equal a recount.

Source of the idea: Materialize's persist-client ``internal/state_diff.rs`` and
``internal/apply.rs``, which in debug builds check that the state rebuilt from the diffs
equals the state computed in full.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from persist.state import ShardState

__all__ = ["ENABLED", "check_catch_up", "check_version"]

#: Whether the state machine checks every version it makes (see the module docstring).
ENABLED: bool = os.environ.get("PERSIST_CHECK_INCREMENTAL") == "1"


def check_version(
    old: ShardState,
    old_texts: Mapping[str, str],
    new: ShardState,
    data: Mapping[str, Any],
    texts: Mapping[str, str],
    touched: set[str],
) -> None:
    """Check the version ``new`` made on ``old`` (whose entry texts are ``old_texts``):
    its incremental ``data``, ``texts`` and ``touched`` keys, and the running counters.

    Raises:
        AssertionError: naming what differs.
    """
    from persist.consensus import Consensus
    from persist.history_record import parts_changed
    from persist.state import ShardState

    full = new.to_entries()
    if dict(data) != full:
        diff = sorted(k for k in set(data) | set(full) if data.get(k) != full.get(k))
        raise AssertionError(f"incremental entries differ from the full encoding at {diff[:5]}")
    want = {k: Consensus.encode(v) for k, v in full.items()}
    if dict(texts) != want:
        diff = sorted(k for k in set(texts) | set(want) if texts.get(k) != want.get(k))
        raise AssertionError(f"incremental texts differ from the full encoding at {diff[:5]}")
    differ = {k for k, t in texts.items() if old_texts.get(k) != t}
    differ.update(k for k in old_texts if k not in texts)
    if not differ <= touched:
        raise AssertionError(
            f"entries changed but not reported touched: {sorted(differ - touched)[:5]}"
        )
    # Decoded from the texts as stored (what a full read of the head decodes), not from
    # ``data``'s objects: a value that does not survive its JSON text (a key order that
    # canonical JSON sorts, a tuple read back as a list) makes the state this process
    # caches differ from every other process's.
    rebuilt = ShardState.from_entries({k: json.loads(t) for k, t in texts.items()})
    if rebuilt != new:
        names = [
            f.name
            for f in dataclasses.fields(new)
            if f.compare and getattr(rebuilt, f.name) != getattr(new, f.name)
        ]
        raise AssertionError(
            f"the state decoded from the stored entries differs from the state at {names}"
        )
    check_counters(new)
    parts = [(p.part_id, p) for b in new.trace.batches() for p in b.parts]
    before = {pid for b in old.trace.batches() for p in b.parts if (pid := p.part_id) is not None}
    after = {pid: (p.rows, p.encoded_size_bytes) for pid, p in parts if pid is not None}
    added = sorted(v for k, v in after.items() if k not in before)
    removed = sum(1 for k in before if k not in after)
    got_added, got_removed = parts_changed(old, new)
    if sorted(got_added) != added or got_removed != removed:
        raise AssertionError(
            f"parts changed: incremental {sorted(got_added)}, {got_removed}; "
            f"recounted {added}, {removed}"
        )


def check_catch_up(
    st: ShardState, data: Mapping[str, Any], texts: Mapping[str, str] | None = None
) -> None:
    """Check a state a machine caught up to by decoding only the entries the newer
    diffs set or removed (:meth:`persist.state.ShardState.from_entries_delta`) against
    the state decoded in full from its entries ``data`` (from their canonical
    ``texts``, when given: what a full read of the head decodes).

    Raises:
        AssertionError: naming what differs.
    """
    from persist.state import ShardState

    if texts is not None:
        stored = {k: json.loads(t) for k, t in texts.items()}
        if stored != dict(data):
            raise AssertionError("caught-up entries differ from their texts")
        data = stored
    full = ShardState.from_entries(data)
    if st != full:
        names = [f for f in vars(full) if getattr(st, f) != getattr(full, f)]
        raise AssertionError(f"caught-up state differs from the full decoding at {names}")
    if st.to_entries() != dict(data):
        raise AssertionError("caught-up state does not encode to the entries it came from")
    check_counters(st)


def check_counters(st: ShardState) -> None:
    """Check the trace's running counters against a recount of its hollow batches.

    Raises:
        AssertionError: naming the counter that differs.
    """
    batches = list(st.trace.batches())
    inline = sum(b.inline_bytes for b in batches)
    if st.trace.inline_bytes() != inline:
        raise AssertionError(f"inline bytes {st.trace.inline_bytes()} != recount {inline}")
    parts = sum(len(b.parts) for b in batches)
    if st.trace.num_parts() != parts:
        raise AssertionError(f"part count {st.trace.num_parts()} != recount {parts}")
    ids = {pid for b in batches for p in b.parts if (pid := p.part_id) is not None}
    indexed: set[str] = set()
    for sb, _ in st.trace.spine_batches():
        indexed.update(sb.part_index)
    if indexed != ids:
        raise AssertionError(f"part index {sorted(indexed ^ ids)[:5]} differs from a recount")
