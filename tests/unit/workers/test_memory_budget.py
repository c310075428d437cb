"""The compile children's default memory caps add up to the host's memory (issue 27, finding
5: before, each child's cap was 75% of RAM while two compiles ran, and the RAM-backed work
dir and /dev/shm were not counted)."""

import pytest

from torchfarm.settings import WorkerSettings
from torchfarm.settings.sizing import (
    COMPILE_SHM_MB,
    MIN_COMPILE_MEMORY_MB,
    WARM_CHILD_MB,
    host_memory_mb,
)


@pytest.mark.parametrize("helper", ["0", "1"])
@pytest.mark.parametrize("concurrency,warm", [(None, None), (1, 0), (2, 2), (3, 1)])
def test_the_default_caps_of_every_child_that_can_run_at_once_fit_the_host(
    concurrency, warm, helper
):
    """With a backward helper (TORCHFARM_CONCURRENT_BACKWARD=1) a compile and a warm child
    are two processes each, both under the cap."""
    processes = int(helper) + 1
    if concurrency and host_memory_mb() < 2048 * processes * concurrency + 8192:
        pytest.skip("a host too small for this many compiles (the settings refuse it)")
    settings = WorkerSettings(
        concurrency=concurrency or 0,
        warm_children=-1 if warm is None else warm,
        concurrent_backward=helper,
    )
    running = settings.concurrency * (
        processes * settings.memory_limit_mb + settings.compile_disk_mb + COMPILE_SHM_MB
    )
    waiting = processes * settings.warm_children * WARM_CHILD_MB
    assert 0 < running + waiting <= host_memory_mb() - 1024
    assert settings.memory_limit_mb >= MIN_COMPILE_MEMORY_MB


def test_a_host_too_small_for_its_concurrency_is_refused_with_what_to_set():
    with pytest.raises(ValueError, match="TORCHFARM_WORKER_CONCURRENCY"):
        WorkerSettings(concurrency=host_memory_mb() // 1024)
    explicit = WorkerSettings(
        concurrency=host_memory_mb() // 1024, memory_limit_mb=512, compile_disk_mb=64
    )
    assert explicit.memory_limit_mb == 512  # the operator's own arithmetic
