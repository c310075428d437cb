"""Runtime parity in one process: the farm-compiled and the locally compiled model, on the
same weights and inputs, with the kernels each compile generated; prints one JSON line.

Compiles: the farm's first, until the machine is quiet (the pool builds the farm's kernels and
measures its GEMMs), then the local one. So neither tunes beside the other on the one GPU: a
user's compile has its GPU to itself, and a farm's pool GPUs of its own.

Timing: once the machine is quiet (the farm's replaced children warm up after a miss, on the
same CPUs and GPU), the farm's and the local step alternate in PAIRS rounds of one step each
(bench/step_parity.py: F L, L F), each step timed alone by CUDA events, Python's collector off;
the eager step is timed apart. Interleaving single steps cancels the drift of clocks and of the
host that the means of longer rounds caught; the figure is the ratio of the median steps, with
a bootstrap 95% interval over the rounds. A timed step is a training step (forward, loss,
backward) without the copies of the outputs that the correctness check takes.

Code: the Triton kernels that the local compile's code runs and those of the farm's artifacts
(their wrappers, in Inductor's cache dir; the farm's load under <cache dir>/torchfarm/),
compared by their bodies from `@triton.jit` on with the kernel's name taken out:
`kernels_local_not_farm` 0 says every kernel the local code runs is in the farm's code, the
same source.
`gemm_picks`: for each GEMM both sides timed (max-autotune), the candidate each picked, from
the local compile's timings file and the worker's kept ones.

GPT's input is larger than the warm-start rows' (32 x 512 tokens) so that the GPU, not the
Python launch loop, sets the step time; a `coverage:NAME` architecture (client.py) takes its
own inputs.

    parity.py MODEL    (TORCHFARM_ADDR and TORCHINDUCTOR_CACHE_DIR from the env)

PARITY_PAIRS (default 300), PARITY_MODE (default "default"), PARITY_ORDER (default "pairs";
"pairs,rotate3" times in each order, the figure the first's), PARITY_QUIET=0 (no wait for a
quiet machine), PARITY_CODE=0 (no comparison of the code, no profiles).

PARITY_CONTROL=1: the control. The "farm" side is a second local compile of its own (Inductor's
caches off while it compiles, so that neither reads the other's timings or code), compiled
where the farm's would be: its ratio is how far two local compiles of the one model land apart,
the spread that max-autotune's own timing noise gives any compile, the farm's included.
"""

from __future__ import annotations

import collections
import contextlib
import cProfile
import gc
import glob
import hashlib
import json
import os
import pstats
import re
import statistics
import sys

import torch
import torch._inductor.config as inductor_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from client import build, make_step, rel_err  # noqa: E402
from step_parity import timed_figures, wait_quiet  # noqa: E402

_KERNEL = re.compile(r"async_compile\.triton\(\s*'(\w+)',\s*'''(.*?)'''", re.DOTALL)


def kernel_bodies(cache_dir: str) -> dict[str, set[str]]:
    """Hashes of the Triton kernels that the compiled code runs (the sources its wrappers
    hold, not the candidates max-autotune only benchmarked), each from `@triton.jit` on with
    its name taken out: the local compile's, and the farm's (its artifacts load under
    <cache_dir>/torchfarm/)."""
    found: dict[str, set[str]] = {"local": set(), "farm": set()}
    for path in glob.glob(os.path.join(cache_dir, "**", "*.py"), recursive=True):
        with open(path, errors="replace") as f:
            text = f.read()
        farm = os.path.relpath(path, cache_dir).startswith("torchfarm" + os.sep)
        for name, source in _KERNEL.findall(text):
            body = source[source.find("@triton.jit") :].replace(name, "KERNEL")
            found["farm" if farm else "local"].add(hashlib.sha256(body.encode()).hexdigest())
    return found


