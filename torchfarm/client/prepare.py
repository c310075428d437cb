"""`torchfarm prepare`: compile a job's graphs on the farm before the job's hardware exists.

The user's entry point (a function that builds the model and runs its first step, as the job
does) runs on fake tensors: nothing is computed and no device is needed, while Dynamo traces
the same graphs that the job will trace on its target. Each graph goes to the farm for the
target's pool (a target file written by `torchfarm target` on a machine of the job's kind, or
this machine's own), which compiles it, or already holds it; nothing is loaded here, and the
graph's code runs on the fake tensors so that the step goes on to its next graph. The job's
first process is then a farm hit for every graph (the keys are the same: same payload bytes,
target and options).

A torch without the target's runtime (a CPU-only build, or a CUDA build on a machine with no
GPU) still makes fake CUDA tensors; what it cannot do with them is patched for the run
(torch_adapter/trace/fake_device.py). The payload must come from the job's own torch build, so a
CUDA job is prepared with its CUDA build, which runs on a machine without a GPU (a CPU-only
build also aborts in autograd on fake CUDA tensors: it has no CUDA device guard). A step
that stops (a device query, a value read from a fake tensor) is reported in one line; the
graphs before it stay prepared.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import time
import traceback
from collections.abc import Callable, Iterator

import torch

from torchfarm.client import records
from torchfarm.client.fetch import Fetched
from torchfarm.client.graph import FarmGraph
from torchfarm.client.pool import Job
from torchfarm.compiler.target import torch_build
from torchfarm.errors import FarmError
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import env
from torchfarm.torch_adapter.trace.deferrable import deferrable
from torchfarm.torch_adapter.trace.fake_device import as_traced_for_real, fake_device
from torchfarm.torch_adapter.trace.fake_ranks import fake_ranks
from torchfarm.torch_adapter.trace.fake_tensors import FakeTensorMode

log = logging.getLogger("torchfarm")
# The target graphs are prepared for while `preparing` runs (client/backend.py asks).
_target: contextvars.ContextVar[pb.Target | None] = contextvars.ContextVar(
    "torchfarm_prepare_target", default=None
)
# A preparation's static graphs, fetched in the background (as DeferredGraph's); `run` records
# them.
_prepared: list[tuple[FarmGraph, Job[Fetched]]] = []


def target() -> pb.Target | None:
    """The target of the preparation under way in this context, or None (a normal run)."""
    return _target.get()


@dataclasses.dataclass
class Summary:
    """What a preparation did: one row per graph (label, source, seconds), and why a step
    stopped early, if it did."""

    rows: list[tuple[str, str, float]]
    stopped: str
    seconds: float

    def count(self, *sources: str) -> int:
        return sum(1 for _, source, _ in self.rows if source in sources)

    def table(self) -> str:
        lines = [f"{'graph':<12} {'farm':<8} {'seconds':>8}"]
        lines += [f"{label:<12} {source:<8} {secs:>8.2f}" for label, source, secs in self.rows]
        lines.append(
            f"{len(self.rows)} graphs: {self.count('hit')} hits, "
            f"{self.count('miss', 'merged')} compiled, {self.count('failed')} failed, "
            f"{self.seconds:.1f} s"
        )
        if self.stopped:
            lines.append(f"stopped early: {self.stopped}")
        return "\n".join(lines)


def run(entry: Callable[[], object], target: pb.Target, world_size: int = 1) -> Summary:
    """Run `entry` on fake tensors with every graph it compiles through the torchfarm backend
    prepared on the farm for `target`; for a data-parallel job of `world_size` ranks, as its
    rank 0 in a process group that communicates nothing (torch_adapter/trace/fake_ranks.py)."""
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, not {world_size}")
    if target.torch_version != torch_build():
        raise ValueError(
            f"prepare with the job's torch build: the target runs {target.torch_version}, "
            f"this is {torch_build()} (a CUDA build prepares on a machine without a GPU)"
        )
    started = time.monotonic()
    first = len(records.history)
    stopped = ""
    with fake_ranks(world_size), preparing(target):
        try:
            entry()
        except Exception as e:  # the graphs before it stay prepared
            stopped = _where(e)
        _finish()
    torch.compiler.reset()  # the frames traced on fake tensors must not serve real calls
    rows = [(r.label, _source(r.source), r.seconds) for r in records.history[first:]]
    return Summary(rows, stopped, time.monotonic() - started)


@contextlib.contextmanager
def preparing(target: pb.Target) -> Iterator[None]:
    """Fake tensors, the device patches, no Dynamo packages (they would hold guards on fake
    tensors), and the backend preparing for `target`. No default device: Dynamo traces
    through `torch.device(...)`'s function mode, which changes the graphs (`x + y` became
    `x.add(y)`), so the entry point names its devices as the job does."""
    token = _target.set(target)
    try:
        with (
            env.override(SKIP_TRACING=False),
            FakeTensorMode(allow_non_fake_inputs=True),
            fake_device(target.cuda_capability),
        ):
            yield
    finally:
        _target.reset(token)


def prepare_graph(graph: FarmGraph, target: pb.Target) -> Callable:
    """The backend's route while preparing: the farm compiles the graph for `target` (or holds
    it already); nothing is loaded, and the graph runs on the fake tensors it was traced on.
    Its shape guards are installed as in a real run, so the graphs after it are traced from
    the same ShapeEnv. A static graph is fetched in the background (DDP's buckets compile at
    once); a failure is recorded, never compiled here."""
    as_traced_for_real(graph.gm)
    question = graph.ask(_target_for(target, graph.device))
    if deferrable(graph.gm):
        _prepared.append((graph, graph.submit(question)))
        return graph.gm.forward
    try:
        fetched = graph.fetch(question)
        graph.install_guards(fetched)
        graph.record_served(fetched)
    except Exception as e:
        _unprepared(graph, e)
    return graph.gm.forward


def _finish() -> None:
    """Wait for the preparation's background fetches and record each."""
    while _prepared:
        graph, job = _prepared.pop(0)
        try:
            graph.record_served(job.result(), deferred=True)
        except Exception as e:
            _unprepared(graph, e)


def _unprepared(graph: FarmGraph, e: Exception) -> None:
    why = f"farm: {type(e).__name__}: {e}"
    records.history.append(records.stamped(graph.label, graph.started, "failed", why))
    log.warning("%s: not prepared (%s)", graph.label, why)


def _target_for(target: pb.Target, device: str) -> pb.Target:
    """The prepared job's target for a graph on `device`: a CPU graph of a CUDA job runs on
    that machine's CPU, which the target describes too (compiler/target.py)."""
    kind = torch.device(device).type
    if kind == target.device:
        return target
    if kind != "cpu":
        raise FarmError(f"a {kind} graph in a job prepared for {target.device}")
    cpu = pb.Target()
    cpu.CopyFrom(target)
    cpu.device = "cpu"
    cpu.ClearField("cuda_capability")
    cpu.ClearField("cuda_version")
    cpu.ClearField("triton_version")
    return cpu


def _source(source: str) -> str:
    return {"local": "failed", "eager": "failed", "split": "failed"}.get(source, source)


def _where(e: Exception) -> str:
    """One line: the error, and the innermost frame of the user's code it came from."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "site-packages" not in f.filename]
    place = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    message = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {message}{place}"
