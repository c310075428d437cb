"""Warm-start benchmark: time to the first result of a compiled training step, each in a
fresh process with an empty local cache unless said otherwise, side by side in one run:

  local_cold      torch.compile, empty caches
  pt_local_warm   torch.compile again on the same local cache dir (PyTorch's warm start)
  pt_remote_warm  PyTorch's own Redis remote caches (FX graph, AOTAutograd, autotune) on a
                  redis-server of their own, filled by one process, read by a fresh process
                  with an empty local dir: what a user picks instead of a farm
  farm_miss       backend="torchfarm" on an empty farm (embedded LocalFarm)
  farm_hit        the same again, empty local cache
  trace_only      backend="eager": Dynamo's tracing alone, the floor of a hit that traces

It prints each median, the ratios, where a miss's time went (the worker's account in the
artifact header, the client's own around it) and where a hit's time went (the profile:
Dynamo's tracing, then per hit, summed over its graphs, whatever timings the client
recorded: payload, key, RPCs, bytes on the wire, decompression, verification, the load and
its C++ / Triton kernel loading, and the rest: the first run). `--json PATH` writes
the medians, `farm_miss_overhead_s` (farm miss minus the compile child's own compile time)
and `hit_profile`. `--model big` measures 8 blocks of width 256 instead of 2 of width 128.

`--blobs` measures farm hits instead, with the artifact bytes in each blob store
(TORCHFARM_BLOB_URL: the cache's Redis, a directory, a real S3 server: SeaweedFS's `weed`),
one farm per store, all running, one miss each, then hits taken in turn: each hit's
first result and its fetch (backend_s: submission to loaded code; rpc_s + transfer_s), the
ratios to Redis, and the Redis bytes per entry.

    .venv/bin/python bench/warm_start.py [--repeats 3] [--model big] [--json PATH] [--blobs]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.s3_server import seaweedfs  # noqa: E402
from torchfarm.cache import keys  # noqa: E402
from torchfarm.local_farm import LocalFarm, free_port  # noqa: E402

CLIENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "first_result.py")
STAGES = {
    "local_cold": "local cold compile",
    "pt_local_warm": "PyTorch local warm cache",
    "pt_remote_warm": "PyTorch remote cache (Redis)",
    "farm_miss": "farm miss",
    "farm_hit": "farm hit, empty local cache",
    "trace_only": "Dynamo tracing alone (eager)",
}
PT_REMOTE = {
    "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "1",
    "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE": "1",
    "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE": "1",
    # not TORCHINDUCTOR_BUNDLED_AUTOTUNE_REMOTE_CACHE: on CPU (torch 2.13) it fails every
    # compile (`assert isinstance(backend_hash, str)`: the CPU has no backend hash)
}
# Where a miss's time went: the worker's MissTimings, then the client's around them.
BREAKDOWN = ("queued_s", "handoff_s", "child_s", "compile_s", "store_s", "transfer_s", "load_s")
# Where a hit's time went, in the order it is spent; any other timing a hit records is
# printed after these. load_native_s and load_triton_s are parts of load_s.
HIT_PARTS = (
    "payload_s",
    "key_s",
    "rpc_s",
    "transfer_s",
    "wire_bytes",
    "decompress_s",
    "verify_s",
    "load_s",
    "load_native_s",
    "load_triton_s",
)


def fresh_process_env(cache_dir: str, **extra: str) -> dict:
    """The environment of a measured process: its own empty Inductor and Triton cache dirs, no
    progress line; `extra` on top (the benches' TORCHFARM_ADDR and their own settings)."""
    return dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=cache_dir,
        TRITON_CACHE_DIR=cache_dir + "-triton",
        TORCHFARM_PROGRESS="0",
        **extra,
    )


def measure(backend: str, cache_dir: str, addr: str = "", env: dict | None = None) -> dict:
    """One fresh process; its JSON report (seconds, source, per-graph timings)."""
    out = subprocess.run(
        [sys.executable, CLIENT, backend],
        env=fresh_process_env(cache_dir, TORCHFARM_ADDR=addr, **(env or {})),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def plain_redis():
    """A passwordless redis-server on loopback, as PyTorch's remote cache expects."""
    port, directory = free_port(), tempfile.mkdtemp(prefix="pt-remote-")
    proc = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port)]
        + ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", directory],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while (
            subprocess.run(
                ["redis-cli", "-p", str(port), "ping"], capture_output=True, check=False
            ).stdout.strip()
            != b"PONG"
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server for the PyTorch remote cache did not start")
            time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(directory, ignore_errors=True)


