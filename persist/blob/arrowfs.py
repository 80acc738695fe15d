"""A blob store on any ``pyarrow.fs`` filesystem (S3, GCS, HDFS, local, mock): :class:`ArrowFsBlob`.

Invariants kept here:

* ``set`` is atomic: on filesystems with an atomic same-directory rename (local, HDFS,
  mock) through a temporary object moved over the target, on object stores because a
  single put already is;
* object stores' empty "directory marker" objects (keys ending in ``/``, left by some
  clients and by ``pyarrow.fs`` itself after a delete) are never keys: ``list_keys``
  skips them, so GC and fsck never see them; a dropped shard's are removed
  (:func:`persist.blob.dirs.remove_empty_dirs`), so a drop leaves nothing under the
  shard's prefix;
* credentials come from the environment only: a URI carrying them is refused
  (:meth:`ArrowFsBlob.from_uri`), and no URI credential ever appears in a ``repr`` or an
  error message (they go through :func:`stash.redact`);
* every failure of the filesystem surfaces as :class:`~persist.errors.BlobError`.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import SplitResult

import pyarrow as pa
import pyarrow.fs as pafs

from persist.blob.base import (
    TMP_PREFIX,
    BlobMetrics,
    Closable,
    is_valid_key,
    validate_key,
    validate_prefix,
)
from persist.errors import BlobError, InvalidUsage
from stash import redact

__all__ = ["ArrowFsBlob"]

_T = TypeVar("_T")
# Query parameter names that carry a credential (refused in object-store URIs).
_SECRET_PARAM_RE = re.compile(r"key|secret|token|pass|credential|signature", re.IGNORECASE)

# Filesystems with real directories and an atomic same-directory rename.
_RENAME_FS_TYPES = frozenset({"local", "mock", "hdfs"})


def _base_type_name(fs: pafs.FileSystem) -> str:
    while isinstance(fs, pafs.SubTreeFileSystem):
        fs = fs.base_fs
    return str(fs.type_name)


#: Attempts of one S3 request inside the SDK (pyarrow's ``S3FileSystem`` default), under
#: :class:`~persist.blob.RetryingBlob`'s own attempts.
S3_SDK_ATTEMPTS = 3


def _bounded_retries(fs: pafs.S3FileSystem) -> pafs.S3FileSystem:
    """``fs`` with the SDK's standard retry strategy of :data:`S3_SDK_ATTEMPTS` attempts.
    An S3 filesystem made by ``FileSystem.from_uri`` has the AWS SDK's default strategy
    instead (up to 10 retries with backoff): a request to a refused endpoint took 6 s
    before failing, where ``S3FileSystem``'s own default takes 0.3-1.2 s, and persist's
    ``RetryingBlob`` multiplies it.  Every other option is the URI's, as ``fs`` has it
    (credentials not given in it stay with the provider chain)."""
    options = fs.__reduce__()[1][0]
    options["region"] = fs.region
    options["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=S3_SDK_ATTEMPTS)
    return pafs.S3FileSystem(**options)


class ArrowFsBlob(Closable):
    """A blob store on any ``pyarrow.fs`` filesystem (S3, GCS, HDFS, local, mock, ...).

    Key ``a/b`` is the path ``root/a/b`` of ``fs``. On filesystems with an atomic rename
    (local, HDFS, mock; also through a ``SubTreeFileSystem``) ``set`` writes a temporary
    ``.tmp-<uuid>`` object in the target's directory and moves it over the target; on
    object stores (S3, GCS, Azure) a single put is already atomic per object, so it writes
    the target directly. Missing directories are created on filesystems that have them.
    No fsync and no permission control: for local directories use :class:`FileBlob`
    (which :func:`open_blob` picks for ``file://`` URIs and paths).

    Args:
        fs: the filesystem.
        root: the path of the store's root inside ``fs`` (e.g. ``"bucket/prefix"`` for S3);
            surrounding ``/`` are stripped except a leading one on local filesystems.

    Raises:
        InvalidUsage: ``root`` is empty on an object store (it must name a bucket).
    """

    def __init__(self, fs: pafs.FileSystem, root: str) -> None:
        self.fs = fs
        self.type_name = _base_type_name(fs)
        self._rename = self.type_name in _RENAME_FS_TYPES
        stripped = root.rstrip("/")
        if self.type_name != "local":
            stripped = stripped.lstrip("/")
        if stripped == "" and root.startswith("/") and self.type_name == "local":
            stripped = "/"
        if stripped == "" and not self._rename:
            raise InvalidUsage(
                f"a {self.type_name} blob store needs a root naming at least a bucket"
            )
        self.root = stripped
        self.metrics = BlobMetrics()

    def __repr__(self) -> str:
        return f"ArrowFsBlob({self.type_name!r}, {self.root!r})"

    @classmethod
    def from_uri(cls, uri: str, parts: SplitResult) -> ArrowFsBlob:
        """The store at a ``pyarrow.fs`` URI (``s3://bucket/prefix``, ``gs://...``,
        ``hdfs://...``, ``mock:///``), ``parts`` being ``urlsplit(uri)``
        (:func:`persist.blob.open_blob` calls this for every scheme it has no other
        store for): ``pyarrow.fs.FileSystem.from_uri`` and the URI's path as the root.
        An ``s3://`` store opens its output streams lazily (``allow_delayed_open=true``
        unless the URI says otherwise), so a part smaller than the multipart threshold
        is one PutObject request, not three.

        Raises:
            InvalidUsage: the URI carries user info (``s3://KEY:SECRET@bucket``) or a
                credential-like query parameter (a name containing ``key``, ``secret``,
                ``token``, ``pass``, ``credential`` or ``signature``), or the filesystem
                cannot be opened; the message carries the redacted URI only.
        """
        scheme = uri.split("://", 1)[0].lower()
        secret_params = sorted(
            {
                name.lower()
                for name in (kv.split("=", 1)[0] for kv in parts.query.split("&") if kv)
                if _SECRET_PARAM_RE.search(name)
            }
        )
        if "@" in parts.netloc or secret_params:
            where = (
                "user info (KEY:SECRET@)"
                if "@" in parts.netloc
                else ("query parameters " + ", ".join(secret_params))
            )
            raise InvalidUsage(
                f"blob URI {redact(uri)!r} carries credentials in its {where}: credentials "
                "come from the environment only (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                "AWS_SESSION_TOKEN or the provider's own chain), never from a URI, which "
                "ends up in logs, process lists and Spark plans"
            )
        target = uri
        if scheme == "s3" and "allow_delayed_open" not in parts.query:
            # A part is written in one request (PutObject) instead of three (a multipart
            # upload's create, part and complete), and a writer killed mid-upload leaves
            # no unfinished multipart upload behind.
            target = uri + ("&" if parts.query else "?") + "allow_delayed_open=true"
        # Errors are raised outside ``except`` blocks so that no exception carrying the
        # raw URI (and its credentials) is chained to them as ``__context__``.
        problem: str | None = None
        try:
            fs, path = pafs.FileSystem.from_uri(target)
        except (pa.ArrowException, OSError, ValueError, TypeError) as e:
            problem = (
                f"cannot open blob store {redact(uri)!r}: {type(e).__name__}: "
                f"{redact(str(e), url=uri)[:500]}"
            )
        if problem is not None:
            raise InvalidUsage(problem)
        if isinstance(fs, pafs.S3FileSystem):
            fs = _bounded_retries(fs)
        return cls(fs, path)

    def _path(self, key: str) -> str:
        validate_key(key)
        if self.root == "":
            return key
        if self.root.endswith("/"):
            return self.root + key
        return f"{self.root}/{key}"

    def _call(self, op: str, key: str, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except (OSError, pa.ArrowException) as e:
            raise BlobError(f"blob {op} {key!r} on {self!r} failed: {e}") from e

    def _is_missing(self, path: str) -> bool:
        info = self.fs.get_file_info(path)
        return bool(info.type == pafs.FileType.NotFound or info.type == pafs.FileType.Directory)

    def get(self, key: str) -> bytes | None:
        """The bytes at ``key`` or ``None``. Raises InvalidKey, BlobError."""
        path = self._path(key)
        self._check_open()

        def read() -> bytes | None:
            try:
                with self.fs.open_input_stream(path) as f:
                    return bytes(f.read())
            except OSError:
                if self._is_missing(path):
                    return None
                raise

        data = self._call("get", key, read)
        self.metrics.record_get(0 if data is None else len(data))
        return data

    def _write(self, path: str, value: bytes) -> None:
        parent = path.rsplit("/", 1)[0] if "/" in path else ""
        try:
            out = self.fs.open_output_stream(path)
        except FileNotFoundError:
            if parent:
                self.fs.create_dir(parent, recursive=True)
            out = self.fs.open_output_stream(path)
        with out:
            out.write(value)

    def set(self, key: str, value: bytes) -> None:
        """Write ``value`` at ``key`` atomically. Raises InvalidKey, BlobError."""
        path = self._path(key)
        self._check_open()
        data = bytes(value)

        def write() -> None:
            if not self._rename:
                self._write(path, data)
                return
            parent = path.rsplit("/", 1)[0] if "/" in path else ""
            tmp = (
                f"{parent}/{TMP_PREFIX}{uuid.uuid4().hex}"
                if parent
                else (f"{TMP_PREFIX}{uuid.uuid4().hex}")
            )
            try:
                self._write(tmp, data)
                self.fs.move(tmp, path)
            except BaseException:
                try:
                    self.fs.delete_file(tmp)
                except (OSError, pa.ArrowException):
                    pass
                raise

        self._call("set", key, write)
        self.metrics.record_set(len(data))

    def delete(self, key: str) -> None:
        """Remove ``key`` (idempotent). Raises InvalidKey, BlobError."""
        path = self._path(key)
        self._check_open()

        def rm() -> None:
            try:
                self.fs.delete_file(path)
            except OSError:
                if self._is_missing(path):
                    return
                raise

        self._call("delete", key, rm)
        self.metrics.record_delete()

    def list_keys(self, prefix: str = "") -> list[tuple[str, int]]:
        """Sorted ``(key, size)`` of keys starting with ``prefix``. Raises BlobError."""
        validate_prefix(prefix)
        self._check_open()
        dir_part = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = self._path(dir_part) if dir_part else self.root
        root_len = 0 if self.root == "" else len(self.root.rstrip("/")) + 1

        def ls() -> list[tuple[str, int]]:
            sel = pafs.FileSelector(base, recursive=True, allow_not_found=True)
            out: list[tuple[str, int]] = []
            for info in self.fs.get_file_info(sel):
                if info.type != pafs.FileType.File:
                    continue
                key = info.path[root_len:] if root_len else info.path
                if key.startswith(prefix) and is_valid_key(key):
                    out.append((key, int(info.size or 0)))
            return out

        out = self._call("list_keys", prefix, ls)
        out.sort()
        self.metrics.record_list()
        return out
