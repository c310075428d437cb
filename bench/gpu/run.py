"""GPU benchmark runner: starts a whole farm on this machine (redis-server, gateway, one GPU
worker in its bwrap sandbox) and runs the checks of one part; writes results.json and a
Markdown table to OUTDIR.

    python bench/gpu/run.py --part {default,autotune} --out OUTDIR

default:  correctness and warm start (local cold, local warm, farm miss, farm hit) in mode
          default for a GPT-style training step and ResNet-50 inference; an SDPA block with
          a dynamic sequence length; runtime parity.
miss:     local cold vs farm miss (then the hit) for GPT and ResNet-50, mode default.
novel:    issue 28: local cold vs farm miss on an empty farm for MODELS (default GPT and four
          coverage architectures, training steps; `zoo:NAME` as in hit), MODE (default
          "default"), and their geomean; step time farm/local from a farm hit after the miss
          (the worker idle); the worker runs TORCHFARM_CONCURRENT_BACKWARD as set (off by
          default); PARITY=gpt then times that model's farm code beside a local compile in one
          process (parity.py).
sibling:  issue 28: for each pair A:B of SIBLINGS (default gpt:gpt-l8, GPT and its 8-layer
          sibling), MODE (default "default"): local cold of B on empty caches; local A, then
          local B with A's caches kept (what one user gets today); the farm's miss of A, then
          of B, with TORCHFARM_PRIVATE=1 (a tenant's Triton entries and tuning results serve
          its private compiles; SIBLING_JOBS=shared: shared jobs, B after the pool's builds
          of A's kernels ended); a farm hit of B for the step time. Ratios B-after-A over
          local cold of B and over local B after A, and the worker's kernel-cache lines.
          SIBLING_ROWS=local runs the local rows only and keeps them in /tmp; a next call on
          the same warm machine with SIBLING_ROWS=farm runs the farm's and takes those (a
          max-autotune pair with the pool's builds does not fit one call).
miss_profile: issue 53, for each of MODELS (default zoo:vit), no farm started: a pool-warmed
          compile child's graphs (child_profile.py --pool-only) and a local cold process's
          compile-to-first-step, both under cProfile, in OUTDIR/miss-profile-MODEL/.
parity:   the farm's steady-state step beside a local compile's in one process (parity.py), for
          each model of PARITY (default gpt), one process each.
smoke:    a farm miss and hit of the SDPA block and a ResNet-50 miss, to check the setup.
hit:      issue 26: the farm hit against what users pick instead, for GPT and ResNet-50 (or
          MODELS=a,b,...; `coverage:NAME` for an architecture of bench/coverage, `zoo:NAME`
          for a model of the third-party zoo, tests/zoo; MODE=... for another mode): local
          cold (the process filling PyTorch's Redis remote caches),
          PyTorch's remote warm start (a fresh process, empty local dir), Dynamo's tracing
          alone (backend="eager"), farm miss, farm hit without the skip
          (torch.compile(backend="torchfarm")) and with it (torchfarm.compile with
          TORCHFARM_SKIP_TRACING=1: one process saves Dynamo's package, the next restores
          it); the hits' profiles, bytes per entry beside
          PyTorch's remote-cache bytes (what they are made of: MODEL-entry-contents.json,
          bench/entry_contents.py), the ratios and their geomeans; with BENCH_STEADY=1
          (default 0 here: first steps only) each stage's steady step over local cold's.
prepare:  issue 30: for GPT and one coverage model (or MODELS=a,b,...): `torchfarm prepare`
          in a process that sees no GPU (CUDA_VISIBLE_DEVICES empty), then the real first step
          on the GPU (every graph should be a hit), a normal farm hit (another fresh process)
          and local cold: the prepared first step over the normal hit.
profile:  for each of MODELS (default gpt): a farm miss, then a hit with the artifact's load
          under cProfile (the top functions in OUTDIR/MODEL-hit-profile.txt), then whole
          processes under cProfile: the farm hit, PyTorch's remote warm start and the skip
          hit (MODEL-whole-*-profile.txt): where each warm start's time goes.
spread:   issue 31: max-autotune-no-cudagraphs (MODE) for GPT (MODELS), the rows SPREAD_ROWS
          names (default check,local,farm,ranks): the seam checked in-process, local cold on
          one GPU, the farm's miss on a worker that spreads one compile's benchmarking over
          all its GPUs where TORCHFARM_SPREAD_TUNING=1, PyTorch's distributed GEMM
          autotuning with the GPUs as ranks of one torchrun job.
autotune: a storm of 16 client processes started at once on one uncompiled model; runtime
          parity of farm vs local compile in one process; reduce-overhead through the farm
          (CUDA graphs on the client); the warm-start rows for max-autotune-no-cudagraphs
          (GPT-small inference).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

from torchfarm.gateway.auth import hash_token, make_token
from torchfarm.local_farm import LocalFarm, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from step_parity import wait_quiet  # noqa: E402
from warm_start import PT_REMOTE, plain_redis  # noqa: E402

from tests.integration.helpers import wait_for_precompiled_headers  # noqa: E402

TOKEN = make_token()  # the bench's tenant: the skip keeps Dynamo's package per tenant
# On the GPU the bundled autotune remote cache works too (it fails only on the CPU).
PT_REMOTE_GPU = dict(PT_REMOTE, TORCHINDUCTOR_BUNDLED_AUTOTUNE_REMOTE_CACHE="1")


SIBLING_LOCAL_ROWS = "/tmp/torchfarm-sibling-local-rows.json"  # SIBLING_ROWS=local/farm
SIBLING_TENSORS = "/tmp/torchfarm-sibling-tensors"  # and the local rows' outputs


class Runner:
    def __init__(self, farm: LocalFarm, outdir: str):
        self.farm, self.outdir, self.rows = farm, outdir, []
        # kept across calls on a warm machine only where the sibling rows are split
        split = os.environ.get("SIBLING_ROWS", "all") != "all"
        self.tensors = SIBLING_TENSORS if split else tempfile.mkdtemp(prefix="bench-tensors-")
        os.makedirs(self.tensors, exist_ok=True)

    def env(self, cache: str, addr: str) -> dict:
        return dict(
            os.environ,
            TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor",
            TRITON_CACHE_DIR=f"{cache}/triton",
            TORCHFARM_ADDR=addr,
            TORCHFARM_TOKEN=TOKEN,
            TORCHFARM_PROGRESS="0",
            # the skip only in the stages that name it (`farm-skip`): on by default on 2.11 since
            # its CPU zoo passed, which would turn the farm-hit stage into a second skip stage
            TORCHFARM_SKIP_TRACING="0",
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
        farm_client = backend.startswith("farm") or backend == "prepare"
        env = self.env(cache, self.farm.addr if farm_client else "")
        if backend == "farm-skip":
            env["TORCHFARM_SKIP_TRACING"] = "1"
        return subprocess.Popen(
            [sys.executable, os.path.join(HERE, "client.py"), model, mode, backend, outfile],
            env={**env, **(extra_env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def run(
        self,
        model: str,
        mode: str,
        backend: str,
        case: str,
        cache: str,
        extra_env: dict | None = None,
    ) -> dict:
        started = time.perf_counter()
        proc = self.client(model, mode, backend, case, cache, extra_env)
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
        if backend == "farm-skip":  # what became of Dynamo's package, and why a frame traced
            name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{model}-{case}")
            with open(os.path.join(self.outdir, f"{name}.stderr.txt"), "w") as f:
                f.write(err)
            row["package_log"] = [
                line[-300:]
                for line in err.splitlines()
                if "dynamo package" in line
                or "Recompiling" in line
                or "triggered by" in line
                or "identity" in line
                or "guard check" in line
                or "traces on every hit" in line
            ][-8:]
        if backend.startswith("farm") and set(row.get("graphs", [])) & {"local", "eager"}:
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

    def novel_miss(self, model: str, mode: str) -> float:
        """Issue 28's novel-miss row: local cold, then the farm's miss of a model it has never
        seen, side by side; the miss over local cold (first steps; NaN if one failed). The
        farm's step time is the hit's, a process later: the same artifact, timed while the
        worker is idle (during the miss's own steps it warms the child that replaces the
        one the miss took, on the same GPU)."""
        rows = {}
        for backend, case, prefix in (
            ("local", "local cold", "local-"),
            ("farm", "farm miss", "miss-"),
            ("farm", "farm hit", "hit-"),
        ):
            quiet_after_s = wait_quiet()  # the previous row's farm work (its whole graph,
            # the pool's kernel builds, a replaced child's warm-up) never runs beside this one
            rows[case] = self.run(model, mode, backend, case, tempfile.mkdtemp(prefix=prefix))
            rows[case]["quiet_after_s"] = round(quiet_after_s, 1)
        cold, miss, hit = rows["local cold"], rows["farm miss"], rows["farm hit"]
        self.compare(model, mode, "farm miss", "local cold")
        ratio = miss.get("first_step_s", float("nan")) / cold.get("first_step_s", float("nan"))
        row = {"model": model, "mode": mode, "case": "miss_over_cold", "value": ratio}
        if hit.get("compiled_ms") and cold.get("compiled_ms"):
            row["step_farm_over_local"] = hit["compiled_ms"] / cold["compiled_ms"]
        print(json.dumps(row), flush=True)
        self.rows.append(row)
        return ratio

    def sibling_miss(self, a: str, b: str, mode: str) -> dict:
        """Issue 28's sibling rows (see the module's docstring); the ratios."""
        rows, kept_rows = os.environ.get("SIBLING_ROWS", "all"), SIBLING_LOCAL_ROWS
        if rows == "farm":  # this machine's local rows, from the call before
            with open(kept_rows) as f:
                cold, after = json.load(f)[f"{a}:{b}:{mode}"]
        else:
            cold = self.run(b, mode, "local", "local cold B", tempfile.mkdtemp(prefix="cold-"))
            kept = tempfile.mkdtemp(prefix="kept-")
            self.run(a, mode, "local", "local A", kept)
            after = self.run(b, mode, "local", "local B after A", kept)
        if rows == "local":
            local = {}
            if os.path.exists(kept_rows):
                with open(kept_rows) as f:
                    local = json.load(f)
            local[f"{a}:{b}:{mode}"] = [cold, after]
            with open(kept_rows, "w") as f:
                json.dump(local, f)
            return {}
        shared = os.environ.get("SIBLING_JOBS", "private") == "shared"
        jobs = {} if shared else {"TORCHFARM_PRIVATE": "1"}
        self.run(a, mode, "farm", "farm miss A", tempfile.mkdtemp(prefix="miss-"), jobs)
        builds = wait_for_pool_builds(self.outdir) if shared else {}
        miss = self.run(b, mode, "farm", "farm miss B after A", tempfile.mkdtemp(), jobs)
        hit = self.run(b, mode, "farm", "farm hit B", tempfile.mkdtemp(prefix="hit-"), jobs)
        self.compare(b, mode, "farm miss B after A", "local cold B")
        first = {
            k: r.get("first_step_s", float("nan"))
            for k, r in (("cold", cold), ("after", after), ("miss", miss))
        }
        row = {
            "model": f"{a}:{b}",
            "mode": mode,
            "case": "sibling",
            "jobs": "shared" if shared else "private",
            "pool_builds": builds,
            "miss_over_cold_b": first["miss"] / first["cold"],
            "miss_over_local_b_after_a": first["miss"] / first["after"],
            "local_b_after_a_over_cold_b": first["after"] / first["cold"],
            "kernel_cache": kernel_cache_lines(self.outdir)[-2:],
        }
        if hit.get("compiled_ms") and cold.get("compiled_ms"):
            row["step_farm_over_local"] = hit["compiled_ms"] / cold["compiled_ms"]
        print(json.dumps(row), flush=True)
        self.rows.append(row)
        return row

    def hit_vs_pytorch(self, model: str, mode: str, redis_port: int) -> dict:
        """Issue 26's rows, each a fresh process: the farm hit with Dynamo's tracing skipped
        (torchfarm.compile, TORCHFARM_SKIP_TRACING=1) and without it, next to PyTorch's Redis
        remote-cache warm start and Dynamo's tracing alone; the local cold compile is the
        process that fills PyTorch's remote cache. Returns the first-step seconds by stage."""
        remote = dict(
            PT_REMOTE_GPU,
            TORCHINDUCTOR_REDIS_HOST="127.0.0.1",
            TORCHINDUCTOR_REDIS_PORT=str(redis_port),
        )
        subprocess.run(["redis-cli", "-p", str(redis_port), "flushall"], check=True)
        stages = {
            "local_cold": self.run(model, mode, "local", "local cold", tempfile.mkdtemp(), remote)
        }
        pt_bytes = redis_value_bytes(redis_port)
        stages["pt_remote_warm"] = self.run(
            model, mode, "local", "pt remote warm", tempfile.mkdtemp(), remote
        )
        stages["trace_only"] = self.run(
            model, mode, "eager", "trace only", tempfile.mkdtemp(), {"BENCH_STEADY": "0"}
        )
        before = {(r["key"], r["digest"]) for r in self.farm.store().rows()}
        stages["farm_miss"] = self.run(model, mode, "farm", "farm miss", tempfile.mkdtemp())
        entries = [r for r in self.farm.store().rows() if (r["key"], r["digest"]) not in before]
        stages["farm_hit_noskip"] = self.run(
            model, mode, "farm", "farm hit noskip", tempfile.mkdtemp()
        )
        # torchfarm.compile with the skip: one process traces and saves Dynamo's package,
        # the next restores it and traces nothing
        self.run(model, mode, "farm-skip", "skip record", tempfile.mkdtemp())
        stages["farm_hit"] = self.run(model, mode, "farm-skip", "farm hit", tempfile.mkdtemp())
        self.compare(model, mode, "farm hit", "local cold")
        self.compare(model, mode, "farm hit noskip", "local cold")
        seconds = {k: r.get("first_step_s", float("nan")) for k, r in stages.items()}
        steady = {k: r["compiled_ms"] for k, r in stages.items() if r.get("compiled_ms")}
        local_ms = steady.get("local_cold")
        remote_s = seconds["pt_remote_warm"]
        row = {
            "model": model,
            "mode": mode,
            "case": "hit vs pytorch",
            **seconds,
            "hit_over_pt_remote": round(seconds["farm_hit"] / remote_s, 3),
            "noskip_over_pt_remote": round(seconds["farm_hit_noskip"] / remote_s, 3),
            # BENCH_STEADY=1: each stage's steady step (ms) and over local torch.compile's
            "steady_ms": steady,
            "steady_over_local": {
                k: round(ms / local_ms, 3) for k, ms in steady.items() if local_ms
            },
            "hit_graphs": stages["farm_hit"].get("graphs"),
            "hit_frames_traced": stages["farm_hit"].get("frames_traced"),
            "noskip_frames_traced": stages["farm_hit_noskip"].get("frames_traced"),
            "hit_profile": stages["farm_hit"].get("timings"),
            "noskip_profile": stages["farm_hit_noskip"].get("timings"),
            "hit_ptxas_calls": stages["farm_hit"].get("ptxas_calls"),
            # bytes per entry: the farm's raw artifact and what it stores and sends (zstd),
            # beside what PyTorch's remote caches hold for the same model
            "farm_raw_bytes": sum(r["size"] for r in entries),
            "farm_wire_bytes": sum(r["stored_bytes"] for r in entries),
            "farm_entries": len(entries),
            "pt_remote_bytes": pt_bytes,
        }
        print(json.dumps(row), flush=True)
        self.rows.append(row)
        self.write_entry_contents(model, entries)
        return seconds

    def write_entry_contents(self, model: str, entries: list[dict]) -> None:
        """What the new entries' bytes are made of (bench/entry_contents.py), in
        MODEL-entry-contents.json; a failure to list them is printed, the run goes on."""
        try:
            from entry_contents import contents

            store = self.farm.store()
            listing = []
            for row in entries:
                entry = store.artifacts.entry(row["key"], row["digest"])
                data = store.artifacts.read(row["key"], entry) if entry else None
                listing.append(contents(data) if data else {"key": row["key"], "read": False})
            name = f"{model.replace(':', '-')}-entry-contents.json"
            with open(os.path.join(self.outdir, name), "w") as f:
                json.dump(listing, f, indent=1)
        except Exception as e:  # noqa: BLE001 - the listing must not cost the run its rows
            print(f"entry contents of {model}: {e!r}", flush=True)

    def profile_hit(self, model: str, redis_port: int) -> None:
        """A miss, then a hit with its load under cProfile (MODEL-hit-profile.txt); then the
        farm hit, PyTorch's remote warm start and the skip hit under cProfile, side by side
        (MODEL-whole-*-profile.txt and .prof): where each warm start's time goes. The whole
        process, or with PROFILE_WINDOW=first the compile call to the first step's end only
        (and the client's debug lines: the prewarm's steps)."""
        window = os.environ.get("PROFILE_WINDOW", "1")
        self.run(model, "default", "farm", "farm miss", tempfile.mkdtemp())
        if window == "1":
            self._profiled(model, "farm", "hit", {}, "0")
        self._profiled(model, "farm", "whole-farm-hit", {}, window)
        remote = dict(
            PT_REMOTE_GPU,
            TORCHINDUCTOR_REDIS_HOST="127.0.0.1",
            TORCHINDUCTOR_REDIS_PORT=str(redis_port),
        )
        self.run(model, "default", "local", "pt remote fill", tempfile.mkdtemp(), remote)
        self._profiled(model, "local", "whole-pt-remote", remote, window)
        self.run(model, "default", "farm-skip", "skip record", tempfile.mkdtemp())
        self._profiled(model, "farm-skip", "whole-skip-hit", {}, window)

    def _profiled(self, model: str, backend: str, name: str, extra: dict, whole: str) -> None:
        env = self.env(tempfile.mkdtemp(), self.farm.addr if backend.startswith("farm") else "")
        if backend == "farm-skip":
            env["TORCHFARM_SKIP_TRACING"] = "1"
        profiled(self.outdir, model, backend, name, {**env, **extra}, whole)

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

    def ranks(self, model: str, mode: str, case: str, ranks: int, extra_env: dict) -> dict:
        """One torchrun job of `ranks` local-compile clients, one per GPU, sharing one cache
        dir as ranks of a machine do; the row is the slowest rank's first step."""
        cache = tempfile.mkdtemp(prefix="ranks-")
        outfile = os.path.join(self.tensors, f"{model}-{mode}-{case}.pt")
        started = time.perf_counter()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc-per-node={ranks}",
                f"--master-port={free_port()}",
                os.path.join(HERE, "client.py"),
                model,
                mode,
                "local",
                outfile,
            ],
            env={**self.env(cache, ""), **extra_env},
            capture_output=True,
            text=True,
            timeout=480,
        )
        results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        row = {"model": model, "mode": mode, "case": case, "ranks": ranks}
        row["process_s"] = round(time.perf_counter() - started, 1)
        if len(results) == ranks:
            row["first_step_s"] = max(r["first_step_s"] for r in results)
            row["first_step_s_per_rank"] = [r["first_step_s"] for r in results]
            row["max_rel_err"] = max(r["max_rel_err"] for r in results)
            row["compiled_ms"] = max(r["compiled_ms"] for r in results)
        else:
            row["error"] = proc.stderr[-2000:]
        print(json.dumps(row), flush=True)
        self.rows.append(row)
        return row

    def spread(self, model: str, mode: str, rows: list[str]) -> None:
        """Issue 31: one compile's max-autotune benchmarking spread over this worker's GPUs
        (`farm`: the farm's miss; spread or not as TORCHFARM_SPREAD_TUNING started the farm),
        against a local cold compile on one GPU (`local`) and PyTorch's distributed GEMM
        autotuning with the GPUs as ranks of one job (`ranks`); `check` first shows the seam
        at work in this process. Ratios of the rows this call ran."""
        gpus = torch.cuda.device_count()
        spread = os.environ.get("TORCHFARM_SPREAD_TUNING", "0") == "1"
        farm_case = f"farm miss, {gpus}-GPU worker, spread {'on' if spread else 'off'}"
        got: dict[str, dict] = {}
        if "check" in rows:
            self.rows.append(spread_check(gpus))
            print(json.dumps(self.rows[-1]), flush=True)
        if "local" in rows:
            got["local"] = self.run(model, mode, "local", "local cold", tempfile.mkdtemp())
        if "farm" in rows:
            got["farm"] = self.run(model, mode, "farm", farm_case, tempfile.mkdtemp())
            if "local" in rows:
                self.compare(model, mode, farm_case, "local cold")
        if "ranks" in rows and gpus > 1:
            got["ranks"] = self.ranks(
                model,
                mode,
                f"PyTorch distributed GEMM autotune, {gpus} ranks",
                gpus,
                {"TORCHINDUCTOR_DISTRIBUTED_MAX_AUTOTUNE_GEMM": "1", "BENCH_STEADY": "0"},
            )
        firsts = {k: r["first_step_s"] for k, r in got.items() if "first_step_s" in r}
        ratios: dict = {"model": model, "mode": mode, "case": "ratios", "first_step_s": firsts}
        for a, b in (("farm", "local"), ("farm", "ranks"), ("ranks", "local")):
            if a in firsts and b in firsts:
                ratios[f"{a}_over_{b}"] = round(firsts[a] / firsts[b], 3)
        if "farm" in firsts and "local" in firsts:
            ratios["step_ms_farm_over_local"] = round(
                got["farm"]["compiled_ms"] / max(got["local"]["compiled_ms"], 1e-9), 3
            )
        print(json.dumps(ratios), flush=True)
        self.rows.append(ratios)

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