def hit_profile(hits: list[dict], trace_only: float) -> dict[str, float]:
    """Median over hits of each timing summed over the hit's graphs. `trace_only_s`: the
    trace_only stage's whole first step (Dynamo alone, another process); `dynamo_s`: the
    hit's own Dynamo compile minus its backend calls; `backend_s`: from each graph's
    submission until its code was ready (fetch and load); `rest_s`: what the step spent
    outside Dynamo's compile (the first run, first-use costs)."""
    seen = {part for hit in hits for graph in hit["graphs"] for part in graph}
    parts = [p for p in HIT_PARTS if p in seen] + sorted(seen - set(HIT_PARTS))
    profile = {
        "trace_only_s": trace_only,
        "dynamo_s": statistics.median(h["compile_s"] - h["backend_compile_s"] for h in hits),
    }
    for part in parts:
        profile[part] = statistics.median(sum(g.get(part, 0.0) for g in h["graphs"]) for h in hits)
    profile["backend_s"] = statistics.median(h["backend_s"] for h in hits)
    profile["rest_s"] = statistics.median(h["seconds"] - h["compile_s"] for h in hits)
    profile["graphs"] = statistics.median(len(h["graphs"]) for h in hits)
    return profile


BLOB_STORES = ("redis", "file", "s3")


def redis_bytes_per_entry(store) -> float:
    """Redis memory (MEMORY USAGE) of the index and usage hashes of every key, per entry."""
    client, entries, held = store.artifacts.redis, 0, 0
    for key, _ in store.artifacts.keys():
        entries += len(store.artifacts.entries(key, usage=False))
        held += sum(client.memory_usage(n) or 0 for n in (keys.index(key), keys.usage(key)))
    return held / max(entries, 1)


