"""Another tenant's first answer while strangers and two tenants hold every stream they can
(issue 50, item 2; target: within 2 s).

A real gateway and redis-server at their default settings (128 threads; no worker: nothing
compiles). In a process of their own, strangers (no token) open health Watch and reflection
streams, and tenants A and C open idle Get streams that never send their ask, each reopening
every stream that ends (refused, or cancelled at the message deadline), so that all of them
ask for more streams than the gateway gives throughout. Then tenant B, on a new channel,
makes its first Get: a hit whose stored bytes are streamed in chunks (it needs a stream
slot). Prints one JSON line: B's first answer (connection included) and its first hits, and
how the others' streams ended. Usage: fair_streams.py [--streams 400] [--hits 50]."""

import argparse
import json
import multiprocessing
import os
import sys
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2_grpc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from torchfarm.contract.cache_key import cache_key  # noqa: E402
from torchfarm.gateway import auth  # noqa: E402
from torchfarm.local_farm import LocalFarm  # noqa: E402
from torchfarm.proto import torchfarm_pb2 as pb  # noqa: E402
from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc  # noqa: E402
from torchfarm.settings import GatewaySettings  # noqa: E402

TARGET = pb.Target(device="cpu", torch_version="2.13.0", python_version="3.11")
KEY = cache_key(b"a graph", TARGET, pb.Options())


def _metadata(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def hold_streams(addr: str, tokens: list[str], streams: int, report, stop) -> None:
    """Strangers and tenants `tokens`, `streams` each, reopened as they end."""
    ends: dict[str, int] = {}
    lock = threading.Lock()
    never = threading.Event()
    channels = [grpc.insecure_channel(addr) for _ in range(16)]

    def silent():
        never.wait()
        yield from ()

    def open_one(who: str, i: int) -> None:
        channel = channels[i % len(channels)]
        if who == "watch":
            call = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(), timeout=600
            )
        elif who == "reflection":
            call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                silent(), timeout=600
            )
        else:
            call = pb_grpc.FarmStub(channel).Get(silent(), metadata=_metadata(who), timeout=600)

        def ended(done) -> None:
            name = f"{'tenant' if who.startswith('tf_') else who}:{done.code().name}"
            with lock:
                ends[name] = ends.get(name, 0) + 1
            if not stop.is_set():
                open_one(who, i)

        call.add_done_callback(ended)

    for who in ("watch", "reflection", *tokens):
        for i in range(streams):
            open_one(who, i)
    report.put("open")
    stop.wait()
    with lock:
        report.put(dict(ends))
    never.set()


def first_answers(addr: str, token: str, hits: int) -> list[float]:
    """Tenant B on a new channel: seconds from the channel's creation to its first Get's
    last chunk, then `hits` more Gets."""
    seconds = []
    started = time.perf_counter()
    with grpc.insecure_channel(addr) as channel:
        farm = pb_grpc.FarmStub(channel)
        for _ in range(hits + 1):
            events = list(
                farm.Get(
                    iter([pb.GetRequest(ask=pb.Ask(key=KEY))]),
                    metadata=_metadata(token),
                    timeout=60,
                )
            )
            seconds.append(time.perf_counter() - started)
            assert events[0].header.source == "hit" and len(events) > 2, events[0]
            started = time.perf_counter()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=400)
    parser.add_argument("--hits", type=int, default=50)
    args = parser.parse_args()
    a, b, c = auth.make_token(), auth.make_token(), auth.make_token()
    tenants = ",".join(f"{n}:{auth.hash_token(t)}" for n, t in zip("abc", (a, b, c)))
    settings = GatewaySettings()
    chunk = 64 << 10
    env = {"TORCHFARM_CHUNK_BYTES": str(chunk)}
    with LocalFarm(workers=0, tenants=tenants, admins="", extra_env=env) as farm:
        farm.store().artifacts.put(KEY, os.urandom(4 * chunk), pb.EntryMeta(tenant="b"))
        context = multiprocessing.get_context("spawn")
        report, stop = context.Queue(), context.Event()
        others = context.Process(
            target=hold_streams, args=(farm.addr, [a, c], args.streams, report, stop)
        )
        others.start()
        assert report.get(timeout=120) == "open"
        time.sleep(5)  # their streams reach the gateway: held up to the caps, the rest refused
        answers = first_answers(farm.addr, b, args.hits)
        stop.set()
        ends = report.get(timeout=120)
        others.join(30)
    later = sorted(answers[1:])
    print(
        json.dumps(
            {
                "threads": settings.threads,
                "tenant_share": settings.tenant_max_streams,
                "gateway_streams": settings.max_streams,
                "stranger_pool": settings.unauthenticated_streams,
                "streams_asked_each": args.streams,
                "first_answer_s": round(answers[0], 3),
                "target_s": 2.0,
                "next_hits_p50_ms": round(later[len(later) // 2] * 1000, 2),
                "next_hits_max_ms": round(later[-1] * 1000, 2),
                "others_stream_ends": ends,
            }
        )
    )


if __name__ == "__main__":
    main()
