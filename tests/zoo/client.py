"""One fresh process of the zoo: a model's training and inference loops, eager and compiled
three ways, every step compared with eager. Prints one JSON line.

    client.py NAME INDUCTOR_CACHE

The variants, each on its own copy of the model (same seed, so the same weights), one after
another with Dynamo reset between them (torch._dynamo.reset: "as if you had started a fresh
process"), after the eager reference:
  inductor  torch.compile(model, backend="inductor"), its local cache in INDUCTOR_CACHE
            (shared by the zoo's processes: the reference is not what is measured)
  native    torch.compile(model, backend="torchfarm")
  skip      torchfarm.compile(model)
Both farm variants run with the tenant's token and TORCHFARM_SKIP_TRACING=1: the first process
traces and saves Dynamo's package (one per entry point), the second restores it.
The farm variants keep the process's own empty local cache (TORCHINDUCTOR_CACHE_DIR).

Per variant: the exception that stopped it (if any), steps whose loss, output or gradients
left eager's tolerance, Dynamo's graphs (counters["stats"]["unique_graphs"]: every frame
traced, restored ones excluded; `first_step_graphs`: those of the first training step) and
recompiles (guard failures that made Dynamo compile a frame
again), the steady training step (median of steps 5-12), the farm's graph sources, what
became of the package, and the time spent in torchfarm's identity-check guard
(dynamo_package.LateChecks.__call__, timed from outside).

Steady steps are timed in wall time and in the thread's CPU time (time.thread_time: one
intra-op thread, so the forward and the CPU backward run on this thread; the time other
processes hold the core is left out). With ZOO_STEADY_ROUNDS=N (the runner's bench; the pytest
tier leaves it unset and costs what it did) each variant's loop runs N more timed training
steps, inductor's loop runs again after the farm's variants (`inductor_again`: the two bracket
them), and each farm variant runs N rounds of alternating steps beside a fresh copy of the
model under inductor (`alternating`; its modules get classes of their own so that in a restoring
process it does not run the restored precompile entries, which torch checks first for any
backend; `valid` is False where it traced nothing, and the figures then time one code twice).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from tests.zoo import models  # noqa: E402

TRAIN_STEPS = 12
STEADY = slice(4, 12)  # steps 5-12
# The runner's bench (ZOO_STEADY_ROUNDS; the pytest tier's 0 keeps its time): as many more
# training steps in each variant's loop, timed only, inductor's loop again after the farm's,
# and as many rounds of the alternating measurement (alternate_with_inductor)
ROUNDS = int(os.environ.get("ZOO_STEADY_ROUNDS", "0"))
WARM_ROUNDS = 4  # the alternating phase's first rounds, not kept: inductor's copy compiles there
INFER_STEPS = 3
LR = 1e-2
TOLERANCE = 1e-3  # relative (norm) error against eager: loss, output and every gradient
# below this norm a tensor's error is measured against it instead: a gradient that is zero in
# exact arithmetic (an attention key's bias: softmax ignores a shift) is rounding noise in
# both eager and compiled code, ~1e-9, and its relative error means nothing
NORM_FLOOR = 1e-4
VARIANTS = ("inductor", "native", "skip")


def rel_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.detach().double(), expected.detach().double()
    if got.shape != expected.shape:
        return float("inf")
    return ((got - expected).norm() / expected.norm().clamp_min(NORM_FLOOR)).item()


class GuardTimer:
    """Time in the guard code torchfarm adds to Dynamo's (dynamo_package.LateChecks: the
    identity of a later frame's locals, checked when the frame runs; every other identity
    guard is Dynamo's own, built at install), wrapped from outside (Dynamo calls the instance,
    so the class's __call__ is looked up on every call)."""

    def __init__(self) -> None:
        self.calls, self.ns, self.first_ns = 0, 0, 0
        try:
            from torchfarm.torch_adapter.trace.dynamo_package import LateChecks

            original = LateChecks.__call__
        except (ImportError, AttributeError):  # the design moved on: nothing to time
            self.available = False
            return
        self.available = True
        timer = self

        def timed(guard, *args, **kwargs):
            started = time.perf_counter_ns()
            try:
                return original(guard, *args, **kwargs)
            finally:  # the first call fingerprints each object; the others compare them
                if timer.calls:
                    timer.ns += time.perf_counter_ns() - started
                else:
                    timer.first_ns = time.perf_counter_ns() - started
                timer.calls += 1

        LateChecks.__call__ = timed  # type: ignore[method-assign]

    def take(self) -> dict:
        """µs per call after the first (the steady cost), and the first call's."""
        per_call = round(self.ns / (self.calls - 1) / 1e3, 2) if self.calls > 1 else None
        first = round(self.first_ns / 1e3, 1) if self.calls else None
        row = {"calls": self.calls, "us_per_call": per_call, "first_us": first}
        self.calls, self.ns, self.first_ns = 0, 0, 0
        return row


