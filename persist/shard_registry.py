"""The shard registry: the stash collection ``persist.shards`` (key: shard name, value
``{"shard_id": ..., "created_ms": ...}``) mapping names to shard ids, as a base of
:class:`persist.consensus.Consensus` (which supplies the stash and its retrying calls).

Invariants kept here: a name is registered once; of two processes registering one name
at once, both get the winner's id (the registering append commits only on top of the
registry upper read before the lookup).  An entry that is not persist's (a name that is
not a shard name, a value that is not ``{"shard_id": <shard id>, ...}``, a
multiplicity other than 1, two live entries for one name) raises
:class:`~persist.errors.ConsensusError` naming the entry and the rule it breaks, where
it is read (never a bare ``KeyError``, never a silent skip that would register the
name again).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from persist.errors import ConsensusError, InvalidUsage
from persist.ids import new_shard_id, validate_shard_id, validate_shard_name
from stash import AppendBatch, AppendLowerMismatch, Stash, StashCollection
from stash.antichain import Antichain

__all__ = ["REGISTRY_COLLECTION", "ShardRegistry"]

REGISTRY_COLLECTION = "persist.shards"

T = TypeVar("T")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def entry_shard_id(name: Any, value: Any, diff: int) -> str:
    """The shard id of the registry entry ``(name, value)`` with multiplicity ``diff``
    (> 0: a live entry).

    Raises:
        ConsensusError: the entry is not persist's, naming it and the rule broken (the
            name a shard name, the value ``{"shard_id": <"s" and a UUID>, ...}``, the
            multiplicity 1).
    """
    where = f"shard registry entry {_show(name)} (stash collection {REGISTRY_COLLECTION})"
    try:
        validate_shard_name(name)
    except InvalidUsage as e:
        raise ConsensusError(f"{where}: its name is not a shard name: {e}") from None
    if diff != 1:
        raise ConsensusError(
            f"{where} has multiplicity {diff}: a name is registered once (multiplicity 1)"
        )
    sid = value.get("shard_id") if isinstance(value, dict) else None
    try:
        return validate_shard_id(sid)
    except InvalidUsage:
        raise ConsensusError(
            f"{where} has value {_show(value)}: it must be an object whose 'shard_id' is "
            "'s' followed by a lower-case UUID (it was not written by persist)"
        ) from None


class ShardRegistry:
    """The registry methods of :class:`persist.consensus.Consensus`."""

    stash: Stash
    _registry: StashCollection[Any, Any] | None

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        raise NotImplementedError  # pragma: no cover - Consensus supplies it

    def _registry_coll(self) -> StashCollection[Any, Any] | None:
        """The registry collection; ``None`` when it does not exist yet and the stash
        is readonly (so no shard exists)."""
        if self._registry is None:
            if self.stash.mode == "readonly" and REGISTRY_COLLECTION not in self._call(
                "listing collections", self.stash.collections
            ):
                return None
            self._registry = self._call(
                "opening the shard registry",
                lambda: self.stash.collection(REGISTRY_COLLECTION, key="str", value="json"),
            )
        return self._registry

    def shards(self) -> dict[str, str]:
        """Every registered shard: name -> shard id."""
        reg = self._registry_coll()
        if reg is None:
            return {}
        rows = self._call("listing shards", lambda: self.stash.iter(reg))
        out: dict[str, str] = {}
        for (name, v), _t, d in rows:
            if d == 0:
                continue
            sid = entry_shard_id(name, v, d)
            if name in out:
                raise _twice(name, [out[name], sid])
            out[name] = sid
        return dict(sorted(out.items()))

    def lookup(self, name: str) -> str | None:
        """The shard id registered under ``name``, or ``None``."""
        reg = self._registry_coll()
        if reg is None:
            return None
        rows = self._call(f"looking up shard {name!r}", lambda: self.stash.iter_key(reg, name))
        ids = [entry_shard_id(name, v, d) for v, _t, d in rows if d != 0]
        if len(ids) > 1:
            raise _twice(name, ids)
        return ids[0] if ids else None

    def register(self, name: str, now_ms: int) -> str:
        """The id of shard ``name``, registering a new id if there is none (race-safe:
        of two processes registering one name at once, both get the winner's id)."""
        validate_shard_name(name)
        reg = self._registry_coll()
        if reg is None:
            raise ConsensusError(f"cannot register shard {name!r}: the stash is readonly")
        for attempt in range(1000):
            # Read the upper first: the append below commits only if nothing was
            # registered since, so the lookup in between cannot be stale.
            upper = self._call("reading the registry upper", lambda: self.stash.upper(reg))
            found = self.lookup(name)
            if found is not None:
                return found
            shard_id = new_shard_id()
            t = upper.as_option()
            if t is None:
                raise ConsensusError("the shard registry is sealed (empty upper)")
            batch = AppendBatch(
                collection=reg,
                lower=upper,
                upper=Antichain.from_elem(t + 1),
                compact=Antichain.from_elem(t),
                timestamp=t,
            )
            reg.append_to_batch(batch, name, {"shard_id": shard_id, "created_ms": now_ms}, 1)
            try:
                self._call(
                    f"registering shard {name!r}",
                    partial(self.stash.append, [batch]),
                )
            except AppendLowerMismatch:
                time.sleep(random.uniform(0, min(0.05, 0.001 * 2**attempt)))
                continue
            return shard_id
        raise ConsensusError(f"could not register shard {name!r}: too much contention")


def _twice(name: str, ids: list[str]) -> ConsensusError:
    return ConsensusError(
        f"shard registry (stash collection {REGISTRY_COLLECTION}) holds {len(ids)} live "
        f"entries for the name {name!r} (shard ids {ids}): a name is registered once"
    )
