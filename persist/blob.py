"""Blob stores: durable maps from validated string keys to immutable byte values.

A shard's parts live here (DESIGN section 5); its metadata lives in consensus. This module
holds the :class:`Blob` protocol, its implementations (:class:`FileBlob` for local files,
:class:`MemoryBlob` for tests, :class:`ArrowFsBlob` for any ``pyarrow.fs`` filesystem such
as S3), :func:`open_blob` to pick one from a URI, the fault injector
:class:`UnreliableBlob` (after the first persist engine's ``UnreliableBlob`` in seeds
``000``/``001``), and :func:`validate_key`.

Invariants kept here:

* every key is validated by :func:`validate_key` before any I/O: keys are relative paths
  of ``/``-separated segments matching ``[A-Za-z0-9][A-Za-z0-9._=-]*``, so no key can
  name ``..``, an absolute path, a hidden file or anything outside the store's root;
* ``set`` is atomic: a reader sees either the previous value (or nothing) or the whole
  new value, never a prefix. :class:`FileBlob` writes a temporary file in the target's
  directory (whose name starts with ``.`` and therefore is never a valid key), fsyncs it,
  renames it over the target and fsyncs the directory;
* ``delete`` is idempotent: deleting a missing key is not an error;
* :class:`FileBlob` creates directories with mode ``0o700`` and files with ``0o600`` (the
  user's only; issue 7);
* every failure of the underlying storage surfaces as :class:`~persist.errors.BlobError`
  (or its subclass :class:`~persist.errors.InvalidKey`), and no URI credential ever
  appears in a ``repr`` or an error message.
"""

from __future__ import annotations

import os
import random
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol, TypeVar, runtime_checkable
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from persist.errors import BlobError, InvalidKey, InvalidUsage

__all__ = [
    "ArrowFsBlob",
    "Blob",
    "BlobMetrics",
    "FileBlob",
    "MAX_KEY_LENGTH",
    "MemoryBlob",
    "UnreliableBlob",
    "open_blob",
    "redact_uri",
    "validate_key",
]

#: Longest key accepted by :func:`validate_key`, in characters.
MAX_KEY_LENGTH = 1024
#: Longest segment (between ``/``) accepted, in characters (the usual file-name limit).
MAX_SEGMENT_LENGTH = 255

_SEGMENT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=-]*")
_T = TypeVar("_T")


# --------------------------------------------------------------------------- keys


def _key_repr(key: object) -> str:
    """``repr`` of a key for error messages, cut to at most ~120 characters."""
    r = repr(key)
    return r if len(r) <= 120 else r[:100] + "...(" + str(len(r)) + " chars)"


def _key_rule_broken(key: object) -> str | None:
    if not isinstance(key, str):
        return f"a key must be a str, not {type(key).__name__}"
    if key == "":
        return "a key must not be empty"
    if len(key) > MAX_KEY_LENGTH:
        return f"a key must be at most {MAX_KEY_LENGTH} characters, this one has {len(key)}"
    if "\x00" in key:
        return "a key must not contain NUL"
    if "\\" in key:
        return "a key must not contain a backslash"
    if key.startswith("/"):
        return "a key must be relative (no leading '/')"
    for segment in key.split("/"):
        if segment == "":
            return "a key must not have empty segments ('//' or a trailing '/')"
        if segment in (".", ".."):
            return f"a key must not contain the segment {segment!r}"
        if len(segment) > MAX_SEGMENT_LENGTH:
            return f"a key segment must be at most {MAX_SEGMENT_LENGTH} characters"
        if not _SEGMENT_RE.fullmatch(segment):
            return (
                f"segment {_key_repr(segment)} must match [A-Za-z0-9][A-Za-z0-9._=-]* "
                "(start with a letter or digit; then letters, digits, '.', '_', '=', '-')"
            )
    return None


