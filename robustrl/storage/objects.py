"""Object store: checkpoint blobs and manifests, on S3 (MinIO / rclone serve s3) or a local folder.

Two backends behind one small interface. ``S3ObjectStore`` talks to any S3 server through the
``minio`` client; ``FileObjectStore`` keeps objects as files (``file://`` URLs) and makes each
write atomic with a temporary file and a rename, so a reader sees a whole object or none.

Every backend error leaves this module as ``StorageError`` (``raise ... from exc``), and a
missing key as ``ObjectNotFound``, which names the key.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Generator
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote, urlparse

from tenacity import (
    before_sleep_log,
    retry,
    retry_if_exception_type,
    stop_after_delay,
    wait_random_exponential,
)

from robustrl.config import Settings
from robustrl.errors import ConfigError, StorageError

CONNECT_TIMEOUT_S = 5.0
"""How long to wait for a TCP connection to the S3 server."""
READ_TIMEOUT_S = 60.0
"""How long one S3 request may go without receiving data."""
RETRIES = 2
"""Retries of one S3 request after a connection error or a 5xx answer (with back-off)."""
PART_SIZE = 64 * 1024 * 1024
"""Multipart part size: objects up to this size go up in one PUT."""
UNAVAILABLE_RETRY_S = 30.0
"""How long an S3 call is retried (backoff with jitter) while the server cannot be reached at
all, e.g. during its restart; every call here is idempotent (a PUT of the same key and bytes)."""

log = logging.getLogger(__name__)

_TMP_MARK = ".tmp-"


class ObjectNotFound(StorageError, KeyError):
    """No object at ``key``. Also a ``KeyError``, so mapping-style callers can catch that."""

    retryable = False

    def __str__(self) -> str:  # KeyError would repr() the message
        return StorageError.__str__(self)


class StoreUnavailable(StorageError):
    """The S3 server could not be reached (refused, reset, timed out): retried by every call."""


_retry_unavailable = retry(
    retry=retry_if_exception_type(StoreUnavailable), stop=stop_after_delay(UNAVAILABLE_RETRY_S),
    wait=wait_random_exponential(0.1, 2.0), reraise=True, before_sleep=before_sleep_log(log, logging.WARNING))


def check_key(key: str) -> str:
    """Validate an object key: non-empty, '/'-separated, no empty, '.' or '..' segments.

    Raises:
        StorageError: the key is malformed (``key`` field names it).
    """
    parts = key.split("/")
    if not key or "\x00" in key or any(p in ("", ".", "..") for p in parts):
        raise StorageError("invalid object key", key=key)
    if any(_TMP_MARK in p for p in parts):
        raise StorageError(f"object key may not contain {_TMP_MARK!r}", key=key)
    return key


class ObjectStore(ABC):
    """A flat key -> bytes store with prefix listing. Implementations are thread-safe."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` at ``key``, replacing any object there; readers see all of it or the old one."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The object at ``key``.

        Raises:
            ObjectNotFound: no object at ``key``.
            StorageError: the store failed.
        """

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object is stored at ``key``."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Every key that starts with ``prefix`` (plain string prefix), sorted."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; removing a missing key is not an error."""

    def delete_prefix(self, prefix: str) -> int:
        """Remove every key that starts with ``prefix``; return how many were removed."""
        keys = self.list(prefix)
        for key in keys:
            self.delete(key)
        return len(keys)


def _xml_error_code(exc: Exception) -> str | None:
    """The ``<Code>`` of an S3 XML error body that minio could not parse, if there is one."""
    body = getattr(exc, "_body", None)
    if not body:
        return None
    match = re.search(r"<Code>([^<]+)</Code>", body)
    return match.group(1) if match else None


# -- S3 -------------------------------------------------------------------------------------------


