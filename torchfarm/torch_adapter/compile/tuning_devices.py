"""Benchmark one compile's autotuning candidates on every GPU of the worker at once.

Under max-autotune, Inductor compiles each GEMM template candidate on the host's cores (its
precompile thread pool) and then benchmarks them one after another on the compiling GPU.
With `autotune_in_subproc` and `autotune_multi_device` it benchmarks them instead in a pool
of subprocesses, one per GPU, each candidate on whichever GPU is free
(`autotune_process.TuningProcessPool`). That pool takes its GPUs from the compiling process's
CUDA_VISIBLE_DEVICES, but a compile child sees only its own GPU (workers/sandbox.py gives
each child one in turn): `spread_over` hands the pool the worker's GPUs instead. The
subprocesses run inside the child's sandbox, which binds every /dev/nvidia* node.

Other compiles' children may benchmark on the same GPUs at the same time: nothing is held
exclusively, so nothing waits for a GPU (and nothing can deadlock), at the price of timings
taken beside other work, as on a shared GPU of a single process.

Uses: inductor config `autotune_in_subproc`, `autotune_multi_device`, and
`autotune_process.TuningProcessPool.get_device_list` (a staticmethod: the pool's own in torch
2.11-2.14, inherited from `TuningPoolBase` in 2.15)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from unittest import mock

from torch._inductor import config as inductor_config


def devices_of(gpus: Sequence[str]) -> list[int | str]:
    """The pool's device names: TuningProcess puts `str(device)` into a subprocess's
    CUDA_VISIBLE_DEVICES, so ordinals stay ints (as torch's own list holds) and UUIDs
    (GPU-...) pass as they are."""
    return [int(g) if g.isdigit() else g for g in gpus]


@contextlib.contextmanager
def spread_over(gpus: Sequence[str]) -> Iterator[None]:
    """While entered, max-autotune benchmarks candidates on all of `gpus` (as the worker's
    CUDA_VISIBLE_DEVICES names them) at once; with fewer than two, nothing changes."""
    if len(gpus) < 2:
        yield
        return
    from torch._inductor import autotune_process  # here: only a spread compile needs it

    listed = devices_of(gpus)
    # mock.patch.object restores the pool's own method, or removes ours where it inherits one
    with (
        mock.patch.object(
            autotune_process.TuningProcessPool,
            "get_device_list",
            staticmethod(lambda: list(listed)),
        ),
        inductor_config.patch(autotune_in_subproc=True, autotune_multi_device=True),
    ):
        yield
