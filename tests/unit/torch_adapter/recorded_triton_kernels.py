"""The Triton kernels of a GPT-style training step as Inductor wrote them on an H100 (torch
2.11.0, triton 3.6.0): pointwise kernels, persistent reductions and a GEMM template."""

import json
import pathlib

KERNELS: dict[str, str] = json.loads(
    (pathlib.Path(__file__).parent / "data" / "triton_kernels_h100_torch211.json").read_text()
)
NAME = "triton_per_fused_gelu_native_layer_norm_0"
