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

import errno
import os
import tempfile
import urllib.parse
from collections.abc import Iterable
from typing import Protocol, TypeAlias

import redis

from torchfarm.cache import keys

# The cache's Redis: one server, or a Redis Cluster (cache/store.py's connect, keys.py's tags).
CacheClient: TypeAlias = "redis.Redis | redis.RedisCluster"
CachePipeline: TypeAlias = "redis.client.Pipeline | redis.cluster.ClusterPipeline"

# What a Redis at its memory limit raises (missing from the types-redis stubs).
OutOfMemoryError: type[Exception] = redis.exceptions.OutOfMemoryError  # type: ignore[attr-defined]


class CacheFull(Exception):
    """The cache's storage refused a write (Redis at its memory limit, the blob store full or
    refusing); nothing was kept."""


class BlobBackend(Protocol):
    """Where encoded artifact bytes live, by digest."""

    # Which store this is, without endpoint or credentials (redis, file:///dir,
    # s3://bucket/prefix): recorded in the cache by its workers, so that a process pointed at
    # another store refuses to run instead of taking every blob for missing.
    where: str

    def get(self, digest: str) -> bytes | None:
        """The stored bytes, or None if there are none (any other failure raises)."""

    def put(self, digest: str, stored: bytes) -> None:
        """Store; raise CacheFull if the backend is out of space (and keep nothing)."""

    def delete(self, digests: Iterable[str]) -> None:
        """Remove these blobs; absent ones are no error."""

    def check(self) -> None:
        """Make the store ready for writes (a directory, a bucket), or raise saying why not:
        a worker calls it once at start, so a wrong URL fails there, not on a first compile."""


class RedisBlobs:
    """Blobs in the cache's Redis, at keys.blob(digest)."""

    where = "redis"

    def __init__(self, client: CacheClient):
        self.redis = client

    def get(self, digest: str) -> bytes | None:
        return self.redis.get(keys.blob(digest))

    def put(self, digest: str, stored: bytes) -> None:
        try:
            self.redis.set(keys.blob(digest), stored)
        except OutOfMemoryError as e:
            raise CacheFull(str(e)) from e

    def delete(self, digests: Iterable[str]) -> None:
        names = [keys.blob(d) for d in digests]
        if names:
            self.redis.delete(*names)

    def check(self) -> None:
        self.redis.ping()


class FileBlobs:
    """Blobs as files under `root`, written to a temporary name and renamed into place, so a
    reader sees a whole blob or none, whatever crashes mid-write."""

    def __init__(self, root: str):
        self.root = root
        self.where = f"file://{root}"

    def path(self, digest: str) -> str:
        return os.path.join(self.root, keys.blob_object(digest))

    def get(self, digest: str) -> bytes | None:
        try:
            with open(self.path(digest), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def put(self, digest: str, stored: bytes) -> None:
        path = self.path(digest)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".put-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(stored)
                os.replace(temporary, path)
            except BaseException:
                os.unlink(temporary)
                raise
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CacheFull(f"the blob directory {self.root} is full: {e}") from e
            raise

    def delete(self, digests: Iterable[str]) -> None:
        for digest in digests:
            try:
                os.unlink(self.path(digest))
            except FileNotFoundError:
                pass

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

    def name(self, digest: str) -> str:
        return (
            f"{self.prefix}/{keys.blob_object(digest)}" if self.prefix else keys.blob_object(digest)
        )

    def get(self, digest: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.name(digest))["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def put(self, digest: str, stored: bytes) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=self.name(digest), Body=stored)
        except ClientError as e:  # the store answered no (full, over quota, not allowed)
            raise CacheFull(f"the blob store refused {self.name(digest)}: {e}") from e

    def delete(self, digests: Iterable[str]) -> None:
        names = [self.name(d) for d in digests]
        for start in range(0, len(names), self.DELETE_BATCH):
            batch = names[start : start + self.DELETE_BATCH]
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
