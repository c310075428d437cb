"""Inductor's standalone compile: compile a graph into an artifact, serialize it, load it.

The worker compiles with `standalone_compile(..., aot=True)`: AOTAutograd's bundled cache
entry (`BundledAOTAutogradResult`) then holds the compiled forward and backward graphs
themselves, their Triton bundle (kernel binaries and statically launchable autotuners)
included, instead of FX-cache keys. `AOTCompiledArtifact.serialize()` gives its bytes in
memory and `AOTCompiledArtifact.deserialize(bytes)` loads them from memory: no artifact file,
no Mega-Cache unpacking into the cache dir, no FX-cache lookup by key (so two artifacts of
one dynamic graph cannot collide). The default format (`CacheCompiledArtifact`) could only
be loaded from a file, by unpacking every entry into the cache dir and looking it up there.

`load` runs the post-compile in a TracingContext of its own, as `CacheCompiledArtifact`'s
loader does: the caller may be inside Dynamo's backend, whose context must not see it.
`cache_dir_at` swaps TORCHINDUCTOR_CACHE_DIR, which Inductor reads on every access (no
torch object is patched). A compile child imports the compile path ahead of its request
(`import_compiler`), and a GPU child's warm-up compiles a graph that leaves nothing behind
(`throwaway_compiles`: workers/warm_compile.py).

Uses torch._inductor.standalone_compile (its `aot` flag and the "should have serialize
method" RuntimeError raised when AOTAutograd bundled nothing), standalone_compile
.AOTCompiledArtifact (serialize, deserialize), torch._guards.TracingContext / tracing,
torch._inductor.list_mode_options, the Inductor and functorch config modules (and
`compile_threads`), torch._inductor.runtime.cache_dir_utils.cache_dir, the modules
torch._inductor.codecache (and its torch_key) and compile_fx, torch._inductor.utils.fresh_cache and
clear_caches, and torch._dynamo.reset.
Verified: torch 2.11.0, 2.13.0, 2.15.0.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch._inductor
from torch._functorch import config as functorch_config
from torch._guards import TracingContext, tracing
from torch._inductor import config as inductor_config
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch._inductor.standalone_compile import AOTCompiledArtifact
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from torchfarm.errors import NotSaveable

__all__ = [
    "cache_dir",
    "cache_dir_at",
    "compile_graph",
    "functorch_config",
    "import_compiler",
    "inductor_config",
    "load",
    "mode_options",
    "save",
    "throwaway_compiles",
    "torch_key",
]


def mode_options(mode: str) -> dict:
    """The Inductor config patches that a torch.compile mode stands for."""
    return dict(torch._inductor.list_mode_options(mode))


def compile_graph(gm: torch.fx.GraphModule, inputs: list, config_patches: dict):
    """AOTAutograd + Inductor on a graph whose inputs carry their own fake mode, bundled
    into one serializable entry. Raises NotSaveable when AOTAutograd did not cache it."""
    try:
        return torch._inductor.standalone_compile(
            gm,
            inputs,
            dynamic_shapes="from_graph",
            options={"config_patches": config_patches},
            aot=True,
        )
    except RuntimeError as e:
        if "should have serialize method" in str(e):
            raise NotSaveable(str(e)) from e
        raise


def save(compiled) -> bytes:
    """The compiled graph's bytes: AOTAutograd's bundled entry with Inductor's output code."""
    return compiled.serialize()


def load(data: bytes) -> Callable:
    """Load `save`'s bytes from memory into a callable taking the graph's inputs."""
    with tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv()))):
        return AOTCompiledArtifact.deserialize(data)


@contextlib.contextmanager
def cache_dir_at(directory: str) -> Iterator[None]:
    """Make Inductor's cache dir `directory` for the block."""
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = directory
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved


def import_compiler() -> None:
    """Import Inductor's compile path (its code cache, compile_fx: the standalone_compile
    path) ahead of a first compile."""
    import torch._inductor.codecache
    import torch._inductor.compile_fx  # noqa: F401


@contextlib.contextmanager
def throwaway_compiles() -> Iterator[None]:
    """Compiles in the block leave nothing behind: Inductor's caches point to a temporary
    directory (fresh_cache), its Triton kernels compile in this process (compile_threads 1,
    so no compile worker inherits that directory), and on leaving, whatever happened, its
    in-memory caches are cleared and Dynamo is reset."""
    from torch._inductor.utils import clear_caches, fresh_cache

    try:
        with fresh_cache(), inductor_config.patch(compile_threads=1):
            yield
    finally:
        clear_caches()
        torch._dynamo.reset()


def torch_key() -> bytes:
    """Inductor's hash of this torch build's sources (codecache.torch_key; memoized): a
    client of the same build loads with it instead of hashing them again."""
    import torch._inductor.codecache

    return torch._inductor.codecache.torch_key()
