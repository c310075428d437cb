"""GPU check of issue 18.4 (one compile for all ranks): starts a whole farm on this machine
and runs fresh client processes, each on one GPU; writes results-device.json to OUTDIR and
exits non-zero when a check fails.

    python bench/gpu/device_index.py --out OUTDIR          (bench/gpu/run.sh device)

1. cuda:0, farm miss: compiled on the farm from cuda:0, loaded and run on cuda:0, equal to
   eager (outputs and gradients of a training step).
2. cuda:0, every loaded graph put through the whole device rewrite (0 -> 0): the rewrite of
   real artifacts (output code, Triton bundle, statically launched kernels) runs on a
   one-GPU machine, and the result still equals eager. Reports how many statically
   launched kernels the rewrite kept (the rest are rebuilt from source: slower, not wrong).
3. With 2 or more GPUs visible: cuda:1 is a hit of cuda:0's entries (same keys, no new
   worker compile) and runs equal to eager on cuda:1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

CHILD = "--child"


class Model(torch.nn.Module):
    """A small MLP with a tensor constant and fresh tensors made on the device in forward:
    the places where Inductor's output code names the device index."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor([0.5, 2.0], device=x.device).prod()
        bias = torch.ones(256, device=x.device)
        return (self.layers(x) * scale + bias).softmax(-1)


def child(index: int, rewrite: bool) -> dict:
    """One client process on cuda:`index`: eager step, then the farm-compiled step."""
    from torchfarm.client import backend  # noqa: PLC0415
    from torchfarm.torch_adapter.load import device_remap  # noqa: PLC0415

    rewrites: list[dict] = []
    if rewrite:  # the whole rewrite even for 0 -> 0, and what it kept
        remap_graph = device_remap.remap_graph

        def counted(graph, to):
            bundle = graph._triton_bundle
            before = len(bundle.static_autotuners) if bundle else 0
            remap_graph(graph, to)
            after = len(graph._triton_bundle.static_autotuners) if bundle else 0
            rewrites.append({"static_kernels": before, "kept": after})

        device_remap.remap_graph = counted
        device_remap.on_device = device_remap.rewriting

    torch.cuda.set_device(index)
    device = torch.device("cuda", index)
    torch.manual_seed(0)
    model = Model().to(device)
    x = torch.randn(64, 256, device=device)

    def step(fn):
        model.zero_grad(set_to_none=True)
        out = fn(x)
        out.square().mean().backward()
        return out.detach().clone(), [p.grad.detach().clone() for p in model.parameters()]

    eager = step(model)
    started = time.perf_counter()
    compiled = step(torch.compile(model, backend="torchfarm"))
    first_s = time.perf_counter() - started
    errors = [
        ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
        for a, b in zip([compiled[0], *compiled[1]], [eager[0], *eager[1]], strict=True)
    ]
    return {
        "device": str(device),
        "rewrite": rewrite,
        "first_step_s": round(first_s, 2),
        "graphs": [r.source for r in backend.history],
        "keys": [r.key for r in backend.history],
        "max_rel_err": max(errors),
        "on_device": compiled[0].device == device and all(g.device == device for g in compiled[1]),
        "rewrites": rewrites,
    }


def _run_child(farm, index: int, rewrite: bool) -> dict:
    cache = tempfile.mkdtemp(prefix=f"device-{index}-")
    env = dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor",
        TRITON_CACHE_DIR=f"{cache}/triton",
        TORCHFARM_ADDR=farm.addr,
        TORCHFARM_PROGRESS="0",
    )
    args = [sys.executable, os.path.abspath(__file__), CHILD, str(index), str(int(rewrite))]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=500)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"device": f"cuda:{index}", "rewrite": rewrite, "error": proc.stderr[-3000:]}


def _compiles(farm) -> float:
    return farm.store().counters.farm().get("compiles", 0.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from torchfarm.local_farm import LocalFarm  # noqa: PLC0415

    sandbox = os.environ.get("TORCHFARM_SANDBOX", "bwrap")
    rows, failures = [], []
    with LocalFarm(device="cuda", sandbox=sandbox, log_dir=args.out) as farm:
        first = _run_child(farm, 0, rewrite=False)
        rows.append(first)
        rewritten = _run_child(farm, 0, rewrite=True)
        rows.append(rewritten)
        compiles = _compiles(farm)
        for row in (first, rewritten):
            if "error" in row or row["max_rel_err"] > 1e-3 or not row["on_device"]:
                failures.append(f"{row['device']} rewrite={row['rewrite']}: not equal to eager")
            elif set(row["graphs"]) - {"miss", "hit", "merged"}:
                failures.append(f"{row['device']}: graphs served {row['graphs']}, not the farm")
        if torch.cuda.device_count() >= 2:
            other = _run_child(farm, 1, rewrite=False)
            other["new_worker_compiles"] = _compiles(farm) - compiles
            rows.append(other)
            if "error" in other or other["max_rel_err"] > 1e-3 or not other["on_device"]:
                failures.append("cuda:1: not equal to eager on cuda:1")
            elif other["keys"] != first["keys"] or set(other["graphs"]) != {"hit"}:
                failures.append(f"cuda:1: not a hit of cuda:0's entries: {other['graphs']}")
            elif other["new_worker_compiles"]:
                failures.append("cuda:1 made the worker compile again")
        farm_stats = farm.store().counters.farm()
    result = {
        "part": "device",
        "device": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "farm_stats": farm_stats,
        "rows": rows,
        "failures": failures,
    }
    print(json.dumps(result, indent=1), flush=True)
    with open(os.path.join(args.out, "results-device.json"), "w") as f:
        json.dump(result, f, indent=1)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == CHILD:
        print(json.dumps(child(int(sys.argv[2]), rewrite=sys.argv[3] == "1")), flush=True)
    else:
        main()
