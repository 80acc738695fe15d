"""Protects: a blob URI whose ``//`` is missing is not taken for a local directory.

``open_blob`` read any string without ``://`` as a local path, so ``s3:/bucket/prefix``
(one slash short) became the directory ``./s3:/bucket/prefix`` under the working
directory: a client wrote its parts to local disk while its user believed them in S3,
and RFC 8089's ``file:/abs/path`` became ``./file:/abs/path`` (a reader of an existing
table found a different, empty store). Now ``file:/abs/path`` is the file store at
``/abs/path`` and any other ``scheme:`` without ``//`` is refused, creating nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pytest

from persist import InvalidUsage, PersistClient
from persist.blob import FileBlob, open_blob
from stash import Stash

pytestmark = pytest.mark.adversarial


@pytest.mark.parametrize(
    "uri",
    ["s3:/bucket/prefix", "s3:bucket/prefix", "gs:/b/p", "file:relative/blob", "S3:/b"],
)
def test_a_scheme_without_slashes_is_refused_and_creates_nothing(
    uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    scheme = uri.split(":", 1)[0]
    with pytest.raises(InvalidUsage, match=f"scheme '{scheme}' but has no '//'"):
        open_blob(uri)
    with Stash.open(f"sqlite:///{tmp_path}/s.db", fenced=False) as s:
        with pytest.raises(InvalidUsage):
            PersistClient(s, uri)
    assert sorted(os.listdir(tmp_path)) == ["s.db"]


def test_secrets_of_a_refused_uri_are_not_shown(tmp_path: Path) -> None:
    with pytest.raises(InvalidUsage) as e:
        open_blob("s3:AKIAEXAMPLE:wJalrXUtnFEMI@bucket/p")
    assert "wJalrXUtnFEMI" not in str(e.value)


def test_file_colon_absolute_path_is_the_file_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "blob"
    blob = open_blob(f"file:{root}")
    assert isinstance(blob, FileBlob)
    assert Path(blob.root) == root
    with Stash.open(f"sqlite:///{tmp_path}/s.db", fenced=False) as s:
        c = PersistClient(s, f"file://{root}")
        c.create_table("t", pa.schema([("id", pa.int64())]), key=["id"]).append(
            pa.table({"id": [1, 2]})
        )
        c.close()
        c = PersistClient(s, f"file:{root}")
        assert c.table("t").to_arrow().num_rows == 2
        c.close()
    assert not (tmp_path / "file:").exists()


@pytest.mark.parametrize("path", ["C:/data/blob", "relative/blob", "./s3:/x"])
def test_paths_stay_paths(path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    blob = open_blob(path, create=False)
    assert isinstance(blob, FileBlob)
