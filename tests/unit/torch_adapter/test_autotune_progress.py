"""Autotuning stages from Inductor's own log lines (algorithm selection) and from the one
wrapped method (Triton configs); torch's handlers see only what they saw before."""

import logging

from torch._inductor.runtime.triton_heuristics import CachingAutotuner

from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.torch_adapter.compile import autotune_progress

LOGGER = logging.getLogger("torch._inductor.select_algorithm")


def test_algorithm_selection_log_lines_mark_the_stages():
    stages = []
    with autotune_progress.reporting(stages.append):
        LOGGER.debug("Autotuning elapsed time: %.02fs", 0.1)  # all timings cached: no stage
        LOGGER.debug("Starting autotuning")
        LOGGER.debug("Starting autotuning")
        LOGGER.debug("Autotuning elapsed time: %.02fs", 1.5)
    LOGGER.debug("Starting autotuning")  # after the compile: not heard
    assert stages == [pb.Progress.AUTOTUNING, pb.Progress.COMPILING]


def test_torch_handlers_see_what_they_saw_before(caplog):
    stages = []
    caplog.set_level(logging.INFO, logger="torch._inductor.select_algorithm")
    level, propagate = LOGGER.level, LOGGER.propagate
    with autotune_progress.reporting(stages.append):
        assert LOGGER.level == logging.DEBUG
        LOGGER.debug("Starting autotuning")
        LOGGER.info("Filtered to %d choices based on best_config", 3)
    assert (LOGGER.level, LOGGER.propagate) == (level, propagate)
    assert [r.getMessage() for r in caplog.records] == [
        "Filtered to 3 choices based on best_config"
    ]
    assert stages == [pb.Progress.AUTOTUNING]


def test_triton_benchmarks_mark_the_stages_and_the_method_is_restored():
    original = CachingAutotuner.benchmark_all_configs
    stages = []
    with autotune_progress.reporting(stages.append):
        assert CachingAutotuner.benchmark_all_configs is not original
        try:
            CachingAutotuner.benchmark_all_configs(object())
        except Exception:
            pass  # not a real autotuner: the stages are still reported around the call
    assert CachingAutotuner.benchmark_all_configs is original
    assert stages == [pb.Progress.AUTOTUNING, pb.Progress.COMPILING]


def test_nothing_is_touched_without_a_listener():
    original = CachingAutotuner.benchmark_all_configs
    handlers, level = list(LOGGER.handlers), LOGGER.level
    with autotune_progress.reporting(None):
        assert CachingAutotuner.benchmark_all_configs is original
        assert (LOGGER.handlers, LOGGER.level) == (handlers, level)
