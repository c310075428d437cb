"""Load run: many client processes asking an embedded farm for a cached graph at once.

Each request is what a client does on a hit: `Lookup` by key (the entries and their guards), then
`Compile` with the chosen digest, the artifact streamed back and its digest checked. The
graph is compiled once first (the miss), so every timed request is a hit.

    .venv/bin/python bench/load.py [--clients 20] [--seconds 30]

Prints one JSON object: requests, errors, throughput, p50/p90/p99 latency, artifact bytes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import time


def _payload() -> tuple[bytes, dict]:
    """A small MLP's Dynamo graph, serialized as the client backend would send it."""
    import torch

    from torchfarm.compiler import serialize

    captured = {}

    def capture(gm, example_inputs):
        captured["graph"], captured["hints"] = serialize.dumps(gm), serialize.size_hints(gm)
        return gm.forward

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    torch.compile(model, backend=capture)(torch.randn(32, 64))
    return captured["graph"], captured["hints"]


def _request(graph: bytes, hints: dict):
    from torchfarm.compiler.target import local_target
    from torchfarm.proto import torchfarm_pb2 as pb

    return pb.CompileRequest(graph=graph, target=local_target(), size_hints=hints, label="load")


def _client(
    addr: str,
    graph: bytes,
    hints: dict,
    seconds: float,
    start_at: float,
    results: multiprocessing.Queue,
) -> None:
    from torchfarm.client import remote
    from torchfarm.contract.cache_key import public_key
    from torchfarm.settings import ClientSettings

    settings = ClientSettings(addr=addr, progress=False)
    request = _request(graph, hints)
    key = public_key(request.graph, request.target, request.options)
    latencies, errors, nbytes = [], [], 0
    time.sleep(max(0.0, start_at - time.time()))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.perf_counter()
        try:
            candidates = remote.lookup(key, settings)
            request.digest = candidates[0].digest if candidates else ""
            header, data = remote.fetch(request, settings)
            if header.source != "hit":
                errors.append(f"source {header.source}")
            nbytes = len(data)
        except Exception as e:  # counted, not fatal: the run measures errors
            errors.append(f"{type(e).__name__}: {e}")
            continue
        latencies.append(time.perf_counter() - started)
    results.put({"latencies": latencies, "errors": errors, "bytes": nbytes})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=30)
    args = parser.parse_args()

    from torchfarm.client import remote
    from torchfarm.local_farm import LocalFarm
    from torchfarm.settings import ClientSettings

    graph, hints = _payload()
    with LocalFarm() as farm:
        header, _ = remote.fetch(_request(graph, hints), ClientSettings(addr=farm.addr))
        assert header.source == "miss", header.source
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        start_at = time.time() + 5  # every client imported and connected by then
        procs = [
            ctx.Process(
                target=_client, args=(farm.addr, graph, hints, args.seconds, start_at, results)
            )
            for _ in range(args.clients)
        ]
        for proc in procs:
            proc.start()
        runs = [results.get(timeout=args.seconds + 120) for _ in procs]
        for proc in procs:
            proc.join()
    latencies = sorted(x for r in runs for x in r["latencies"])
    errors = [e for r in runs for e in r["errors"]]
    cuts = statistics.quantiles(latencies, n=100)
    print(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d"),
                "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                "clients": args.clients,
                "seconds": args.seconds,
                "requests": len(latencies),
                "errors": len(errors),
                "error_samples": errors[:3],
                "throughput_per_s": round(len(latencies) / args.seconds, 1),
                "p50_ms": round(cuts[49] * 1000, 1),
                "p90_ms": round(cuts[89] * 1000, 1),
                "p99_ms": round(cuts[98] * 1000, 1),
                "artifact_bytes": runs[0]["bytes"],
            }
        )
    )


if __name__ == "__main__":
    main()
