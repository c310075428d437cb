"""Make a loaded artifact's Triton kernels use the autotune results the worker found.

A Triton kernel comes out of an artifact as a pickled CachingAutotuner that remembers where
its source lay on the worker, and on load torch rechecks the autotune cache beside that
path (`CachingAutotuner.recheck_autotune_cache`). While `worker_results_win` is entered:
- `AutotuneCacheArtifact.populate_cache` skips the results the worker's final files
  replace (Inductor records a kernel's first result in the artifact; coordinate descent
  may find a better one after that);
- `recheck_autotune_cache` first points the kernel at the artifact's directory and files
  the worker's result under this kernel's configs: the worker tuned at compile time, so the
  bundled kernel keeps only the winner and the hash of its configs no longer matches the
  one the result was filed under. Then torch's own recheck runs, whatever its version does
  (2.14.1 added `dynamic_scale_rblock_eligible` and turned an assert into a raise).
- torch 2.11's recheck ignores a kernel with a single config, which is what coordinate
  descent (max-autotune) leaves, so there it is replaced by `_recheck_2_11` (the body of
  2.13's recheck, with the worker's result found). Like 2.13's, a kernel whose result was
  found is not rescaled after it (`_dynamic_scale_rblock`): 2.11 would compile configs with
  halved reduction blocks beside the result on the client, and the worker's bundle holds
  only the result's binary (torch_adapter/compile/triton_selection.py).

`filed_result` is the config a load takes from the worker's result: the compile side cuts a
kernel's bundled autotuner to it (triton_selection).

`result_path` / `module_result_path` name where Inductor's local autotune cache keeps a
kernel's result: the compile side places earlier results there
(triton_kernels.results_found).

`coordesc_results_kept()` is the compile side too: Inductor's mark on a coordinate-descent
result survives the trip from its compile workers.

Uses PyCodeCache.write, triton.Config's
__setstate__ (3.6, 3.9: it keeps only the attributes it knows),
AutotuneCache._prepare_key / _make_local_cache_key (2.13+; 2.11 hashes the key with
torch_key itself), AutotuneCacheArtifact.populate_cache,
CachingAutotuner.recheck_autotune_cache (and the autotuner's compile_results, filename,
inductor_meta, fn, _precompile_config), check_autotune_cache, hash_configs,
triton_config_to_hashable, AutotuneCache.create / its local_cache, and
autotune_cache._load_cached_autotuning.
Verified: torch 2.11.0 (replacement, on the GPU), 2.13.0 and 2.15.0 (wrapper; CPU only, so
the patching is tested and the effect read from the sources).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Collection, Iterator

from torch._inductor import codecache
from torch._inductor.runtime import autotune_cache
from torch._inductor.runtime import triton_heuristics as heuristics
from torch._inductor.runtime.autotune_cache import AutotuneCacheArtifact

from torchfarm.torch_adapter import gate

# Before 2.13 the recheck considered only kernels with more than one config.
_RECHECK_IGNORES_SINGLE_CONFIGS = gate.release_tuple() < (2, 13)


def result_path(kernel_path: str) -> str:
    """Where Inductor's local autotune cache keeps the result of the kernel module written
    at `kernel_path` (`<dir>/<hash>.best_config`), as AutotuneCache.create names it."""
    cache = autotune_cache.AutotuneCache
    key = cache._prepare_key(kernel_path)
    directory = os.path.dirname(kernel_path)
    if hasattr(cache, "_make_local_cache_key"):  # 2.13+
        return cache._make_local_cache_key(directory, key)
    hashed = hashlib.sha256(key.encode("utf-8") + codecache.torch_key()).hexdigest()
    return f"{directory}/{hashed}.best_config"  # 2.11's _setup_local_cache


def module_result_path(source_code: str) -> str:
    """`result_path` of a Triton kernel module, written first where Inductor writes it (the
    same file Inductor's own write of that module finds there)."""
    return result_path(codecache.PyCodeCache.write(source_code)[1])


@contextlib.contextmanager
def coordesc_results_kept() -> Iterator[None]:
    """While entered, a Triton config keeps Inductor's `found_by_coordesc` mark through a
    pickle. Triton's `Config.__setstate__` drops attributes it does not know, so a kernel that
    Inductor's compile worker built from a stored coordinate-descent result reaches the
    compiling process unmarked, and coordinate descent runs again from that result (and
    rewrites it). Measured on the H100 (torch 2.11, triton 3.6): 13 of 15 stored results of a
    max-autotune sibling were tuned again. A host without Triton has nothing to keep."""
    try:
        from triton import Config
    except ImportError:
        yield
        return
    original = Config.__setstate__

    def setstate(self, state):
        original(self, state)
        if state.get("found_by_coordesc"):
            self.found_by_coordesc = True

    Config.__setstate__ = setstate  # type: ignore[method-assign]
    try:
        yield
    finally:
        Config.__setstate__ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def worker_results_win(directory: str, tuned: Collection[str]) -> Iterator[None]:
    """Load kernels with the results under `directory`; `tuned` names those written there
    (`<2 chars>/<hash>.best_config`), which win over the ones recorded in the artifact."""
    populate = AutotuneCacheArtifact.populate_cache
    autotuner = heuristics.CachingAutotuner
    original = autotuner.recheck_autotune_cache

    def populate_unless_tuned(self):
        if self.key not in tuned:
            populate(self)

    def recheck_here(self, *args, **kwargs):
        if self.filename:
            self.filename = os.path.join(directory, *self.filename.split(os.sep)[-2:])
        if _RECHECK_IGNORES_SINGLE_CONFIGS:
            return _recheck_2_11(self, *args, **kwargs)
        _file_under_these_configs(self)
        return original(self, *args, **kwargs)

    setattr(AutotuneCacheArtifact, "populate_cache", populate_unless_tuned)  # noqa: B010
    setattr(autotuner, "recheck_autotune_cache", recheck_here)  # noqa: B010
    try:
        yield
    finally:
        setattr(AutotuneCacheArtifact, "populate_cache", populate)  # noqa: B010
        setattr(autotuner, "recheck_autotune_cache", original)  # noqa: B010


def _local_result(autotuner):
    """(store, key, result) of the kernel's result file, or None."""
    if not autotuner.filename:
        return None
    cache = autotune_cache.AutotuneCache.create(autotuner.inductor_meta, autotuner.filename, "")
    if cache is None or cache.local_cache is None:
        return None
    store, key = cache.local_cache
    result = store.get(key)
    return (store, key, result) if isinstance(result, dict) and result else None


def _result_for(result: dict, configs: list, inductor_meta) -> object | None:
    """The config `result` names for a kernel that started from `configs`, checked against
    the configs hash it was filed under (the file was written for this kernel's source)."""
    return autotune_cache._load_cached_autotuning(
        dict(result), str(result.get("configs_hash")), configs, inductor_meta
    )


def filed_result(autotuner) -> object | None:
    """The config a load of `autotuner` takes from the result filed beside its source: one of
    its compile results' configs, or one found beside them (by coordinate descent; on 2.13+
    also by the rblock rescaling); None where no result is filed or it names none."""
    found = _local_result(autotuner)
    if found is None:
        return None
    configs = [result.config for result in autotuner.compile_results]
    return _result_for(found[2], configs, autotuner.inductor_meta)


def _file_under_these_configs(autotuner) -> None:
    """Re-file the worker's result under the hash of the kernel's bundled configs."""
    found = _local_result(autotuner)
    if found is None:
        return
    store, key, result = found
    configs = [r.config for r in autotuner.compile_results]
    wanted = heuristics.hash_configs(configs)
    if result.get("configs_hash") == wanted:
        return
    if _result_for(result, configs, autotuner.inductor_meta) is not None:
        store.put(key, {**result, "configs_hash": wanted})


def _recheck_2_11(self, reload_kernel_from_src) -> None:
    """torch 2.13's recheck_autotune_cache, also taking the worker's result (torch 2.11)."""
    configs = [result.config for result in self.compile_results]
    cached, _, self.autotune_cache_info = heuristics.check_autotune_cache(
        configs, self.filename, self.inductor_meta
    )
    if self.autotune_cache_info.get("autotune_cache_state") == "hit":
        best = cached[0]
    else:
        best = filed_result(self)
        if best is None:
            return
        self.autotune_cache_info = {"autotune_cache_state": "hit", "source": "torchfarm"}
    # 2.13's _dynamic_scale_rblock skips a kernel whose result was found; 2.11's would add
    # configs with halved reduction blocks next to the result (compiled here, then tuned again)
    self.inductor_meta = {**self.inductor_meta, "dynamic_scale_rblock": False}
    by_coordesc = getattr(best, "found_by_coordesc", False)
    wanted = heuristics.triton_config_to_hashable(best)
    for result in self.compile_results:
        if heuristics.triton_config_to_hashable(result.config) == wanted:
            result.config.found_by_coordesc = by_coordesc
            self.compile_results = [result]
            return
    # Found by coordinate descent after the kernel was bundled: compile that config.
    if self.fn.fn is None:
        self.fn = reload_kernel_from_src().fn
    self.compile_results = [self._precompile_config(best)]