def profiled(outdir: str, model: str, backend: str, name: str, env: dict, whole: str) -> None:
    """One client process of MODEL under cProfile (bench/gpu/profiled_client.py; `whole`: its
    PROFILE_WHOLE window), its pstats in OUTDIR/MODEL-NAME.prof and its top functions by
    cumulative and by own time in OUTDIR/MODEL-NAME-profile.txt."""
    import pstats

    prof = os.path.join(outdir, f"{model}-{name}.prof".replace(":", "-"))
    with tempfile.TemporaryDirectory() as scratch:  # the client's outputs, not kept
        subprocess.run(
            [sys.executable, os.path.join(HERE, "profiled_client.py"), prof]
            + [model, "default", backend, os.path.join(scratch, f"profiled-{name}.pt")],
            env={**env, "BENCH_STEADY": "0", "PROFILE_WHOLE": whole},
            check=False,
        )
    with open(prof.replace(".prof", "-profile.txt"), "w") as f:
        stats = pstats.Stats(prof, stream=f)
        stats.sort_stats("cumulative").print_stats(250)
        stats.sort_stats("tottime").print_stats(60)


def miss_profile(outdir: str, models: list[str]) -> None:
    """Issue 53: where a miss's compile child spends time a local cold compile does not. Per
    model, no farm running: child_profile.py's rows (a pool-warmed child, empty caches) in
    OUTDIR/miss-profile-MODEL/child.jsonl, then a local cold process's compile-to-first-step
    under cProfile (`profiled`, window "first")."""
    for model in models:
        out = os.path.join(outdir, f"miss-profile-{model.removeprefix('zoo:')}")
        os.makedirs(out, exist_ok=True)
        with open(f"{out}/child.jsonl", "w") as rows, open(f"{out}/child.err", "w") as err:
            child = [sys.executable, os.path.join(HERE, "child_profile.py"), model, out]
            done = subprocess.run(child + ["--pool-only"], stdout=rows, stderr=err, timeout=300)
        if done.returncode:
            print(f"child profile {model} failed ({done.returncode})", flush=True)
        cache = tempfile.mkdtemp()
        env = dict(
            os.environ,
            TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor",
            TRITON_CACHE_DIR=f"{cache}/triton",
            TORCHFARM_ADDR="",
        )
        profiled(out, model, "local", "local-cold", env, "first")