def chosen_configs(cache_dir: str) -> dict[str, dict[str, tuple[str, str, str]]]:
    """(name, launch config, launcher class) of each live Triton kernel, by the hash of its
    body (the function's source, its name taken out): the local compile's (from `cache_dir`),
    and the farm's (any other path: the worker's, or the artifact's dir under torchfarm/)."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    found: dict[str, dict[str, tuple[str, str, str]]] = {"local": {}, "farm": {}}
    for kernel in gc.get_objects():
        # type(), not isinstance: the collector also holds proxies that raise on __class__
        if not issubclass(type(kernel), CachingAutotuner) or len(kernel.launchers) != 1:
            continue
        name, source = kernel.inductor_meta.get("kernel_name"), getattr(kernel.fn, "src", None)
        if name and source:
            where = os.path.relpath(kernel.filename or "/", cache_dir)  # the farm's: its worker's
            side = "local" if not where.startswith(("..", "torchfarm" + os.sep)) else "farm"
            key = hashlib.sha256(source.replace(name, "KERNEL").encode()).hexdigest()
            runner = kernel.launchers[0].__globals__.get("runner")
            launch = type(getattr(runner, "__self__", runner)).__name__  # static or Triton's
            found[side][key] = (name, str(kernel.launchers[0].config), launch)
    return found


def _timings(paths: list[str]) -> dict[tuple[str, str, str], dict[str, float]]:
    """Inductor's GEMM timings files (PersistentCache: {"cache": op -> inputs key -> precision
    -> choice hash -> ms}), merged: the candidates' timings per (op, inputs key, precision)."""
    found: dict[tuple[str, str, str], dict[str, float]] = {}
    for path in paths:
        try:
            with open(path) as f:
                cache = json.load(f)["cache"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        for op, by_inputs in cache.items():
            for inputs, by_precision in by_inputs.items():
                for precision, by_choice in by_precision.items():
                    found.setdefault((op, inputs, precision), {}).update(by_choice)
    return found


def _pick(timings: dict[str, float], other: dict[str, float]) -> list:
    """The fastest candidate ("mm", "bias_addmm", "triton_mm", ...), its ms, and the other
    side's ms for the same candidate (None where it did not time it)."""
    choice = min(timings, key=timings.__getitem__)
    return [choice.split("-")[0], round(timings[choice], 5), other.get(choice)]


def gemm_picks(cache_dir: str) -> list[dict]:
    """Each GEMM that both the local compile and the farm timed: the candidate each picked
    (ATen's `mm`/`addmm`/`bias_addmm` or a template), its ms there and on the other side. The local
    timings are the local compile's (`<cache_dir>/cache/`); the farm's are those its worker
    keeps (TORCHFARM_KERNEL_CACHE, as run.py sets it for both: the pool's builder measurement
    of a shared job's GEMMs, or a private job's own), so a pick that differs shows whether the
    two timed the same candidates apart or only ranked near-ties otherwise."""
    local = _timings(glob.glob(os.path.join(cache_dir, "cache", "*")))
    kept = os.environ.get("TORCHFARM_KERNEL_CACHE") or os.path.expanduser(
        "~/.cache/torchfarm/kernels"
    )
    farm = _timings(glob.glob(os.path.join(kept, "**", "tuning", "cache", "*"), recursive=True))
    rows = []
    for key in sorted(local.keys() & farm.keys()):
        rows.append(
            {
                "op": key[0],
                "inputs": key[1][:120],
                "local": _pick(local[key], farm[key]),
                "farm": _pick(farm[key], local[key]),
                "candidates": [len(local[key]), len(farm[key])],
            }
        )
    return rows


def device_ms(step, xs: tuple, steps: int = 20) -> float:
    """GPU time of one step: the sum of its kernels' (and copies') device time, profiled."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(*xs)
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1000 / steps


_OUTPUT_CODE = re.compile(r"c\w{40,}\.py")


def python_profile(steps: dict, xs: tuple, n: int = 100) -> list[list]:
    """Where the farm's steps spend more host time than the local ones: cProfile over `n`
    steps of each (backward included), the functions whose own time differs most: [name, ms
    per step farm - local, local's ms per step]."""
    own: dict[str, dict[str, float]] = {}
    for k in ("farm", "local"):  # the backward on this thread, where cProfile sees it
        profile = cProfile.Profile()
        with torch.autograd.set_multithreading_enabled(False):
            profile.enable()
            for _ in range(n):
                steps[k](*xs)
            torch.cuda.synchronize()
            profile.disable()
        own[k] = {}
        for (path, _, func), (_, _, tottime, _, _) in pstats.Stats(profile).stats.items():
            generated = _OUTPUT_CODE.fullmatch(os.path.basename(path))  # names differ per side
            key = f"{'output code' if generated else '/'.join(path.split('/')[-2:])}:{func}"
            own[k][key] = own[k].get(key, 0.0) + tottime * 1000 / n
    diff = {
        f: own["farm"].get(f, 0.0) - own["local"].get(f, 0.0)
        for f in own["farm"].keys() | own["local"].keys()
    }
    top = sorted(diff, key=lambda f: -abs(diff[f]))[:15]
    return [[f, round(diff[f], 4), round(own["local"].get(f, 0.0), 4)] for f in top]


def runtime_calls(steps: dict, xs: tuple, n: int = 20) -> dict[str, list[float]]:
    """CUDA runtime and driver calls per step (count, host ms), farm and local, where they
    differ: a synchronization or an allocation the farm's code adds shows here."""
    per_step: dict[str, dict[str, tuple[float, float]]] = {}
    for k in ("farm", "local"):
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(n):
                steps[k](*xs)
            torch.cuda.synchronize()
        per_step[k] = {
            e.key: (e.count / n, e.self_cpu_time_total / 1000 / n)
            for e in prof.key_averages()
            if e.key.startswith("cu")
        }
    found = {}
    for name in per_step["farm"].keys() | per_step["local"].keys():
        farm, local = per_step["farm"].get(name, (0, 0)), per_step["local"].get(name, (0, 0))
        if farm[0] != local[0] or abs(farm[1] - local[1]) > 0.02:
            found[name] = [farm[0], local[0], round(farm[1], 4), round(local[1], 4)]
    return found


def code_report(cache_dir: str, steps: dict, xs: tuple) -> dict:
    """The farm's code beside the local compile's: kernel sources, launch configs, GPU time."""
    kernels, configs = kernel_bodies(cache_dir), chosen_configs(cache_dir)
    both = configs["local"].keys() & configs["farm"].keys()
    gpu_ms: dict[str, list[float]] = {"farm": [], "local": []}
    for _ in range(2):
        for k, ms in gpu_ms.items():
            ms.append(round(device_ms(steps[k], xs), 4))
    return {
        "kernels_local": len(kernels["local"]),
        "kernels_farm": len(kernels["farm"]),
        "kernels_local_not_farm": len(kernels["local"] - kernels["farm"]),
        "configs_compared": len(both),
        "configs_differ": [
            {
                "kernel": configs["local"][k][0],
                "local": " ".join(configs["local"][k][1:]),
                "farm": " ".join(configs["farm"][k][1:]),
            }
            for k in both
            if configs["local"][k][1:] != configs["farm"][k][1:]  # config or launcher
        ],
        "gpu_ms": gpu_ms,
        "launchers": {
            side: collections.Counter(launcher for _, _, launcher in configs[side].values())
            for side in configs
        },
        "gemm_picks": gemm_picks(cache_dir),
        "runtime_calls_farm_local": runtime_calls(steps, xs),
        "host_ms_farm_minus_local": python_profile(steps, xs),
    }


class _LocalApart(torch._TorchCompileInductorWrapper):
    """torch.compile's Inductor backend for the control's second local compile: unequal to the
    first's, which Dynamo would otherwise reuse for it (it shares the code of equal backends)."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__


def main(name: str, pairs: int, mode: str) -> None:
    model, xs, spec = build(name)
    if name.startswith("gpt") and not name.startswith("gpt-small"):
        xs = (xs[0].repeat(2, 2),)  # a step is step(*xs)
    compile_mode = None if mode == "default" else mode
    control = os.environ.get("PARITY_CONTROL", "0") == "1"
    compiled = {
        "farm": torch.compile(model, backend=_LocalApart(compile_mode, None, None))
        if control
        else torch.compile(model, backend="torchfarm", mode=compile_mode),
        "local": torch.compile(model, backend="inductor", mode=compile_mode),
    }
    checked = {k: make_step(fn, model, spec) for k, fn in [("eager", model), *compiled.items()]}
    quiet = os.environ.get("PARITY_QUIET", "1") == "1"
    results = {"eager": checked["eager"](*xs)}
    uncached = inductor_config.patch(force_disable_caches=True, autotune_local_cache=False)
    with uncached if control else contextlib.nullcontext():
        results["farm"] = checked["farm"](*xs)
    waited_s = wait_quiet() if quiet else 0.0  # the pool's builds of the farm's kernels
    results["local"] = checked["local"](*xs)  # the local compile: alone on the GPU, as a user's
    errors = {
        k: max(
            rel_err(a, b)
            for a, b in zip(
                [results[k][0], *results[k][1]], [results["local"][0], *results["local"][1]]
            )
        )
        for k in ("farm", "eager")
    }
    quiet_after_s = waited_s + (wait_quiet() if quiet else 0.0)
    steps = {
        k: make_step(fn, model, spec, keep=False) for k, fn in [("eager", model), *compiled.items()]
    }
    orders = os.environ.get("PARITY_ORDER", "pairs").split(",")
    times, figures = timed_figures(steps, xs, pairs, orders, "cuda")
    from torchfarm.client.backend import history

    code: dict = {}
    try:  # a diagnosis; its failure must not cost the timing
        if os.environ.get("PARITY_CODE", "1") == "1":
            code = code_report(os.environ["TORCHINDUCTOR_CACHE_DIR"], steps, xs)
    except Exception as e:
        code = {"code_report_error": repr(e)}
    print(
        json.dumps(
            {
                "model": name,
                "mode": mode,
                "case": f"{'control: local vs local' if control else 'parity'} (one process)",
                **figures,
                "farm_vs_local_rel_err": errors["farm"],
                **code,
                "eager_vs_local_rel_err": errors["eager"],
                "quiet_after_s": round(quiet_after_s, 1),
                "graphs": [r.source for r in history],
                "quartiles_ms": {
                    k: [round(q, 4) for q in statistics.quantiles(v, n=4)] for k, v in times.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main(
        sys.argv[1],
        int(os.environ.get("PARITY_PAIRS", "300")),
        os.environ.get("PARITY_MODE", "default"),
    )
