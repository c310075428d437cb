"""The cost of a graph's payload and key on the client (issue 52 item 1), this checkout's
serializer beside another revision's (default origin/main), in one process: each zoo model's
Dynamo graphs (a training step) are serialized alternately by both, the bytes compared, and
the median over rounds reported per graph, with the rest of what the client computes before
asking the farm (`payload_s`: the descriptor of a static graph, else the payload, with size
hints and target; `key_s`: the key, its parts and the structure digest), in CPU milliseconds
of the calling thread; and the descriptor's own cost (`describe_ms`).

Key equality (key format v4): each row carries the sha256 of the payload and of the
descriptor (compare two processes' rows for determinism); over all rows of a run, two
graphs' descriptors are equal exactly where their payloads are, and each descriptor is
found again in the graph the worker rebuilds from the payload (`descriptor.verified`).

    .venv/bin/python bench/payload.py [--models llama,gpt2] [--scale cpu|cuda] [--rounds 9]
        [--against origin/main] [--dynamic]

The other revision's compiler/serialize.py runs under this module's name (pickle names its
classes by module), with this checkout's torch adapter. Prints one JSON object per graph and
exits 1 if any payload's bytes differ from the other revision's or key equality fails.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]

import torch  # noqa: E402

from tests.zoo import models  # noqa: E402
from torchfarm.compiler import descriptor, serialize, structure  # noqa: E402
from torchfarm.compiler.target import local_target  # noqa: E402
from torchfarm.contract.cache_key import key_parts, public_key  # noqa: E402
from torchfarm.proto import torchfarm_pb2 as pb  # noqa: E402
from torchfarm.torch_adapter.trace.guard_text import hints, symbol_inputs  # noqa: E402


def _serializer_at(revision: str) -> types.ModuleType:
    source = subprocess.run(
        ["git", "show", f"{revision}:torchfarm/compiler/serialize.py"],
        cwd=os.path.dirname(HERE),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    module = types.ModuleType(serialize.__name__)
    module.__file__ = f"{revision}:torchfarm/compiler/serialize.py"
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


@contextlib.contextmanager
def _as_serialize(module: types.ModuleType):
    """Pickle finds a class by its module's name: make `module` the one that name means."""
    sys.modules[serialize.__name__] = module
    try:
        yield
    finally:
        sys.modules[serialize.__name__] = serialize


def _graphs(name: str, scale: str, dynamic: bool) -> list[torch.fx.GraphModule]:
    built = models.build(name, scale)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    args, kwargs = built.batch(0, True)
    loss, _ = built.loss(
        torch.compile(built.model, backend=backend, dynamic=dynamic)(*args, **kwargs)
    )
    loss.backward()
    return graphs


def _architecture_graphs(name: str) -> list[torch.fx.GraphModule]:
    """The graphs of one of bench/coverage's architectures, inference then a training step."""
    sys.path.insert(0, os.path.join(HERE, "coverage"))
    import architectures  # noqa: PLC0415
    import client  # noqa: PLC0415

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for phase in ("infer", "train"):
        model, inputs = architectures.build(name)
        torch._dynamo.reset()
        client.step(torch.compile(model, backend=backend), inputs, phase)
    return graphs


def _timed(fn) -> tuple[float, object]:
    """The thread's CPU seconds: on a shared machine the wall clock also counts the waits for
    a core, which other processes decide (on an idle one the two agree)."""
    started = time.thread_time()
    result = fn()
    return time.thread_time() - started, result


def _described(gm: torch.fx.GraphModule) -> bytes:
    try:
        return descriptor.describe(gm)
    except descriptor.Unsupported:
        return b""


def _request(gm: torch.fx.GraphModule) -> pb.CompileRequest:
    """What `payload_s` covers (client/graph.py, FarmGraph.ask)."""
    described = _described(gm)
    return pb.CompileRequest(
        graph=b"" if described else serialize.dumps(gm),
        descriptor=described,
        target=local_target("cpu"),
        size_hints=serialize.size_hints(gm),
    )


