"""The `extern_kernels` namespace of a loaded graph's Python wrapper, without Inductor's
compile path.

Inductor's output code imports `extern_kernels` from `torch._inductor.select_algorithm`, a
namespace that the kernel modules fill at import (`ExternKernelChoice`): importing it
imports the lowerings and the kernel templates, which jinja compiles (38% of a CPU skip
hit's torch imports; 0.5-0.7 s of a GPU one). The worker points the code it ships here
instead (torch_adapter/compile/light_wrapper.py). The kernels that are torch functions are
those functions themselves; any other name (Inductor's own Python helpers, such as
`bias_addmm`, and ops of optional libraries) is select_algorithm's, imported on first use.

Uses torch._inductor.select_algorithm.extern_kernels (the fallback). Verified (every name
below is select_algorithm's own object: tests/unit/torch_adapter/test_light_wrapper.py):
torch 2.11.0, 2.13.0, 2.15.0.
"""

from __future__ import annotations

import torch

mm = torch.mm
mm_dtype = torch.mm
addmm = torch.addmm
bmm = torch.bmm
bmm_dtype = torch.bmm
baddbmm = torch.baddbmm
convolution = torch.convolution
_int_mm = torch._int_mm
_scaled_mm = torch._scaled_mm
_grouped_mm = torch._grouped_mm
_scaled_grouped_mm = torch._scaled_grouped_mm
_sparse_semi_structured_mm = torch._sparse_semi_structured_mm
_weight_int8pack_mm = torch._weight_int8pack_mm


def __getattr__(name: str) -> object:
    """Any other extern kernel: select_algorithm's (which imports the compile path once)."""
    if name.startswith("__"):  # introspection (copy, inspect, pickle): not a kernel
        raise AttributeError(name)
    from torch._inductor.select_algorithm import extern_kernels

    return getattr(extern_kernels, name)
