"""A blob store in a local directory: :class:`FileBlob`.

Invariants kept here:

* ``set`` is atomic and durable: the value goes to a temporary file in the target's
  directory (named :data:`~persist.blob.base.TMP_PREFIX` ``<uuid>``, never a valid key),
  which is fsynced, renamed over the target and followed by an fsync of the directory;
  a crash leaves at most such a temporary file, which :meth:`FileBlob.sweep_temporaries`
  removes;
* directories this store creates get mode ``0o700`` and files ``0o600`` (the user's only);
* nothing outside the root is ever read, written, listed or deleted: the root is resolved
  once, and then no symbolic link below it is followed, at any level (every path is
  walked component by component with ``O_NOFOLLOW`` and ``dir_fd``); a link met is named
  in a :class:`~persist.errors.BlobError`, and :meth:`FileBlob.find_symlinks` lists them;
* only regular files are values: FIFOs, sockets and devices are never read, listed or
  removed (a FIFO is opened non-blocking, so it cannot hang a read).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
import uuid
from pathlib import Path
from urllib.parse import SplitResult, unquote

from persist.blob.base import (
    SEGMENT_RE,
    TMP_PREFIX,
    BlobMetrics,
    Closable,
    is_valid_key,
    validate_key,
    validate_prefix,
)
from persist.errors import BlobError, InvalidUsage
from stash import redact

__all__ = ["FileBlob"]

log = logging.getLogger(__name__)

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


class FileBlob(Closable):
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
        root: the directory (created if missing, unless ``create`` is false).
        fsync: fsync files and directories on ``set`` (default ``True``; ``False`` keeps
            atomicity against concurrent readers but not durability against power loss).
        create: ``True`` (the default): create a missing root now.  ``False``: create
            nothing now; while the root is missing the store reads as empty (``get``
            gives ``None``, ``list_keys`` nothing, ``delete`` does nothing) and the first
            ``set`` creates it.  Read-only tools (``persist shards``, ``cat``, ``fsck``)
            open stores so, so a mistyped path never leaves a directory behind.

    Attributes:
        root: the root, absolute and with every symbolic link resolved.

    Raises:
        BlobError: the root cannot be created or is not a directory (with ``create``
            false: it exists and is not a directory).
    """

    def __init__(
        self, root: str | os.PathLike[str], fsync: bool = True, *, create: bool = True
    ) -> None:
        given = Path(root).absolute()
        self._fsync = fsync
        self._root_may_be_missing = not create
        self.metrics = BlobMetrics()
        if create:
            try:
                self._make_dirs(given)
            except OSError as e:
                raise BlobError(f"cannot create blob root {str(given)!r}: {e.strerror}") from e
        if (create or given.exists()) and not given.is_dir():
            raise BlobError(f"blob root {str(given)!r} is not a directory")
        self.root = Path(os.path.realpath(given))

    def __repr__(self) -> str:
        return f"FileBlob({str(self.root)!r})"

    @classmethod
    def from_uri(cls, uri: str, parts: SplitResult, *, create: bool = True) -> FileBlob:
        """The store of a ``file:///absolute/path`` URI (host empty or ``localhost``),
        ``parts`` being ``urlsplit(uri)`` (:func:`persist.blob.open_blob` calls this);
        ``create`` as for the constructor.

        Raises:
            InvalidUsage: a host, query or fragment, or an empty path (the message
                carries the redacted URI).
            BlobError: the root cannot be created or is not a directory.
        """
        if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
            raise InvalidUsage(
                f"malformed blob URI {redact(uri)!r}: use file:///absolute/path "
                "(no host, query or fragment)"
            )
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise InvalidUsage(f"malformed blob URI {redact(uri)!r}: the path is empty")
        return cls(path, create=create)

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

    def root_exists(self) -> bool:
        """Whether the root directory exists (always, unless opened with
        ``create=False`` and nothing was written yet)."""
        return self.root.is_dir()

    def _open_root(self, create: bool) -> int | None:
        """A descriptor of the root; ``None`` when it is missing, the store was opened
        with ``create=False`` and ``create`` is false here too (else it is made now)."""
        try:
            return os.open(self.root, _DIR_FLAGS)
        except FileNotFoundError:
            if not self._root_may_be_missing:
                raise
            if not create:
                return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _SymlinkMet(".") from None
            raise
        self._make_dirs(self.root)  # the first write of a store opened with create=False
        return os.open(self.root, _DIR_FLAGS)

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
        fd = self._open_root(create)
        if fd is None:
            return None
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
                tmp = f"{TMP_PREFIX}{uuid.uuid4().hex}"
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
        validate_prefix(prefix)
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
                    if not SEGMENT_RE.fullmatch(entry.name):
                        continue
                    sub = self._open_dir(fd, entry.name, entry.name)
                    if sub is not None:
                        try:
                            n += self._sweep(sub, cutoff)
                        finally:
                            os.close(sub)
                elif entry.name.startswith(TMP_PREFIX) and entry.is_file(follow_symlinks=False):
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
        validate_prefix(prefix)
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
            if not SEGMENT_RE.fullmatch(entry.name):
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
                and is_valid_key(name)
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
        validate_prefix(prefix)
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