def _key(gm: torch.fx.GraphModule, request: pb.CompileRequest, options: pb.Options) -> None:
    """What `key_s` covers (client/graph.py, FarmGraph._ask), the RPC left out."""
    public_key(request.graph, request.target, options, request.descriptor)
    key_parts(request.graph, request.target, options, structure.digest(gm), request.descriptor)
    hints(symbol_inputs(serialize.example_inputs(gm)))


def _measure(gm: torch.fx.GraphModule, old: types.ModuleType, rounds: int) -> tuple[dict, bool]:
    """Median CPU ms of each step, alternating the two serializers; whether their bytes agree."""
    times: dict[str, list[float]] = {
        "old": [],
        "new": [],
        "describe": [],
        "payload": [],
        "key": [],
    }
    options = pb.Options(mode="default")
    same = True
    for _ in range(rounds):
        with _as_serialize(old):
            seconds, old_bytes = _timed(lambda: old.dumps(gm))
        times["old"].append(seconds)
        seconds, new_bytes = _timed(lambda: serialize.dumps(gm))
        times["new"].append(seconds)
        times["describe"].append(_timed(lambda: _described(gm))[0])
        same &= old_bytes == new_bytes
        seconds, request = _timed(lambda: _request(gm))
        times["payload"].append(seconds)
        times["key"].append(_timed(lambda: _key(gm, request, options))[0])  # noqa: B023
    return {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}, same


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="llama,gpt2")
    parser.add_argument("--scale", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--against", default="origin/main")
    parser.add_argument("--dynamic", action="store_true")
    parser.add_argument(
        "--architectures", default="", help="bench/coverage's, comma-separated, instead"
    )
    args = parser.parse_args()
    old = _serializer_at(args.against)
    differ = False
    pairs: list[tuple[str, str]] = []  # (payload sha256, descriptor sha256) of every graph
    names = args.architectures.split(",") if args.architectures else args.models.split(",")
    for name in names:
        graphs = (
            _architecture_graphs(name)
            if args.architectures
            else _graphs(name, args.scale, args.dynamic)
        )
        for number, gm in enumerate(graphs):
            ms, same = _measure(gm, old, args.rounds)
            differ |= not same
            nodes = len(gm.graph.nodes)
            payload, described = serialize.dumps(gm), _described(gm)
            if described:
                rebuilt = descriptor.verified(payload, serialize.size_hints(gm), described)
                differ |= descriptor.describe(rebuilt) != described
            pairs.append((_sha(payload), _sha(described) if described else _sha(payload)))
            row = {
                "model": name,
                "scale": args.scale,
                "dynamic": args.dynamic,
                "graph": number,
                "nodes": nodes,
                "bytes": len(payload),
                "same_bytes": same,
                "keyed_by": "descriptor" if described else "payload",
                "descriptor_bytes": len(described),
                "payload_sha256": pairs[-1][0][:16],
                "descriptor_sha256": _sha(described)[:16] if described else "",
                "describe_ms": ms["describe"],
                f"dumps_ms_{args.against}": ms["old"],
                "dumps_ms": ms["new"],
                "payload_ms": ms["payload"],
                "key_ms": ms["key"],
                "dumps_ms_per_node": round(ms["new"] / nodes, 3),
                f"dumps_ms_per_node_{args.against}": round(ms["old"] / nodes, 3),
            }
            print(json.dumps(row), flush=True)
    equal = all((a[0] == b[0]) == (a[1] == b[1]) for a in pairs for b in pairs)
    print(
        json.dumps(
            {"graphs": len(pairs), "payloads": len({p for p, _ in pairs}), "key_equality": equal}
        )
    )
    sys.exit(1 if differ or not equal else 0)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


if __name__ == "__main__":
    main()
