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
import contextlib
import dataclasses
import logging
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from torchfarm.client.pool import Job
from torchfarm.contract import shape_guards
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.torch_adapter.guard_text import symbol_inputs

log = logging.getLogger("torchfarm")

# How long the backend waits for the farm's first word on a graph before running it eagerly:
# a miss says so within a round trip or two (the gateway's first progress event), a hit starts
# its download; a farm that says nothing in this time (unreachable, slow) costs no more.
FIRST_WORD_S = 1.0

# Held by a local compile in the background (TORCHFARM_NOWAIT_FALLBACK=local) while it
# patches torch's process-global state off the training thread; a load on the training thread
# never waits for it: the graph stays eager one more call instead.
_global_state = threading.Lock()

# What a graph switches to: its code and the shape guards under which that code is valid.
Switch = tuple[Callable, pb.ShapeGuards]


@dataclasses.dataclass(frozen=True)
class Pending:
    """A job in the background, and what turns its outcome into the graph's next step (called
    on the calling thread, between two calls, once the job is done)."""

    job: Job
    resolve: Callable[[Job, SwitchingGraph], Next]


# The code to switch to; a job still to wait for (the same: try again at the next call); or
# None: eager for good.
Next = Switch | Pending | None


@contextlib.contextmanager
def holding_global_state() -> Iterator[None]:
    """Around a compile off the training thread: no load runs meanwhile."""
    with _global_state:
        yield


@contextlib.contextmanager
def global_state_or_none() -> Iterator[bool]:
    """Holds torch's global state for a load if it is free; yields whether it is."""
    free = _global_state.acquire(blocking=False)
    try:
        yield free
    finally:
        if free:
            _global_state.release()


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
        if not self._heard.wait(first_word_s):
            return False
        if self.downloading:
            concurrent.futures.wait([job.future])
        return job.future.done() and job.future.exception() is None


class SwitchingGraph:
    """A graph's code in no-wait mode: the eager graph until `pending` resolves to code, then
    that code for every call whose sizes its shape guards cover (other sizes keep running
    eagerly). `eager_calls` counts the calls that ran eagerly."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[object],
        pending: Pending,
        label: str,
    ):
        self._eager = gm.forward
        self.label = label
        symbols = {id(s) for s in symbol_inputs(example_inputs)}
        self._symbols = [i for i, x in enumerate(example_inputs) if id(x) in symbols]
        self.pending: Pending | None = pending
        self._compiled: Callable | None = None
        self._guards = pb.ShapeGuards()
        self._covered: dict[tuple[int, ...], bool] = {}
        self._lock = threading.Lock()
        self.eager_calls = 0

    @property
    def switched(self) -> bool:
        return self._compiled is not None

    def __call__(self, *args: Any) -> Any:
        pending = self.pending
        if pending is not None and pending.job.future.done():
            self._advance(pending)
        if self._compiled is not None and self._covers(args):
            return self._compiled(*args)
        self.eager_calls += 1
        return self._eager(*args)

    def _advance(self, pending: Pending) -> None:
        with self._lock:
            if self.pending is not pending:  # another thread got there first
                return
            outcome = pending.resolve(pending.job, self)
            self.pending = outcome if isinstance(outcome, Pending) else None
            if isinstance(outcome, tuple):
                self._compiled, self._guards = outcome

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
