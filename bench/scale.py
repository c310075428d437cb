"""Scale run (issue 29): a fleet's ranks starting together against one farm of several
gateways, a real S3-compatible object store (SeaweedFS) and one Redis, on this machine.

1. **The start**: `--ranks` simulated ranks (threads spread over `--processes` client
   processes, each process one gRPC channel round-robin over every gateway, as a training
   job's processes would have) ask at the same instant for one of `--graphs` distinct graphs
   (rank i asks for graph i mod graphs), each with its payload, exactly as the client backend
   asks on its first step: the farm has none of them. Reported: compiles per distinct graph
   (single-flight across gateways: 1 is right), errors, the first-result latency.
2. **The hit storm**: every rank asks again and again for its graph for `--seconds`:
   hits/s, p50/p99, errors, and the CPU time per hit of the gateways together and of the
   cache's redis-server (from /proc, so what the machine's other work took is not counted
   in it).
3. **Redis memory per entry**: `MEMORY USAGE` of every key in the cache's Redis, summed per
   kind of key, over the entries stored.

    .venv/bin/python bench/scale.py [--ranks 1000] [--processes 10] [--gateways 2]
        [--graphs 3] [--seconds 20] [--json PATH]

Prints one JSON object. docs/scaling.md extrapolates these figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import platform
import statistics
import sys
import threading
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from bench.load import _ask, _cpu_s, _payload, _request  # noqa: E402

TOKEN = "scale-bench-token-0123456789abcdef"


def _rank(
    settings, ask, request, start_at: float, storm_at: float, storm_end: float, out: list
) -> None:
    from torchfarm.client import remote

    time.sleep(max(0.0, start_at - time.time()))
    started = time.perf_counter()
    try:
        first = remote.get(ask, request, settings).header.source
    except Exception as e:  # counted, not fatal: the run measures errors
        first = f"error {type(e).__name__}: {str(e)[:200]}"
    out.append(("start", first, time.perf_counter() - started))
    time.sleep(max(0.0, storm_at - time.time()))
    while time.time() < storm_end:
        started = time.perf_counter()
        try:
            source = remote.get(ask, None, settings).header.source
        except Exception as e:
            source = f"error {type(e).__name__}: {str(e)[:200]}"
        out.append(("storm", source, time.perf_counter() - started))


def _process(
    addr: str,
    requests: list[bytes],
    ranks: range,
    times: tuple[float, float, float],
    results: multiprocessing.Queue,
) -> None:
    from torchfarm.proto import torchfarm_pb2 as pb
    from torchfarm.settings import ClientSettings

    settings = ClientSettings(addr=addr, token=TOKEN, progress=False, connect_timeout_s=30)
    graphs = [pb.CompileRequest.FromString(r) for r in requests]
    asks = [_ask(r) for r in graphs]
    out: list = []
    threads = [
        threading.Thread(
            target=_rank,
            args=(settings, asks[i % len(graphs)], graphs[i % len(graphs)], *times, out),
            daemon=True,
        )
        for i in ranks
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    results.put(out)


def _percentiles(latencies: list[float]) -> dict:
    if len(latencies) < 2:
        return {"n": len(latencies)}
    cuts = statistics.quantiles(latencies, n=100)
    return {
        "n": len(latencies),
        "p50_ms": round(cuts[49] * 1000, 1),
        "p99_ms": round(cuts[98] * 1000, 1),
        "max_ms": round(max(latencies) * 1000, 1),
    }


def _redis_memory(store, entries: int) -> dict:
    """MEMORY USAGE of every key of the cache's Redis, per kind (the key's first two parts)."""
    redis = store.artifacts.redis
    kinds: dict[str, int] = collections.Counter()
    for key in redis.scan_iter(count=1000):
        kind = ":".join(key.decode(errors="replace").split(":")[:2])
        kinds[kind] += redis.memory_usage(key, samples=0) or 0
    total = sum(kinds.values())
    return {
        "entries": entries,
        "bytes_per_entry": round(total / max(entries, 1)),
        "by_kind": dict(kinds.most_common()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=1000)
    parser.add_argument("--processes", type=int, default=10)
    parser.add_argument("--gateways", type=int, default=2)
    parser.add_argument("--graphs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument(
        "--blobs", choices=("s3", "file"), default="s3", help="file: the farm's dir"
    )
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    load_before = os.getloadavg()

    from tests.s3_server import seaweedfs
    from torchfarm.gateway.auth import hash_token
    from torchfarm.local_farm import LocalFarm

    # distinct graphs: MLP training steps of other widths (artifacts of ~0.1-0.3 MB)
    requests = [_request(*_payload(8, 64 + 32 * g)) for g in range(args.graphs)]
    with (
        seaweedfs() as s3,
        LocalFarm(
            tenants=f"fleet:{hash_token(TOKEN)}",
            gateways=args.gateways,
            blob_url=s3.blob_url("scale") if args.blobs == "s3" else "",
            extra_env=s3.env,
        ) as farm,
    ):
        os.environ.update(s3.env)  # this process's own store reads the bucket too
        store = farm.store()
        addr = ",".join(farm.addrs)
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        # every process spawned, imported and its threads started before the start
        start_at = time.time() + 20 + args.ranks / 100
        storm_at = start_at + 60  # after every first result (compiles of a few seconds)
        storm_end = storm_at + args.seconds
        per = -(-args.ranks // args.processes)
        procs = [
            ctx.Process(
                target=_process,
                args=(
                    addr,
                    [r.SerializeToString() for r in requests],
                    range(p * per, min(args.ranks, (p + 1) * per)),
                    (start_at, storm_at, storm_end),
                    results,
                ),
            )
            for p in range(args.processes)
        ]
        for proc in procs:
            proc.start()
        pids = {name: proc.pid for name, proc in farm.procs.items() if name.startswith("gateway")}
        pids["redis"] = farm.procs["redis"].pid
        time.sleep(max(0.0, storm_at - time.time()))
        compiles = store.counters.farm().get("compiles", 0)
        cpu = {name: _cpu_s(pid) for name, pid in pids.items()}
        time.sleep(max(0.0, storm_end - time.time()))
        cpu = {name: _cpu_s(pid) - cpu[name] for name, pid in pids.items()}
        rows = [row for _ in procs for row in results.get(timeout=600)]
        for proc in procs:
            proc.join()
        memory = _redis_memory(store, len(list(store.artifacts.keys())))
    start = [r for r in rows if r[0] == "start"]
    storm = [r for r in rows if r[0] == "storm"]
    storm_hits = [r[2] for r in storm if r[1] == "hit"]
    gateway_cpu = sum(v for k, v in cpu.items() if k.startswith("gateway"))
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "load_average_before": [round(x, 2) for x in load_before],
        "ranks": args.ranks,
        "processes": args.processes,
        "gateways": args.gateways,
        "blobs": args.blobs,
        "distinct_graphs": args.graphs,
        "start": {
            "compiles": compiles,
            "compiles_per_distinct_graph": compiles / args.graphs,
            "sources": dict(collections.Counter(r[1].split(":")[0] for r in start)),
            "errors": [r[1] for r in start if r[1].startswith("error")][:3],
            "first_result": _percentiles([r[2] for r in start]),
        },
        "hit_storm": {
            "seconds": args.seconds,
            "hits": len(storm_hits),
            "not_hits": len(storm) - len(storm_hits),
            "errors": [r[1] for r in storm if r[1].startswith("error")][:3],
            "hits_per_s": round(len(storm_hits) / args.seconds, 1),
            **_percentiles(storm_hits),
            "cpu_ms_per_hit": {
                "gateways": round(1000 * gateway_cpu / max(len(storm_hits), 1), 3),
                "redis": round(1000 * cpu["redis"] / max(len(storm_hits), 1), 3),
            },
        },
        "redis_memory": memory,
    }
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
