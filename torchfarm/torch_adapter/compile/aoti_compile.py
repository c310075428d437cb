"""AOTInductor's compile, `torch._inductor.aoti_compile_and_package`: torch's documented entry
point, but under a private module name, so it is reached only through here."""

from __future__ import annotations

from typing import Any

import torch._inductor


def compile_and_package(
    program: torch.export.ExportedProgram, path: str, configs: dict[str, Any] | None
) -> str:
    """`program` compiled by AOTInductor with Inductor `configs` into the .pt2 package at
    `path`; its path."""
    return torch._inductor.aoti_compile_and_package(
        program, package_path=path, inductor_configs=configs
    )
