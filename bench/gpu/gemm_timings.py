"""Do the pool's own GEMM measurements serve a sibling's compile? (issue 28, without a farm)

Model A compiles in max-autotune with the GEMM problems it benchmarks recorded (as a shared
job's child records them); each problem is measured as the pool's builder measures it (a fresh
`python -m torchfarm.workers.gemm_measure DEVICE`, its own empty cache dir), and the
timings are merged as the worker keeps them; model B then compiles with only those timings in
its cache dir, and again with an empty one. Prints one JSON line per step: GEMM candidates
benchmarked and seconds. Run on the GPU machine from the repository root:

    python3 bench/gpu/gemm_timings.py --a gpt-small --b gpt-small-l2 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def compile_model(name: str, cache_dir: str, problems_out: str) -> None:
    """In this process: compile `name` once (a first step), print what it benchmarked."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    import torch

    from bench.gpu import models
    from torchfarm.proto import torchfarm_pb2 as pb
    from torchfarm.torch_adapter.compile import gemm_benchmarks
    from torchfarm.torch_adapter.worker import gemm_problems

    model, inputs, spec = models.build(name)
    started = time.perf_counter()
    with gemm_benchmarks.counted() as count:
        compiled = torch.compile(model, mode="max-autotune-no-cudagraphs")
        with torch.autocast("cuda", torch.bfloat16, enabled=spec["bf16"]):
            out = compiled(*inputs)
            if spec["train"]:
                out.float().sum().backward()
        torch.cuda.synchronize()
    found = gemm_problems.problems(count.problems, "cuda")
    with open(problems_out, "wb") as f:  # as a shared job's child reports them
        f.write(pb.KernelFiles(gemm_problems=found).SerializeToString())
    print(
        json.dumps(
            {
                "model": name,
                "first_step_s": round(time.perf_counter() - started, 2),
                "gemm_candidates_benchmarked": count.candidates,
                "problems": len(found),
            }
        ),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--a", default="gpt-small")
    parser.add_argument("--b", default="gpt-small-l2")
    parser.add_argument("--out", default="/tmp/torchfarm-bench")
    parser.add_argument("--compile", nargs=3, help=argparse.SUPPRESS)  # name, cache dir, out
    args = parser.parse_args()
    if args.compile:
        compile_model(*args.compile)
        return
    from torchfarm.proto import torchfarm_pb2 as pb
    from torchfarm.workers import kernel_cache

    work = tempfile.mkdtemp(prefix="gemm-timings-")
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def run_compile(name: str, cache_dir: str) -> str:
        problems = os.path.join(work, f"problems-{name}-{os.path.basename(cache_dir)}")
        subprocess.run(
            [sys.executable, __file__, "--compile", name, cache_dir, problems], env=env, check=True
        )
        return problems

    problems = run_compile(args.a, os.path.join(work, "a"))
    pool = kernel_cache.KernelCache(os.path.join(work, "kernels"), "bench", 1 << 30)
    pool_dir = pool.pool_dir("gpu")
    with open(problems, "rb") as f:
        reported = pb.KernelFiles.FromString(f.read())
    for gemm in reported.gemm_problems:
        cache_dir = tempfile.mkdtemp(dir=work, prefix="measure-")
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "torchfarm.workers.gemm_measure", "cuda"],
            input=gemm.SerializeToString(),
            env={**env, "TORCHINDUCTOR_CACHE_DIR": cache_dir},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=True,
        )
        files = kernel_cache.report(cache_dir, "")
        timings = {n: d for n, d in files.built.items() if kernel_cache.is_gemm_timings(n)}
        pool.keep(pool_dir, pb.KernelFiles(built=timings))
        print(
            json.dumps({"measured": gemm.op, "s": round(time.perf_counter() - started, 1)}),
            flush=True,
        )
    with_pool = os.path.join(work, "b-pool")
    for name in os.listdir(os.path.join(pool_dir, kernel_cache.TUNING, "cache")):
        source = os.path.join(pool_dir, kernel_cache.TUNING, "cache", name)
        os.makedirs(os.path.join(with_pool, "cache"), exist_ok=True)
        shutil.copyfile(source, os.path.join(with_pool, "cache", name))
    run_compile(args.b, with_pool)
    run_compile(args.b, os.path.join(work, "b-cold"))


if __name__ == "__main__":
    main()
