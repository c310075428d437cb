"""Inductor's Triton kernels as a compile asks for them, and a pool's build of one.

`seen(on_kernel)`: each Triton kernel a compile's output code asks for
(`AsyncCompile.triton(kernel_name, source_code)`, whether Inductor then compiles it or a
looked-up cache entry brings it) is first passed to `on_kernel`: a shared job's child
records the kernels for the pool's builds (workers/kernel_cache.py). `results_found(place)`
is the same hook with the kernel's module written first (so every process sees the same
file), for `place` to put an earlier autotune result where Inductor's local autotune cache
will look for it (autotune_results.result_path).

`build(module, kernel_name, result)`: what Inductor's compile workers do with a kernel,
nothing more: load its module, compile every config its decorator yields into
TRITON_CACHE_DIR (`precompile(warm_cache_only=True)`), launch nothing. The module must pass
triton_source_check before it runs, and its JIT functions must then be the ones checked. A
compile's autotune result comes with it where the compile tuned the kernel: written where the
decorator looks for it, it makes the decorator yield that one config (as in a later compile
that finds it), if Inductor takes it for the kernel's own configs (their hash, and on 2.11
without coordinate descent an exact match) and `admissible` finds each field within the
tuners' range.
Inductor selects Triton's GPU driver first (`triton_helpers.set_driver_to_gpu`), which needs
libcuda and a visible GPU; compiling for the target the kernel names (its DeviceProperties)
needs neither, Triton's own ptxas does it. So the build skips that selection: a pool's
builds need no GPU, and a host without one (this project's CI) builds the same entries.

Uses AsyncCompile.triton, PyCodeCache.load / write, triton_helpers.set_driver_to_gpu,
CachingAutotuner.precompile(warm_cache_only=True) and .autotune_cache_info, and
hints.TRITON_MAX_BLOCK. Verified: torch 2.11.0 + triton 3.6.0 and 2.15.0 + triton 3.9.0 on
the CPU (a recorded H100 kernel built, with and without a coordinate-descent result, then
found by a later compile's Triton with nothing compiled), 2.11.0 on the GPU (bench/gpu/run.sh
sibling, shared jobs).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator

from torch._inductor import async_compile, codecache

from torchfarm.torch_adapter.load import autotune_results


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


@contextlib.contextmanager
def results_found(place: Callable[[str, str, str], None]) -> Iterator[None]:
    """While entered, each Triton kernel Inductor compiles first has its module written and
    `place(kernel_name, source_code, result_path(module))` called, before any process tunes or
    compiles it."""

    def on_kernel(kernel_name: str, source_code: str) -> None:
        place(kernel_name, source_code, autotune_results.module_result_path(source_code))

    with seen(on_kernel):
        yield


def build(module: str, kernel_name: str, result: bytes = b"") -> bytes:
    """Compile the kernel `kernel_name` of the Inductor kernel module `module` into Triton's
    cache dir (errors.BuildRefused where the module is not one Inductor writes), with
    the autotune result `result` where it is one Inductor's tuners could have chosen
    (`admissible`) and Inductor takes it for this kernel's configs; that result, rewritten,
    or b"" where none was taken."""
    from torch._inductor.runtime import triton_helpers

    from torchfarm.torch_adapter.worker import triton_source_check

    triton_source_check.check(module, kernel_name)
    triton_helpers.set_driver_to_gpu = lambda: None  # this process only builds
    tuned = admissible(result) if result else None
    if tuned is not None:  # where the kernel's decorator looks for it
        with open(autotune_results.module_result_path(module), "w") as f:
            json.dump(tuned, f, sort_keys=True)
    loaded = codecache.PyCodeCache.load(module)
    triton_source_check.same_as_validated(loaded, module)
    kernel = getattr(loaded, kernel_name)
    info = getattr(kernel, "autotune_cache_info", None) or {}
    kernel.precompile(warm_cache_only=True)
    taken = tuned is not None and info.get("autotune_cache_state") == "hit"
    return json.dumps(tuned, sort_keys=True).encode() if taken else b""


# The fields of a `.best_config` besides block sizes, and their types.
_RESULT_FIELDS: dict[str, tuple[type, ...]] = {
    "configs_hash": (str,),
    "found_by_coordesc": (bool,),
    "time_taken_ms": (int, float),
    "triton_cache_hash": (str, type(None)),
    "num_warps": (int,),
    "num_stages": (int,),
}
_NUM_WARPS = (1, 2, 4, 8, 16, 32)


def admissible(result: bytes) -> dict | None:
    """A compile's autotune result (`.best_config` JSON), if each of its fields is within what
    Inductor's tuners choose from: block sizes (`XBLOCK`, `R0_BLOCK`, ...) powers of two up
    to Inductor's limit for their dimension, num_warps a power of two up to 32, num_stages 1
    to 8, nothing else (no extra options, no other constexprs). Any such config computes the
    kernel's result (Inductor's kernels mask every block), at some speed; else None."""
    from torch._inductor.runtime.hints import TRITON_MAX_BLOCK

    try:
        data = json.loads(result)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("configs_hash"), str):
        return None
    for key, value in data.items():
        kinds = _RESULT_FIELDS.get(key)
        if kinds is not None:
            if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
                return None
            continue
        bound = TRITON_MAX_BLOCK.get(key[: -len("BLOCK")]) if key.endswith("BLOCK") else None
        power_of_two = isinstance(value, int) and not isinstance(value, bool) and value > 0
        if bound is None or not power_of_two or value & (value - 1) or value > bound:
            return None
    if data.get("num_warps") not in _NUM_WARPS or data.get("num_stages") not in range(1, 9):
        return None
    return data