class PackageLog(logging.Handler):
    """torchfarm's log lines about Dynamo's package (restored, saved, not restored...)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        logger = logging.getLogger("torchfarm")
        logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "package" in message or "identity" in message:
            self.lines.append(message[:300])

    def take(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines


class TooManyGraphs(Exception):
    """More graphs or recompiles than inductor's whole loop had: the row has failed, and more
    steps of a recompiling loop (a second each) would only spend the CI machine's time."""


def _error(tensors: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    errs = [rel_err(g, e) for g, e in zip(tensors, expected)]
    return max([*errs, 0.0 if len(tensors) == len(expected) else float("inf")])


def train_step(built: models.Built, fn, optimizer, step: int) -> tuple:
    """One training step (forward, loss, backward, SGD step) on the batch of `step`: its loss,
    output and gradients, and its wall and thread CPU milliseconds. With one intra-op thread
    (main) the forward and the CPU backward run on this thread: its CPU time leaves out the
    time other processes hold the core (not their effect on the core's caches)."""
    args, kwargs = built.batch(step, True)
    started, started_cpu = time.perf_counter(), time.thread_time()
    optimizer.zero_grad(set_to_none=True)
    loss, out = built.loss(fn(*args, **kwargs))
    loss.backward()
    grads = [p.grad.clone() for p in built.model.parameters() if p.grad is not None]
    optimizer.step()
    cpu_ms = (time.thread_time() - started_cpu) * 1e3
    return loss, out, grads, (time.perf_counter() - started) * 1e3, cpu_ms


def run_loops(built: models.Built, fn, references: list[dict], limits: dict | None = None) -> dict:
    """Train TRAIN_STEPS steps (forward, loss, backward, SGD step), then INFER_STEPS steps
    of inference, each step against `references` (records: eager's, then inductor's). A step
    is wrong when it is off eager and off inductor's same step: a CNN whose training
    amplifies rounding (BatchNorm on small batches, ReLU and max-pool ties) leaves eager
    within 12 steps under inductor too, and the farm promises inductor's numbers. Stops
    (TooManyGraphs) once Dynamo's graphs or recompiles pass `limits` (inductor's counts)."""
    model = built.model
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    record: dict = {"train": [], "infer": []}
    errors: list[float] = []
    wrong: list[str] = []
    step_ms: list[float] = []
    cpu_ms: list[float] = []

    def check(phase: str, step: int, tensors: list[torch.Tensor]) -> None:
        record[phase].append(tensors)
        if not references:
            return
        errs = [_error(tensors, r[phase][step]) for r in references]
        errors.append(errs[0])
        if min(errs) > TOLERANCE:
            wrong.append(f"{phase} step {step + 1}: error {errs[0]:.2e}")
        counts = dynamo_counts()
        for count, limit in (limits or {}).items():
            if counts[count] > limit:
                raise TooManyGraphs(f"{counts[count]} {count} after {phase} step {step + 1}")

    model.train()
    for step in range(TRAIN_STEPS):
        loss, out, grads, wall, cpu = train_step(built, fn, optimizer, step)
        step_ms.append(wall)
        cpu_ms.append(cpu)
        check("train", step, [loss.detach().clone(), out.detach().clone(), *grads])
        if step == 0:  # the skip hit: a restored package traces nothing here
            first_step_graphs = dynamo_counts()["graphs"]
    for step in range(TRAIN_STEPS, TRAIN_STEPS + ROUNDS):  # timed only: no reference
        *_, wall, cpu = train_step(built, fn, optimizer, step % TRAIN_STEPS)
        step_ms.append(wall)
        cpu_ms.append(cpu)
    model.eval()
    infer_ms = []
    with torch.no_grad():
        for step in range(INFER_STEPS):
            args, kwargs = built.batch(100 + step, False)
            started = time.perf_counter()
            _, out = built.loss(fn(*args, **kwargs))
            infer_ms.append((time.perf_counter() - started) * 1e3)
            check("infer", step, [out.clone()])
    return {
        "record": record,
        "max_err": max(errors, default=0.0),
        "wrong": wrong,
        "steady_ms": round(statistics.median(step_ms[STEADY]), 3),
        # the thread's CPU time, median of steps 5-12 and the ROUNDS timed ones
        "steady_cpu_ms": round(statistics.median(cpu_ms[STEADY.start :]), 3),
        "first_step_s": round(step_ms[0] / 1e3, 2),
        "first_step_graphs": first_step_graphs,
        "infer_ms": round(statistics.median(infer_ms[1:]), 3),
    }


def alternate_with_inductor(name: str, built: models.Built, fn, inductor_cache: str) -> dict:
    """The steady step of a farm variant's code beside inductor's, in one window: a fresh copy
    of the model under torch.compile(backend="inductor") (no Dynamo reset: the farm's frames
    stay installed, restored or traced; inductor's copy compiles from the run's local cache)
    and ROUNDS rounds of one training step of each, in ABBA order, so that the box's load
    and the process's drift fall on both. Medians of the kept rounds' wall and thread CPU ms.
    `valid` is False where inductor's copy ran no frame of its own (it would time the farm's
    code twice)."""
    from torch._dynamo.utils import counters

    other = models.build(name)
    _own_classes(other.model)
    sides = [(built, fn), (other, torch.compile(other.model, backend="inductor"))]
    optimizers = [torch.optim.SGD(b.model.parameters(), lr=LR) for b, _ in sides]
    times: list[list[tuple[float, float]]] = [[], []]
    graphs = counters["stats"]["unique_graphs"]
    private = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache
    try:
        for b, _ in sides:
            b.model.train()
        for round_ in range(WARM_ROUNDS + ROUNDS):
            for i in (0, 1) if round_ % 2 == 0 else (1, 0):
                *_, wall, cpu = train_step(*sides[i], optimizers[i], round_ % TRAIN_STEPS)
                times[i].append((wall, cpu))
    finally:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = private
    farm, inductor = (t[WARM_ROUNDS:] for t in times)
    if os.environ.get("ZOO_PROFILE"):  # a folder: where each side's operators went
        for side, optimizer, label in zip(sides, optimizers, ("farm", "inductor")):
            _profile(*side, optimizer, os.path.join(os.environ["ZOO_PROFILE"], label))

    def median(times: list, i: int) -> float:
        return round(statistics.median(t[i] for t in times), 3)

    return {
        "valid": counters["stats"]["unique_graphs"] > graphs,
        "inductor_graphs": counters["stats"]["unique_graphs"] - graphs,
        "rounds": ROUNDS,
        "farm_ms": median(farm, 0),
        "inductor_ms": median(inductor, 0),
        "farm_cpu_ms": median(farm, 1),
        "inductor_cpu_ms": median(inductor, 1),
    }


def _own_classes(model: torch.nn.Module) -> None:
    """Gives each module of `model` a subclass of its class, with nothing of its own: the
    same code, but a type that no guard of the farm's frames accepts (Dynamo guards a
    module's type), so that in a restoring process inductor's copy traces its own frames
    instead of running the restored precompile entries, which torch checks first, for any
    backend."""
    made: dict[type, type] = {}
    for module in model.modules():
        cls = type(module)
        if cls not in made:
            made[cls] = type(cls.__name__, (cls,), {"__module__": cls.__module__})
        module.__class__ = made[cls]


def _profile(built: models.Built, fn, optimizer, prefix: str) -> None:
    """torch.profiler's table of 12 training steps (self CPU time by operator and by Python
    function), written to `prefix`-<pid>.txt."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for step in range(TRAIN_STEPS):
            train_step(built, fn, optimizer, step)
    averages = prof.key_averages()
    with open(f"{prefix}-{os.getpid()}.txt", "w") as f:
        f.write(
            averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=90)
        )
        f.write(
            prof.key_averages(group_by_stack_n=6).table(
                sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=90
            )
        )


def compiled(variant: str, model: torch.nn.Module):
    if variant == "inductor":
        return torch.compile(model, backend="inductor")
    if variant == "native":
        return torch.compile(model, backend="torchfarm")
    import torchfarm

    return torchfarm.compile(model)


def dynamo_counts() -> dict:
    from torch._dynamo.utils import counters, guard_failures

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "recompiles": sum(len(reasons) for reasons in guard_failures.values()),
        "recompile_reasons": [r[:200] for rs in guard_failures.values() for r in rs][:3],
    }


def run_variant(
    name: str,
    variant: str,
    references: list[dict],
    timers: tuple,
    inductor_cache: str,
    limits: dict | None = None,
) -> dict:
    from torch._dynamo.utils import counters

    from torchfarm.client.backend import history

    torch._dynamo.reset()
    counters.clear()
    history.clear()
    private_cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    if variant == "inductor":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache
    built = models.build(name)
    row: dict = {"exception": "", "stopped": ""}
    counts = None
    try:
        fn = compiled(variant, built.model)
        result = run_loops(built, fn, references, limits)
        row.update({k: v for k, v in result.items() if k != "record"})
        row["record"] = result["record"]
        counts = dynamo_counts()  # before the alternating phase: its inductor copy traces
        if ROUNDS and variant != "inductor":
            row["alternating"] = alternate_with_inductor(name, built, fn, inductor_cache)
    except TooManyGraphs as e:
        row["stopped"] = str(e)
    except Exception as e:
        row["exception"] = f"{type(e).__name__}: {str(e)[:500]}"
        row["traceback"] = traceback.format_exc()[-2000:]
    finally:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = private_cache
    row.update(counts or dynamo_counts())
    row["sources"] = sorted({r.source for r in history})
    row["not_farm"] = [f"{r.label}: {r.source}: {r.why[-300:]}" for r in history if r.why]
    guard, log = timers
    row["identity_guard"] = guard.take()
    row["package_log"] = log.take()
    return row


def main(name: str, inductor_cache: str) -> dict:
    why = models.unavailable(name)
    result: dict = {"model": name, "torch": torch.__version__, "unavailable": why}
    if why:
        return result
    torch.set_num_threads(1)  # the CI box's two cores hold the farm too; steady ratios
    timers = GuardTimer(), PackageLog()
    built = models.build(name)
    eager = run_loops(built, built.model, [])
    result["eager_ms"] = eager["steady_ms"]
    result["guard_timed"] = timers[0].available
    inductor = run_variant(name, "inductor", [eager["record"]], timers, inductor_cache)
    # inductor's record where its loop ran whole: a farm step must match eager or it
    references = [eager["record"], *([inductor.pop("record")] if "record" in inductor else [])]
    result["variants"] = {"inductor": inductor}
    limits = {count: inductor[count] for count in ("graphs", "recompiles")}
    for variant in VARIANTS[1:]:
        row = run_variant(name, variant, references, timers, inductor_cache, limits)
        row.pop("record", None)
        result["variants"][variant] = row
    if ROUNDS:  # inductor again, after the farm's variants: its two runs bracket theirs
        again = run_variant(name, "inductor", references, timers, inductor_cache)
        again.pop("record", None)
        result["variants"]["inductor_again"] = again
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
