"""Inductor's standalone compile: compile a graph into a CompiledArtifact, save it, load it.

Uses torch._inductor.standalone_compile and CompiledArtifact (save/load, "binary" format),
torch._inductor.list_mode_options, the Inductor and functorch config modules, and
torch._inductor.runtime.cache_dir_utils.cache_dir. `cache_dir_at` swaps
TORCHINDUCTOR_CACHE_DIR, which Inductor reads on every access (no torch object is patched).
Verified: torch 2.11.0, 2.13.0, 2.15.0.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator

import torch._inductor
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config
from torch._inductor.runtime.cache_dir_utils import cache_dir

__all__ = [
    "cache_dir",
    "cache_dir_at",
    "compile_graph",
    "functorch_config",
    "inductor_config",
    "load",
    "mode_options",
    "save",
]


def mode_options(mode: str) -> dict:
    """The Inductor config patches that a torch.compile mode stands for."""
    return dict(torch._inductor.list_mode_options(mode))


def compile_graph(gm: torch.fx.GraphModule, inputs: list, config_patches: dict):
    """AOTAutograd + Inductor on a graph whose inputs carry their own fake mode."""
    return torch._inductor.standalone_compile(
        gm, inputs, dynamic_shapes="from_graph", options={"config_patches": config_patches}
    )


def save(compiled) -> bytes:
    """A CompiledArtifact's bytes ("binary" format: Inductor and AOTAutograd cache entries).
    Raises RuntimeError when AOTAutograd did not cache the graph."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "artifact.bin")
        compiled.save(path=path, format="binary")
        with open(path, "rb") as f:
            return f.read()


def load(path: str) -> Callable:
    """Load a saved CompiledArtifact: unpacks its entries into the current cache dir, then
    looks the graph up there by its FX key with shape guards switched off."""
    return torch._inductor.CompiledArtifact.load(path=path, format="binary")


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
