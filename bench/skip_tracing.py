"""Skipping Dynamo's tracing on a farm hit (issue 19 item 4): time to the first result of
bench/first_result.py's training step, each in a fresh process with an empty local cache
unless said otherwise, side by side in one run:

  dynamo_only     Dynamo's tracing alone (backend="eager"): what a hit that traces pays at least
  pt_local_warm   torch.compile on a warm local cache dir
  pt_remote_warm  PyTorch's Redis remote caches (bench/warm_start.py's setup), empty local dir
  farm_hit        torchfarm.compile, graphs already on the farm, TORCHFARM_SKIP_TRACING=0:
                  Dynamo traces
  farm_hit_skip   the same with the skip (the default) and the package saved by an earlier
                  process: Dynamo's output installed, no frame traced
  floor           no compile: the imports that a restored graph's code needs (Dynamo, for its
                  guards and frames, and what its optimize() imports; AOTAutograd's and
                  Inductor's runtime, which the load and the loaded wrapper import), with the
                  garbage collector paused as torchfarm.compile pauses it, then the step run
                  eagerly: what any skip hit pays at least

It prints each median, frames traced, and farm_hit_skip / pt_remote_warm and / pt_local_warm
(issue 26's CPU target: farm_hit_skip <= 0.4x pt_local_warm), and floor / pt_local_warm.
`--json PATH` writes the medians.

    .venv/bin/python bench/skip_tracing.py [--model {blocks,gpt2}] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
TOKEN = "bench-skip-token-0123456789"
STAGES = {
    "dynamo_only": "Dynamo's tracing alone (eager)",
    "pt_local_warm": "PyTorch local warm cache",
    "pt_remote_warm": "PyTorch remote cache (Redis)",
    "farm_hit": "farm hit, Dynamo traces",
    "farm_hit_skip": "farm hit, tracing skipped",
    "floor": "imports a restore needs + eager",
}
# What a restored graph's code imports on the CPU (torch 2.13): Dynamo (its package, guards
# and frames, and the debug wrapper its optimize() imports), AOTAutograd's cache entry, and
# what the load and Inductor's Python wrapper import, as the worker rewrites it
# (torch_adapter/compile/light_wrapper.py; not select_algorithm's lowerings and kernel
# templates, nor codegen.memory_planning, nor Inductor's decompositions or debug module)
RESTORE_IMPORTS = (
    "torch._dynamo",
    "torch._dynamo.repro.after_dynamo",
    "torch._functorch._aot_autograd.aot_autograd_result",
    "torch._inductor.async_compile",
)


def build(name: str):
    """The model and its first step: first_result.py's blocks, or a small transformers GPT-2
    (built from a config: no weights are downloaded)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=6, n_embd=512, n_head=8, vocab_size=8192, n_positions=256)
        ids = torch.randint(0, 8192, (4, 128))
        return GPT2LMHeadModel(config), lambda m: m(ids, labels=ids).loss.backward()
    from tests.models import TransformerBlock

    model = nn.Sequential(TransformerBlock(128, 4), TransformerBlock(128, 4), nn.LayerNorm(128))
    x = torch.randn(4, 64, 128)
    return model, lambda m: m(x).square().mean().backward()


def client(backend: str, model_name: str) -> None:
    """One first training step in this process; prints a JSON line."""
    import torch

    model, first_step = build(model_name)
    started = time.perf_counter()
    if backend == "torchfarm":
        import torchfarm

        compiled = torchfarm.compile(model)
    elif backend == "floor":
        from torchfarm.client import collector

        with collector.paused():
            for name in RESTORE_IMPORTS:
                importlib.import_module(name)
        compiled = model
    else:
        compiled = torch.compile(model, backend=backend)
    first_step(compiled)
    seconds = time.perf_counter() - started
    sources = []
    if backend == "torchfarm":
        from torchfarm.client.backend import history

        sources = [r.source for r in history]
    traced = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    print(json.dumps({"seconds": seconds, "sources": sources, "traced_graphs": traced}))


def measure(backend: str, model: str, cache_dir: str, env: dict | None = None) -> dict:
    from warm_start import fresh_process_env

    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--client", backend, "--model", model],
        env=fresh_process_env(cache_dir, **(env or {})),
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise RuntimeError(f"{backend} on {model} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from warm_start import PT_REMOTE, plain_redis

    from torchfarm.gateway.auth import hash_token
    from torchfarm.local_farm import LocalFarm

    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the medians (seconds) here")
    parser.add_argument("--model", choices=("blocks", "gpt2"), default="blocks")
    parser.add_argument("--client", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        return client(args.client, args.model)
    runs: dict[str, list[float]] = {k: [] for k in STAGES}
    traced: dict[str, list[int]] = {k: [] for k in STAGES}
    with LocalFarm(tenants=f"bench:{hash_token(TOKEN)}") as farm, plain_redis() as redis_port:
        remote = dict(
            PT_REMOTE,
            TORCHINDUCTOR_REDIS_HOST="127.0.0.1",
            TORCHINDUCTOR_REDIS_PORT=str(redis_port),
        )
        on_farm = dict(TORCHFARM_ADDR=farm.addr, TORCHFARM_TOKEN=TOKEN, TORCHFARM_SKIP_TRACING="0")
        skip = dict(on_farm, TORCHFARM_SKIP_TRACING="1")
        warm = tempfile.mkdtemp()
        measure("inductor", args.model, warm)  # fills the local cache
        measure("inductor", args.model, tempfile.mkdtemp(), env=remote)  # fills the remote caches
        # the farm's graphs and the package
        measure("torchfarm", args.model, tempfile.mkdtemp(), env=skip)
        for _ in range(args.repeats):
            for stage, backend, cache, env in (
                ("dynamo_only", "eager", tempfile.mkdtemp(), None),
                ("pt_local_warm", "inductor", warm, None),
                ("pt_remote_warm", "inductor", tempfile.mkdtemp(), remote),
                ("farm_hit", "torchfarm", tempfile.mkdtemp(), on_farm),
                ("farm_hit_skip", "torchfarm", tempfile.mkdtemp(), skip),
                ("floor", "floor", tempfile.mkdtemp(), None),
            ):
                result = measure(backend, args.model, cache, env)
                if backend == "torchfarm":
                    assert set(result["sources"]) == {"hit"}, result
                runs[stage].append(result["seconds"])
                traced[stage].append(result["traced_graphs"])
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(
        f"torch {__import__('torch').__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, model {args.model}, {args.repeats} repeats (median; all runs "
        "in brackets)"
    )
    for k, name in STAGES.items():
        print(
            f"{k:<15} {name:<32} {med[k]:6.2f} s  {[round(x, 2) for x in runs[k]]}"
            f"  graphs traced {traced[k]}"
        )
    for base in ("pt_remote_warm", "pt_local_warm", "dynamo_only"):
        print(f"farm_hit_skip / {base:<15} = {med['farm_hit_skip'] / med[base]:.2f}")
    print(f"farm_hit / pt_remote_warm        = {med['farm_hit'] / med['pt_remote_warm']:.2f}")
    print(f"floor / pt_local_warm            = {med['floor'] / med['pt_local_warm']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**med, "runs": runs, "graphs_traced": traced}, f, indent=1)


if __name__ == "__main__":
    main()
