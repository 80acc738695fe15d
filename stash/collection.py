"""Collection handles and append batches.

A :class:`StashCollection` names one durable collection of ``((key, value), time, diff)``
and carries the codecs of its keys and values.  An :class:`AppendBatch` is the unit of the
atomic multi-collection ``append``.  Invariants kept here:

* a handle's ``id`` and ``name`` never change, and its codecs were the ones recorded with
  the collection when the handle was made (:attr:`StashCollection.codec_names` names
  them as recorded); every stash read that decodes and every write that encodes through
  the handle checks, in its own transaction, that the collection still records them (a
  ``TypedCollection.migrate`` may have changed them since) and refuses otherwise;
* a handle's key codec is in the key role (:func:`stash.codec.resolve_key_codec`,
  whatever codec it was made with), so every read and write of a key through a handle
  encodes it by the one key rule;
* an ``AppendBatch``'s entries are already encoded (canonical JSON text): those
  ``append_to_batch`` encoded are canonical, and any other is checked and made
  canonical with the collection's codecs before it is stored, so pre-encoded entries
  land alike on every backend (``1.0`` and ``1`` are one value everywhere);
* ``make_batch`` builds Materialize's "next tick" batch: ``lower`` = current upper ``{t}``,
  ``upper`` = ``{t + 1}``, ``compact`` = ``{t}`` (or, when the collection has a
  retention, the since it keeps: ``Stash.set_retention``), entries at time ``t``.

Source of the idea: Materialize's ``StashCollection``, ``AppendBatch``, ``make_batch`` and
``append_to_batch`` (``src/stash/src/lib.rs``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from stash.antichain import I64_MAX, Antichain, check_i64
from stash.codec import JsonCodec, canonical_json, key_texts, resolve_key_codec
from stash.errors import StashError

K = TypeVar("K")
V = TypeVar("V")


class UpperSource(Protocol):
    """What :meth:`StashCollection.make_batch` needs of a stash: its ``upper`` (every
    :class:`stash.base.Stash` is one; this module does not import :mod:`stash.base`,
    which imports it)."""

    def upper(self, collection: StashCollection[Any, Any]) -> Antichain: ...


MAX_NAME_LENGTH = 255
_CONTROL_CHAR = re.compile("[\x00-\x1f\x7f]")


def validate_collection_name(name: object) -> str:
    """Return ``name`` if it is a valid collection name.

    Rules: a ``str`` of 1 to 255 characters with no control characters (NUL included).

    Raises:
        StashError: the name breaks a rule; the message says which.
    """
    if not isinstance(name, str):
        raise StashError(f"collection name must be a str, got {type(name).__name__}")
    if not name:
        raise StashError("collection name must not be empty")
    if len(name) > MAX_NAME_LENGTH:
        raise StashError(
            f"collection name is {len(name)} characters long; the limit is {MAX_NAME_LENGTH}"
        )
    if _CONTROL_CHAR.search(name):
        raise StashError(f"collection name {name!r} contains a control character")
    return name


@dataclass(frozen=True)
class StashCollection(Generic[K, V]):
    """A handle to one named collection of a stash.

    Attributes:
        id: the collection's id in the stash (``int``).
        name: its name (``str``).
        key_codec, value_codec: the codecs of keys and values (see :mod:`stash.codec`).
        recorded: the codec names recorded for the collection when the handle was made,
            if they are not the codecs' own names (``Stash.collections()`` reads a
            collection whose recorded codec cannot be imported with JSON codecs);
            ``None``: the codecs' names.
        stash_id: the identity of the stash the handle was made by (a uuid as 32 hex
            digits, recorded in the stash when it was created); ``append`` refuses a
            batch whose handle carries another (or none).
        stash_url: that stash's URL with its secrets redacted (for messages only).
    """

    id: int
    name: str
    key_codec: Any = field(compare=False)
    value_codec: Any = field(compare=False)
    recorded: tuple[str, str] | None = field(default=None, compare=False, repr=False)
    stash_id: str | None = field(default=None, compare=False, repr=False)
    stash_url: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        # The key role (records without their fields at default): one key rule for
        # every path, whoever made the handle (Stash.collection, keyed writes, ...).
        object.__setattr__(self, "key_codec", resolve_key_codec(self.key_codec))

    @property
    def codec_names(self) -> tuple[str, str]:
        """``(key_codec, value_codec)`` names as recorded with the collection when this
        handle was made: what the stash checks every read and write of it against."""
        if self.recorded is not None:
            return self.recorded
        return self.key_codec.name, self.value_codec.name

    def make_batch(self, stash: UpperSource) -> AppendBatch:
        """A new batch for this collection from its current upper ``{t}``: lower ``{t}``,
        upper ``{t + 1}``, compact ``{t}``, entries at time ``t``.

        Raises:
            StashError: the upper is the empty frontier (``cannot determine batch
                timestamp``) or ``t + 1`` overflows i64 (``cannot determine new upper``).
        """
        frontiers = getattr(stash, "batch_frontiers", None)
        stamp = False
        if frontiers is not None:  # a stash: the upper and the retained since, one read
            t, since, stamp = frontiers(self)
        else:
            t = stash.upper(self).as_option()
            since = t
        if t is None:
            raise StashError("cannot determine batch timestamp")
        if t >= I64_MAX:
            raise StashError("cannot determine new upper")
        batch = AppendBatch(
            collection=self,
            lower=Antichain.from_elem(t),
            upper=Antichain.from_elem(t + 1),
            compact=Antichain.from_elem(t if since is None else since),
            timestamp=t,
        )
        batch._stamp = stamp
        return batch

    def append_to_batch(
        self, batch: AppendBatch, key: K, value: V, diff: int, *, key_text: str | None = None
    ) -> None:
        """Encode ``(key, value)`` and add it to ``batch`` at ``batch.timestamp`` with
        ``diff``.  ``key_text``: the key's text as read from the collection (one of its
        candidate texts, :func:`stash.codec.key_texts`), to retract exactly what is
        stored (a transaction's retractions); default the key codec's encoding.

        Raises:
            StashError: the batch is for another collection, or key/value/diff is invalid.
        """
        if batch.collection.id != self.id:
            raise StashError(f"batch is for collection {batch.collection.name}, not {self.name}")
        kj = self.key_codec.encode(key) if key_text is None else key_text
        entry = (
            (kj, self.value_codec.encode(value)),
            batch.timestamp,
            _check_diff(diff),
        )
        batch.entries.append(entry)
        batch._encoded.append(entry)

    def canonical_entry(self, key_text: object, value_text: object) -> tuple[str, str]:
        """``(key_text, value_text)``, texts encoded by hand, as this handle's codecs
        encode the values they decode to (``1.0`` becomes ``1`` with the JSON codec),
        the same on every backend; a key text that is one of its key's candidate texts
        (:func:`stash.codec.key_texts`: the text an earlier release wrote) stays that
        text, made canonical, so a retraction by hand retracts what is stored.

        Raises:
            StashError: a text is not a ``str``, or not an encoding of the codec (naming
                the collection, the codec and the text).
        """
        out = []
        for what, codec, text in (
            ("key", self.key_codec, key_text),
            ("value", self.value_codec, value_text),
        ):
            if not isinstance(text, str):
                raise StashError("append batch entries must be encoded (use append_to_batch)")
            try:
                decoded = codec.decode(text)
                canonical = codec.encode(decoded)
                if what == "key":
                    # A key's text of an earlier release (its fields at default written)
                    # is kept: a retraction by hand retracts what is stored.
                    texts = key_texts(codec, decoded)
                    if len(texts) > 1:
                        norm = canonical_json(JsonCodec().decode(text))
                        canonical = norm if norm in texts else canonical
                out.append(canonical)
            except (StashError, TypeError, ValueError) as e:
                shown = text if len(text) <= 200 else text[:200] + "..."
                msg = str(e).removeprefix("stash error: ")
                raise StashError(
                    f"append to collection {self.name}: entry {what} {shown!r} is not an "
                    f"encoding of the {codec.name} codec: {msg}; nothing was committed"
                ) from None
        return out[0], out[1]

    def encode_entry(self, key: K, value: V) -> tuple[str, str]:
        """The canonical encodings of ``(key, value)``."""
        return self.key_codec.encode(key), self.value_codec.encode(value)


def _check_diff(diff: object) -> int:
    try:
        return check_i64(diff, "diff")
    except (TypeError, ValueError) as e:
        raise StashError(str(e)) from None


def check_time(time: object) -> int:
    """Return ``time`` if it is an i64 int, else raise :class:`StashError`."""
    try:
        return check_i64(time, "time")
    except (TypeError, ValueError) as e:
        raise StashError(str(e)) from None


def check_diff(diff: object) -> int:
    """Return ``diff`` if it is an i64 int, else raise :class:`StashError`."""
    return _check_diff(diff)


@dataclass
class AppendBatch:
    """One collection's part of an atomic ``append`` (Materialize's ``AppendBatch``).

    Attributes:
        collection: the target collection.
        lower: must equal the collection's upper when the append commits.
        upper: becomes the collection's new upper.
        compact: becomes the collection's new since.
        timestamp: the time ``append_to_batch`` gives entries.
        entries: ``[((key_json, value_json), time, diff)]``, already encoded; an entry
            not added by ``append_to_batch`` is checked and made canonical with the
            collection's codecs by ``append`` (the same on every backend).
    """

    collection: StashCollection[Any, Any]
    lower: Antichain
    upper: Antichain
    compact: Antichain
    timestamp: int = 0
    entries: list[tuple[tuple[str, str], int, int]] = field(default_factory=list)
    #: The entries ``append_to_batch`` encoded (the same objects): canonical already, so
    #: ``append`` checks only the others.
    _encoded: list[tuple[tuple[str, str], int, int]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )
    #: Set by ``make_batch`` under a retention by duration: ``append`` records the wall
    #: clock it commits ``timestamp`` at (see :mod:`stash.retention`).
    _stamp: bool = field(default=False, init=False, repr=False, compare=False)

    def canonical_entries(self) -> list[tuple[tuple[str, str], int, int]]:
        """The entries, each one ``append_to_batch`` did not encode made canonical by
        :meth:`StashCollection.canonical_entry` (raising as it does)."""
        # The ids of the entries append_to_batch made: ``_encoded`` keeps those objects
        # alive, so no other live object has one of these ids (entries may have been
        # cleared, reordered or mixed with entries encoded by hand since).
        known = {id(e) for e in self._encoded}
        out = list(self.entries)
        for i, e in enumerate(out):
            if id(e) in known:
                continue
            if not isinstance(e, tuple) or len(e) != 3 or not isinstance(e[0], tuple):
                raise StashError("append batch entries must be ((key, value), time, diff)")
            (k, v), t, d = e
            out[i] = (self.collection.canonical_entry(k, v), t, d)
        return out
