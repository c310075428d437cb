"""Tell when Inductor starts and stops benchmarking, for the compile's progress stages.

- Algorithm selection (max-autotune GEMM/conv templates): a logging.Handler on
  torch._inductor.select_algorithm, whose DEBUG lines "Starting autotuning" (logged when
  benchmarking starts) and "Autotuning elapsed time" (after it) mark the start and end. Its level is
  lowered to DEBUG while a compile runs; those records reach torch's own handlers only at
  the level they would have passed anyway.
- Triton kernel configs (GPU, tuned at compile time): CachingAutotuner.benchmark_all_configs
  is wrapped while the compile runs. No log line marks its start (it logs its timings at
  DEBUG only when it is done), so the narrowest route is this one method.
Verified: torch 2.11.0, 2.13.0, 2.15.0 (the messages and the method are the same in all).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

from torch._inductor.runtime.triton_heuristics import CachingAutotuner

from torchfarm.proto import torchfarm_pb2 as pb

_SELECT_ALGORITHM_LOGGER = "torch._inductor.select_algorithm"
_START = "Starting autotuning"
_END = "Autotuning elapsed time"


class _Stages:
    """Calls on_stage(AUTOTUNING) when the outermost benchmarking starts and
    on_stage(COMPILING) when it ends."""

    def __init__(self, on_stage: Callable[[pb.Progress.Stage.ValueType], None]) -> None:
        self.on_stage = on_stage
        self.depth = 0

    def start(self) -> None:
        self.depth += 1
        if self.depth == 1:
            self.on_stage(pb.Progress.AUTOTUNING)

    def end(self) -> None:
        if self.depth == 0:
            return
        self.depth -= 1
        if self.depth == 0:
            self.on_stage(pb.Progress.COMPILING)


class _SelectAlgorithmLog(logging.Handler):
    """Turns algorithm selection's log lines into stages."""

    def __init__(self, stages: _Stages) -> None:
        super().__init__(logging.DEBUG)
        self.stages = stages
        self.started = False

    def emit(self, record: logging.LogRecord) -> None:
        message = str(record.msg)
        if message.startswith(_START) and not self.started:
            self.started = True
            self.stages.start()
        elif message.startswith(_END) and self.started:
            self.started = False
            self.stages.end()


@contextlib.contextmanager
def _select_algorithm_log(stages: _Stages) -> Iterator[None]:
    logger = logging.getLogger(_SELECT_ALGORITHM_LOGGER)
    saved_level, saved_propagate = logger.level, logger.propagate
    handler = _SelectAlgorithmLog(stages)
    forward = _ForwardToParents(logger, logger.getEffectiveLevel())
    logger.addHandler(handler)
    logger.addHandler(forward)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # `forward` passes on what torch's handlers would have shown
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.removeHandler(forward)
        logger.setLevel(saved_level)
        logger.propagate = saved_propagate


class _ForwardToParents(logging.Handler):
    """Hands records at or above the logger's former level to its parents' handlers."""

    def __init__(self, logger: logging.Logger, level: int) -> None:
        super().__init__(level)
        self.parent = logger.parent

    def emit(self, record: logging.LogRecord) -> None:
        if self.parent is not None:
            self.parent.handle(record)


@contextlib.contextmanager
def _triton_benchmarks(stages: _Stages) -> Iterator[None]:
    original = CachingAutotuner.benchmark_all_configs

    def reporting(self, *args, **kwargs):
        stages.start()
        try:
            return original(self, *args, **kwargs)
        finally:
            stages.end()

    setattr(CachingAutotuner, "benchmark_all_configs", reporting)  # noqa: B010
    try:
        yield
    finally:
        setattr(CachingAutotuner, "benchmark_all_configs", original)  # noqa: B010


@contextlib.contextmanager
def reporting(on_stage: Callable[[pb.Progress.Stage.ValueType], None] | None) -> Iterator[None]:
    """Call `on_stage(AUTOTUNING)` / `on_stage(COMPILING)` around Inductor's benchmarking."""
    if on_stage is None:
        yield
        return
    stages = _Stages(on_stage)
    with _select_algorithm_log(stages), _triton_benchmarks(stages):
        yield