def compare_blob_stores(args) -> None:
    """Farm hits with the bytes in each of BLOB_STORES, side by side (see the docstring)."""
    runs: dict[str, dict[str, list[float]]] = {
        b: {"seconds": [], "backend_s": [], "fetch_s": [], "redis_bytes": []} for b in BLOB_STORES
    }
    quiet = {"TORCHFARM_WARM_CHILDREN": "0", "TORCHFARM_WORKER_CONCURRENCY": "1"}
    with contextlib.ExitStack() as stack:
        s3 = stack.enter_context(seaweedfs())
        os.environ.update(s3.env)  # this process's stores and the farms' processes alike
        urls = {"redis": "redis", "file": "", "s3": s3.blob_url("bench")}
        farms = {
            b: stack.enter_context(LocalFarm(blob_url=urls[b], extra_env=quiet))
            for b in BLOB_STORES
        }
        for name, farm in farms.items():  # one miss each: the entry every hit reads
            miss = measure("torchfarm", tempfile.mkdtemp(), farm.addr)
            assert miss["source"] == "miss", miss
            runs[name]["redis_bytes"].append(redis_bytes_per_entry(farm.store()))
        for repeat in range(args.repeats):
            order = BLOB_STORES[repeat % 3 :] + BLOB_STORES[: repeat % 3]
            for name in order:
                hit = measure("torchfarm", tempfile.mkdtemp(), farms[name].addr)
                assert hit["source"] == "hit", hit
                runs[name]["seconds"].append(hit["seconds"])
                runs[name]["backend_s"].append(hit["backend_s"])
                runs[name]["fetch_s"].append(
                    sum(g.get("rpc_s", 0.0) + g.get("transfer_s", 0.0) for g in hit["graphs"])
                )
                print(name, {k: v[-1] for k, v in runs[name].items()}, flush=True)
    med = {b: {k: statistics.median(v) for k, v in r.items()} for b, r in runs.items()}
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, {args.repeats} hits per store, taken in turn "
        "(median; all runs in brackets)"
    )
    for b in BLOB_STORES:
        for k, v in runs[b].items():
            unit = "B" if k == "redis_bytes" else "s"
            print(f"{b:<6} {k:<12} {med[b][k]:10.4f} {unit}  {[round(x, 4) for x in v]}")
    for b in BLOB_STORES[1:]:
        for k in ("seconds", "backend_s", "fetch_s"):
            print(f"{b} / redis  {k:<10} = {med[b][k] / med['redis'][k]:.3f}  (target <= 1.10)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"medians": med, "runs": runs}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the medians (seconds) here")
    parser.add_argument("--model", choices=("small", "big"), default="small")
    parser.add_argument("--blobs", action="store_true", help="compare hits per blob store")
    args = parser.parse_args()
    os.environ["BENCH_MODEL"] = args.model  # the children's model (first_result.py)
    if args.blobs:
        compare_blob_stores(args)
        return
    runs: dict[str, list[float]] = {k: [] for k in STAGES}
    misses: list[dict] = []
    hits: list[dict] = []
    with LocalFarm() as farm, plain_redis() as redis_port:
        store = farm.store()
        remote = dict(PT_REMOTE, TORCHINDUCTOR_REDIS_HOST="127.0.0.1")
        for _ in range(args.repeats):
            warm = tempfile.mkdtemp()
            runs["local_cold"].append(measure("inductor", warm)["seconds"])
            runs["pt_local_warm"].append(measure("inductor", warm)["seconds"])
            subprocess.run(
                ["redis-cli", "-p", str(redis_port), "flushall"], check=True, capture_output=True
            )
            remote["TORCHINDUCTOR_REDIS_PORT"] = str(redis_port)
            measure("inductor", tempfile.mkdtemp(), env=remote)  # fills the remote caches
            runs["pt_remote_warm"].append(
                measure("inductor", tempfile.mkdtemp(), env=remote)["seconds"]
            )
            store.artifacts.redis.flushdb()  # an empty farm cache (jobs live on the broker)
            farm.wait_ready(60)
            miss = measure("torchfarm", tempfile.mkdtemp(), farm.addr)
            assert miss["source"] == "miss", miss
            runs["farm_miss"].append(miss["seconds"])
            misses.append(miss)
            hit = measure("torchfarm", tempfile.mkdtemp(), farm.addr)
            assert hit["source"] == "hit", hit
            runs["farm_hit"].append(hit["seconds"])
            hits.append(hit)
            runs["trace_only"].append(measure("eager", tempfile.mkdtemp())["seconds"])
    med = {k: statistics.median(v) for k, v in runs.items()}
    # Per miss: its timings summed over its graphs; then the median of each part.
    parts = {
        part: statistics.median(sum(g.get(part, 0.0) for g in m["graphs"]) for m in misses)
        for part in BREAKDOWN
    }
    med["farm_miss_overhead_s"] = statistics.median(
        m["seconds"] - sum(g.get("compile_s", 0.0) for g in m["graphs"]) for m in misses
    )
    # What only a farm pays: waiting in the queue and for a child, the child's time beyond
    # its compile (unpickling, packing), storing, the transfer. Dynamo's tracing, the load
    # and the first step are in farm_miss_overhead_s too, but a local compile pays them as well.
    med["farm_only_overhead_s"] = (
        parts["queued_s"]
        + parts["handoff_s"]
        + parts["child_s"]
        - parts["compile_s"]
        + parts["store_s"]
        + parts["transfer_s"]
    )
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, {args.repeats} repeats (median; all runs in brackets)"
    )
    for k, name in STAGES.items():
        print(f"{k:<15} {name:<30} {med[k]:7.2f} s  {[round(x, 2) for x in runs[k]]}")
    print("farm miss, where the time went (median over misses, summed over graphs):")
    print("  " + "  ".join(f"{p[:-2]} {parts[p]:.2f}" for p in BREAKDOWN))
    print(
        f"farm_miss_overhead_s = {med['farm_miss_overhead_s']:.2f}  (farm miss minus the "
        "child's own compile; includes Dynamo tracing and the first step, as local does)"
    )
    print(
        f"farm_only_overhead_s = {med['farm_only_overhead_s']:.2f}  (queue, hand-off, the "
        "child beyond its compile, store, transfer)"
    )
    profile = hit_profile(hits, med["trace_only"])
    print("farm hit, where the time went (median over hits, summed over graphs):")
    for part, value in profile.items():
        print(
            f"  {part:<15} {value:12.4f}" if part != "wire_bytes" else f"  {part:<15} {value:12.0f}"
        )
    print(f"farm_miss / local_cold      = {med['farm_miss'] / med['local_cold']:.2f}  (<= 1.0)")
    print(f"farm_hit / pt_remote_warm   = {med['farm_hit'] / med['pt_remote_warm']:.2f}")
    print(f"farm_hit / pt_local_warm    = {med['farm_hit'] / med['pt_local_warm']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {**med, "breakdown": parts, "hit_profile": profile, "runs": runs}, f, indent=1
            )


if __name__ == "__main__":
    main()
