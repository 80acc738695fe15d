"""Blob stores: durable maps from validated string keys to immutable byte values.

A shard's parts live here; its metadata lives in consensus. This module
holds the :class:`Blob` protocol, its implementations (:class:`FileBlob` for local files,
:class:`MemoryBlob` for tests, :class:`ArrowFsBlob` for any ``pyarrow.fs`` filesystem such
as S3), :func:`open_blob` to pick one from a URI, the fault injector
:class:`UnreliableBlob` (after the first persist engine's ``UnreliableBlob`` in Materialize's
``src/persist/src/indexed/``), and :func:`validate_key`.

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
  user's only);
* :class:`FileBlob` never reads, writes, lists or deletes anything outside its root: it
  resolves the root once and then never follows a symbolic link below it, at any level
  (every path is walked component by component with ``O_NOFOLLOW`` and ``dir_fd``);
  a link met is named in a :class:`~persist.errors.BlobError`, and
  :meth:`FileBlob.find_symlinks` lists them;
* every failure of the underlying storage surfaces as :class:`~persist.errors.BlobError`
  (or its subclass :class:`~persist.errors.InvalidKey`), and no URI credential ever
  appears in a ``repr`` or an error message (they go through :func:`stash.redact`);
  object-store URIs carrying credentials are refused (:func:`open_blob`): they come from
  the environment only;
* object stores' empty "directory marker" objects (keys ending in ``/``, left by some
  clients and by ``pyarrow.fs`` itself after a delete) are never keys: ``list_keys``
  of :class:`ArrowFsBlob` skips them, so GC and fsck never see them; a dropped shard's
  are removed (:func:`persist.blobdirs.remove_empty_dirs`), so a drop leaves nothing
  under the shard's prefix.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import stat
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol, TypeVar, runtime_checkable
from urllib.parse import unquote, urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from persist.errors import BlobError, InvalidKey, InvalidUsage
from stash import redact

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
# Query parameter names that carry a credential (refused in object-store URIs).
_SECRET_PARAM_RE = re.compile(r"key|secret|token|pass|credential|signature", re.IGNORECASE)
_T = TypeVar("_T")
log = logging.getLogger(__name__)


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
# Opening a directory below the root: never through a symbolic link (ELOOP instead).
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Opening a value: never through a symbolic link, and never blocking on a FIFO.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW


class _SymlinkMet(Exception):
    """Internal: a symbolic link sits at ``rel`` (relative to the root)."""

    def __init__(self, rel: str) -> None:
        super().__init__(rel)
        self.rel = rel


def _is_symlink_at(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


class FileBlob(_ClosableMixin):
    """A blob store in a local directory: key ``a/b`` is the file ``root/a/b``.

    Writes are atomic and durable: the value goes to a temporary file next to the target
    (``.tmp-<uuid>``, never a valid key, so never listed), which is fsynced, renamed over
    the target with ``os.replace`` and followed by an fsync of the directory. Directories
    this store creates (the root included, when missing) get mode ``0o700``, files
    ``0o600``; an existing root's mode is left as it is.

    Nothing outside the root is ever read, written, listed or deleted: the root
    is resolved once, at construction (so the path given may itself be, or pass through,
    a symbolic link), and every operation then walks from it one directory at a time
    with ``openat``-style calls (``dir_fd``) and ``O_NOFOLLOW``, so a symbolic link
    anywhere below the root -- a shard directory, a kind directory, a key -- is never
    followed, even if it appears while the operation runs. ``get``, ``set``,
    ``delete`` and ``list_keys`` meeting one raise :class:`BlobError` naming its path
    (relative to the root); :meth:`find_symlinks` lists them all (``persist fsck``);
    :meth:`sweep_temporaries` skips them. Only regular files are values: ``list_keys``
    skips names that are not keys and entries that are neither regular files nor real
    directories (FIFOs, sockets, devices), and ``get``/``delete`` of such an entry
    raise :class:`BlobError` (a FIFO is opened non-blocking, so it cannot hang a read).

    A key that is a prefix directory of another key (``a`` and ``a/b``) cannot both exist
    here; the second ``set`` raises :class:`BlobError`. Persist's keys never do this.

    Args:
        root: the directory (created if missing).
        fsync: fsync files and directories on ``set`` (default ``True``; ``False`` keeps
            atomicity against concurrent readers but not durability against power loss).

    Attributes:
        root: the root, absolute and with every symbolic link resolved.

    Raises:
        BlobError: the root cannot be created or is not a directory.
    """

    def __init__(self, root: str | os.PathLike[str], fsync: bool = True) -> None:
        given = Path(root).absolute()
        self._fsync = fsync
        self.metrics = BlobMetrics()
        try:
            self._make_dirs(given)
        except OSError as e:
            raise BlobError(f"cannot create blob root {str(given)!r}: {e.strerror}") from e
        if not given.is_dir():
            raise BlobError(f"blob root {str(given)!r} is not a directory")
        self.root = Path(os.path.realpath(given))

    def __repr__(self) -> str:
        return f"FileBlob({str(self.root)!r})"

    def _make_dirs(self, path: Path) -> None:
        """Create ``path`` (the root) and its missing parents with mode 0o700."""
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
                fd = os.open(d.parent, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    # ---------------------------------------------------------- walking
    def _symlink_error(self, op: str, key: str, rel: str) -> BlobError:
        return BlobError(
            f"blob {op} {key!r} refused: {rel!r} under the blob root {str(self.root)!r} is a "
            "symbolic link, and FileBlob never follows symbolic links below its root "
            "(replace it with a real directory or file)"
        )

    def _open_root(self) -> int:
        try:
            return os.open(self.root, _DIR_FLAGS)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _SymlinkMet(".") from None
            raise

    def _open_dir(self, parent_fd: int, name: str, rel: str) -> int | None:
        """The directory ``name`` of ``parent_fd`` opened without following a link;
        ``None`` if missing. Raises _SymlinkMet, NotADirectoryError, OSError."""
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP or _is_symlink_at(parent_fd, name):
                raise _SymlinkMet(rel) from None
            raise

    def _walk(self, segments: list[str], create: bool) -> int | None:
        """A descriptor of the directory ``root/segments...`` (the caller closes it),
        reached one component at a time without following any link; missing ones are
        created (0o700, parent fsynced) if ``create``, else ``None`` is returned.

        Raises: _SymlinkMet (a link on the way), NotADirectoryError (a file on the
        way), OSError.
        """
        fd = self._open_root()
        try:
            for i, seg in enumerate(segments):
                rel = "/".join(segments[: i + 1])
                sub = self._open_dir(fd, seg, rel)
                if sub is None:
                    if not create:
                        os.close(fd)
                        return None
                    try:
                        os.mkdir(seg, 0o700, dir_fd=fd)
                        if self._fsync:
                            os.fsync(fd)
                    except FileExistsError:
                        pass  # made concurrently (or a link put there: checked next)
                    sub = self._open_dir(fd, seg, rel)
                    if sub is None:
                        raise FileNotFoundError(errno.ENOENT, "directory vanished", rel)
                os.close(fd)
                fd = sub
            return fd
        except BaseException:
            os.close(fd)
            raise

    # ------------------------------------------------------- operations
    def get(self, key: str) -> bytes | None:
        """The bytes at ``key`` or ``None``. Raises InvalidKey, BlobError (also when a
        symbolic link or a non-regular file is met: named in the message)."""
        segs = validate_key(key).split("/")
        self._check_open()
        try:
            dfd = self._walk(segs[:-1], create=False)
            if dfd is None:
                self.metrics.record_get(0)
                return None
            try:
                fd = os.open(segs[-1], _READ_FLAGS, dir_fd=dfd)
            except (FileNotFoundError, NotADirectoryError):
                self.metrics.record_get(0)
                return None
            except OSError as e:
                if e.errno == errno.ELOOP or _is_symlink_at(dfd, segs[-1]):
                    raise _SymlinkMet(key) from None
                raise
            finally:
                os.close(dfd)
            try:
                mode = os.fstat(fd).st_mode
            except BaseException:
                os.close(fd)
                raise
            if not stat.S_ISREG(mode):
                os.close(fd)
                if stat.S_ISDIR(mode):
                    self.metrics.record_get(0)
                    return None
                raise BlobError(f"blob get {key!r} failed: it is not a regular file")
            with os.fdopen(fd, "rb") as f:
                data = f.read()
        except _SymlinkMet as s:
            raise self._symlink_error("get", key, s.rel) from None
        except NotADirectoryError:
            self.metrics.record_get(0)
            return None
        except OSError as e:
            raise BlobError(f"blob get {key!r} failed: {e.strerror or e}") from e
        self.metrics.record_get(len(data))
        return data

    def set(self, key: str, value: bytes) -> None:
        """Write ``value`` at ``key`` atomically and durably. Raises InvalidKey, BlobError
        (also when a symbolic link is met on the way or at ``key``: named in the
        message)."""
        segs = validate_key(key).split("/")
        self._check_open()
        data = memoryview(value)
        name = segs[-1]
        try:
            dfd = self._walk(segs[:-1], create=True)
            assert dfd is not None
            try:
                if _is_symlink_at(dfd, name):
                    raise _SymlinkMet(key)
                tmp = f"{_TMP_PREFIX}{uuid.uuid4().hex}"
                fd = os.open(tmp, _WRITE_FLAGS, 0o600, dir_fd=dfd)
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                        f.flush()
                        if self._fsync:
                            os.fsync(f.fileno())
                    # A rename replaces a link put at ``name`` meanwhile; it never follows it.
                    os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                except BaseException:
                    try:
                        os.unlink(tmp, dir_fd=dfd)
                    except OSError:
                        pass
                    raise
                if self._fsync:
                    os.fsync(dfd)
            finally:
                os.close(dfd)
        except _SymlinkMet as s:
            raise self._symlink_error("set", key, s.rel) from None
        except OSError as e:
            raise BlobError(f"blob set {key!r} failed: {e.strerror or e}") from e
        self.metrics.record_set(len(data))

    def delete(self, key: str) -> None:
        """Remove ``key`` (a missing key is fine). Raises InvalidKey, BlobError (also for
        a symbolic link on the way or at ``key``, or a non-regular file, named in the
        message: neither is ever removed)."""
        segs = validate_key(key).split("/")
        self._check_open()
        try:
            dfd = self._walk(segs[:-1], create=False)
            if dfd is not None:
                try:
                    self._unlink_regular(dfd, segs[-1], key)
                finally:
                    os.close(dfd)
        except _SymlinkMet as s:
            raise self._symlink_error("delete", key, s.rel) from None
        except NotADirectoryError:
            pass
        except OSError as e:
            raise BlobError(f"blob delete {key!r} failed: {e.strerror or e}") from e
        self.metrics.record_delete()

    @staticmethod
    def _unlink_regular(dfd: int, name: str, key: str) -> None:
        try:
            mode = os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return
        if stat.S_ISLNK(mode):
            raise _SymlinkMet(key)
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), key)
        if not stat.S_ISREG(mode):
            raise BlobError(f"blob delete {key!r} refused: it is not a regular file")
        try:
            os.unlink(name, dir_fd=dfd)  # removes a link swapped in meanwhile, never its target
        except FileNotFoundError:
            pass

    def sweep_temporaries(self, prefix: str, older_than_seconds: float) -> int:
        """Delete the temporary files (``.tmp-*``) a ``set`` interrupted by a crash left
        in the directories under ``prefix`` (a key prefix ending in ``/``), if their last
        change is older than ``older_than_seconds``; returns how many were deleted.  A
        ``set`` still running that long loses its temporary file and fails with
        BlobError (nothing half-written is ever visible).  Best effort: files that vanish
        or cannot be removed are skipped (the crash campaign in ``tests/reliability``
        found these leaking).
        Symbolic links are neither followed nor deleted (a link on the way to ``prefix``
        makes the sweep delete nothing; it is logged): only regular ``.tmp-*`` files in
        real directories below the root are removed.

        Raises: InvalidKey (a bad prefix).
        """
        _validate_prefix(prefix)
        self._check_open()
        cutoff = time.time() - older_than_seconds
        try:
            fd = self._walk([s for s in prefix.split("/") if s], create=False)
        except _SymlinkMet as s:
            log.warning("%r: not sweeping %r: %r is a symbolic link", self, prefix, s.rel)
            return 0
        except OSError:
            return 0
        if fd is None:
            return 0
        try:
            return self._sweep(fd, cutoff)
        finally:
            os.close(fd)

    def _sweep(self, fd: int, cutoff: float) -> int:
        n = 0
        try:
            with os.scandir(fd) as it:
                entries = list(it)
        except OSError:
            return 0
        for entry in entries:
            try:
                if entry.is_symlink():
                    continue
                if entry.is_dir(follow_symlinks=False):
                    if not _SEGMENT_RE.fullmatch(entry.name):
                        continue
                    sub = self._open_dir(fd, entry.name, entry.name)
                    if sub is not None:
                        try:
                            n += self._sweep(sub, cutoff)
                        finally:
                            os.close(sub)
                elif entry.name.startswith(_TMP_PREFIX) and entry.is_file(follow_symlinks=False):
                    if entry.stat(follow_symlinks=False).st_mtime <= cutoff:
                        os.unlink(entry.name, dir_fd=fd)
                        n += 1
            except (OSError, _SymlinkMet):
                continue
        return n

    def list_keys(self, prefix: str = "") -> list[tuple[str, int]]:
        """Sorted ``(key, size)`` of keys starting with ``prefix``. Raises InvalidKey,
        BlobError (also when a symbolic link sits where a key, or a directory of keys
        starting with ``prefix``, would be: named in the message, never followed)."""
        _validate_prefix(prefix)
        self._check_open()
        # Walk only below the deepest directory the prefix fully names.
        dir_part = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        out: list[tuple[str, int]] = []
        try:
            try:
                fd = self._walk(dir_part.split("/") if dir_part else [], create=False)
            except NotADirectoryError:
                fd = None
            if fd is not None:
                try:
                    self._scan(fd, dir_part + "/" if dir_part else "", prefix, out)
                finally:
                    os.close(fd)
        except _SymlinkMet as s:
            raise self._symlink_error("list_keys", prefix, s.rel) from None
        except OSError as e:
            raise BlobError(f"blob list_keys {prefix!r} failed: {e.strerror or e}") from e
        out.sort()
        self.metrics.record_list()
        return out

    def _scan(self, fd: int, rel: str, prefix: str, out: list[tuple[str, int]]) -> None:
        with os.scandir(fd) as it:
            entries = list(it)
        for entry in entries:
            name = rel + entry.name
            if not _SEGMENT_RE.fullmatch(entry.name):
                continue
            if not (name.startswith(prefix) or prefix.startswith(name + "/")):
                continue
            if entry.is_symlink():
                raise _SymlinkMet(name)
            if entry.is_dir(follow_symlinks=False):
                sub = self._open_dir(fd, entry.name, name)
                if sub is not None:
                    try:
                        self._scan(sub, name + "/", prefix, out)
                    finally:
                        os.close(sub)
            elif (
                entry.is_file(follow_symlinks=False)
                and name.startswith(prefix)
                and _is_valid_key(name)
            ):
                try:
                    out.append((name, entry.stat(follow_symlinks=False).st_size))
                except FileNotFoundError:
                    continue  # deleted while listing

    def find_symlinks(self, prefix: str = "") -> list[str]:
        """Every symbolic link below the root whose path starts with ``prefix`` (or lies
        on the way to it), as sorted paths relative to the root, found without following
        any (for ``persist fsck``; every other operation refuses them).  Names that are
        not keys (hidden files too) are searched as well.

        Raises: InvalidKey (a bad prefix), BlobError (the directories cannot be read).
        """
        _validate_prefix(prefix)
        self._check_open()
        dir_part = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        segs = dir_part.split("/") if dir_part else []
        found: list[str] = []
        try:
            try:
                fd = self._walk(segs, create=False)
            except _SymlinkMet as s:
                return [s.rel]
            except NotADirectoryError:
                return []
            if fd is None:
                return []
            try:
                self._find_links(fd, dir_part + "/" if dir_part else "", prefix, found)
            finally:
                os.close(fd)
        except OSError as e:
            raise BlobError(f"blob find_symlinks {prefix!r} failed: {e.strerror or e}") from e
        return sorted(found)

    def _find_links(self, fd: int, rel: str, prefix: str, found: list[str]) -> None:
        with os.scandir(fd) as it:
            entries = list(it)
        for entry in entries:
            name = rel + entry.name
            if not (name.startswith(prefix) or prefix.startswith(name + "/")):
                continue
            if entry.is_symlink():
                found.append(name)
            elif entry.is_dir(follow_symlinks=False):
                try:
                    sub = self._open_dir(fd, entry.name, name)
                except _SymlinkMet:
                    found.append(name)  # swapped for a link while searching
                    continue
                if sub is not None:
                    try:
                        self._find_links(sub, name + "/", prefix, found)
                    finally:
                        os.close(sub)


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

#: The older name of :func:`stash.redact`, the one redaction function.
redact_uri = redact


def open_blob(uri: str | os.PathLike[str]) -> Blob:
    """Open the blob store a URI names.

    * ``file:///abs/path`` (host empty or ``localhost``), or a plain absolute or relative
      path: a :class:`FileBlob` (created if missing);
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
    """
    if isinstance(uri, os.PathLike):
        return FileBlob(os.fspath(uri))
    if not isinstance(uri, str):
        raise InvalidUsage(f"a blob URI must be a str or path, not {type(uri).__name__}")
    if uri == "" or uri.strip() != uri:
        raise InvalidUsage("a blob URI must be non-empty and have no surrounding whitespace")
    if "\x00" in uri:
        raise InvalidUsage(f"blob URI {redact(uri)!r} contains NUL")
    if "://" not in uri:
        return FileBlob(uri)
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
    if scheme == "memory":
        if parts.path or parts.query or parts.fragment or "@" in parts.netloc:
            raise InvalidUsage(
                f"malformed blob URI {redact(uri)!r}: use memory:// or memory://NAME"
            )
        if parts.netloc == "":
            return MemoryBlob()
        if not _is_valid_key(parts.netloc) or "/" in parts.netloc:
            raise InvalidUsage(
                f"malformed blob URI {redact(uri)!r}: the memory store name must be "
                "one key segment ([A-Za-z0-9][A-Za-z0-9._=-]*)"
            )
        return MemoryBlob(parts.netloc)
    if scheme == "file":
        if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
            raise InvalidUsage(
                f"malformed blob URI {redact(uri)!r}: use file:///absolute/path "
                "(no host, query or fragment)"
            )
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise InvalidUsage(f"malformed blob URI {redact(uri)!r}: the path is empty")
        return FileBlob(path)
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
            "AWS_SESSION_TOKEN or the provider's own chain), never from a URI, which ends "
            "up in logs, process lists and Spark plans"
        )
    target = uri
    if scheme == "s3" and "allow_delayed_open" not in parts.query:
        # A part is written in one request (PutObject) instead of three (a multipart
        # upload's create, part and complete), and a writer killed mid-upload leaves no
        # unfinished multipart upload behind.
        target = uri + ("&" if parts.query else "?") + "allow_delayed_open=true"
    try:
        fs, path = pafs.FileSystem.from_uri(target)
    except (pa.ArrowException, OSError, ValueError, TypeError) as e:
        problem = (
            f"cannot open blob store {redact(uri)!r}: {type(e).__name__}: "
            f"{redact(str(e), url=uri)[:500]}"
        )
    if problem is not None:
        raise InvalidUsage(problem)
    return ArrowFsBlob(fs, path)


# ------------------------------------------------------------------ UnreliableBlob


class UnreliableBlob(_ClosableMixin):
    """A :class:`Blob` wrapper that injects faults, after Materialize's ``UnreliableBlob``.

    While faults are on, each call (``get``, ``set``, ``delete``, ``list_keys``) first
    sleeps a random ``0..slow_seconds`` and then fails with :class:`BlobError` with
    probability ``fail_probability``. A failing ``set`` (or ``delete``) is, with
    probability ``after_write_probability``, a call that *did* its work on the inner store
    and then raised (a put whose acknowledgement was lost): callers must treat a failed
    ``set`` as indeterminate. :meth:`make_unavailable` makes every call fail (as the
    Materialize's ``UnreliableHandle::make_unavailable``); :meth:`faults` turns injection on/off.
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
