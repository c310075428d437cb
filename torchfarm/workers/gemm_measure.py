"""`python -m torchfarm.workers.gemm_measure DEVICE [GPU_LOCK]`: measure the GemmProblem on
stdin (torch_adapter/worker/gemm_problems.py) with the worker's Inductor config, each measurement
holding GPU_LOCK's flock (workers/gpu_lock.py). A pool builder runs it in a
fresh interpreter (workers/kernel_builder.py says why)."""

from __future__ import annotations

import sys

from torchfarm.compiler.inductor import WORKER_CONFIG
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.torch_adapter.compile import standalone
from torchfarm.torch_adapter.worker import gemm_problems
from torchfarm.workers import gpu_lock


def main(argv: list[str]) -> None:
    gemm = pb.GemmProblem.FromString(sys.stdin.buffer.read())  # protobuf parse: no code runs
    if len(argv) > 1 and argv[1]:
        gpu_lock.install(argv[1])
    with standalone.inductor_config.patch(WORKER_CONFIG):
        gemm_problems.measure(gemm, argv[0])


if __name__ == "__main__":
    main(sys.argv[1:])
