"""Count the candidates Inductor's algorithm selection benchmarks (max-autotune's GEMM and
convolution templates, C++ on the CPU, Triton on the GPU), for the pool's counters (issue 28).

Algorithm selection asks `lookup(choices, op, inputs, benchmark)` for the timings of a node's
candidates: it takes them from its local cache (`<cache dir>/cache/<system hash>`, where a
private compile finds its tenant's earlier timings staged: workers/kernel_cache.py) and calls
`benchmark(choices)` with all of them only when one is missing. The wrapper counts the
candidates handed to that call, so timings found are not counted, and remembers what the call
was for (op, inputs key, matmul precision): a shared job's GEMM problems, which the pool
measures itself (worker/gemm_problems.py). Not counted: pipelined
autotuning (`pipeline_max_autotune_gemm`, off by default), which benchmarks outside lookup.

Uses PersistentCache.lookup(choices, op, inputs, benchmark, hint_override), which
AlgorithmSelectorCache inherits, as select_algorithm calls it (benchmark positional, or
`benchmark=None`). Verified: torch 2.11.0, 2.13.0, 2.15.0 on the CPU (the same lookup in all
three; a bmm's C++ and ATen candidates counted once, then found).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from unittest import mock

import torch
from torch._inductor.select_algorithm import AlgorithmSelectorCache


@dataclasses.dataclass
class Benchmarked:
    """The candidates benchmarked while `counted` was entered, and for what: (op, inputs key,
    matmul precision) of each benchmarking."""

    candidates: int = 0
    problems: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def counted() -> Iterator[Benchmarked]:
    """While entered, every candidate algorithm selection benchmarks is counted."""
    lookup = AlgorithmSelectorCache.lookup
    count = Benchmarked()

    def counting_lookup(self, choices, op, inputs, benchmark, *args, **kwargs):
        # A size hint overridden (multi-kernel dispatch) files the timings under another key.
        hinted = (args and args[0] is not None) or kwargs.get("hint_override") is not None
        if benchmark is not None:
            run = benchmark

            def benchmark(choices):
                count.candidates += len(choices)
                if not hinted:
                    precision = torch.get_float32_matmul_precision()
                    count.problems.append((op, inputs, precision))
                return run(choices)

        return lookup(self, choices, op, inputs, benchmark, *args, **kwargs)

    with mock.patch.object(AlgorithmSelectorCache, "lookup", counting_lookup):
        yield count
