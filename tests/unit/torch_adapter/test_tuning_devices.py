"""The seam that spreads one compile's max-autotune benchmarking over the worker's GPUs
(torch_adapter/compile/tuning_devices.py), against the installed torch's own TuningProcessPool: with
two GPUs the pool's devices are the worker's and the benchmarks run in subprocesses; with one
(K = 1, the CPU machine's case) nothing changes; either way all is restored afterwards."""

import inspect

from torch._inductor import autotune_process
from torch._inductor import config as inductor_config

from torchfarm.torch_adapter.compile import tuning_devices


def _state():
    pool = autotune_process.TuningProcessPool
    return (
        inductor_config.autotune_in_subproc,
        inductor_config.autotune_multi_device,
        inspect.getattr_static(pool, "get_device_list"),  # its own, or (2.15) its base's
        "get_device_list" in pool.__dict__,
    )


def test_two_gpus_give_the_tuning_pool_the_workers_gpus_in_subprocesses():
    before = _state()
    with tuning_devices.spread_over(("2", "5")):
        assert inductor_config.autotune_in_subproc and inductor_config.autotune_multi_device
        # what TuningProcessPool() starts one TuningProcess per device from
        assert autotune_process.TuningProcessPool.get_device_list() == [2, 5]
    assert _state() == before


def test_gpus_named_by_uuid_pass_as_they_are():
    assert tuning_devices.devices_of(("GPU-1a", "0")) == ["GPU-1a", 0]


def test_one_gpu_changes_nothing():
    before = _state()
    for gpus in ((), ("0",)):
        with tuning_devices.spread_over(gpus):
            assert _state() == before
    assert _state() == before


def test_left_on_an_error_everything_is_restored():
    before = _state()
    try:
        with tuning_devices.spread_over(("0", "1")):
            raise RuntimeError("the compile failed")
    except RuntimeError:
        pass
    assert _state() == before