def spread_check(gpus: int) -> dict:
    """A max-autotune GEMM compiled in this process inside tuning_devices.spread_over, as a
    compile child does: which GPUs Inductor's tuning pool benchmarked on, and the result
    against eager."""
    from torch._inductor import autotune_process

    from torchfarm.torch_adapter.compile import tuning_devices

    a = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
    started = time.perf_counter()
    with tuning_devices.spread_over([str(i) for i in range(gpus)]):
        out = torch.compile(torch.mm, mode="max-autotune-no-cudagraphs")(a, b)
    pool = autotune_process.get_tuning_process_pool()
    return {
        "case": "spread check",
        "compile_s": round(time.perf_counter() - started, 1),
        "tuning_pool_devices": [p.device for p in pool.processes],
        "tuning_processes_alive": sum(p.alive() for p in pool.processes),
        "max_abs_err": (out.float() - (a.float() @ b.float())).abs().max().item(),
    }


NOVEL_MODELS = "gpt,coverage:llama-gqa,coverage:vit,coverage:convnext,coverage:gpt2"


def kernel_cache_lines(log_dir: str) -> list[str]:
    """The worker's `kernel cache: ...` log lines so far (one per compile), oldest first."""
    found = []
    for name in sorted(os.listdir(log_dir)):
        if name.endswith(".log"):
            with open(os.path.join(log_dir, name), errors="replace") as f:
                found += [line.strip()[-200:] for line in f if "kernel cache: " in line]
    return found


