"""Pool names: the queue that serves a target, and a target described for humans.

The gateway routes a miss to the pool named from the request's target; a worker serves the
pool named from its own target, so both must use this one function.
"""

from __future__ import annotations

import hashlib

from torchfarm.proto import torchfarm_pb2 as pb


def pool_name(target: pb.Target) -> str:
    """The queue that serves `target`: same device kind, ISA or GPU arch, torch, Python, triton.

    Thread count and compiler are in the key but not the pool: a worker compiles for any
    thread count, and one pool's workers share one toolchain image.
    """
    if target.device == "cuda":
        arch = (
            f"sm{target.cuda_capability.replace('.', '')}-cuda{target.cuda_version}"
            f"-triton{target.triton_version}"
        )
    else:
        arch = (
            f"{target.cpu_capability.lower()}-"
            + hashlib.sha256(" ".join(target.cpu_flags).encode()).hexdigest()[:8]
        )
    torch_short = target.torch_version.split("+")[0]
    torch_hash = hashlib.sha256(target.torch_version.encode()).hexdigest()[:6]
    return f"{target.device}-{arch}-torch{torch_short}.{torch_hash}-py{target.python_version}"


def describe(target: pb.Target) -> str:
    """One line for humans: what the target is."""
    if target.device == "cuda":
        return (
            f"cuda sm_{target.cuda_capability} CUDA {target.cuda_version} triton "
            f"{target.triton_version}, torch {target.torch_version}"
        )
    return (
        f"cpu {target.cpu_capability} ({len(target.cpu_flags)} ISA flags), "
        f"{target.threads} threads, {target.compiler}, torch {target.torch_version}, "
        f"Python {target.python_version}"
    )
