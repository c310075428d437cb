"""One GPU measurement in a fresh process; prints one JSON line.

    client.py MODEL MODE BACKEND OUTFILE      BACKEND: farm (TORCHFARM_ADDR), farm-skip
                                              (torchfarm.compile, TORCHFARM_SKIP_TRACING=1),
                                              local, eager, or prepare

MODEL: a bench model (models.py), `coverage:NAME`, an architecture of bench/coverage at its
large scale, or `zoo:NAME`, a model of the third-party zoo (tests/zoo/models.py) at its cuda
scale, the library's own module compiled; both run as a training step. BACKEND eager is
torch.compile(backend="eager"): Dynamo's tracing alone, the floor of any warm start that
still traces. BACKEND prepare is `torchfarm prepare` (issue 30): the first step on fake
tensors, for the target in BENCH_TARGET (a `torchfarm target --device cuda` file), with
CUDA_VISIBLE_DEVICES empty as on a machine without the GPU; it prints the preparation's
rows instead of a measurement.
Runs the model eagerly (the reference), then compiled: time from torch.compile to the first
compiled step's result (compile or fetch included), errors against eager, steady-state step
times of both, and what the first step cost in Triton compiles (ptxas calls, logged by a
wrapper that TRITON_PTXAS_PATH points at) and in kernels autotuned at run time.
Outputs and gradients go to OUTFILE so that the runner can compare farm with local. Under
torchrun each rank runs all of this on its own GPU, after joining an NCCL group (`join_ranks`),
and writes OUTFILE.rank<N>.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "coverage"))
from models import build as build_bench  # noqa: E402


def build(name: str):
    """(model, inputs, spec) of a bench model, of `coverage:NAME` or of `zoo:NAME` (a
    training step; a zoo model's inputs are its batch's (args, kwargs))."""
    if name.startswith("zoo:"):
        sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
        from tests.zoo import models as zoo

        why = zoo.unavailable(name.split(":", 1)[1])
        if why:
            print(json.dumps({"model": name, "unavailable": why}))
            sys.exit(0)
        built = zoo.build(name.split(":", 1)[1], "cuda", "cuda")
        spec = {"train": True, "bf16": built.autocast, "zoo": built}
        return built.model.train(), built.batch(0, True), spec
    if not name.startswith("coverage:"):
        model, inputs, spec = build_bench(name)
        return model, (inputs[0],), spec
    from architectures import build as build_architecture

    torch._dynamo.config.allow_rnn = True  # as the coverage suite runs them
    model, inputs = build_architecture(name.split(":", 1)[1], "cuda", "large")
    return model.train(), inputs, {"train": True, "bf16": False}


def make_step(fn, model, spec, keep: bool = True):
    """One step of `fn` (forward, and for training the loss's backward); it returns copies of
    the output and gradients, or None without `keep` (a step timed as a training step is)."""

    def step(*xs):
        x = xs[0]
        if spec["train"]:
            model.zero_grad(set_to_none=True)
        with (
            torch.autocast("cuda", torch.bfloat16, enabled=spec["bf16"]),
            torch.set_grad_enabled(spec["train"]),
        ):
            if "zoo" in spec:  # the library module's own call on (args, kwargs)
                loss, out = spec["zoo"].loss(fn(*xs[0], **xs[1]))
            elif isinstance(out := fn(*xs), tuple):  # a coverage architecture's (loss, logits)
                loss, out = out
            elif spec["train"] and out.dim() == 3 and x.dtype == torch.long:  # GPT: next token
                loss = F.cross_entropy(out.float().flatten(0, 1), x.roll(-1, 1).flatten())
            else:
                loss = out.float().square().mean()
            if spec["train"]:
                loss.backward()
        if not keep:
            return None
        out = out.detach().float().clone()  # CUDA graphs reuse their output buffers
        grads = [p.grad.float().clone() for p in model.parameters() if p.grad is not None]
        return out, grads

    return step


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def step_ms(step, x, iters: int = 20) -> float:
    for _ in range(3):
        step(*x)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(*x)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def ptxas_calls() -> int:
    path = os.environ.get("TF_PTXAS_LOG", "")
    if not path or not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if "--version" not in line)


TUNED_AT_RUN: list[dict] = []


def record_runtime_tuning() -> None:
    """Note each Triton kernel that benchmarks its launch configs, or runs coordinate-descent
    tuning, at run time: the autotuning that a warm cache (or the farm) should spare.
    Inductor's own `benchmarking.*` counters cannot tell: a cache hit replays the counters
    recorded when the graph was compiled."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    def recording(method: str, how: str):
        original = getattr(CachingAutotuner, method)

        def record(self, *args, **kwargs):
            TUNED_AT_RUN.append(
                {
                    "how": how,
                    "kernel": os.path.basename(self.filename or ""),
                    "dir": os.path.dirname(self.filename or "")[-40:],
                    "state": (getattr(self, "autotune_cache_info", None) or {}).get(
                        "autotune_cache_state"
                    ),
                    "configs": len(self.launchers),
                }
            )
            return original(self, *args, **kwargs)

        setattr(CachingAutotuner, method, record)

    recording("benchmark_all_configs", "configs")
    recording("_coordinate_descent_tuning", "coordesc")


def capture_restored_guards() -> list:
    """(code, guard manager) of every frame a package restores: Dynamo checks these before
    its own cache, and a frame whose restored guard fails is traced as if new (no recompile
    log), so a failing guard is found only by asking the manager (BENCH_GUARD_DEBUG=1)."""
    from torch._C._dynamo import eval_frame

    restored: list = []
    original = eval_frame._load_precompile_entry

    def load(code, guard_manager, dynamo_code):
        restored.append((code, guard_manager))
        return original(code, guard_manager, dynamo_code)

    eval_frame._load_precompile_entry = load
    return restored


def report_restored_guards(restored: list, model, x, spec) -> None:
    """Each restored frame's guard, checked against the first step's locals, on stderr."""
    for code, manager in restored:
        names = code.co_varnames[: code.co_argcount]
        if code.co_name != "forward" or len(names) != 1 + len(x):
            continue
        with (
            torch.autocast("cuda", torch.bfloat16, enabled=spec["bf16"]),
            torch.set_grad_enabled(spec["train"]),
        ):
            result = manager.check_verbose(dict(zip(names, [model, *x])))
        print(
            f"restored guard check: {code.co_qualname} passed={result.result} "
            f"failed={list(result.verbose_code_parts)[:6]}",
            file=sys.stderr,
        )


def prepare_only(name: str, mode: str) -> None:
    """The first step of `name` on fake tensors, its graphs compiled by the farm for the
    target in BENCH_TARGET; one JSON line: graphs, sources, seconds, where it stopped."""
    from google.protobuf import json_format

    from torchfarm.client import prepare
    from torchfarm.proto import torchfarm_pb2 as pb

    with open(os.environ["BENCH_TARGET"]) as f:
        target = json_format.Parse(f.read(), pb.Target())

    def first_step():
        model, x, spec = build(name)
        compiled = torch.compile(
            model, backend="torchfarm", mode=None if mode == "default" else mode
        )
        make_step(compiled, model, spec)(*x)

    started = time.perf_counter()
    summary = prepare.run(first_step, target)
    print(summary.table(), file=sys.stderr)
    print(
        json.dumps(
            {
                "model": name,
                "mode": mode,
                "backend": "prepare",
                "cuda_visible": torch.cuda.is_available(),
                "prepare_s": round(time.perf_counter() - started, 2),
                "graphs": [source for _, source, _ in summary.rows],
                "stopped": summary.stopped,
            }
        )
    )


def join_ranks() -> int:
    """Under torchrun (PyTorch's distributed GEMM autotuning, as its users run it): this
    rank's GPU and an NCCL group whose ranks share max-autotune's GEMM benchmarking
    (TORCHINDUCTOR_DISTRIBUTED_MAX_AUTOTUNE_GEMM=1); -1 outside torchrun."""
    if "LOCAL_RANK" not in os.environ:
        return -1
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    return dist.get_rank()


# From the compile call to the end of the first step: the window a warm start is timed over.
first_step_window: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def main(name: str, mode: str, backend: str, outfile: str) -> None:
    if backend == "prepare":
        return prepare_only(name, mode)
    rank = join_ranks()
    if rank >= 0:
        outfile = f"{outfile}.rank{rank}"
    record_runtime_tuning()
    model, x, spec = build(name)
    eager = make_step(model, model, spec)
    ref_out, ref_grads = eager(*x)
    if "dynamic_dim" in spec:
        torch._dynamo.mark_dynamic(x[0], spec["dynamic_dim"])
    torch.cuda.synchronize()
    # From torch.compile, as bench/first_result.py: resolving the backend is part of the cost
    # (backend="inductor" imports Inductor's compile_fx there, before the first step)
    with first_step_window():  # profiled_client.py: PROFILE_WHOLE=first profiles this
        started = time.perf_counter()
        if backend == "farm-skip":  # torchfarm.compile: Dynamo's package kept on the farm
            import logging

            import torchfarm

            logging.basicConfig(level=logging.WARNING)
            logging.getLogger("torchfarm").setLevel(logging.INFO)  # the package's fate, on stderr

            compiled_model = torchfarm.compile(model, mode=mode)
            restored = capture_restored_guards() if os.environ.get("BENCH_GUARD_DEBUG") else []
        else:
            compiled_model = torch.compile(
                model,
                backend={"farm": "torchfarm", "local": "inductor", "eager": "eager"}[backend],
                mode=None if mode == "default" or backend == "eager" else mode,
            )
        compiled = make_step(compiled_model, model, spec)
        out, grads = compiled(*x)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - started
    if backend == "farm-skip":
        report_restored_guards(restored, model, x, spec)
    ptxas_first = ptxas_calls()
    tuned_first = len(TUNED_AT_RUN)
    errors = [rel_err(out, ref_out)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]
    for other in spec.get("others", []):  # dynamic shapes: other sizes, same graph
        o_out, o_grads = compiled(other)
        r_out, r_grads = eager(other)
        errors += [rel_err(o_out, r_out)] + [rel_err(g, r) for g, r in zip(o_grads, r_grads)]
    torch.save({"out": out.cpu(), "grads": [g.cpu() for g in grads]}, outfile)
    steady = os.environ.get("BENCH_STEADY", "1") == "1"
    compiled_ms, eager_ms = (step_ms(compiled, x), step_ms(eager, x)) if steady else (0.0, 0.0)
    from torchfarm.client.backend import history

    print(
        json.dumps(
            {
                "model": name,
                "mode": mode,
                "backend": backend,
                "rank": rank,
                "first_step_s": round(first_s, 2),
                "max_rel_err": max(errors),
                "compiled_ms": round(compiled_ms, 3),
                "eager_ms": round(eager_ms, 3),
                "ptxas_calls": ptxas_first,
                "kernels_tuned_at_run": tuned_first,
                "tuned_sample": TUNED_AT_RUN[:2],
                "graphs": [r.source for r in history],
                # the farm's account of each graph (client/records.py GraphRecord.timings),
                # summed over graphs: the hit profile
                "timings": _summed([r.timings for r in history]),
                # A hit's Triton kernels come ready from the artifact: binaries emitted and
                # statically launched kernels loaded, with ptxas_calls 0 (issue 19).
                "triton_bundle": {
                    k: v
                    for k, v in torch._dynamo.utils.counters["inductor"].items()
                    if k.startswith("triton_bundler_")
                },
                "recompiles": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                # graphs Dynamo traced in this process: 0 on a hit that skipped tracing
                "frames_traced": torch._dynamo.utils.counters["stats"]["unique_graphs"],
            }
        )
    )


def _summed(timings: list[dict]) -> dict:
    total: dict = {}
    for t in timings:
        for k, v in t.items():
            if isinstance(v, (int, float)):
                total[k] = round(total.get(k, 0) + v, 4)
    return total


if __name__ == "__main__":
    main(*sys.argv[1:5])