def validate_key(key: str) -> str:
    """Check that ``key`` is a valid blob key and return it unchanged.

    A key is a relative path of ``/``-separated segments, each matching
    ``[A-Za-z0-9][A-Za-z0-9._=-]*`` and at most 255 characters; the whole key is at most
    :data:`MAX_KEY_LENGTH` (1024) characters. Hence no ``..``, no empty segment, no
    leading ``/``, no backslash, no NUL: a valid key never escapes the store's root.

    Raises:
        InvalidKey: naming the key (``repr``-escaped) and the rule it breaks.
    """
    rule = _key_rule_broken(key)
    if rule is not None:
        raise InvalidKey(f"invalid blob key {_key_repr(key)}: {rule}")
    return key


def _validate_prefix(prefix: str) -> str:
    """A ``list_keys`` prefix: ``""``, or a key, optionally followed by one ``/``.

    A prefix may end in the middle of a segment (``"shard/ab"`` matches ``"shard/abc"``).
    """
    if not isinstance(prefix, str):
        raise InvalidKey(f"invalid blob key prefix {_key_repr(prefix)}: must be a str")
    if prefix == "":
        return prefix
    body = prefix[:-1] if prefix.endswith("/") else prefix
    rule = _key_rule_broken(body)
    if rule is not None:
        raise InvalidKey(f"invalid blob key prefix {_key_repr(prefix)}: {rule}")
    return prefix


def _is_valid_key(key: str) -> bool:
    return _key_rule_broken(key) is None


# ------------------------------------------------------------------------ metrics


@dataclass
class BlobMetrics:
    """Counters of completed blob calls (thread-safe; read them with :meth:`snapshot`).

    Attributes:
        sets: number of successful ``set`` calls.
        set_bytes: bytes written by them.
        gets: number of successful ``get`` calls (hits and misses).
        get_bytes: bytes returned by them.
        deletes: number of successful ``delete`` calls.
        lists: number of successful ``list_keys`` calls.
    """

    sets: int = 0
    set_bytes: int = 0
    gets: int = 0
    get_bytes: int = 0
    deletes: int = 0
    lists: int = 0
    _lock: threading.Lock = field(
        default_factory=threading.Lock, repr=False, compare=False, init=False
    )

    def record_set(self, nbytes: int) -> None:
        with self._lock:
            self.sets += 1
            self.set_bytes += nbytes

    def record_get(self, nbytes: int) -> None:
        with self._lock:
            self.gets += 1
            self.get_bytes += nbytes

    def record_delete(self) -> None:
        with self._lock:
            self.deletes += 1

    def record_list(self) -> None:
        with self._lock:
            self.lists += 1

    def snapshot(self) -> BlobMetrics:
        """A consistent copy of the counters."""
        with self._lock:
            return replace(self)


# ----------------------------------------------------------------------- protocol


