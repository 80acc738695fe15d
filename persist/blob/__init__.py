"""Blob stores: durable maps from validated string keys to immutable byte values.

A shard's parts live here; its metadata lives in consensus. The package holds one module
per concept:

* :mod:`persist.blob.base`: the :class:`Blob` protocol, :func:`validate_key` and the
  key rules, :class:`BlobMetrics`;
* :mod:`persist.blob.file`: :class:`FileBlob`, a local directory (atomic, durable writes;
  never follows a symbolic link below its root);
* :mod:`persist.blob.memory`: :class:`MemoryBlob`, in-process (tests);
* :mod:`persist.blob.arrowfs`: :class:`ArrowFsBlob`, any ``pyarrow.fs`` filesystem (S3,
  GCS, HDFS, mock); :mod:`persist.blob.dirs` removes the empty directories object
  stores leave under a dropped shard's prefix;
* :mod:`persist.blob.unreliable`: :class:`UnreliableBlob`, a fault injector (tests);
* :mod:`persist.blob.retrying`: :class:`RetryingBlob`, retries transient failures.

:func:`open_blob` picks a store by the URI's scheme from :data:`BACKENDS`, a table of
``"module:Class"`` strings imported on first use, as pyiceberg's ``pyiceberg/io/__init__.py``
looks up its ``FileIO`` s and SQLAlchemy's ``dialects/__init__.py`` its dialects: this
module never imports the stores it builds, and the stores are re-exported lazily (on first
access of ``persist.blob.FileBlob`` and the like), so ``from persist.blob import X`` works
for every name in ``__all__``.

Invariants kept (each module states its own in detail):

* every key is validated before any I/O, so no key names anything outside a store's root;
* ``set`` is atomic, ``delete`` idempotent, and every storage failure surfaces as
  :class:`~persist.errors.BlobError` (or its subclass :class:`~persist.errors.InvalidKey`);
* no URI credential ever appears in a ``repr`` or an error message (they go through
  :func:`stash.redact`), and object-store URIs carrying credentials are refused: they come
  from the environment only.
"""

from __future__ import annotations

import importlib
import os
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from persist.blob.base import MAX_KEY_LENGTH, Blob, BlobMetrics, validate_key
from persist.errors import InvalidUsage
from stash import redact

if TYPE_CHECKING:
    from persist.blob.arrowfs import ArrowFsBlob
    from persist.blob.file import FileBlob
    from persist.blob.memory import MemoryBlob
    from persist.blob.retrying import RetryingBlob
    from persist.blob.unreliable import UnreliableBlob

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "MAX_KEY_LENGTH",
    "ArrowFsBlob",
    "Blob",
    "BlobMetrics",
    "FileBlob",
    "MemoryBlob",
    "RetryingBlob",
    "UnreliableBlob",
    "open_blob",
    "redact_uri",
    "validate_key",
]

#: The blob store of each URI scheme, as ``"module:Class"``; the class has a classmethod
#: ``from_uri(uri: str, parts: urllib.parse.SplitResult) -> Blob`` (``parts`` being
#: ``urlsplit(uri)``). The ``file`` store is also called with a plain path.
BACKENDS: dict[str, str] = {
    "file": "persist.blob.file:FileBlob",
    "memory": "persist.blob.memory:MemoryBlob",
}
#: The store of every scheme not in :data:`BACKENDS`: ``pyarrow.fs`` decides.
DEFAULT_BACKEND = "persist.blob.arrowfs:ArrowFsBlob"

# Names re-exported on first access (PEP 562), so that importing this package imports
# no store.
_LAZY: dict[str, str] = {
    "ArrowFsBlob": "persist.blob.arrowfs",
    "FileBlob": "persist.blob.file",
    "MemoryBlob": "persist.blob.memory",
    "RetryingBlob": "persist.blob.retrying",
    "UnreliableBlob": "persist.blob.unreliable",
}

#: The older name of :func:`stash.redact`, the one redaction function.
redact_uri = redact


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


#: A scheme and its colon at the start of a string without ``://`` (two characters at
#: least, so a Windows drive letter ``C:`` stays a path).
_SCHEME_WITHOUT_SLASHES = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):")


