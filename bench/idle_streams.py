"""Another tenant's hits while one tenant holds idle streams (issue 27, finding 1; target: p99
under 100 ms with 1,000 idle streams).

A real gateway and redis-server at their default settings (no worker: nothing compiles).
Tenant A, in a process of its own, opens IDLE Get streams and never sends the ask; with
--reopen it opens a new one each time one ends (refused, or cancelled at the message
deadline), so IDLE stay asked for. Meanwhile tenant B makes HITS Get hits one after another.
Prints one JSON line: B's hit latency (p50/p99/max, ms) alone and under A's streams, and how
A's streams ended. Usage: idle_streams.py [--idle 1000] [--hits 300] [--reopen]."""

import argparse
import json
import multiprocessing
import os
import sys
import threading
import time

import grpc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from torchfarm.contract.cache_key import cache_key  # noqa: E402
from torchfarm.gateway import auth  # noqa: E402
from torchfarm.local_farm import LocalFarm  # noqa: E402
from torchfarm.proto import torchfarm_pb2 as pb  # noqa: E402
from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc  # noqa: E402

TARGET = pb.Target(device="cpu", torch_version="2.13.0", python_version="3.11")
KEY = cache_key(b"a graph", TARGET, pb.Options())


def _metadata(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def hold_idle_streams(addr: str, token: str, idle: int, reopen: bool, report, stop) -> None:
    """Tenant A: `idle` Get streams that never send; reports how they ended."""
    ends: dict[str, int] = {}
    lock = threading.Lock()
    never = threading.Event()
    channels = [grpc.insecure_channel(addr) for _ in range(8)]

    def silent():
        never.wait()
        yield from ()

    def open_one(i: int) -> None:
        call = pb_grpc.FarmStub(channels[i % len(channels)]).Get(
            silent(), metadata=_metadata(token), timeout=600
        )

        def ended(done) -> None:
            with lock:
                ends[done.code().name] = ends.get(done.code().name, 0) + 1
            if reopen and not stop.is_set():
                open_one(i)

        call.add_done_callback(ended)

    for i in range(idle):
        open_one(i)
    report.put("open")
    stop.wait()
    with lock:
        report.put(dict(ends))
    never.set()


def hit_latencies_ms(addr: str, token: str, hits: int) -> list[float]:
    """Tenant B: `hits` Get hits one after another, each on a fresh call."""
    seconds = []
    with grpc.insecure_channel(addr) as channel:
        farm = pb_grpc.FarmStub(channel)
        for _ in range(hits):
            started = time.perf_counter()
            events = list(
                farm.Get(
                    iter([pb.GetRequest(ask=pb.Ask(key=KEY))]),
                    metadata=_metadata(token),
                    timeout=60,
                )
            )
            seconds.append(time.perf_counter() - started)
            assert events[0].header.source == "hit"
    return sorted(s * 1000 for s in seconds)


def summary(ms: list[float]) -> dict:
    return {
        "p50_ms": round(ms[len(ms) // 2], 2),
        "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 2),
        "max_ms": round(ms[-1], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--idle", type=int, default=1000)
    parser.add_argument("--hits", type=int, default=300)
    parser.add_argument("--reopen", action="store_true")
    args = parser.parse_args()
    a, b = auth.make_token(), auth.make_token()
    tenants = f"a:{auth.hash_token(a)},b:{auth.hash_token(b)}"
    with LocalFarm(workers=0, tenants=tenants, admins="") as farm:
        farm.store().artifacts.put(KEY, os.urandom(64 << 10), pb.EntryMeta(tenant="b"))
        hit_latencies_ms(farm.addr, b, 20)  # warm up the channel and the gateway
        alone = hit_latencies_ms(farm.addr, b, args.hits)
        context = multiprocessing.get_context("spawn")
        report, stop = context.Queue(), context.Event()
        attacker = context.Process(
            target=hold_idle_streams, args=(farm.addr, a, args.idle, args.reopen, report, stop)
        )
        attacker.start()
        assert report.get(timeout=120) == "open"
        time.sleep(2)  # A's streams reach the gateway: held up to its cap, the rest refused
        under = hit_latencies_ms(farm.addr, b, args.hits)
        stop.set()
        ends = report.get(timeout=120)
        attacker.join(30)
    print(
        json.dumps(
            {
                "idle_streams": args.idle,
                "reopen": args.reopen,
                "hits": args.hits,
                "alone": summary(alone),
                "under_idle_streams": summary(under),
                "idle_stream_ends": ends,
            }
        )
    )


if __name__ == "__main__":
    main()