def wait_for_pool_builds(log_dir: str, timeout_s: float = 420.0) -> dict:
    """Wait until the worker's pool builds of the sources its compiles queued have ended (as
    a farm would have long before a sibling came); how many were built, refused, failed."""
    deadline, ended = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        queued, ended = 0, {"built": 0, "refused": 0, "failed": 0, "skipped": 0}
        for name in sorted(os.listdir(log_dir)):
            if not name.endswith(".log"):
                continue
            with open(os.path.join(log_dir, name), errors="replace") as f:
                for line in f:
                    if "sources queued for the pool's builds" in line:
                        queued += int(line.split("kernel cache: ")[1].split()[0])
                    elif "pool kernel build: " in line:
                        ended["built"] += 1
                    elif "pool kernel build refused" in line:
                        ended["refused"] += 1
                    elif "pool kernel build failed" in line:
                        ended["failed"] += 1
                    elif "pool kernel build skipped" in line:
                        ended["skipped"] += 1
        if queued and sum(ended.values()) >= queued:
            break
        time.sleep(2)
    print(json.dumps({"pool_builds": ended}), flush=True)
    return ended


def redis_value_bytes(port: int) -> int:
    """The bytes of every value in a redis-server: what PyTorch's remote caches stored."""
    import redis

    client = redis.Redis(port=port)
    return sum(client.strlen(key) for key in client.scan_iter(_type="string"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--part",
        choices=(
            "default",
            "autotune",
            "smoke",
            "miss",
            "novel",
            "sibling",
            "hit",
            "profile",
            "skipcheck",
            "prepare",
            "spread",
            "parity",
            "miss_profile",
        ),
        required=True,
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.part == "miss_profile":  # MODELS; no farm: a child and a local process alone
        miss_profile(args.out, os.environ.get("MODELS", "zoo:vit").split(","))
        return
    sandbox = os.environ.get("TORCHFARM_SANDBOX", "bwrap")
    # each part's farm starts with an empty kernel cache, as a new farm does; its clients see
    # where (parity.py reads the GEMM timings the worker keeps there)
    os.environ["TORCHFARM_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="kernels-")
    with LocalFarm(
        device="cuda",
        sandbox=sandbox,
        log_dir=args.out,
        tenants=f"bench:{hash_token(TOKEN)}",
        extra_env={"TORCHFARM_KERNEL_CACHE": os.environ["TORCHFARM_KERNEL_CACHE"]},
    ) as farm:
        runner = Runner(farm, args.out)
        if args.part in ("novel", "sibling"):  # local rows on a quiet machine, not beside
            wait_for_precompiled_headers(farm)  # the worker's build of its headers
        if args.part == "smoke":  # one quick miss + hit, to check the setup
            for case in ("farm miss", "farm hit"):
                runner.run("sdpa-dynamic", "default", "farm", case, tempfile.mkdtemp())
            runner.run("resnet50", "default", "farm", "farm miss", tempfile.mkdtemp())
        elif args.part == "hit":
            os.environ.setdefault("BENCH_STEADY", "0")  # first steps only: more models a call
            models = os.environ.get("MODELS", "gpt,resnet50").split(",")
            mode = os.environ.get("MODE", "default")
            with plain_redis() as redis_port:
                for model in models:
                    runner.hit_vs_pytorch(model, mode, redis_port)
            for field in ("hit_over_pt_remote", "noskip_over_pt_remote"):
                ratios = [r[field] for r in runner.rows if field in r]
                ratios = [x for x in ratios if x == x]  # a model whose stage failed has none
                if ratios:
                    geomean = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
                    runner.rows.append({"case": f"geomean {field}", "value": geomean})
                    print(f"geomean {field} over {len(ratios)}: {geomean:.3f}")
        elif args.part == "skipcheck":  # the skip alone: miss, save the package, restore it
            os.environ.setdefault("BENCH_STEADY", "0")
            for model in os.environ.get("MODELS", "gpt").split(","):
                runner.run(model, "default", "farm", "farm miss", tempfile.mkdtemp())
                runner.run(
                    model,
                    "default",
                    "farm-skip",
                    "skip record",
                    tempfile.mkdtemp(),
                    {"TORCH_LOGS": "recompiles,dynamo"},
                )
                runner.run(
                    model,
                    "default",
                    "farm-skip",
                    "farm hit",
                    tempfile.mkdtemp(),
                    {"TORCH_LOGS": "recompiles,dynamo", "BENCH_GUARD_DEBUG": "1"},
                )
        elif args.part == "prepare":
            os.environ.setdefault("BENCH_STEADY", "0")
            target_file = os.path.join(args.out, "target.json")
            with open(target_file, "w") as f:
                subprocess.run(
                    [sys.executable, "-m", "torchfarm", "target", "--device", "cuda"],
                    stdout=f,
                    check=True,
                )
            for model in os.environ.get("MODELS", "gpt,coverage:llama-gqa").split(","):
                no_gpu = {"CUDA_VISIBLE_DEVICES": "", "BENCH_TARGET": target_file}
                runner.run(model, "default", "prepare", "prepare", tempfile.mkdtemp(), no_gpu)
                runner.run(model, "default", "farm", "first step after prepare", tempfile.mkdtemp())
                runner.run(model, "default", "farm", "farm hit", tempfile.mkdtemp())
                runner.run(model, "default", "local", "local cold", tempfile.mkdtemp())
                runner.compare(model, "default", "first step after prepare", "farm hit")
        elif args.part == "spread":  # issue 31: MODELS (default gpt), MODE
            mode = os.environ.get("MODE", "max-autotune-no-cudagraphs")
            rows = os.environ.get("SPREAD_ROWS", "check,local,farm,ranks").split(",")
            for model in os.environ.get("MODELS", "gpt").split(","):
                runner.spread(model, mode, rows)
        elif args.part == "parity":  # PARITY (default gpt): farm vs local steps, one process each
            for model in os.environ.get("PARITY", "gpt").split(","):
                runner.parity(model)
        elif args.part == "profile":
            with plain_redis() as redis_port:
                for model in os.environ.get("MODELS", "gpt").split(","):
                    runner.profile_hit(model, redis_port)
        elif args.part == "novel":  # issue 28: MODELS, MODE
            mode = os.environ.get("MODE", "default")
            models = os.environ.get("MODELS", NOVEL_MODELS).split(",")
            ratios = [runner.novel_miss(model, mode) for model in models]
            ratios = [x for x in ratios if x == x]
            if ratios:
                geomean = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
                runner.rows.append({"case": "geomean miss_over_cold", "value": geomean})
                print(f"geomean miss_over_cold over {len(ratios)}: {geomean:.3f}", flush=True)
            for model in os.environ.get("PARITY", "").split(","):  # a bench model it compiled:
                if model:  # the farm's steady-state code, timed beside local in one process
                    runner.parity(model)
        elif args.part == "sibling":  # issue 28: SIBLINGS (a:b,...), MODE
            mode = os.environ.get("MODE", "default")
            for pair in os.environ.get("SIBLINGS", "gpt:gpt-l8").split(","):
                runner.sibling_miss(*pair.split(":"), mode)
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
