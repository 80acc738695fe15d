"""Removing the empty directories an object store keeps under a prefix.

``pyarrow.fs`` keeps a directory alive on object stores (S3, GCS) with an empty
"directory marker" object (key ending in ``/``): after deleting a directory's last file
it writes one for that directory (apache/arrow#36275 on GitHub), and S3 consoles and other
clients write them too.  They are never keys (:meth:`persist.blob.arrowfs.ArrowFsBlob.list_keys`
skips them), but a dropped shard should leave nothing under its prefix: this removes
them.

Invariant kept here: a directory holding a file is never removed (only empty ones are,
deepest first), and nothing outside the given prefix is touched.
"""

from __future__ import annotations

import pyarrow.fs as pafs

from persist.blob.arrowfs import ArrowFsBlob
from persist.blob.base import validate_prefix

__all__ = ["remove_empty_dirs"]


def remove_empty_dirs(blob: ArrowFsBlob, prefix: str) -> int:
    """Remove the directory ``prefix`` (a key followed by ``/``) of ``blob`` and every
    directory under it that holds no file, deepest first (removing one may make
    ``pyarrow.fs`` mark its parent, removed next).  A directory holding a file is kept.
    Nothing may write under ``prefix`` meanwhile (a file written between the listing and
    the removal of its directory goes with it): ``finalize_shard`` calls this on a
    dropped shard's prefix.

    Returns: how many directories were removed.

    Raises:
        InvalidKey: ``prefix`` is not a valid key prefix.
        BlobError: the store failed.
    """
    top = blob._path(validate_prefix(prefix).rstrip("/"))
    blob._check_open()
    fs = blob.fs

    def prune() -> int:
        infos = fs.get_file_info(pafs.FileSelector(top, recursive=True, allow_not_found=True))
        files = [i.path for i in infos if i.type == pafs.FileType.File]
        dirs = [i.path for i in infos if i.type == pafs.FileType.Directory] + [top]
        n = 0
        for d in sorted(dirs, key=lambda p: p.count("/"), reverse=True):
            if any(f.startswith(d + "/") for f in files):
                continue
            if fs.get_file_info(d).type == pafs.FileType.Directory:
                fs.delete_dir(d)
                n += 1
        return n

    return blob._call("remove_empty_dirs", prefix, prune)
