"""Where AOTInductor puts each weight in a package's weight blob, recorded while it compiles.

With `aot_inductor.package_constants_on_disk_format = "binary_blob"` a package keeps its
weights in one file, `<wrapper>_weights.blob`, which the runtime reads at load
(aoti_runtime/model_base.h, `load_constants`): the storage of each constant that was not
folded, in `graph.constants` order, each padded to 64 bytes unless every one is on a CUDA
device (`AotCodeCompiler.compile` writes it; `CppWrapperCpu` codegens the same sizes into
the .so's `constants_info_`). The runtime checks neither the file's size nor its contents
(a short one crashes the load with SIGBUS; measured, 2.13). `recording` captures that
layout from the graph being compiled, so that another process can write the same file from
other tensors of the same shapes.

Uses torch._inductor.codecache.AotCodeCompiler.compile (wrapped; it is given the
GraphLowering) and GraphLowering's `constants`, `folded_constants`,
`get_original_value_of_constant`, `dynamo_flat_name_to_original_fqn` and
`allocated_constant_name` (the name the runtime gives each constant, as CppWrapperCpu
writes `original_fqn`), and torch._inductor.utils.ALIGN_BYTES.
Verified: torch 2.13.0 (CPU: this module, the farm's tests); 2.11.0 on an H200 (CUDA fp32
and bf16, where no constant is padded, and CPU: the same layout computed from the graph matched
the blob torch wrote, another model's weights written there ran under torch's Python and C++
loaders equal to eager; the package built with /usr/bin/g++, see README "Troubleshooting").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from unittest import mock

import torch
from torch._inductor import codecache
from torch._inductor.utils import ALIGN_BYTES

BLOB_SUFFIX = "_weights.blob"  # codecache.py: f"{wrapper stem}_weights.blob"


@dataclass(frozen=True)
class BlobEntry:
    """One constant of the blob: its runtime name (the program's FQN), the tensor compiled
    with, and where its storage lies in the blob."""

    name: str
    tensor: torch.Tensor
    offset: int
    storage_bytes: int


def _layout(graph) -> tuple[list[BlobEntry], int]:
    names = [n for n in graph.constants if n not in graph.folded_constants]
    tensors = [graph.get_original_value_of_constant(n) for n in names]
    all_cuda = all(t.is_cuda for t in tensors)
    entries, offset = [], 0
    for name, tensor in zip(names, tensors, strict=True):
        if tensor.is_mkldnn:
            raise ValueError(f"{name}: an MKL-DNN constant has no layout torchfarm can write")
        nbytes = tensor.untyped_storage().nbytes() if tensor.numel() else 0
        flat_names = graph.dynamo_flat_name_to_original_fqn
        fqn = flat_names[name] if name in flat_names else graph.allocated_constant_name[name]
        entries.append(BlobEntry(fqn, tensor, offset, nbytes))
        offset += nbytes if all_cuda else -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
    return entries, offset


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[list[BlobEntry], int]]]:
    """Inside, every AOTInductor compile appends (its blob's entries, the blob's size) to
    the list yielded."""
    layouts: list[tuple[list[BlobEntry], int]] = []
    compile_ = codecache.AotCodeCompiler.compile  # bound to the class

    def recorded(cls, graph, *args, **kwargs):
        layouts.append(_layout(graph))
        return compile_(graph, *args, **kwargs)

    with mock.patch.object(codecache.AotCodeCompiler, "compile", classmethod(recorded)):
        yield layouts
