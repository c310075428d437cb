"""One throwaway compile in a warm GPU compile child, before its request exists.

Inductor does much of its work once per process, at its first compile: it imports its code
generators and passes lazily, registers its pattern-matcher replacements (traced on first
use), hashes Triton's and torch's sources for its cache keys, and sets up benchmarking on the
GPU. A local compile pays that once per process; a farm pays it in every child, so on every
miss. Measured on an H200 (torch 2.11, bench/gpu/child_profile.py), a warm child took
4.3-4.9 s for a graph of 9-23 nodes (an embedding, a language-model head, a loss), about half
of it such once-only work.

So a GPU child compiles a small training graph of the farm's own (a matmul, GELU and a
reduction, forward and backward, through a request's path) while it warms up. Nothing of it
is left for the request to find: Inductor's and Triton's caches point to a temporary
directory, removed afterwards (Inductor's `fresh_cache`); Inductor's in-memory caches are
cleared and Dynamo is reset after it; its Triton kernels are compiled in this process
(`compile_threads` 1) before the compile-worker pool starts, so no pool worker inherits the
temporary environment. Not on CPU pools: their children are forked from a warm parent, and a
child forked after the parent traced a backward cannot run autograd ("Unable to handle
autograd's threading in combination with fork-based multiprocessing", torch 2.11); a
matmul-only one there spared a compile about 0.5 s of ~6.4 s on the 2-core box.

Torch's part (a temporary cache dir, one compile thread, caches cleared and Dynamo reset
after it) is torch_adapter/compile/standalone.py's `throwaway_compiles`.
"""

from __future__ import annotations

import sys

import torch

from torchfarm.compiler import inductor, serialize, trace_state
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.torch_adapter.compile import standalone


def compile_once(device: str) -> None:
    """Compile the throwaway graph on `device`, leaving no cache entry and no in-memory state."""
    try:
        with standalone.throwaway_compiles():
            graph, options = _traced(device)
            inductor.compile_payload(
                serialize.dumps(graph), options, 0, serialize.size_hints(graph)
            )
    except Exception as e:  # a slower first compile, never a child that cannot start
        print(f"torchfarm: the warm-up's throwaway compile failed: {e!r}", file=sys.stderr)


def _traced(device: str) -> tuple[torch.fx.GraphModule, pb.Options]:
    """Dynamo's graph of a small training step, and its options, as a client would send them."""
    captured: list[tuple[torch.fx.GraphModule, pb.Options]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list):
        captured.append((gm, pb.Options(mode="default", state=trace_state.capture())))
        return gm.forward

    def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x @ w).sum(dim=-1)

    x = torch.randn(16, 32, device=device)
    w = torch.randn(32, 32, device=device, requires_grad=True)
    torch.compile(step, backend=backend, fullgraph=True)(x, w)  # compile_once resets Dynamo
    return captured[0]
