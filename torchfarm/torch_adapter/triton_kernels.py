"""Inductor's Triton kernels as a compile asks for them, and a pool's build of one.

`seen(on_kernel)`: each Triton kernel a compile's output code asks for
(`AsyncCompile.triton(kernel_name, source_code)`, whether Inductor then compiles it or a
looked-up cache entry brings it) is first passed to `on_kernel`: autotune results are placed
there (autotune_results.py), and a shared job's child records the kernels for the pool's
builds (workers/kernel_cache.py).

`build(module, kernel_name)`: what Inductor's compile workers do with a kernel, nothing more:
load its module, compile every config its decorator yields into TRITON_CACHE_DIR
(`precompile(warm_cache_only=True)`), launch nothing. The module must pass
triton_source_check before it runs, and its JIT functions must then be the ones checked.
Inductor selects Triton's GPU driver first (`triton_helpers.set_driver_to_gpu`), which needs
libcuda and a visible GPU; compiling for the target the kernel names (its DeviceProperties)
needs neither, Triton's own ptxas does it. So the build skips that selection: a pool's
builds need no GPU, and a host without one (this project's CI) builds the same entries.

Uses AsyncCompile.triton, PyCodeCache.load, triton_helpers.set_driver_to_gpu and
CachingAutotuner.precompile(warm_cache_only=True). Verified: torch 2.11.0 + triton 3.6.0 and
2.15.0 + triton 3.9.0 on the CPU (a recorded H100 kernel built, then found by a later
compile's Triton with nothing compiled), 2.11.0 on the GPU (bench/gpu/run.sh sibling).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch._inductor import async_compile, codecache


@contextlib.contextmanager
def seen(on_kernel: Callable[[str, str], None]) -> Iterator[None]:
    """While entered, `on_kernel(kernel_name, source_code)` hears of each Triton kernel a
    compile asks for, before anything compiles it."""
    original = async_compile.AsyncCompile.triton

    def triton(self, kernel_name, source_code, *args, **kwargs):
        on_kernel(kernel_name, source_code)
        return original(self, kernel_name, source_code, *args, **kwargs)

    async_compile.AsyncCompile.triton = triton  # type: ignore[method-assign]
    try:
        yield
    finally:
        async_compile.AsyncCompile.triton = original  # type: ignore[method-assign]


def build(module: str, kernel_name: str) -> None:
    """Compile the kernel `kernel_name` of the Inductor kernel module `module` into Triton's
    cache dir; triton_source_check.Refused where the module is not one Inductor writes."""
    from torch._inductor.runtime import triton_helpers

    from torchfarm.torch_adapter import triton_source_check

    triton_source_check.check(module, kernel_name)
    triton_helpers.set_driver_to_gpu = lambda: None  # this process only builds
    loaded = codecache.PyCodeCache.load(module)
    triton_source_check.same_as_validated(loaded, module)
    getattr(loaded, kernel_name).precompile(warm_cache_only=True)
