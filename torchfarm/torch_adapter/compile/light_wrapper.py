"""Inductor's output code, made to import only what running it needs, before it is saved.

The Python wrapper that Inductor generates imports two modules of its compile path for one
name each: `extern_kernels` from `select_algorithm` (which imports the lowerings and the
kernel templates, compiled by jinja at import) and `_align` from `codegen.memory_planning`
(which imports Inductor's code generators). A client that loads the artifact pays those
imports on its first call: most of Inductor's import time on a farm hit. The worker, which
made the code, points these two lines at the same objects elsewhere: torchfarm's
`extern_kernels` (torch_adapter/load/extern_kernels.py) and `torch._inductor.utils._align`,
where memory_planning takes it from. One line for one: the code's line map stays right.
The compiled graph's `fx_kwargs` name Inductor's `select_decomp_table` (a compile-time
step, never called by a loaded graph): unpickled, that reference imports Inductor's
decompositions, so it names the picker the caller gives instead (compiler/inductor.py gives
torch_adapter/load/decompositions.py's).

Uses torch._inductor.standalone_compile.AOTCompiledArtifact (its constructor, which takes
an object whose `serialize()` gives the bundled entry that it pickles, and its
`inner_fn.compiled_fn`), the output code's `source_code`
(torch._inductor.output_code.CompiledFxGraph) in the entry's `compiled_fw` / `compiled_bw`
`.result` and its `fx_kwargs["get_decomp_fn"]`, and the two import lines of
codegen/wrapper.py's `write_header`.
Verified: torch 2.11.0, 2.13.0, 2.15.0.
"""

from __future__ import annotations

from collections.abc import Callable

from torch._inductor.standalone_compile import AOTCompiledArtifact

_LIGHTER = {
    "from torch._inductor.select_algorithm import extern_kernels": (
        "import torchfarm.torch_adapter.load.extern_kernels as extern_kernels"
    ),
    "from torch._inductor.codegen.memory_planning import _align as align": (
        "from torch._inductor.utils import _align as align"
    ),
}


DecompPicker = Callable[[], dict]


def lightened(compiled: AOTCompiledArtifact, decomp_picker: DecompPicker) -> AOTCompiledArtifact:
    """standalone_compile's `compiled`, serializing with its output code's imports rewritten
    and `decomp_picker` for Inductor's (forward and backward)."""
    lighter = _Lightened(compiled.inner_fn.compiled_fn, decomp_picker)
    return AOTCompiledArtifact(lighter)  # type: ignore[arg-type]  # serialized, never called


class _Lightened:
    """AOTAutograd's compiled function as AOTCompiledArtifact serializes it (its `serialize`
    gives the bundled entry: the one made by the compile, or on a hit in AOTAutograd's
    cache, a new copy each time), the entry's output code rewritten."""

    def __init__(self, compiled_fn, decomp_picker: DecompPicker) -> None:
        self._compiled_fn = compiled_fn
        self._decomp_picker = decomp_picker

    def serialize(self):
        entry = self._compiled_fn.serialize()
        for part in (entry.compiled_fw, entry.compiled_bw):
            output_code = getattr(part, "result", None)
            if isinstance(getattr(output_code, "source_code", None), str):
                output_code.source_code = lighter_source(output_code.source_code)
                output_code.fx_kwargs = lighter_fx_kwargs(
                    output_code.fx_kwargs, self._decomp_picker
                )
        return entry


def lighter_fx_kwargs(fx_kwargs: dict, decomp_picker: DecompPicker) -> dict:
    """A copy of a compiled graph's `fx_kwargs` with `decomp_picker` for Inductor's
    decomposition picker; another picker (a caller's own) is kept."""
    # the worker's import: a client that loads an artifact never imports the decompositions
    from torch._inductor.decomposition import select_decomp_table

    if fx_kwargs.get("get_decomp_fn") is not select_decomp_table:
        return fx_kwargs
    return {**fx_kwargs, "get_decomp_fn": decomp_picker}


def lighter_source(source: str) -> str:
    """`source` with each import line of `_LIGHTER` replaced by its lighter one."""
    return "\n".join(_LIGHTER.get(line, line) for line in source.split("\n"))
