"""Triton's compile cache, looked up in a staged directory first: a tenant's earlier kernels.

Triton keys every compile by what determines it (its own version and sources, the kernel
function's text, the signature and constants, the backend and target, the options) and skips
the whole compile (MLIR, LLVM, ptxas) where `<TRITON_CACHE_DIR>/<key>/` holds it. Its cache
manager class is pluggable (`TRITON_CACHE_MANAGER=module:Class`, read in every process,
Inductor's compile workers included). `StagedFirst` is Triton's own file manager that, on a
miss, copies the entry `<staged>/<key>/` (if the worker staged one) into its own directory
and serves it from there: so the Triton bundler packs it into the artifact and the static
launcher finds its binary, as for an entry compiled here. The staged directory is read
only by key: the key comes from the compile's own sources, so a child reaches only entries
of kernels it compiles.

Uses triton.runtime.cache.FileCacheManager (key, cache_dir, get_group, put, put_group) and
knobs.cache.manager_class's `TRITON_CACHE_MANAGER`. Verified: triton 3.6.0 (torch 2.11.0, on
the GPU) and 3.9.0 (torch 2.15.0, CPU only: the class is exercised by the unit tests).
"""

from __future__ import annotations

import os

from triton.runtime.cache import FileCacheManager

from torchfarm.settings import env


def environment(staged: str) -> dict[str, str]:
    """The environment that makes every Triton compile of this process tree (set before any
    is started) look in `staged` after its own cache directory."""
    return {"TRITON_CACHE_MANAGER": f"{__name__}:StagedFirst", **env.environ(TRITON_STAGED=staged)}


class StagedFirst(FileCacheManager):
    """Triton's file cache manager, falling back to the staged entry of the same key."""

    def get_group(self, filename: str) -> dict[str, str] | None:
        group = super().get_group(filename)
        staged = env.get("TRITON_STAGED")
        if group is not None or not staged or not self.cache_dir:
            return group
        entry = os.path.join(staged, self.key)
        try:
            names = [n for n in os.listdir(entry) if not n.startswith("__grp__")]
        except OSError:  # nothing staged under this key
            return None
        if filename not in names:  # no metadata: not an entry Triton can use
            return None
        paths = {}
        for name in names:
            with open(os.path.join(entry, name), "rb") as f:
                paths[name] = self.put(f.read(), name)
        self.put_group(filename, paths)
        return super().get_group(filename)
