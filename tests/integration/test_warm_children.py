"""Warm compile children on a real farm: a compile is handed to a child that warmed up
before the request came, and a warm child that is killed is replaced (issue 18)."""

import os
import signal
import time
import urllib.request

import pytest
import torch

import torchfarm
from torchfarm.client import backend
from torchfarm.local_farm import LocalFarm

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def warm_farm():
    # One compile at once and one warm child: the box's two cores stay the other tests'.
    # warm children as many as compiles at once: the default, not what conftest sets for the
    # tier's other farms
    with LocalFarm(
        extra_env={"TORCHFARM_WORKER_CONCURRENCY": "1", "TORCHFARM_WARM_CHILDREN": "-1"}
    ) as farm:
        yield farm


def _metrics(farm) -> str:
    url = f"http://127.0.0.1:{farm.worker_metrics_ports['worker0']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def _value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def _until(condition, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.2)


def _ready_children(farm) -> float:
    return _value(_metrics(farm), "torchfarm_worker_warm_children_ready")


def _compile_children(farm) -> list[int]:
    """Pids of the worker's compile children (each its bwrap process)."""
    worker = farm.procs["worker0"].pid
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if parent == worker and b"torchfarm.workers.compile_child" in cmdline:
            found.append(int(pid))
    return found


def _compile_matches_eager(farm, model: torch.nn.Module, x: torch.Tensor) -> None:
    backend.history.clear()
    compiled = torchfarm.compile(model, addr=farm.addr)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    assert [r.source for r in backend.history] == ["miss"]


def test_a_compile_is_served_by_a_child_warmed_up_before_the_request(warm_farm):
    _until(lambda: _ready_children(warm_farm) == 1)
    before = _metrics(warm_farm)
    _compile_matches_eager(
        warm_farm,
        torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Hardswish()),
        torch.randn(4, 7),
    )
    after = _metrics(warm_farm)
    for series, grew_by in [
        ('torchfarm_worker_children_taken_total{state="ready"}', 1),
        ('torchfarm_worker_children_taken_total{state="warming"}', 0),
        ('torchfarm_worker_children_taken_total{state="started"}', 0),
        ("torchfarm_worker_child_handoff_seconds_count", 1),
    ]:
        assert _value(after, series) - _value(before, series) == grew_by, series
    assert _value(after, 'torchfarm_worker_settings{setting="warm_children"}') == 1
    assert _value(after, 'torchfarm_worker_settings{setting="concurrency"}') == 1


def test_a_killed_warm_child_is_replaced_and_the_next_compile_works(warm_farm):
    _until(lambda: _ready_children(warm_farm) == 1 and len(_compile_children(warm_farm)) == 1)
    (victim,) = _compile_children(warm_farm)
    replaced = 'torchfarm_worker_children_replaced_total{reason="died"}'
    before = _value(_metrics(warm_farm), replaced)
    os.kill(victim, signal.SIGKILL)
    _until(lambda: _value(_metrics(warm_farm), replaced) == before + 1)
    _until(lambda: _ready_children(warm_farm) == 1)
    assert victim not in _compile_children(warm_farm)
    _compile_matches_eager(
        warm_farm, torch.nn.Sequential(torch.nn.Linear(6, 11), torch.nn.SELU()), torch.randn(2, 6)
    )
