"""Loading an AOTInductor package without Inductor's CPU probe.

torch's loader (`torch.export.pt2_archive._package._load_aoti`) asks
`codecache.get_device_information` for this machine's platform, CPU vector ISA and compute
capability, only to warn where the package's metadata differs. The ISA comes from
`cpu_vec_isa.pick_vec_isa`, which builds and runs test programs on first use of a cache dir:
1.1 s of a 1.2 s load on the 2-core CPU box (cProfile), whoever built the package, and a
serving process starts with an empty cache dir. While `without_isa_probe` is entered the
loader gets the same information less the ISA (platform, machine, compute capability): every
comparison but that one still warns. `load_package` is torch's loader called so.

Uses `torch._inductor.aoti_load_package` (torch's documented loader, under a private module
name), `torch._inductor.codecache.get_device_information` (looked up by `_load_aoti` when it
runs) and `torch._dynamo.device_interface.get_interface_for_device`. Verified: torch 2.11.0,
2.13.0 and 2.15.0 (CPU).
"""

from __future__ import annotations

import contextlib
import platform
import sys
from collections.abc import Iterator
from unittest import mock

import torch._inductor
from torch._dynamo.device_interface import get_interface_for_device
from torch._inductor import codecache


def _device_information(device_type: str) -> dict[str, str]:
    """get_device_information's answer without AOTI_CPU_ISA (the probe)."""
    return {
        "AOTI_PLATFORM": sys.platform,
        "AOTI_MACHINE": platform.machine(),
        "AOTI_COMPUTE_CAPABILITY": str(
            get_interface_for_device(device_type).get_compute_capability()
        ),
    }


@contextlib.contextmanager
def without_isa_probe() -> Iterator[None]:
    """torch's package loader, inside, compares the package with this machine without
    building Inductor's ISA test programs."""
    with mock.patch.object(codecache, "get_device_information", _device_information):
        yield


def load_package(path: str):
    """The AOTInductor package at `path`, loaded by torch's loader without the ISA probe."""
    with without_isa_probe():
        return torch._inductor.aoti_load_package(path)