def _backend(scheme: str) -> Any:
    """The store class for ``scheme`` (:data:`BACKENDS`, else :data:`DEFAULT_BACKEND`),
    imported now."""
    module, _, name = BACKENDS.get(scheme, DEFAULT_BACKEND).partition(":")
    return getattr(importlib.import_module(module), name)


def open_blob(uri: str | os.PathLike[str], *, create: bool = True) -> Blob:
    """Open the blob store a URI names.

    * ``file:///abs/path`` (host empty or ``localhost``; RFC 8089's ``file:/abs/path``
      too), or a plain absolute or relative path: a :class:`FileBlob` (its root created
      if missing; with ``create=False`` nothing is created until the first write, and a
      missing root reads as empty).  A path's first segment may not look like a scheme
      (``s3:/bucket``, ``file:rel``): that is a URI missing its ``//``, refused rather
      than read as a local directory named ``s3:`` (write ``./s3:/x`` for one);
    * ``memory://``: a fresh private :class:`MemoryBlob`; ``memory://name``: the
      in-process store shared by every ``memory://name`` of this process;
    * anything else (``s3://bucket/prefix``, ``gs://...``, ``hdfs://...``, ``mock:///``):
      ``pyarrow.fs.FileSystem.from_uri`` and an :class:`ArrowFsBlob` at the URI's path.
      An ``s3://`` store opens its output streams lazily (``allow_delayed_open=true``
      unless the URI says otherwise), so a part smaller than the multipart threshold is
      one PutObject request, not three.

    Credentials come from the environment only (``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN`` or the provider's usual chain): a URI
    carrying user info (``s3://KEY:SECRET@bucket``) or a credential-like query parameter
    (a name containing ``key``, ``secret``, ``token``, ``pass``, ``credential`` or
    ``signature``) is refused, and no error message shows what it carried.

    Raises:
        InvalidUsage: the URI is empty, malformed, names an unknown scheme, carries
            credentials, or the filesystem cannot be opened (message carries the
            redacted URI).
        BlobError: a local root cannot be created or is not a directory.
    """
    blob: Blob
    if isinstance(uri, os.PathLike):
        blob = _backend("file")(os.fspath(uri), create=create)
        return blob
    if not isinstance(uri, str):
        raise InvalidUsage(f"a blob URI must be a str or path, not {type(uri).__name__}")
    if uri == "" or uri.strip() != uri:
        raise InvalidUsage("a blob URI must be non-empty and have no surrounding whitespace")
    if "\x00" in uri:
        raise InvalidUsage(f"blob URI {redact(uri)!r} contains NUL")
    if "://" not in uri:
        head = _SCHEME_WITHOUT_SLASHES.match(uri)
        if head is None:
            blob = _backend("file")(uri, create=create)
            return blob
        if head.group(1).lower() != "file" or not uri[len(head.group(0)) :].startswith("/"):
            raise InvalidUsage(
                f"blob URI {redact(uri)!r} starts with the scheme {head.group(1)!r} but has "
                f"no '//' after it: write {head.group(1)}://..., or ./{redact(uri)} for a "
                "local directory of that name"
            )
        uri = "file://" + uri[len(head.group(0)) :]  # RFC 8089: file:/abs/path
    scheme = uri.split("://", 1)[0].lower()
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
        raise InvalidUsage(f"blob URI {redact(uri)!r} has a malformed scheme")
    # Errors are raised outside ``except`` blocks so that no exception carrying the raw
    # URI (and its credentials) is chained to them as ``__context__``.
    problem: str | None = None
    try:
        parts = urlsplit(uri)
    except ValueError as e:
        problem = f"malformed blob URI {redact(uri)!r}: {redact(str(e), url=uri)}"
    if problem is not None:
        raise InvalidUsage(problem)
    if scheme == "file":
        blob = _backend(scheme).from_uri(uri, parts, create=create)
    else:  # object stores and memory create nothing on open
        blob = _backend(scheme).from_uri(uri, parts)
    return blob
