"""The target descriptor: everything besides the graph that compiled code depends on.

Inductor's own cache key ignores the CPU vector ISA (an AVX-512 artifact gave wrong numbers
under AVX2), so the descriptor carries ISA flags, threads, compiler and torch build on CPU,
and compute capability, CUDA and triton versions on GPU. Pools are named from it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys

import torch

from torchfarm.proto import torchfarm_pb2 as pb

# /proc/cpuinfo flags that change what machine code Inductor may emit (-march=native).
_ISA_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4", "bmi", "vnni", "sve", "asimd")


@functools.cache
def _cpu_flags() -> tuple[str, ...]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = line.split(":", 1)[1].split()
                    return tuple(sorted({x for x in flags if x.startswith(_ISA_FLAG_PREFIXES)}))
    except OSError:
        pass
    return (platform.machine(),)


@functools.cache
def _compiler() -> str:
    """The C++ compiler Inductor would use here, with its version ("none" if absent)."""
    cxx = os.environ.get("CXX", "g++")
    if not shutil.which(cxx):
        return "none"
    try:
        out = subprocess.run(
            [cxx, "-dumpfullversion", "-dumpversion"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = "unknown"
    return f"{os.path.basename(cxx)} {out}"


def torch_build() -> str:
    return f"{torch.__version__}+git{(torch.version.git_version or '')[:12]}"


def local_target(device: str = "cpu") -> pb.Target:
    """Describe this process's target for code that runs on `device` ("cpu" or "cuda[:n]")."""
    kind = torch.device(device).type
    target = pb.Target(
        device=kind,
        torch_version=torch_build(),
        python_version=f"{sys.version_info.major}.{sys.version_info.minor}",
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        cpu_flags=_cpu_flags(),
        threads=torch.get_num_threads(),
        compiler=_compiler(),
    )
    if kind == "cuda":
        import triton  # noqa: PLC0415  (only present where CUDA is)

        index = torch.device(device).index or 0
        major, minor = torch.cuda.get_device_capability(index)
        target.cuda_capability = f"{major}.{minor}"
        target.cuda_version = torch.version.cuda or ""
        target.triton_version = triton.__version__
    return target


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
