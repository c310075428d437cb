"""Where a farm compile child's time goes, graph by graph: the floor of a miss.

    child_profile.py MODEL OUTDIR [--pool-only]   (MODEL: a bench model, coverage:NAME, zoo:NAME)

The parent traces one training step of MODEL with a backend that keeps each graph's
CompileRequest and runs eagerly. Each distinct request is then compiled in a fresh process
warmed as a GPU pool's compile child is (workers/compile_child.warm_up), on empty Inductor and
Triton caches, the backward in the same process (no helper), under cProfile: once warmed
without the throwaway compile (workers/warm_compile.py), once with it, one after the other
(`--pool-only`: only with it, as a GPU pool's children are). One JSON line per graph and warm-up
on stdout: warm-up and compile seconds, the top functions by cumulative time, and torch's
own compile-phase times; the pstats files go to OUTDIR.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def requests(name: str) -> list[tuple[str, bytes]]:
    """(label, serialized CompileRequest) of each distinct graph of one step."""
    sys.path.insert(0, HERE)
    from client import build, make_step

    from torchfarm.compiler import serialize, trace_state
    from torchfarm.compiler.target import local_target
    from torchfarm.proto import torchfarm_pb2 as pb

    kept: dict[bytes, tuple[str, bytes]] = {}

    def keep(gm: torch.fx.GraphModule, label: str) -> None:
        request = pb.CompileRequest(
            graph=serialize.dumps(gm),
            target=local_target("cuda"),
            options=pb.Options(mode="default", state=trace_state.capture()),
            label=label,
            size_hints=serialize.size_hints(gm),
        )
        kept.setdefault(request.graph, (label, request.SerializeToString()))

    def backend(gm: torch.fx.GraphModule, example_inputs: list):
        keep(gm, f"graph {len(kept) + 1} ({len(gm.graph.nodes)} nodes)")
        return gm.forward

    model, inputs, spec = build(name)
    make_step(torch.compile(model, backend=backend), model, spec)(*inputs)
    return list(kept.values())


def compile_one(path: str, outdir: str, throwaway: bool) -> None:
    """In a fresh process: warm up as a compile child, then compile the request under cProfile."""
    from torchfarm.proto import torchfarm_pb2 as pb
    from torchfarm.workers import compile_child

    with open(path, "rb") as f:
        request = pb.CompileRequest.FromString(f.read())
    started = time.perf_counter()
    compile_child.warm_up(request.target.device, [], throwaway=throwaway)
    warm_s = time.perf_counter() - started
    from torch._dynamo.utils import compile_times

    from torchfarm.compiler import inductor

    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    artifact = inductor.compile_payload(
        request.graph, request.options, request.target.threads, dict(request.size_hints)
    )
    profiler.disable()
    compile_s = time.perf_counter() - started
    suffix = "-throwaway" if throwaway else ""
    profiler.dump_stats(os.path.join(outdir, f"{os.path.basename(path)}{suffix}.pstats"))
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
    tottime = io.StringIO()
    pstats.Stats(profiler, stream=tottime).sort_stats("tottime").print_stats(20)
    row = {
        "label": request.label,
        "throwaway": throwaway,
        "warm_up_s": round(warm_s, 2),
        "compile_s": round(compile_s, 2),
        "kernels": len(artifact.kernels),
        "phases": compile_times(repr="str", aggregate=True),
        "cumulative": text.getvalue().splitlines()[-60:],
        "tottime": tottime.getvalue().splitlines()[-26:],
    }
    print(json.dumps(row), flush=True)


def main(name: str, outdir: str, pool_only: bool) -> None:
    os.makedirs(outdir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="child-profile-")
    for number, (label, data) in enumerate(requests(name)):
        path = os.path.join(work, f"{name.replace(':', '-')}-{number}.req")
        with open(path, "wb") as f:
            f.write(data)
        for throwaway in (True,) if pool_only else (False, True):
            env = {
                **os.environ,
                "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor-"),
                "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="triton-"),
            }
            flag = ["--throwaway"] if throwaway else []
            proc = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--compile", path, outdir, *flag],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            lines = proc.stdout.strip().splitlines()
            failed = {"label": label, "throwaway": throwaway, "error": proc.stderr[-3000:]}
            ok = proc.returncode == 0 and lines
            print(lines[-1] if ok else json.dumps(failed), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--compile":
        compile_one(sys.argv[2], sys.argv[3], throwaway="--throwaway" in sys.argv[4:])
    else:
        main(sys.argv[1], sys.argv[2], pool_only="--pool-only" in sys.argv[3:])
