"""The backward helper takes the child's pad_mm decisions (whether padding a matmul's operands
makes it faster, which Inductor benchmarks): it waits for the one the child leaves in the
cache dir they share, and benchmarks itself only where none comes
(torch_adapter/compile/concurrent_backward.py)."""

import threading

from torch._inductor.fx_passes import pad_mm
from torch._inductor.utils import fresh_cache

from torchfarm.torch_adapter.compile import concurrent_backward


def test_the_helper_waits_for_the_childs_decision_and_goes_on_without_one():
    with fresh_cache(), concurrent_backward._childs_pad_decisions(wait_s=0.3):
        child = threading.Timer(0.05, pad_mm.set_cached_should_pad, ("bmm-key", True))
        child.start()  # the child's benchmark decided, a moment later
        assert pad_mm.get_cached_should_pad("bmm-key") is True
        child.join()
        assert pad_mm.get_cached_should_pad("never-decided") is None  # the helper benchmarks
