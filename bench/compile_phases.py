"""Where a local cold compile's time goes: one training step per model, each in a fresh process
with an empty Inductor and Triton cache, with torch's own phase timers (dynamo_timed).

    python bench/compile_phases.py --device cuda --models gpt,coverage:llama-gqa [--json F]

Prints one JSON line per model: the first step's seconds and the phases that decide what a
farm can overlap (Dynamo, AOTAutograd's trace and partition, the forward's and backward's
Inductor compiles, the wait for Triton compile workers, autotuning). Issue 28 uses it to see
how much a miss gains by compiling forward and backward at once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# dynamo_timed names (torch 2.11-2.15) summed into each reported phase.
PHASES = {
    "dynamo": ("_compile.compile_inner",),
    "aot_total": ("create_aot_dispatcher_function",),
    "partition": ("min_cut_rematerialization_partition",),
    "forward": ("compile_fx.<locals>.fw_compiler_base",),
    "backward": ("compile_fx.<locals>.bw_compiler",),
    "triton_wait": ("async_compile.wait",),
    "codegen": ("GraphLowering.compile_to_module", "GraphLowering.codegen"),
}


def one(model: str, device: str) -> dict:
    """Child: compile and run one step of `model`; the phase seconds."""
    import torch

    sys.path.insert(0, os.path.join(HERE, "gpu"))
    from client import build, make_step  # noqa: E402  (bench/gpu/client.py)

    torch.manual_seed(0)
    module, inputs, spec = build(model)
    compiled = torch.compile(module)
    started = time.perf_counter()
    make_step(compiled, module, spec)(*inputs)
    if device == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - started
    names, values = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    table = dict(zip(names, (float(v) for v in values), strict=True))
    row = {"model": model, "first_step_s": round(first, 2)}
    for phase, keys in PHASES.items():
        row[phase] = round(sum(table.get(k, 0.0) for k in keys), 2)
    row["top"] = dict(sorted(table.items(), key=lambda kv: -kv[1])[:12])
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default="gpt")
    parser.add_argument("--json", default="")
    parser.add_argument("--child", default="")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one(args.child, args.device)), flush=True)
        return
    rows = []
    for model in args.models.split(","):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="phases-"))
        env["TRITON_CACHE_DIR"] = os.path.join(env["TORCHINDUCTOR_CACHE_DIR"], "triton")
        proc = subprocess.run(
            [sys.executable, __file__, "--device", args.device, "--child", model],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        try:
            row = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            row = {"model": model, "error": proc.stderr[-2000:]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
