"""Where the cache's encoded artifact bytes live, by digest: one BlobBackend per kind of store,
chosen by one URL (TORCHFARM_BLOB_URL, `open_blobs`):

  redis                            the cache's Redis itself (keys.blob): the old layout, for
                                   small farms; a multi-MB value blocks Redis while it moves
  file:///var/lib/torchfarm/blobs  a directory every process of the farm sees: one host (the
                                   embedded farm of `torchfarm up`), or a shared file system
  s3://bucket[/prefix]?endpoint=http://host:8333&region=us-east-1
                                   an S3-compatible object store (AWS S3, SeaweedFS, MinIO...);
                                   credentials as every AWS client finds them (AWS_ACCESS_KEY_ID
                                   and AWS_SECRET_ACCESS_KEY, a profile, an instance role)

Outside Redis the cache's Redis keeps only the index, usage and totals: a few hundred bytes
per entry, whatever the artifact's size. Objects are named by keys.blob_object (the format
version first, so an upgrade never reads old objects as new). Backends store and return bytes
as given: verifying them (size, sha256, signature) is the cache's and the client's job.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
import urllib.parse
from collections.abc import Iterable, Iterator
from typing import Protocol, TypeAlias

import redis

from torchfarm.cache import keys
from torchfarm.errors import CacheFull

log = logging.getLogger("torchfarm.cache")

# The cache's Redis: one server, or a Redis Cluster (cache/store.py's connect, keys.py's tags).
CacheClient: TypeAlias = "redis.Redis | redis.RedisCluster"
CachePipeline: TypeAlias = "redis.client.Pipeline | redis.cluster.ClusterPipeline"

# What a Redis at its memory limit raises (missing from the types-redis stubs).
OutOfMemoryError: type[Exception] = redis.exceptions.OutOfMemoryError  # type: ignore[attr-defined]


class BlobBackend(Protocol):
    """Where encoded artifact bytes live, by blob name (keys.blob_name: a digest, or its
    details'; any other name raises keys.BadBlobName before it reaches the store)."""

    # Which store this is, without endpoint or credentials (redis, file:///dir,
    # s3://bucket/prefix): recorded in the cache by its workers, so that a process pointed at
    # another store refuses to run instead of taking every blob for missing.
    where: str

    def get(self, name: str, max_bytes: int) -> bytes | None:
        """The stored bytes; None if there are none, or if what is there is no blob of at most
        `max_bytes` (longer, or no regular file): the caller knows the size it stored, so
        nothing a store writer plants makes a read longer than that (any other failure
        raises)."""

    def put(self, name: str, stored: bytes) -> None:
        """Store; raise CacheFull if the backend is out of space (and keep nothing)."""

    def delete(self, names: Iterable[str]) -> None:
        """Remove these blobs; absent ones are no error."""

    def check(self) -> None:
        """Make the store ready for writes (a directory, a bucket), or raise saying why not:
        a worker calls it once at start, so a wrong URL fails there, not on a first compile."""


class RedisBlobs:
    """Blobs in the cache's Redis, at keys.blob(name)."""

    where = "redis"

    def __init__(self, client: CacheClient):
        self.redis = client

    def get(self, name: str, max_bytes: int) -> bytes | None:
        stored = self.redis.getrange(keys.blob(name), 0, max_bytes)  # b"" where there is none
        return stored if 0 < len(stored) <= max_bytes else None

    def put(self, name: str, stored: bytes) -> None:
        try:
            self.redis.set(keys.blob(name), stored)
        except OutOfMemoryError as e:
            raise CacheFull(str(e)) from e

    def delete(self, names: Iterable[str]) -> None:
        found = [keys.blob(n) for n in names]
        if found:
            self.redis.delete(*found)

    def check(self) -> None:
        self.redis.ping()


# How FileBlobs opens what it did not make itself: never through a link (O_NOFOLLOW), never
# waiting on a FIFO (O_NONBLOCK, cleared once fstat says it is a regular file).
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class FileBlobs:
    """Blobs as files under `root`, written to a temporary name and renamed into place, so a
    reader sees a whole blob or none, whatever crashes mid-write. Whoever else can write the
    directory (a shared file system) may plant links, FIFOs or devices in it: every path is
    walked from the root one directory at a time without following a link, and only a
    regular file is read, never past the size asked for."""

    def __init__(self, root: str):
        self.root = root
        self.where = f"file://{root}"

    @contextlib.contextmanager
    def _directory(self, name: str, create: bool = False) -> Iterator[tuple[int, str]]:
        """(an open descriptor of the blob's directory, the blob's file name there): reached
        from the root without following links (OSError, ELOOP or ENOTDIR, where one is)."""
        *parts, leaf = keys.blob_object(name).split("/")
        if create:
            os.makedirs(self.root, exist_ok=True)  # the operator's: followed where a link
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for part in parts:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, dir_fd=fd)
                parent, fd = fd, -1
                try:
                    fd = os.open(part, _DIRECTORY, dir_fd=parent)
                finally:
                    os.close(parent)
            yield fd, leaf
        finally:
            if fd >= 0:
                os.close(fd)

    def get(self, name: str, max_bytes: int) -> bytes | None:
        try:
            with self._directory(name) as (directory, leaf):
                fd = os.open(leaf, _READ, dir_fd=directory)
        except FileNotFoundError:
            return None
        except OSError as e:  # a link (ELOOP), a file where a directory was, a socket (ENXIO)
            log.warning("blob %s is no regular file (%s): not read", name[:16], e)
            return None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                log.warning("blob %s is no regular file: not read", name[:16])
                return None
            os.set_blocking(fd, True)
            stored = f.read(max_bytes + 1)
        return stored if len(stored) <= max_bytes else None

    def put(self, name: str, stored: bytes) -> None:
        try:
            with self._directory(name, create=True) as (directory, leaf):
                temporary = f".put-{secrets.token_hex(8)}"
                fd = os.open(temporary, _WRITE, 0o600, dir_fd=directory)
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(stored)
                    os.replace(temporary, leaf, src_dir_fd=directory, dst_dir_fd=directory)
                except BaseException:
                    os.unlink(temporary, dir_fd=directory)
                    raise
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CacheFull(f"the blob directory {self.root} is full: {e}") from e
            raise

    def delete(self, names: Iterable[str]) -> None:
        for name in names:
            try:
                with self._directory(name) as (directory, leaf):
                    os.unlink(leaf, dir_fd=directory)  # a link itself, never what it names
            except FileNotFoundError:
                pass
            except OSError as e:  # a link or a file where a directory was, a directory
                log.warning("blob %s not removed (%s)", name[:16], e)

    def check(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        if not os.access(self.root, os.W_OK):
            raise PermissionError(f"the blob directory {self.root} is not writable")


class S3Blobs:
    """Blobs as objects of one bucket of an S3-compatible store, through boto3 (the server
    extra): the AWS SDK's own credential chain, retries and connection pool."""

    DELETE_BATCH = 1000  # DeleteObjects' limit

    def __init__(self, bucket: str, prefix: str = "", endpoint: str = "", region: str = ""):
        import boto3
        from botocore.config import Config

        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.where = f"s3://{bucket}/{self.prefix}"
        self.client = boto3.client(
            "s3",
            endpoint_url=endpoint or None,
            region_name=region or None,
            config=Config(
                connect_timeout=5,
                read_timeout=60,
                retries={"max_attempts": 3, "mode": "standard"},
                max_pool_connections=64,  # the gateway serves hits from many threads
                # Bucket in the path: works with every S3-compatible server and any bucket name.
                s3={"addressing_style": "path"},
                # Checksums only where S3 requires them: the newer default trailers are not
                # understood by every S3-compatible server, and the cache checks sha256 anyway.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )

    def name(self, name: str) -> str:
        return f"{self.prefix}/{keys.blob_object(name)}" if self.prefix else keys.blob_object(name)

    def get(self, name: str, max_bytes: int) -> bytes | None:
        from botocore.exceptions import ClientError

        try:  # one byte more than asked: a longer object is no blob of that size
            body = self.client.get_object(
                Bucket=self.bucket, Key=self.name(name), Range=f"bytes=0-{max_bytes}"
            )["Body"]
        except self.client.exceptions.NoSuchKey:
            return None
        except ClientError as e:  # an empty object has no byte 0
            if e.response.get("Error", {}).get("Code") != "InvalidRange":
                raise
            return None
        stored = body.read(max_bytes + 1)
        body.close()
        return stored if len(stored) <= max_bytes else None

    def put(self, name: str, stored: bytes) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=self.name(name), Body=stored)
        except ClientError as e:  # the store answered no (full, over quota, not allowed)
            raise CacheFull(f"the blob store refused {self.name(name)}: {e}") from e

    def delete(self, names: Iterable[str]) -> None:
        found = [self.name(n) for n in names]
        for start in range(0, len(found), self.DELETE_BATCH):
            batch = found[start : start + self.DELETE_BATCH]
            self.client.delete_objects(
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": n} for n in batch], "Quiet": True},
            )

    def check(self) -> None:
        """The bucket, made if it is missing (a farm's own store); any other refusal raises."""
        from botocore.exceptions import ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket"):
                raise
            self.client.create_bucket(Bucket=self.bucket)


def open_blobs(url: str, cache: CacheClient) -> BlobBackend:
    """The backend TORCHFARM_BLOB_URL names (the module's docstring lists the forms); `cache`
    is the cache's Redis, for `redis`."""
    parsed = urllib.parse.urlsplit(url)
    if url in ("", "redis"):
        return RedisBlobs(cache)
    if parsed.scheme == "file" and parsed.path.startswith("/") and not parsed.netloc:
        return FileBlobs(parsed.path)
    if parsed.scheme == "s3" and parsed.netloc:
        query = dict(urllib.parse.parse_qsl(parsed.query))
        unknown = set(query) - {"endpoint", "region"}
        if not unknown:
            return S3Blobs(
                parsed.netloc, parsed.path, query.get("endpoint", ""), query.get("region", "")
            )
    raise ValueError(
        f"TORCHFARM_BLOB_URL {url!r}: expected redis, file:///absolute/dir or "
        "s3://bucket[/prefix][?endpoint=URL&region=NAME]"
    )
