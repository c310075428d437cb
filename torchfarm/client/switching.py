"""No-wait mode (TORCHFARM_WAIT=0, issue 20): a graph the farm has to compile runs eagerly
meanwhile, and switches to the compiled code between two calls once it has arrived.

Why between calls is enough: a step's backward is built by whatever ran its forward (the eager
ops' autograd graph, or the artifact's AOTAutograd Function), so a switch between calls never
mixes the two within one step.

Why the artifact is loaded on the calling thread, at the first call after its bytes arrived,
and not on the fetching thread: a load patches process-global torch state while it runs
(Inductor's config, CppCodeCache.load_async, FxGraphCache's and AOTAutograd's post-compile
hooks: compiler/inductor.py), which a Dynamo or Inductor compile on the training thread would
see in that window; and CUDA graph trees (reduce-overhead) belong to the thread that runs the
code, which also records them only once switched. That one call pays the load (no compiler
runs on a load: the farm ships the objects).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torchfarm.client import records
from torchfarm.client.fetch import Fetched
from torchfarm.client.graph import FarmGraph
from torchfarm.client.pool import Job
from torchfarm.contract import shape_guards
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.torch_adapter.load import load_prewarm
from torchfarm.torch_adapter.trace.guard_text import symbol_inputs

log = logging.getLogger("torchfarm")

# How long the backend waits for the farm's first word on a graph before running it eagerly:
# a miss says so within a round trip or two (the gateway's first progress event), a hit starts
# its download; a farm that says nothing in this time (unreachable, slow) costs no more.
FIRST_WORD_S = 1.0
# A fetch that no pool thread has taken after this long waits behind other graphs' compiles.
QUEUED_S = 0.25

# What a graph switches to: its code and the shape guards under which that code is valid.
Switch = tuple[Callable, pb.ShapeGuards]


class FarmAnswer:
    """The farm's first word on a graph, heard on the fetching thread: an artifact is coming
    (the header arrived: DOWNLOADING), the farm compiles (any other stage), or the fetch
    ended. With Get (issue 19) `missing` counts as "compiling": report it as a Progress."""

    def __init__(self) -> None:
        self._heard = threading.Event()
        self.downloading = False

    def heard(self, progress: pb.Progress) -> None:
        if not self._heard.is_set():
            self.downloading = progress.stage == pb.Progress.DOWNLOADING
            self._heard.set()

    def serves(self, job: Job, first_word_s: float = FIRST_WORD_S) -> bool:
        """Whether `job` brought (or is bringing: then this waits for it) an artifact: a hit,
        served as in wait mode. False: the farm compiles, failed, or said nothing in time."""
        job.future.add_done_callback(lambda _: self._heard.set())
        queued_s = min(QUEUED_S, first_word_s)
        if not self._heard.wait(queued_s) and not job.future.running():
            return False  # every pool thread is busy with other graphs: no word will come soon
        if not self._heard.wait(first_word_s - queued_s):
            return False
        if self.downloading:
            concurrent.futures.wait([job.future])
        return job.future.done() and job.future.exception() is None


@dataclasses.dataclass(frozen=True)
class Pending:
    """The code a graph waits for: the farm's fetch (`job`), and `resolve`, which turns the
    finished job into code to switch to (None: the farm failed, the graph stays eager)."""

    job: Job
    resolve: Callable[[Job, SwitchingGraph], Switch | None]


class SwitchingGraph:
    """A graph's code in no-wait mode: the eager graph until the pending job is done and its
    `resolve` (called then, on the calling thread, between two calls) gives code to switch to;
    then that code for every call whose sizes its shape guards cover, other sizes running
    eagerly. If `resolve` gives None the graph stays eager. `eager_calls` counts the calls
    that ran eagerly. `after_first_call` runs at the start of the second call: work for the
    switch that must not slow the first step (the load's prewarm)."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[object],
        pending: Pending,
        label: str,
        after_first_call: Callable[[], object] | None = None,
    ):
        self._eager = gm.forward
        self.label = label
        symbols = {id(s) for s in symbol_inputs(example_inputs)}
        self._symbols = [i for i, x in enumerate(example_inputs) if id(x) in symbols]
        self._pending: Pending | None = pending
        self._compiled: Callable | None = None
        self._guards = pb.ShapeGuards()
        self._covered: dict[tuple[int, ...], bool] = {}
        self._lock = threading.Lock()
        self.eager_calls = 0
        self._after_first_call = after_first_call
        self._called = False

    def __call__(self, *args: Any) -> Any:
        if self._after_first_call is not None and self._called:
            after, self._after_first_call = self._after_first_call, None
            after()
        self._called = True
        pending = self._pending
        if pending is not None and pending.job.future.done():
            with self._lock:
                if self._pending is pending:  # not taken by another thread meanwhile
                    self._pending = None
                    switch = pending.resolve(pending.job, self)
                    if switch is not None:
                        self._compiled, self._guards = switch
        if self._compiled is not None and self._covers(args):
            return self._compiled(*args)
        self.eager_calls += 1
        return self._eager(*args)

    def _covers(self, args: Sequence[Any]) -> bool:
        """Whether the switched-to code's shape guards hold for these sizes (memoized)."""
        sizes = tuple(int(args[i]) for i in self._symbols)
        if sizes not in self._covered:
            try:
                self._covered[sizes] = shape_guards.evaluate(self._guards, list(sizes))
            except ValueError:  # malformed guards hold nowhere
                self._covered[sizes] = False
            if not self._covered[sizes]:
                log.info("%s: sizes %s not covered by its compiled code: eager", self.label, sizes)
        return self._covered[sizes]


def announce(text: str, enabled: bool) -> None:
    """One line on stderr (a TTY only, as the progress line) for a graph's switch."""
    if enabled and sys.stderr.isatty():
        sys.stderr.write(f"\r\033[K[torchfarm] {text}\n")
        sys.stderr.flush()


def eager_while_compiling(graph: FarmGraph, job: Job[Fetched]) -> SwitchingGraph:
    """The graph runs eagerly until `job` (the farm's fetch) brings its code; on a farm
    failure it stays eager (no local compile: docs/architecture.md, "Never wait")."""
    started = records.stamped(graph.label, graph.started, "eager-while-compiling")
    records.history.append(dataclasses.replace(started, seconds=0.0))
    log.info("%s: running eagerly while the farm compiles it", graph.label)
    return SwitchingGraph(
        graph.gm,
        graph.inputs,
        Pending(job, functools.partial(_farm_code, graph)),
        graph.label,
        after_first_call=load_prewarm.resume,
    )


def _farm_code(graph: FarmGraph, job: Job[Fetched], switching: SwitchingGraph) -> Switch | None:
    """The graph's fetch is done: its loaded artifact to switch to; or, on a failure, None:
    the graph stays eager (one warning)."""
    try:
        fetched = job.result()
        compiled = graph.load(fetched)
    except Exception as e:  # the farm must never break training, nor make it wait
        why = graph.farm_failed(e, instead="running eagerly")
        stays = records.stamped(graph.label, graph.started, "eager", why)
        records.history.append(dataclasses.replace(stays, eager_calls=switching.eager_calls))
        log.info("%s: eager (%s)", graph.label, why)
        return None
    served = records.served(graph.label, graph.started, fetched)
    records.add_served(
        dataclasses.replace(served, eager_calls=switching.eager_calls, switched=time.monotonic())
    )
    announce(
        f"{graph.label}: switched to the farm's code after {switching.eager_calls} eager calls",
        graph.settings.progress,
    )
    return compiled, fetched.artifact.guards
