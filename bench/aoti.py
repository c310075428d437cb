"""AOTInductor packages on the farm against a local AOTInductor compile (issue 30).

Starts an embedded farm for the device, then for each model runs, each in a fresh process
with an empty Inductor cache:
  local       torch._inductor.aoti_compile_and_package (what users run today), load, run;
  farm miss   torchfarm.aoti_compile_and_package (weights not sent): the farm's package, the
              program's weights written into it here;
  farm hit    the same, another process: the same package, signed;
  farm sent   weights=True: the weights built into the .so on the farm.
Every package is self-contained and loaded by torch's loader as it is. Farm rows also give
the bytes the farm stores for the entry (`entry_bytes`, the Artifact, weights left out unless
sent) and the client's time to write the weights into the package (`write_s`).
Each row: the package call's seconds (export excluded), its load and first call, the step time of
the package, the package's bytes and its largest difference from eager (relative to eager's
largest value); a row's package is built in one fresh process and loaded in another, as a
serving process loads it. The ratios farm / local are printed and written to --json.

    python bench/aoti.py --device cuda --models gpt,resnet50 --json results.json
    python bench/aoti.py --device cpu --models gpt-cpu --json results.json

AOTI_LOADER=torch loads every package with `torch._inductor.aoti_load_package` itself (the
Inductor CPU probe included), as a serving stack that never heard of torchfarm does.
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = ("local", "farm miss", "farm hit", "farm sent")
LOADER = os.environ.get("AOTI_LOADER", "torchfarm")


def build(name: str, device: str) -> tuple[torch.nn.Module, tuple]:
    """An inference model and its example input, seeded: the same in every process."""
    sys.path.insert(0, os.path.join(HERE, "gpu"))
    from models import GPT  # bench/gpu/models.py

    torch.manual_seed(0)
    if name == "gpt":  # the GPU bench's GPT (6 layers, d=512), bf16 inference
        model = GPT().to(device, torch.bfloat16).eval()
        return model, (torch.randint(0, 8192, (16, 256), device=device),)
    if name == "gpt-cpu":  # a small one for the CPU box
        model = GPT(layers=2, d=128, heads=4, vocab=1024, context=128).to(device).eval()
        return model, (torch.randint(0, 1024, (4, 64), device=device),)
    if name == "resnet50":
        import torchvision

        model = torchvision.models.resnet50(weights=None).to(device, torch.bfloat16).eval()
        return model, (torch.randn(32, 3, 224, 224, device=device, dtype=torch.bfloat16),)
    raise ValueError(f"unknown model {name}")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step_ms(fn, inputs: tuple, device: str, iters: int = 20) -> float:
    for _ in range(3):
        fn(*inputs)
    _sync(device)
    started = time.perf_counter()
    for _ in range(iters):
        fn(*inputs)
    _sync(device)
    return (time.perf_counter() - started) / iters * 1e3


def package_row(name: str, row: str, device: str, path: str) -> dict:
    """Build one row's package at `path` in this (fresh) process: the package call's time."""
    import torch._inductor.package  # noqa: F401  (the loader's imports: not the package's cost)

    from torchfarm.client import exported
    from torchfarm.compiler import aoti

    model, inputs = build(name, device)
    with torch.no_grad():
        program = torch.export.export(model, inputs)

    started = time.perf_counter()
    stored = {}
    if row == "local":
        torch._inductor.aoti_compile_and_package(program, package_path=path)
    else:
        artifact, _ = exported.package_artifact(program, weights=row == "farm sent")
        writing = time.perf_counter()
        aoti.write_package(path, artifact, program)
        stored = {
            "entry_bytes": artifact.ByteSize(),
            "write_s": round(time.perf_counter() - writing, 3),
        }
    return {
        "model": name,
        "row": row,
        "package_s": round(time.perf_counter() - started, 2),
        **stored,
    }


def load_row(name: str, row: str, device: str, path: str) -> dict:
    """Load one row's package in this (fresh) process, as a serving process would, with
    torchfarm's loader (torch's, without Inductor's CPU probe: torch_adapter/load/aoti_load.py),
    whoever built it: the load, the first call, the step time and the difference from
    eager."""
    import torch._inductor.package  # noqa: F401

    import torchfarm

    model, inputs = build(name, device)
    with torch.no_grad():
        eager = model(*inputs).float()
    started = time.perf_counter()
    if LOADER == "torch":  # every row's package holds its weights
        compiled = torch._inductor.aoti_load_package(path)
    else:
        compiled = torchfarm.aoti_load_package(path)
    load_s = time.perf_counter() - started
    with torch.no_grad():
        started = time.perf_counter()
        out = compiled(*inputs)
        _sync(device)
        first_s = time.perf_counter() - started
        out = out[0] if isinstance(out, (list, tuple)) else out
        diff = ((out.float() - eager).abs().max() / eager.abs().max()).item()
        ms = step_ms(compiled, inputs, device)
        eager_ms = step_ms(model, inputs, device)
    return {
        "loader": LOADER,
        "load_s": round(load_s, 2),
        "first_call_s": round(first_s, 2),
        "step_ms": round(ms, 3),
        "eager_ms": round(eager_ms, 3),
        "package_bytes": os.path.getsize(path),
        "rel_diff": diff,
    }


def _child(farm, caches: str, *args: str) -> dict:
    env = dict(
        os.environ,
        TORCHFARM_ADDR=farm.addr,
        TORCHFARM_TOKEN=farm.bench_token,
        TORCHFARM_PROGRESS="0",
        TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(dir=caches),
        TRITON_CACHE_DIR=tempfile.mkdtemp(dir=caches),
    )
    proc = subprocess.run(
        [sys.executable, "-X", "faulthandler", __file__, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        lines = [x for x in proc.stderr.splitlines() if not x.startswith(("DEBUG", "W1", "I1"))]
        return {"exit": proc.returncode, "error": lines[-40:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_row(farm, name: str, row: str, device: str) -> dict:
    """A row's package built in one fresh process and loaded in another, each with empty
    caches."""
    with tempfile.TemporaryDirectory() as caches:
        path = os.path.join(caches, "model.pt2")
        common = ["--models", name, "--device", device, "--path", path]
        result = _child(farm, caches, "--row", row, *common)
        if "package_s" in result:
            result.update(_child(farm, caches, "--load", row, *common))
    return {"model": name, "row": row, **result}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--models", default="gpt-cpu")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--row", help="build one row's package here (the driver's child)")
    parser.add_argument("--load", help="load one row's package here (the driver's child)")
    parser.add_argument("--path", help="the row's package")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if args.row or args.load:
        if args.row:
            result = package_row(args.models, args.row, args.device, args.path)
        else:
            result = load_row(args.models, args.load, args.device, args.path)
        print(json.dumps(result), flush=True)
        return

    from torchfarm.gateway.auth import hash_token, make_token
    from torchfarm.local_farm import LocalFarm

    token = make_token()
    results = []
    with LocalFarm(
        device=args.device,
        sandbox=os.environ.get("TORCHFARM_SANDBOX", "bwrap"),
        tenants=f"bench:{hash_token(token)}",
        log_dir=os.path.dirname(os.path.abspath(args.json)) if args.json else None,
    ) as farm:
        print(f"farm ready at {farm.addr}", flush=True)
        farm.bench_token = token
        for name in args.models.split(","):
            rows = {}
            for row in args.rows.split(","):
                rows[row] = run_row(farm, name, row, args.device)
                print(json.dumps(rows[row]), flush=True)
                results.append(rows[row])
                _write(args.json, results)  # a call cut short keeps what it measured
            ratios = {"model": name, "row": "ratios"}
            local = rows.get("local", {})
            for row in ("farm miss", "farm hit", "farm sent"):
                if "step_ms" in rows.get(row, {}) and "step_ms" in local:  # both loaded
                    ratios[f"{row} / local"] = round(rows[row]["package_s"] / local["package_s"], 3)
                    ratios[f"{row} step / local step"] = round(
                        rows[row]["step_ms"] / local["step_ms"], 3
                    )
            print(json.dumps(ratios), flush=True)
            results.append(ratios)
            _write(args.json, results)


def _write(path: str, results: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
