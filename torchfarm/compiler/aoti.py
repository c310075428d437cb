"""AOTInductor on the farm: an exported program into a .pt2 package (compile child), and a
package loaded with the user's weights (client).

Without the weights (the default), the child compiles over placeholders
(compiler/exported.py) with every parameter, buffer and constant kept a constant that the
package is fed at run time: `aot_inductor.package_constants_in_so` off (no weights in the
package) and `always_keep_tensor_constants` on (Inductor would otherwise write small ones'
values into the kernels' code). Freezing folds weights' values into the code, so it is
refused there. The client then loads the package with torch's loader and hands it its own
weights (`load`). With the weights sent, the package is built as torch builds it locally,
weights inside.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping

import torch

from torchfarm.compiler import exported, serialize, structure
from torchfarm.compiler.compilers import CompileContext
from torchfarm.compiler.inductor import ARTIFACT_FORMAT, config_patches
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.torch_adapter import aoti_load, autotune_progress

# What a package built without the user's weights needs (see above).
_WITHOUT_WEIGHTS = {
    "aot_inductor.package_constants_in_so": False,
    "always_keep_tensor_constants": True,
}


def inductor_configs(options: pb.Options, weights: bool) -> dict:
    """AOTInductor's configs for `options` (the mode's and the user's patches); ValueError
    for what an AOTInductor package cannot do."""
    if options.mode == "reduce-overhead":
        raise ValueError(
            "AOTInductor has no reduce-overhead mode: CUDA graphs are the runtime's to "
            "record (use default or max-autotune)"
        )
    configs = config_patches(options)
    if not weights:
        if configs.get("freezing"):
            raise ValueError(
                "freezing folds the weights into the code: send them (weights=True) or "
                "leave freezing off"
            )
        configs.update(_WITHOUT_WEIGHTS)
    return configs


class AOTInductorCompiler:
    """Options.compiler "aoti": the ExportedProgram payload into Artifact.package."""

    def compile(self, request: pb.CompileChildRequest, context: CompileContext) -> pb.Artifact:
        started = time.perf_counter()
        if request.target.threads > 0:
            torch.set_num_threads(request.target.threads)
        program, weights = exported.loads(request.graph)
        configs = inductor_configs(request.options, weights)
        gm = program.graph_module
        graph_structure, op_counts, code = structure.digest(gm), serialize.op_counts(gm), gm.code
        with (
            tempfile.TemporaryDirectory() as directory,
            autotune_progress.reporting(context.on_stage),
        ):
            path = torch._inductor.aoti_compile_and_package(
                program,
                package_path=os.path.join(directory, "model.pt2"),
                inductor_configs=configs,
            )
            with open(path, "rb") as f:
                package = f.read()
        return pb.Artifact(
            format=ARTIFACT_FORMAT,
            package=package,
            compile_seconds=time.perf_counter() - started,
            op_counts=op_counts,
            graph_code=code,
            structure=graph_structure,
        )


def weights_of(
    program_or_weights: torch.export.ExportedProgram | Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and constant by name: an exported program's, or as given."""
    if isinstance(program_or_weights, torch.export.ExportedProgram):
        return {**program_or_weights.state_dict, **program_or_weights.constants}
    return dict(program_or_weights)


def load(
    path: str,
    weights: torch.export.ExportedProgram | Mapping[str, torch.Tensor] | None = None,
):
    """The package at `path`, loaded by torch's own loader (without Inductor's CPU probe:
    torch_adapter/aoti_load.py); with `weights` (the exported program it was built from, or
    its tensors by name), fed those: what a package built without the weights needs before
    it runs."""
    with aoti_load.without_isa_probe():
        compiled = torch._inductor.aoti_load_package(path)
    if weights is None:
        return compiled
    tensors = weights_of(weights)
    names = compiled.get_constant_fqns()
    missing = [name for name in names if name not in tensors]
    if missing:
        raise ValueError(f"the package needs weights not given: {', '.join(sorted(missing))}")
    compiled.load_constants({name: tensors[name] for name in names}, check_full_update=True)
    return compiled
