"""What an idempotency token names: one append exactly.

An append records its idempotency token in the shard state together with a
*fingerprint* of the append (``token + TOKEN_SEP + fingerprint``, see
:data:`persist.state.TOKEN_SEP`).  A later call passing the same token is taken as a
retry of that append only if its own fingerprint is equal; a token reused on any other
append is refused (:func:`check_same_append`), so a retry is never acknowledged for
rows that were not written.

The fingerprint names the append's bounds (``expected_upper``, ``new_upper``) and its
contents, as a SHA-256 digest (first 128 bits, hex):

* ``compare_and_append``: the updates as given (normalized to the shard's schema, in
  the given row order), by the Arrow IPC message of them as one record batch (chunking
  and slicing do not change it; a retry must pass the same updates in the same order);
* ``compare_and_append_batch``: each batch's description and rewrite frontier, and each
  of its parts' blob key (or ``inline``), row count, encoded size and SHA-256 checksum.

Forms recorded by earlier versions (the token alone, ``r<rows>d<diff sum>``,
``b<digest of checksums>``) named at most an append's shape; a retry against one of
them cannot be checked and is refused, naming that (nothing is written).  Transactions record ``t<ts>``.

Source of the idea: persist-client's ``WriterState`` (``internal/state.rs``) records a
writer's most recent idempotency token together with that write's upper
(``most_recent_write_token``, ``most_recent_write_upper``), and its
``compare_and_append`` takes a retry by the token only at that upper; here the
contents are named too, and a writer's last few tokens are kept.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pyarrow as pa

from persist.errors import InvalidUsage
from persist.state import TOKEN_SEP
from stash import Antichain

if TYPE_CHECKING:
    from persist.batch import Batch

__all__ = ["batches_fingerprint", "check_same_append", "updates_fingerprint"]

#: Prefixes of the fingerprints recorded here (updates, batches).
UPDATES, BATCHES = "U", "B"
#: Prefixes of the shape-only fingerprints of earlier versions.
_LEGACY = ("r", "b")


def _bounds(expected: Antichain, new: Antichain) -> bytes:
    return repr((expected.to_json(), new.to_json())).encode()


def updates_fingerprint(expected: Antichain, new: Antichain, table: pa.Table) -> str:
    """The fingerprint of ``compare_and_append(table, expected, new)``: ``"U"`` and 32
    hex digits (see the module docstring).  ``table`` is the normalized updates table.
    """
    h = hashlib.sha256(_bounds(expected, new))
    if table.num_rows:
        # One record batch's IPC message (the schema is the shard's): written from the
        # rows' values, whatever the chunks, offsets or slack of the buffers.
        for batch in table.combine_chunks().to_batches():
            h.update(batch.serialize())
    return UPDATES + h.hexdigest()[:32]


def batches_fingerprint(expected: Antichain, new: Antichain, batches: Sequence[Batch]) -> str:
    """The fingerprint of ``compare_and_append_batch(batches, expected, new)``: ``"B"``
    and 32 hex digits (see the module docstring).  Two decodings of one transmitted
    batch have equal fingerprints."""
    h = hashlib.sha256(_bounds(expected, new))
    for b in batches:
        f = b.rewrite_frontier
        h.update(repr((b.hollow.desc.to_json(), None if f is None else f.to_json())).encode())
        for p in b.hollow.parts:
            h.update(repr((p.key or "inline", p.rows, p.encoded_size_bytes, p.checksum)).encode())
    return BATCHES + h.hexdigest()[:32]


def check_same_append(entry: str, token: str, fingerprint: str) -> None:
    """A caller's token that landed (recorded as ``entry``) must name *this* append
    (``fingerprint``), else acknowledging it would claim rows that were never written.

    Raises:
        InvalidUsage: the token was used by a different append, or recorded by an
            earlier version that did not record what it names (nothing is written).
    """
    _, sep, recorded = entry.partition(TOKEN_SEP)
    if sep and recorded == fingerprint:
        return
    if not sep or recorded[:1] in _LEGACY:
        raise InvalidUsage(
            f"idempotency_token {token!r} was recorded by an earlier version of persist "
            "that did not record which append it names, so whether it is this append "
            "cannot be told: nothing was written; read the shard to see whether its "
            "updates are there"
        )
    raise InvalidUsage(
        f"idempotency_token {token!r} names a different append that already landed "
        "(other bounds, updates or batches); a token may only retry the append it was "
        "given for: nothing was written"
    )
