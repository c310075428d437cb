"""The gateway's memory while an admin imports a 600 MB bundle (issue 50, item 4; target:
refused, resident memory growth <= 64 MB; before: 466 -> 1,631 MB and the bundle decoded
without a limit).

A real gateway and redis-server (no worker). The admin's upload is a real bundle's bytes,
then zeros, sent 1 MiB a chunk as they are generated (the sender holds none of it). The
gateway's resident memory (/proc/PID/status VmRSS) is sampled every 5 ms from before the
call to after its answer. Prints one JSON line: the answer and the growth. Usage:
import_bound.py [--mb 600]."""

import argparse
import itertools
import json
import os
import sys
import threading
import time

import grpc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from torchfarm.cache.admin import MAX_BUNDLE_BYTES, CacheAdmin  # noqa: E402
from torchfarm.gateway import auth  # noqa: E402
from torchfarm.local_farm import LocalFarm  # noqa: E402
from torchfarm.proto import torchfarm_pb2 as pb  # noqa: E402
from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc  # noqa: E402


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=600)
    args = parser.parse_args()
    admin_token = auth.make_token()
    with LocalFarm(workers=0, admins=f"ops:{auth.hash_token(admin_token)}") as farm:
        store = farm.store()
        key = "0" * 64
        store.artifacts.put(key, os.urandom(1 << 20), pb.EntryMeta())
        bundle = CacheAdmin(store).export(pb.ExportRequest())  # a real bundle's start
        store.artifacts.drop(key)
        pid = farm.procs["gateway"].pid
        baseline, peak, done = rss_mb(pid), [0.0], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], rss_mb(pid))
                time.sleep(0.005)

        sampler = threading.Thread(target=sample)
        sampler.start()
        chunks = itertools.chain(
            [pb.BundleChunk(data=bundle)],
            (pb.BundleChunk(data=bytes(1 << 20)) for _ in range(args.mb)),
        )
        started = time.monotonic()
        with grpc.insecure_channel(farm.addr) as channel:
            try:
                reply = pb_grpc.AdminStub(channel).Import(
                    chunks, metadata=[("authorization", f"Bearer {admin_token}")], timeout=600
                )
                answer = f"OK: {reply.entries} entries"
            except grpc.RpcError as e:
                answer = f"{e.code().name}: {e.details()}"
        seconds = time.monotonic() - started
        time.sleep(0.2)
        done.set()
        sampler.join()
        stored = len(store.artifacts.keys())
    print(
        json.dumps(
            {
                "upload_mb": args.mb,
                "cap_mb": MAX_BUNDLE_BYTES >> 20,
                "answer": answer,
                "seconds": round(seconds, 2),
                "entries_stored": stored,
                "gateway_rss_before_mb": round(baseline, 1),
                "gateway_rss_peak_mb": round(peak[0], 1),
                "growth_mb": round(peak[0] - baseline, 1),
                "target_growth_mb": 64,
            }
        )
    )


if __name__ == "__main__":
    main()