@runtime_checkable
class Blob(Protocol):
    """A durable map of validated keys (see :func:`validate_key`) to byte values.

    Every method validates its key first and raises :class:`InvalidKey` for a bad one;
    storage failures raise :class:`BlobError`. Implementations are thread-safe.
    """

    @property
    def metrics(self) -> BlobMetrics:
        """Counters of the calls made through this handle."""
        ...

    def get(self, key: str) -> bytes | None:
        """The value at ``key``, or ``None`` if there is none."""
        ...

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` at ``key`` atomically (readers see all of it or none of it);
        an existing value is replaced."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; removing a missing key is not an error (idempotent)."""
        ...

    def list_keys(self, prefix: str = "") -> list[tuple[str, int]]:
        """``(key, size in bytes)`` of every key starting with ``prefix``, sorted by key."""
        ...

    def close(self) -> None:
        """Release resources; later calls raise :class:`BlobError`."""
        ...


class _ClosableMixin:
    _closed: bool = False

    def _check_open(self) -> None:
        if self._closed:
            raise BlobError(f"{self!r} is closed")

    def close(self) -> None:
        """Mark this handle closed; later calls raise :class:`BlobError`. Idempotent."""
        self._closed = True


# ----------------------------------------------------------------------- FileBlob


_TMP_PREFIX = ".tmp-"


class FileBlob(_ClosableMixin):
    """A blob store in a local directory: key ``a/b`` is the file ``root/a/b``.

    Writes are atomic and durable: the value goes to a temporary file next to the target
    (``.tmp-<uuid>``, never a valid key, so never listed), which is fsynced, renamed over
    the target with ``os.replace`` and followed by an fsync of the directory. Directories
    this store creates (the root included, when missing) get mode ``0o700``, files
    ``0o600``; an existing root's mode is left as it is. Reads do not follow a symlink at
    the final component; ``list_keys`` skips symlinks and non-key names.

    A key that is a prefix directory of another key (``a`` and ``a/b``) cannot both exist
    here; the second ``set`` raises :class:`BlobError`. Persist's keys never do this.

    Args:
        root: the directory (created if missing).
        fsync: fsync files and directories on ``set`` (default ``True``; ``False`` keeps
            atomicity against concurrent readers but not durability against power loss).

    Raises:
        BlobError: the root cannot be created or is not a directory.
    """

    def __init__(self, root: str | os.PathLike[str], fsync: bool = True) -> None:
        self.root = Path(root).absolute()
        self._fsync = fsync
        self.metrics = BlobMetrics()
        try:
            self._make_dirs(self.root)
        except OSError as e:
            raise BlobError(f"cannot create blob root {str(self.root)!r}: {e.strerror}") from e
        if not self.root.is_dir():
            raise BlobError(f"blob root {str(self.root)!r} is not a directory")

    def __repr__(self) -> str:
        return f"FileBlob({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*validate_key(key).split("/"))

    def _make_dirs(self, path: Path) -> None:
        """Create ``path`` and its missing parents with mode 0o700, fsyncing parents."""
        missing: list[Path] = []
        p = path
        while not p.is_dir():
            missing.append(p)
            if p.parent == p:
                break
            p = p.parent
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                if not d.is_dir():
                    raise
                continue
            if self._fsync:
                self._fsync_dir(d.parent)

    @staticmethod
    def _fsync_dir(d: Path) -> None:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def get(self, key: str) -> bytes | None:
        """The bytes at ``key`` or ``None``. Raises InvalidKey, BlobError."""
        path = self._path(key)
        self._check_open()
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            self.metrics.record_get(0)
            return None
        except IsADirectoryError:
            self.metrics.record_get(0)
            return None
        except OSError as e:
            raise BlobError(f"blob get {key!r} failed: {e.strerror}") from e
        try:
            with os.fdopen(fd, "rb") as f:
                data = f.read()
        except IsADirectoryError:
            self.metrics.record_get(0)
            return None
        except OSError as e:
            raise BlobError(f"blob get {key!r} failed: {e.strerror}") from e
        self.metrics.record_get(len(data))
        return data

    def set(self, key: str, value: bytes) -> None:
        """Write ``value`` at ``key`` atomically and durably. Raises InvalidKey, BlobError."""
        path = self._path(key)
        self._check_open()
        data = memoryview(value)
        tmp = path.parent / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            try:
                fd = os.open(tmp, flags, 0o600)
            except FileNotFoundError:
                self._make_dirs(path.parent)
                fd = os.open(tmp, flags, 0o600)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    if self._fsync:
                        os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            if self._fsync:
                self._fsync_dir(path.parent)
        except OSError as e:
            raise BlobError(f"blob set {key!r} failed: {e.strerror or e}") from e
        self.metrics.record_set(len(data))

    def delete(self, key: str) -> None:
        """Remove ``key`` (a missing key is fine). Raises InvalidKey, BlobError."""
        path = self._path(key)
        self._check_open()
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as e:
            raise BlobError(f"blob delete {key!r} failed: {e.strerror}") from e
        self.metrics.record_delete()

    def sweep_temporaries(self, prefix: str, older_than_seconds: float) -> int:
        """Delete the temporary files (``.tmp-*``) a ``set`` interrupted by a crash left
        in the directories under ``prefix`` (a key prefix ending in ``/``), if their last
        change is older than ``older_than_seconds``; returns how many were deleted.  A
        ``set`` still running that long loses its temporary file and fails with
        BlobError (nothing half-written is ever visible).  Best effort: files that vanish
        or cannot be removed are skipped (issue 7's crash campaign found these leaking).

        Raises: InvalidKey (a bad prefix).
        """
        _validate_prefix(prefix)
        self._check_open()
        start = self.root.joinpath(*[s for s in prefix.split("/") if s])
        cutoff = time.time() - older_than_seconds
        n = 0
        for dirpath, _dirs, files in os.walk(start):
            for f in files:
                if not f.startswith(_TMP_PREFIX):
                    continue
                p = os.path.join(dirpath, f)
                try:
                    if os.lstat(p).st_mtime <= cutoff:
                        os.unlink(p)
                        n += 1
                except OSError:
                    continue
        return n

    def list_keys(self, prefix: str = "") -> list[tuple[str, int]]:
        """Sorted ``(key, size)`` of keys starting with ``prefix``. Raises BlobError."""
        _validate_prefix(prefix)
        self._check_open()
        # Walk only below the deepest directory the prefix fully names.
        dir_part = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root.joinpath(*dir_part.split("/")) if dir_part else self.root
        out: list[tuple[str, int]] = []
        stack: list[tuple[Path, str]] = [(start, dir_part + "/" if dir_part else "")]
        try:
            while stack:
                d, rel = stack.pop()
                try:
                    it = os.scandir(d)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                with it:
                    for entry in it:
                        name = rel + entry.name
                        if entry.is_symlink() or not _SEGMENT_RE.fullmatch(entry.name):
                            continue
                        if entry.is_dir(follow_symlinks=False):
                            if name.startswith(prefix) or prefix.startswith(name + "/"):
                                stack.append((Path(entry.path), name + "/"))
                        elif entry.is_file(follow_symlinks=False) and name.startswith(prefix):
                            if _is_valid_key(name):
                                out.append((name, entry.stat(follow_symlinks=False).st_size))
        except OSError as e:
            raise BlobError(f"blob list_keys {prefix!r} failed: {e.strerror}") from e
        out.sort()
        self.metrics.record_list()
        return out


# --------------------------------------------------------------------- MemoryBlob


class _MemoryStore:
    """The shared dict behind one or more :class:`MemoryBlob` handles."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.data: dict[str, bytes] = {}


_NAMED_STORES: dict[str, _MemoryStore] = {}
_NAMED_STORES_LOCK = threading.Lock()


class MemoryBlob(_ClosableMixin):
    """An in-process blob store (for tests): a dict guarded by a lock.

    Args:
        name: ``None`` for a fresh private store; a name shares the store with every
            other ``MemoryBlob`` of that name in this process (``open_blob("memory://n")``).
            The name must be a valid single key segment.

    Raises:
        InvalidKey: the name is not a valid key segment.
    """

    def __init__(self, name: str | None = None) -> None:
        self.name = name
        self.metrics = BlobMetrics()
        if name is None:
            self._store = _MemoryStore()
        else:
            if "/" in name:
                raise InvalidKey(f"invalid memory blob name {_key_repr(name)}: no '/' allowed")
            validate_key(name)
            with _NAMED_STORES_LOCK:
                self._store = _NAMED_STORES.setdefault(name, _MemoryStore())

    def __repr__(self) -> str:
        return "MemoryBlob()" if self.name is None else f"MemoryBlob({self.name!r})"

    def get(self, key: str) -> bytes | None:
        """The bytes at ``key`` or ``None``. Raises InvalidKey, BlobError (closed)."""
        validate_key(key)
        self._check_open()
        with self._store.lock:
            value = self._store.data.get(key)
        self.metrics.record_get(0 if value is None else len(value))
        return value

    def set(self, key: str, value: bytes) -> None:
        """Store a copy of ``value`` at ``key``. Raises InvalidKey, BlobError (closed)."""
        validate_key(key)
        self._check_open()
        data = bytes(value)
        with self._store.lock:
            self._store.data[key] = data
        self.metrics.record_set(len(data))

    def delete(self, key: str) -> None:
        """Remove ``key`` (idempotent). Raises InvalidKey, BlobError (closed)."""
        validate_key(key)
        self._check_open()
        with self._store.lock:
            self._store.data.pop(key, None)
        self.metrics.record_delete()

    def list_keys(self, prefix: str = "") -> list[tuple[str, int]]:
        """Sorted ``(key, size)`` of keys starting with ``prefix``."""
        _validate_prefix(prefix)
        self._check_open()
        with self._store.lock:
            out = [(k, len(v)) for k, v in self._store.data.items() if k.startswith(prefix)]
        out.sort()
        self.metrics.record_list()
        return out


# -------------------------------------------------------------------- ArrowFsBlob

# Filesystems with real directories and an atomic same-directory rename.
_RENAME_FS_TYPES = frozenset({"local", "mock", "hdfs"})


def _base_type_name(fs: pafs.FileSystem) -> str:
    while isinstance(fs, pafs.SubTreeFileSystem):
        fs = fs.base_fs
    return str(fs.type_name)


class ArrowFsBlob(_ClosableMixin):
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
                f"{parent}/{_TMP_PREFIX}{uuid.uuid4().hex}"
                if parent
                else (f"{_TMP_PREFIX}{uuid.uuid4().hex}")
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
        _validate_prefix(prefix)
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
                if key.startswith(prefix) and _is_valid_key(key):
                    out.append((key, int(info.size or 0)))
            return out

        out = self._call("list_keys", prefix, ls)
        out.sort()
        self.metrics.record_list()
        return out


# ----------------------------------------------------------------------- open_blob

_SECRET_QUERY_HINT = "***"


def redact_uri(uri: str) -> str:
    """``uri`` with its password/user info and every query value replaced by ``***``.

    Safe to print, log or put in an exception message.
    """
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "<unparseable uri>"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = "&".join(
        f"{k}={_SECRET_QUERY_HINT}" for k, _ in parse_qsl(parts.query, keep_blank_values=True)
    )
    return SplitResult(parts.scheme, netloc, parts.path, query, "").geturl()


def _secrets_of(uri: str) -> list[str]:
    """Substrings of ``uri`` that may be secrets (user info, query values)."""
    out: list[str] = []
    try:
        parts = urlsplit(uri)
    except ValueError:
        return [uri]
    if "@" in parts.netloc:
        userinfo = parts.netloc.rsplit("@", 1)[0]
        out.append(userinfo)
        user, _, password = userinfo.partition(":")
        if password:
            out.extend((password, unquote(password)))
        if len(user) >= 4:  # access key ids sit here; short user names are left readable
            out.extend((user, unquote(user)))
    for _, v in parse_qsl(parts.query, keep_blank_values=True):
        if v:
            out.append(v)
    if parts.query:
        out.append(parts.query)
    # Longest first, so a secret containing another is replaced whole.
    return sorted(set(out), key=len, reverse=True)


def _scrub(text: str, uri: str) -> str:
    text = text.replace(uri, redact_uri(uri))
    for s in _secrets_of(uri):
        text = text.replace(s, "***")
    return text


def open_blob(uri: str | os.PathLike[str]) -> Blob:
    """Open the blob store a URI names.

    * ``file:///abs/path`` (host empty or ``localhost``), or a plain absolute or relative
      path: a :class:`FileBlob` (created if missing);
    * ``memory://``: a fresh private :class:`MemoryBlob`; ``memory://name``: the
      in-process store shared by every ``memory://name`` of this process;
    * anything else (``s3://bucket/prefix``, ``gs://...``, ``hdfs://...``, ``mock:///``):
      ``pyarrow.fs.FileSystem.from_uri`` and an :class:`ArrowFsBlob` at the URI's path.

    Credentials in the URI are never put in reprs or error messages.

    Raises:
        InvalidUsage: the URI is empty, malformed, names an unknown scheme, or the
            filesystem cannot be opened (message carries the redacted URI).
    """
    if isinstance(uri, os.PathLike):
        return FileBlob(os.fspath(uri))
    if not isinstance(uri, str):
        raise InvalidUsage(f"a blob URI must be a str or path, not {type(uri).__name__}")
    if uri == "" or uri.strip() != uri:
        raise InvalidUsage("a blob URI must be non-empty and have no surrounding whitespace")
    if "\x00" in uri:
        raise InvalidUsage(f"blob URI {redact_uri(uri)!r} contains NUL")
    if "://" not in uri:
        return FileBlob(uri)
    scheme = uri.split("://", 1)[0].lower()
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
        raise InvalidUsage(f"blob URI {redact_uri(uri)!r} has a malformed scheme")
    # Errors are raised outside ``except`` blocks so that no exception carrying the raw
    # URI (and its credentials) is chained to them as ``__context__``.
    problem: str | None = None
    try:
        parts = urlsplit(uri)
    except ValueError as e:
        problem = f"malformed blob URI {redact_uri(uri)!r}: {_scrub(str(e), uri)}"
    if problem is not None:
        raise InvalidUsage(problem)
    if scheme == "memory":
        if parts.path or parts.query or parts.fragment or "@" in parts.netloc:
            raise InvalidUsage(
                f"malformed blob URI {redact_uri(uri)!r}: use memory:// or memory://NAME"
            )
        if parts.netloc == "":
            return MemoryBlob()
        if not _is_valid_key(parts.netloc) or "/" in parts.netloc:
            raise InvalidUsage(
                f"malformed blob URI {redact_uri(uri)!r}: the memory store name must be "
                "one key segment ([A-Za-z0-9][A-Za-z0-9._=-]*)"
            )
        return MemoryBlob(parts.netloc)
    if scheme == "file":
        if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
            raise InvalidUsage(
                f"malformed blob URI {redact_uri(uri)!r}: use file:///absolute/path "
                "(no host, query or fragment)"
            )
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise InvalidUsage(f"malformed blob URI {redact_uri(uri)!r}: the path is empty")
        return FileBlob(path)
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (pa.ArrowException, OSError, ValueError, TypeError) as e:
        problem = (
            f"cannot open blob store {redact_uri(uri)!r}: {type(e).__name__}: "
            f"{_scrub(str(e), uri)[:500]}"
        )
    if problem is not None:
        raise InvalidUsage(problem)
    return ArrowFsBlob(fs, path)


# ------------------------------------------------------------------ UnreliableBlob


class UnreliableBlob(_ClosableMixin):
    """A :class:`Blob` wrapper that injects faults, after the seed's ``UnreliableBlob``.

    While faults are on, each call (``get``, ``set``, ``delete``, ``list_keys``) first
    sleeps a random ``0..slow_seconds`` and then fails with :class:`BlobError` with
    probability ``fail_probability``. A failing ``set`` (or ``delete``) is, with
    probability ``after_write_probability``, a call that *did* its work on the inner store
    and then raised (a put whose acknowledgement was lost): callers must treat a failed
    ``set`` as indeterminate. :meth:`make_unavailable` makes every call fail (as the
    seed's ``UnreliableHandle::make_unavailable``); :meth:`faults` turns injection on/off.
    Keys are validated before any fault, so :class:`InvalidKey` stays deterministic.

    Args:
        inner: the store that does the real work.
        fail_probability: chance in ``[0, 1]`` that a call fails.
        seed: seed of the private ``random.Random`` (reproducible faults).
        slow_seconds: upper bound of the random delay per call, in seconds.
        after_write_probability: chance in ``[0, 1]`` that an injected ``set``/``delete``
            failure happens after the inner call succeeded.

    Attributes:
        faults_injected: number of injected failures so far.

    Raises:
        ValueError: a probability outside ``[0, 1]`` or a negative ``slow_seconds``.
    """

    def __init__(
        self,
        inner: Blob,
        fail_probability: float = 0.1,
        seed: int | None = None,
        slow_seconds: float = 0.0,
        after_write_probability: float = 0.5,
    ) -> None:
        for name, p in (
            ("fail_probability", fail_probability),
            ("after_write_probability", after_write_probability),
        ):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {p}")
        if slow_seconds < 0:
            raise ValueError(f"slow_seconds must be >= 0, got {slow_seconds}")
        self.inner = inner
        self.fail_probability = fail_probability
        self.slow_seconds = slow_seconds
        self.after_write_probability = after_write_probability
        self.faults_injected = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._on = True
        self._unavailable = False

    def __repr__(self) -> str:
        return f"UnreliableBlob({self.inner!r}, fail_probability={self.fail_probability})"

    @property
    def metrics(self) -> BlobMetrics:
        """The inner store's counters (what really reached storage)."""
        return self.inner.metrics

    def faults(self, on: bool) -> None:
        """Turn fault injection (failures and delays) on or off."""
        with self._lock:
            self._on = on

    def make_unavailable(self) -> None:
        """Make every call fail until :meth:`make_available` (even with faults off)."""
        with self._lock:
            self._unavailable = True

    def make_available(self) -> None:
        """Undo :meth:`make_unavailable`."""
        with self._lock:
            self._unavailable = False

    def _decide(self) -> tuple[bool, bool, float]:
        """(fail?, after the write?, delay in seconds) for one call."""
        with self._lock:
            if self._unavailable:
                fail, after, delay = True, False, 0.0
            elif not self._on:
                return False, False, 0.0
            else:
                delay = self._rng.uniform(0, self.slow_seconds) if self.slow_seconds else 0.0
                fail = self._rng.random() < self.fail_probability
                after = fail and self._rng.random() < self.after_write_probability
            if fail:
                self.faults_injected += 1
            return fail, after, delay

    def _fault(self, op: str, key: str, after: bool) -> BlobError:
        when = " after the write" if after else ""
        return BlobError(f"unavailable: injected fault{when} in blob {op} {key!r}")

    def get(self, key: str) -> bytes | None:
        """Like the inner ``get``, but may sleep and raise BlobError."""
        validate_key(key)
        self._check_open()
        fail, _, delay = self._decide()
        if delay:
            time.sleep(delay)
        if fail:
            raise self._fault("get", key, False)
        return self.inner.get(key)

    def set(self, key: str, value: bytes) -> None:
        """Like the inner ``set``; may raise BlobError before or after writing."""
        validate_key(key)
        self._check_open()
        fail, after, delay = self._decide()
        if delay:
            time.sleep(delay)
        if fail and not after:
            raise self._fault("set", key, False)
        self.inner.set(key, value)
        if fail:
            raise self._fault("set", key, True)

    def delete(self, key: str) -> None:
        """Like the inner ``delete``; may raise BlobError before or after deleting."""
        validate_key(key)
        self._check_open()
        fail, after, delay = self._decide()
        if delay:
            time.sleep(delay)
        if fail and not after:
            raise self._fault("delete", key, False)
        self.inner.delete(key)
        if fail:
            raise self._fault("delete", key, True)

    def list_keys(self, prefix: str = "") -> list[tuple[str, int]]:
        """Like the inner ``list_keys``, but may sleep and raise BlobError."""
        _validate_prefix(prefix)
        self._check_open()
        fail, _, delay = self._decide()
        if delay:
            time.sleep(delay)
        if fail:
            raise self._fault("list_keys", prefix, False)
        return self.inner.list_keys(prefix)

    def close(self) -> None:
        """Close this wrapper and the inner store."""
        super().close()
        self.inner.close()
