"""Load run: many client processes asking one gateway of an embedded farm for a cached graph.

Each request is what a client does on a hit (`remote.get`): one call with the key computed
locally and the graph's SymInt sizes (no payload sent), the unary `Hit` where the stored bytes
fit one message (they do with the defaults) and a `Get` stream otherwise; the artifact's
bytes arrive as stored (zstd) and are decompressed, their size and sha256 checked. The graph (a
training step of an MLP of `--layers` layers of width `--width`: an artifact of 0.9 MB
with the defaults) is compiled once first, the miss, so every timed request is a hit.

    .venv/bin/python bench/load.py [--clients 8] [--seconds 30] [--layers 48] [--width 256]

Prints one JSON object: requests, errors, throughput, p50/p90/p99 latency, the artifact's
size and stored size, bytes on the wire per hit, the machine's load average before the run,
and the CPU time per hit of the gateway, the cache's redis-server and the clients: on a
shared machine the throughput is what the others left, the CPU time per hit is not.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import time


def _payload(layers: int, width: int) -> tuple[bytes, dict]:
    """A training step of an MLP, serialized as the client backend would send it."""
    import torch

    from torchfarm.compiler import serialize

    captured = {}

    def capture(gm, example_inputs):
        captured["graph"], captured["hints"] = serialize.dumps(gm), serialize.size_hints(gm)
        return gm.forward

    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
    model = torch.nn.Sequential(*blocks)
    torch.compile(model, backend=capture)(torch.randn(32, width)).sum().backward()
    return captured["graph"], captured["hints"]


def _request(graph: bytes, hints: dict):
    from torchfarm.compiler.target import local_target
    from torchfarm.proto import torchfarm_pb2 as pb

    return pb.CompileRequest(graph=graph, target=local_target(), size_hints=hints, label="load")


def _ask(request):
    from torchfarm.contract.cache_key import public_key
    from torchfarm.proto import torchfarm_pb2 as pb

    key = public_key(request.graph, request.target, request.options)
    return pb.Ask(key=key, label=request.label)  # a static graph: no SymInt sizes


def _client(
    addr: str,
    request_bytes: bytes,
    seconds: float,
    start_at: float,
    results: multiprocessing.Queue,
) -> None:
    from torchfarm.client import remote
    from torchfarm.proto import torchfarm_pb2 as pb
    from torchfarm.settings import ClientSettings

    settings = ClientSettings(addr=addr, progress=False)
    request = pb.CompileRequest.FromString(request_bytes)
    ask = _ask(request)
    latencies, errors, wire = [], [], []
    time.sleep(max(0.0, start_at - time.time()))
    cpu = time.process_time()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.perf_counter()
        try:
            received = remote.get(ask, request, settings)
            if received.header.source != "hit":
                errors.append(f"source {received.header.source}")
        except Exception as e:  # counted, not fatal: the run measures errors
            errors.append(f"{type(e).__name__}: {e}")
            continue
        latencies.append(time.perf_counter() - started)
        wire.append(received.timings["wire_bytes"])
    cpu = time.process_time() - cpu
    results.put({"latencies": latencies, "errors": errors, "wire": wire, "cpu_s": cpu})


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=8, help="client processes")
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--gateway-threads", type=int, default=0, help="0: the default")
    args = parser.parse_args()
    load_before = os.getloadavg()  # the machine is shared: how busy it was

    from torchfarm.client import remote
    from torchfarm.local_farm import LocalFarm
    from torchfarm.settings import ClientSettings

    graph, hints = _payload(args.layers, args.width)
    request = _request(graph, hints)
    env = {"TORCHFARM_GATEWAY_THREADS": str(args.gateway_threads)} if args.gateway_threads else {}
    with LocalFarm(extra_env=env) as farm:
        missed = remote.get(_ask(request), request, ClientSettings(addr=farm.addr))
        assert missed.header.source == "miss", missed.header.source
        entry = farm.store().artifacts.entry(missed.header.key, missed.header.digest)
        assert entry is not None
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        start_at = time.time() + 5  # every client imported and connected by then
        procs = [
            ctx.Process(
                target=_client,
                args=(farm.addr, request.SerializeToString(), args.seconds, start_at, results),
            )
            for _ in range(args.clients)
        ]
        for proc in procs:
            proc.start()
        farm_pids = {name: farm.procs[name].pid for name in ("gateway", "redis")}
        time.sleep(max(0.0, start_at - time.time()))
        farm_cpu = {name: _cpu_s(pid) for name, pid in farm_pids.items()}
        runs = [results.get(timeout=args.seconds + 120) for _ in procs]
        farm_cpu = {name: _cpu_s(pid) - farm_cpu[name] for name, pid in farm_pids.items()}
        for proc in procs:
            proc.join()
    latencies = sorted(x for r in runs for x in r["latencies"])
    wire = [w for r in runs for w in r["wire"]]
    errors = [e for r in runs for e in r["errors"]]
    cuts = statistics.quantiles(latencies, n=100)
    cpu_ms = {
        **{name: 1000 * used / len(latencies) for name, used in farm_cpu.items()},
        "clients": 1000 * sum(r["cpu_s"] for r in runs) / len(latencies),
    }
    print(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d %H:%M"),
                "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                "load_average_before": [round(x, 2) for x in load_before],
                "clients": args.clients,
                "seconds": args.seconds,
                "requests": len(latencies),
                "errors": len(errors),
                "error_samples": errors[:3],
                "throughput_per_s": round(len(latencies) / args.seconds, 1),
                "p50_ms": round(cuts[49] * 1000, 1),
                "p90_ms": round(cuts[89] * 1000, 1),
                "p99_ms": round(cuts[98] * 1000, 1),
                "artifact_bytes": entry.size,
                "stored_bytes": entry.stored_bytes,
                "wire_bytes_per_hit": round(statistics.mean(wire)) if wire else 0,
                "payload_bytes": len(graph),
                "cpu_ms_per_hit": {name: round(ms, 3) for name, ms in cpu_ms.items()},
                # estimates from the CPU time per hit, for two idle cores: the gateway serves
                # from one core at most (the GIL); with the clients elsewhere, or here too
                "estimated_hits_per_s": {
                    "gateway_and_redis": round(
                        min(1000 / cpu_ms["gateway"], 2000 / (cpu_ms["gateway"] + cpu_ms["redis"]))
                    ),
                    "clients_here_too": round(
                        min(1000 / cpu_ms["gateway"], 2000 / sum(cpu_ms.values()))
                    ),
                },
            }
        )
    )


if __name__ == "__main__":
    main()
