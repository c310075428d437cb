"""GPU benchmark runner: starts a whole farm on this machine (redis-server, gateway, one GPU
worker in its bwrap sandbox) and runs the checks of one part; writes results.json and a
Markdown table to OUTDIR.

    python bench/gpu/run.py --part {default,autotune} --out OUTDIR

default:  correctness and warm start (local cold, local warm, farm miss, farm hit) in mode
          default for a GPT-style training step and ResNet-50 inference; an SDPA block with
          a dynamic sequence length; runtime parity.
miss:     local cold vs farm miss (then the hit) for GPT and ResNet-50, mode default.
smoke:    a farm miss and hit of the SDPA block and a ResNet-50 miss, to check the setup.
autotune: a storm of 16 client processes started at once on one uncompiled model; runtime
          parity of farm vs local compile in one process; reduce-overhead through the farm
          (CUDA graphs on the client); the warm-start rows for max-autotune-no-cudagraphs
          (GPT-small inference).
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

from torchfarm.local_farm import LocalFarm

HERE = os.path.dirname(os.path.abspath(__file__))


class Runner:
    def __init__(self, farm: LocalFarm, outdir: str):
        self.farm, self.outdir, self.rows = farm, outdir, []
        self.tensors = tempfile.mkdtemp(prefix="bench-tensors-")

    def env(self, cache: str, addr: str) -> dict:
        return dict(
            os.environ,
            TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor",
            TRITON_CACHE_DIR=f"{cache}/triton",
            TORCHFARM_ADDR=addr,
            TORCHFARM_PROGRESS="0",
            TF_PTXAS_LOG=f"{cache}/ptxas-{time.time_ns()}.log",
        )

    def client(
        self,
        model: str,
        mode: str,
        backend: str,
        case: str,
        cache: str,
        extra_env: dict | None = None,
    ) -> subprocess.Popen:
        outfile = os.path.join(self.tensors, f"{model}-{mode}-{case}.pt")
        env = self.env(cache, self.farm.addr if backend == "farm" else "")
        return subprocess.Popen(
            [sys.executable, os.path.join(HERE, "client.py"), model, mode, backend, outfile],
            env={**env, **(extra_env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def run(self, model: str, mode: str, backend: str, case: str, cache: str) -> dict:
        started = time.perf_counter()
        proc = self.client(model, mode, backend, case, cache)
        try:
            out, err = proc.communicate(timeout=420)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        row = {
            "model": model,
            "mode": mode,
            "case": case,
            "process_s": round(time.perf_counter() - started, 1),
        }
        try:
            row.update(json.loads(out.strip().splitlines()[-1]))
        except (IndexError, json.JSONDecodeError):
            row["error"] = err[-2000:]
        if backend == "farm" and set(row.get("graphs", [])) & {"local", "eager"}:
            row["fallback"] = [line for line in err.splitlines() if "torchfarm" in line][-3:]
        print(json.dumps(row), flush=True)
        self.rows.append(row)
        return row

    def warm_start(self, model: str, mode: str) -> None:
        """Four fresh processes: local cold, local warm (same dirs), farm miss, farm hit."""
        local = tempfile.mkdtemp(prefix="local-")
        self.run(model, mode, "local", "local cold", local)
        self.run(model, mode, "local", "local warm", local)
        self.run(model, mode, "farm", "farm miss", tempfile.mkdtemp(prefix="miss-"))
        self.run(model, mode, "farm", "farm hit", tempfile.mkdtemp(prefix="hit-"))
        self.compare(model, mode, "farm hit", "local cold")

    def miss_vs_cold(self, model: str, mode: str) -> None:
        """Issue 18's rows: local cold and farm miss side by side, then the hit."""
        self.run(model, mode, "local", "local cold", tempfile.mkdtemp(prefix="local-"))
        self.run(model, mode, "farm", "farm miss", tempfile.mkdtemp(prefix="miss-"))
        self.run(model, mode, "farm", "farm hit", tempfile.mkdtemp(prefix="hit-"))
        self.compare(model, mode, "farm miss", "local cold")

    def compare(self, model: str, mode: str, case: str, reference: str) -> None:
        """Outputs and gradients of two runs with the same weights and inputs."""

        def load(c):
            return torch.load(os.path.join(self.tensors, f"{model}-{mode}-{c}.pt"))

        try:
            a, b = load(case), load(reference)
        except FileNotFoundError as e:
            self.rows.append(
                {"model": model, "mode": mode, "case": f"{case} vs {reference}", "error": str(e)}
            )
            return
        errs = [
            ((x - y).norm() / y.norm().clamp_min(1e-12)).item()
            for x, y in zip([a["out"], *a["grads"]], [b["out"], *b["grads"]])
        ]
        row = {
            "model": model,
            "mode": mode,
            "case": f"{case} vs {reference}",
            "max_rel_err": max(errs),
        }
        print(json.dumps(row), flush=True)
        self.rows.append(row)

    def parity(self, model: str) -> None:
        proc = subprocess.run(
            [sys.executable, os.path.join(HERE, "parity.py"), model],
            env=self.env(tempfile.mkdtemp(prefix="parity-"), self.farm.addr),
            capture_output=True,
            text=True,
            timeout=400,
        )
        try:
            row = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            row = {"model": model, "case": "parity (one process)", "error": proc.stderr[-2000:]}
        print(json.dumps(row), flush=True)
        self.rows.append(row)

    def storm(self, clients: int = 16) -> None:
        store = self.farm.store()
        before = store.counters.farm().get("compiles", 0)
        started = time.perf_counter()
        procs = [
            self.client(
                "gpt-storm",
                "default",
                "farm",
                f"storm{i}",
                tempfile.mkdtemp(prefix="storm-"),
                {"BENCH_STEADY": "0"},
            )
            for i in range(clients)
        ]
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=420)
            try:
                results.append(json.loads(out.strip().splitlines()[-1]))
            except (IndexError, json.JSONDecodeError):
                results.append({"error": err[-1500:]})
        row = {
            "model": "gpt-storm",
            "mode": "default",
            "case": f"storm x{clients}",
            "wall_s": round(time.perf_counter() - started, 1),
            "worker_compiles": store.counters.farm().get("compiles", 0) - before,
            "sources": sorted(s for r in results for s in r.get("graphs", ["error"])),
            "max_rel_err": max(r.get("max_rel_err", float("inf")) for r in results),
            "first_step_s_max": max(r.get("first_step_s", 0) for r in results),
            "errors": [r["error"] for r in results if "error" in r][:2],
        }
        print(json.dumps(row), flush=True)
        self.rows.append(row)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=("default", "autotune", "smoke", "miss"), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    sandbox = os.environ.get("TORCHFARM_SANDBOX", "bwrap")
    with LocalFarm(device="cuda", sandbox=sandbox, log_dir=args.out) as farm:
        runner = Runner(farm, args.out)
        if args.part == "smoke":  # one quick miss + hit, to check the setup
            for case in ("farm miss", "farm hit"):
                runner.run("sdpa-dynamic", "default", "farm", case, tempfile.mkdtemp())
            runner.run("resnet50", "default", "farm", "farm miss", tempfile.mkdtemp())
        elif args.part == "miss":
            runner.miss_vs_cold("gpt", "default")
            runner.miss_vs_cold("resnet50", "default")
        elif args.part == "default":
            runner.warm_start("gpt", "default")
            runner.warm_start("resnet50", "default")
            runner.run(
                "sdpa-dynamic", "default", "farm", "farm miss", tempfile.mkdtemp(prefix="dyn-")
            )
            runner.run(
                "sdpa-dynamic", "default", "local", "local cold", tempfile.mkdtemp(prefix="dyn-")
            )
            runner.compare("sdpa-dynamic", "default", "farm miss", "local cold")
        else:
            runner.storm()
            runner.parity("gpt")
            runner.run("gpt-small", "reduce-overhead", "farm", "farm miss", tempfile.mkdtemp())
            runner.run("gpt-small", "reduce-overhead", "farm", "farm hit", tempfile.mkdtemp())
            runner.warm_start("gpt-small", "max-autotune-no-cudagraphs")
        store = farm.store()
        stats = store.counters.farm()
        entries = [
            {k: e.get(k) for k in ("mode", "compile_seconds", "size", "tuned_kernels")}
            | {"kernels": len(e.get("kernels", []))}
            for e in store.rows()
        ]
    result = {
        "part": args.part,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "sandbox": sandbox,
        "farm_stats": stats,
        "entries": entries,
        "rows": runner.rows,
    }
    with open(os.path.join(args.out, f"results-{args.part}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
