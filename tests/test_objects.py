"""Object store on both backends: S3 (rclone serve s3) and local files."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from robustrl.config import Settings
from robustrl.errors import ConfigError, StorageError
from robustrl.storage.objects import (
    FileObjectStore,
    ObjectNotFound,
    ObjectStore,
    S3ObjectStore,
    open_object_store,
)


@pytest.fixture(params=["s3", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "s3":
        yield request.getfixturevalue("object_store")
    else:
        yield FileObjectStore(tmp_path / "objects")


def test_put_get_exists_overwrite(store: ObjectStore) -> None:
    store.put("a/b/c.bin", b"one")
    assert store.get("a/b/c.bin") == b"one"
    assert store.exists("a/b/c.bin")
    assert not store.exists("a/b/other")
    store.put("a/b/c.bin", b"two")
    assert store.get("a/b/c.bin") == b"two"
    store.put("empty", b"")
    assert store.get("empty") == b""


def test_list_is_sorted_and_prefix_filtered(store: ObjectStore) -> None:
    for key in ["job/ckpt/000000000010/x", "job/ckpt/000000000002/y", "job/ckpt/000000000002/a", "jobx/z",
                "other"]:
        store.put(key, key.encode())
    assert store.list("job/") == ["job/ckpt/000000000002/a", "job/ckpt/000000000002/y",
                                  "job/ckpt/000000000010/x"]
    assert store.list("job") == ["job/ckpt/000000000002/a", "job/ckpt/000000000002/y",
                                 "job/ckpt/000000000010/x", "jobx/z"]
    assert store.list("job/ckpt/0000000000") == store.list("job/")
    assert store.list("nothing/") == []
    assert store.list("") == sorted(store.list(""))
    assert len(store.list("")) == 5


def test_delete_and_delete_prefix(store: ObjectStore) -> None:
    for key in ["p/1", "p/2", "p/q/3", "pp/4"]:
        store.put(key, b"x")
    store.delete("p/1")
    store.delete("p/1")  # missing key: no error
    assert store.list("p/") == ["p/2", "p/q/3"]
    assert store.delete_prefix("p/") == 2
    assert store.list("") == ["pp/4"]
    assert store.delete_prefix("none/") == 0


def test_missing_key_error_names_key(store: ObjectStore) -> None:
    with pytest.raises(ObjectNotFound) as err:
        store.get("no/such/key")
    assert isinstance(err.value, StorageError) and isinstance(err.value, KeyError)
    assert err.value.key == "no/such/key"
    assert "no/such/key" in str(err.value)
    assert not err.value.retryable


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/../b", "a/./b", "trailing/", "x/.y.tmp-1"])
def test_invalid_keys_rejected(store: ObjectStore, key: str) -> None:
    with pytest.raises(StorageError):
        store.put(key, b"x")


def test_large_object_multipart(object_store: S3ObjectStore, infra: Settings) -> None:
    small_parts = S3ObjectStore(infra.s3_endpoint, infra.s3_access_key, infra.s3_secret_key,
                                object_store.bucket, part_size=5 * 1024 * 1024)
    data = os.urandom(1024 * 1024) * 12  # 12 MiB: three parts
    small_parts.put("big/blob", data)
    assert object_store.get("big/blob") == data
    assert object_store.list("big/") == ["big/blob"]


def test_file_store_writes_atomically(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path)
    store.put("d/k", b"v" * 1000)
    names = [p.name for p in (tmp_path / "d").iterdir()]
    assert names == ["k"], "no temporary file may be left behind"
    # A stray temp file (a writer that died mid-put) is never listed.
    (tmp_path / "d" / ".k.tmp-dead").write_bytes(b"partial")
    assert store.list("") == ["d/k"]
    store.delete("d/k")
    assert store.list("") == []


def test_s3_errors_translated(infra: Settings) -> None:
    with pytest.raises(StorageError) as err:
        S3ObjectStore(infra.s3_endpoint, infra.s3_access_key, "wrong-secret", "b-any")
    assert "b-any" in str(err.value)
    with pytest.raises(StorageError, match=r"127\.0\.0\.1:9"):
        S3ObjectStore("127.0.0.1:9", "a", "b", "bucket", connect_timeout_s=0.5)


def test_open_object_store(infra: Settings, tmp_path: Path) -> None:
    s3 = open_object_store(infra)
    assert isinstance(s3, S3ObjectStore) and s3.bucket == infra.s3_bucket
    file_store = open_object_store(infra.model_copy(update={"object_store_url": f"file://{tmp_path}/obj"}))
    assert isinstance(file_store, FileObjectStore) and file_store.root == (tmp_path / "obj").resolve()
    file_store.put("k", b"v")
    assert (tmp_path / "obj" / "k").read_bytes() == b"v"
    with pytest.raises(ConfigError):
        open_object_store(infra.model_copy(update={"object_store_url": "s3://bucket"}))