class S3ObjectStore(ObjectStore):
    """Objects in one bucket of an S3 server, through the ``minio`` client.

    Args:
        endpoint: ``host:port`` of the server.
        access_key, secret_key: credentials.
        bucket: created if missing.
        secure: use HTTPS.
        part_size: objects larger than this go up as a multipart upload (S3 minimum 5 MiB).
        region: fixed so the client never asks the server for it (rclone answers that lookup
            for a missing bucket in a way minio cannot parse).
    """

    def __init__(self, endpoint: str, access_key: str, secret_key: str, bucket: str, secure: bool = False,
                 *, connect_timeout_s: float = CONNECT_TIMEOUT_S, read_timeout_s: float = READ_TIMEOUT_S,
                 part_size: int = PART_SIZE, region: str = "us-east-1") -> None:
        from minio import Minio
        from urllib3 import PoolManager, Retry, Timeout

        self.endpoint = endpoint
        self.bucket = bucket
        self.part_size = part_size
        # minio's default pool retries for minutes; a checkpoint upload must fail in bounded time.
        http = PoolManager(
            timeout=Timeout(connect=connect_timeout_s, read=read_timeout_s),
            retries=Retry(total=RETRIES, backoff_factor=0.2, status_forcelist=(500, 502, 503, 504)),
            maxsize=8,
        )
        self._client = Minio(endpoint, access_key=access_key, secret_key=secret_key, secure=secure,
                             region=region, http_client=http)
        with self._errors("create bucket", None):
            if not self._client.bucket_exists(bucket):
                with contextlib.suppress(Exception):  # a racing creator is fine; re-checked below
                    self._client.make_bucket(bucket)
                if not self._client.bucket_exists(bucket):
                    raise StorageError("bucket could not be created", bucket=bucket)

    @contextlib.contextmanager
    def _errors(self, op: str, key: str | None) -> Generator[None, None, None]:
        """Translate minio / urllib3 / OS errors into the RobustRL tree (the one place that does)."""
        from minio.error import InvalidResponseError, MinioException, S3Error
        from urllib3.exceptions import HTTPError

        try:
            yield
        except StorageError:
            raise
        except (S3Error, InvalidResponseError) as exc:
            # rclone serve s3 sends its XML errors as text/xml, which minio refuses to parse and
            # reports as InvalidResponseError with the raw body; read the code from that body.
            code = exc.code if isinstance(exc, S3Error) else _xml_error_code(exc)
            if code in ("NoSuchKey", "NoSuchObject"):
                raise ObjectNotFound("no such object", key=key, bucket=self.bucket) from exc
            raise StorageError(f"S3 {op} failed: {code or exc}", key=key, bucket=self.bucket) from exc
        except (HTTPError, OSError) as exc:
            raise StoreUnavailable(f"S3 {op} failed at {self.endpoint}: {exc}", key=key,
                                   bucket=self.bucket) from exc
        except (MinioException, ValueError) as exc:
            raise StorageError(f"S3 {op} failed at {self.endpoint}: {exc}", key=key,
                               bucket=self.bucket) from exc

    @_retry_unavailable
    def put(self, key: str, data: bytes) -> None:
        check_key(key)
        with self._errors("put", key):
            self._client.put_object(self.bucket, key, io.BytesIO(data), len(data), part_size=self.part_size)

    @_retry_unavailable
    def get(self, key: str) -> bytes:
        check_key(key)
        with self._errors("get", key):
            resp = self._client.get_object(self.bucket, key)
            try:
                return resp.read()
            finally:
                resp.close()
                resp.release_conn()

    @_retry_unavailable
    def exists(self, key: str) -> bool:
        check_key(key)
        try:
            with self._errors("stat", key):
                self._client.stat_object(self.bucket, key)
        except ObjectNotFound:
            return False
        return True

    @_retry_unavailable
    def list(self, prefix: str = "") -> list[str]:
        with self._errors("list", prefix):
            return sorted(o.object_name for o in self._client.list_objects(self.bucket, prefix=prefix,
                                                                           recursive=True)
                          if o.object_name is not None and not o.is_dir)

    @_retry_unavailable
    def delete(self, key: str) -> None:
        check_key(key)
        with self._errors("delete", key):
            self._client.remove_object(self.bucket, key)

    def delete_prefix(self, prefix: str) -> int:
        from minio.deleteobjects import DeleteObject

        keys = self.list(prefix)
        if not keys:
            return 0
        with self._errors("delete", prefix):
            failures = list(self._client.remove_objects(self.bucket, [DeleteObject(k) for k in keys]))
        if failures:
            raise StorageError(f"S3 delete failed for {len(failures)} objects: {failures[0]}", key=prefix,
                               bucket=self.bucket)
        return len(keys)


# -- local files ----------------------------------------------------------------------------------


def _create(path: Path) -> BinaryIO:
    """Open a new file for writing, creating its folder (again, if a concurrent delete removed it)."""
    for _attempt in range(3):
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            return open(path, "wb")  # the caller closes it
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "wb")


class FileObjectStore(ObjectStore):
    """Objects as files under ``root``; keys map to relative paths."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).resolve()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create object store root: {exc}", key=str(self.root)) from exc

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = path.with_name(f".{path.name}{_TMP_MARK}{uuid.uuid4().hex}")
        try:
            with _create(tmp) as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StorageError(f"file put failed: {exc}", key=key) from exc

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise ObjectNotFound("no such object", key=key) from exc
        except OSError as exc:
            raise StorageError(f"file get failed: {exc}", key=key) from exc

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        keys: list[str] = []
        try:
            for dirpath, dirs, files in os.walk(self.root):
                rel = Path(dirpath).relative_to(self.root).as_posix()
                base = "" if rel == "." else rel + "/"
                # Prune walks that cannot match: the folder must be a prefix of the key prefix or under it.
                if base and not (base.startswith(prefix) or prefix.startswith(base)):
                    dirs.clear()
                    continue
                keys.extend(base + f for f in files if _TMP_MARK not in f and (base + f).startswith(prefix))
        except OSError as exc:
            raise StorageError(f"file list failed: {exc}", key=prefix) from exc
        return sorted(keys)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            raise StorageError(f"file delete failed: {exc}", key=key) from exc
        # Drop folders left empty so listing stays fast; a concurrent put recreates them.
        parent = path.parent
        while parent != self.root:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent


def open_object_store(settings: Settings) -> ObjectStore:
    """The object store the settings name: ``object_store_url`` ``file:///path`` if set, else S3.

    Raises:
        ConfigError: ``object_store_url`` has a scheme other than ``file``.
        StorageError: the store cannot be reached or its bucket created.
    """
    url = settings.object_store_url
    if url:
        parsed = urlparse(url)
        if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"object_store_url must be file:///path, got {url!r}", field="object_store_url")
        return FileObjectStore(unquote(parsed.path))
    return S3ObjectStore(settings.s3_endpoint, settings.s3_access_key, settings.s3_secret_key,
                         settings.s3_bucket, secure=settings.s3_secure)
