"""The target descriptor: everything besides the graph that compiled code depends on.

Inductor's own cache key ignores the CPU vector ISA (an AVX-512 artifact gave wrong numbers
under AVX2), so the descriptor carries ISA flags, threads, compiler and torch build on CPU,
and compute capability, CUDA and triton versions on GPU. Pools are named from it
(torchfarm.contract.pools, torch-free).
"""

from __future__ import annotations

import functools
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
