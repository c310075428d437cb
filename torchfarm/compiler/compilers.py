"""Which compiler a request runs: one registered compiler per name (Options.compiler).

A compiler turns a CompileChildRequest (its payload, target and options) into an Artifact,
in the sandboxed compile child. Built in: "inductor" (a Dynamo graph through Inductor, the
default) and "aoti" (a torch.export program through AOTInductor into a .pt2 package). A pool
runs the compilers its TORCHFARM_COMPILERS names: a built-in by its name, any other as
`name=module:Class`, importable in the child's environment. So a third compiler (TensorRT,
XLA) is a class with a `compile` method and a pool setting; the gateway only checks the
name's form and routes by target as ever, and the client sends the name.

Torch-free: the worker's parent reads the pool's names here; the child imports the class.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Protocol

from torchfarm.contract.options import AOTI, COMPILER_NAME, INDUCTOR
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import env

BUILT_IN = {
    INDUCTOR: "torchfarm.compiler.inductor:InductorCompiler",
    AOTI: "torchfarm.compiler.aoti:AOTInductorCompiler",
}
DEFAULT = env.default("COMPILERS")  # every built-in (tests/unit/test_settings.py checks)


@dataclasses.dataclass(frozen=True)
class CompileContext:
    """What the child gives every compile besides the request: where to report a change of
    stage (COMPILING / AUTOTUNING), and the worker's GPUs to benchmark on, if several."""

    on_stage: Callable[[pb.Progress.Stage.ValueType], None] | None = None
    tuning_gpus: tuple[str, ...] = ()


class Compiler(Protocol):
    def compile(self, request: pb.CompileChildRequest, context: CompileContext) -> pb.Artifact:
        """The request's artifact; raises on a payload it cannot compile (its message is the
        error the client hears). Runs tenant-supplied payloads: sandbox only."""
        ...


def parse(spec: str) -> dict[str, str]:
    """TORCHFARM_COMPILERS (`inductor,aoti,trt=my_pkg.trt:TensorRTCompiler`) as name ->
    `module:Class`; ValueError for a malformed entry or an unknown built-in."""
    compilers: dict[str, str] = {}
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        name, _, where = entry.partition("=")
        name, where = name.strip(), where.strip() or BUILT_IN.get(name.strip(), "")
        if not COMPILER_NAME.fullmatch(name):
            raise ValueError(f"TORCHFARM_COMPILERS: malformed compiler name {name!r}")
        module, _, attribute = where.partition(":")
        if not (module and attribute):
            raise ValueError(
                f"TORCHFARM_COMPILERS: {name!r} is not built in ({', '.join(BUILT_IN)}): "
                "give it as name=module:Class"
            )
        compilers[name] = where
    return compilers


def load(name: str, compilers: dict[str, str]) -> Compiler:
    """An instance of the compiler `name` of a pool's `compilers` (parse); LookupError where
    the pool does not run it."""
    where = compilers.get(name)
    if where is None:
        raise LookupError(
            f"this pool does not run the compiler {name!r} "
            f"(TORCHFARM_COMPILERS: {', '.join(compilers) or 'none'})"
        )
    module, _, attribute = where.partition(":")
    return getattr(importlib.import_module(module), attribute)()
