"""AOTInductor on the farm: an exported program into a .pt2 package (compile child), the
user's weights written into it, and a package loaded with other weights (client).

Without the weights (the default), the child compiles over placeholders
(compiler/exported.py) with every parameter, buffer and constant kept a constant the
package reads at load: `aot_inductor.package_constants_in_so` off and
`always_keep_tensor_constants` on (Inductor would otherwise write small ones' values into
the kernels' code). Freezing folds weights' values into the code, so it is refused there.
The package keeps its weights in one file of its archive, AOTInductor's binary blob: the
child takes that file (the placeholders) out of the package it returns and records the blob's
layout instead (`Artifact.package_weights`), after checking it against the file; the client
writes the user's own weights there (`write_package`), so the package is self-contained and
torch's loaders run it as they are, while the farm never holds a weight. With the weights
sent, the package is built as torch builds it locally, weights inside the .so.
"""

from __future__ import annotations

import io
import os
import tempfile
import time
import zipfile
from collections.abc import Mapping

import torch

from torchfarm.compiler import exported, serialize, structure
from torchfarm.compiler.compilers import CompileContext
from torchfarm.compiler.exported import BLOB, SENT
from torchfarm.compiler.inductor import ARTIFACT_FORMAT, config_patches
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.torch_adapter.compile import aoti_compile, aoti_weights_blob, autotune_progress
from torchfarm.torch_adapter.load import aoti_load

# What a package built without the user's weights needs (see above).
_WITHOUT_WEIGHTS = {
    "aot_inductor.package_constants_in_so": False,
    "always_keep_tensor_constants": True,
}
_BLOB = {"aot_inductor.package_constants_on_disk_format": "binary_blob"}


def inductor_configs(options: pb.Options, weights: str) -> dict:
    """AOTInductor's configs for `options` (the mode's and the user's patches) and where the
    package's weights come from (compiler/exported.py); ValueError for what an AOTInductor
    package cannot do."""
    if options.mode == "reduce-overhead":
        raise ValueError(
            "AOTInductor has no reduce-overhead mode: CUDA graphs are the runtime's to "
            "record (use default or max-autotune)"
        )
    configs = config_patches(options)
    if weights != SENT:
        if configs.get("freezing"):
            raise ValueError(
                "freezing folds the weights into the code: send them (weights=True) or "
                "leave freezing off"
            )
        configs.update(_WITHOUT_WEIGHTS)
        if weights == BLOB:
            configs.update(_BLOB)
    return configs


def _in_storage(storage: torch.Tensor, weight: pb.PackageWeight) -> torch.Tensor:
    """The weight as it lies in its storage's bytes (`storage`, uint8)."""
    spec = weight.tensor
    dtype = exported.dtype_of(spec)
    return storage.view(dtype).as_strided(
        tuple(spec.sizes), tuple(spec.strides), weight.storage_offset
    )


def _layout(
    archive: zipfile.ZipFile,
    recorded: list[tuple[list[aoti_weights_blob.BlobEntry], int]],
    placeholders: Mapping[str, torch.Tensor],
) -> pb.PackageWeights:
    """The blob's layout as the compile recorded it, checked against the blob it wrote: each
    weight read back at its place equals the program's placeholder of that name."""
    paths = [n for n in archive.namelist() if n.endswith(aoti_weights_blob.BLOB_SUFFIX)]
    if len(paths) != 1 or len(recorded) != 1:
        raise RuntimeError(
            f"expected one weight blob from one compile, got {paths} from {len(recorded)}"
        )
    entries, size = recorded[0]
    blob = bytearray(archive.read(paths[0]))
    if len(blob) != size:
        raise RuntimeError(f"the weight blob has {len(blob)} bytes, its layout says {size}")
    layout = pb.PackageWeights(path=paths[0], size=size)
    for entry in entries:
        placeholder = placeholders.get(entry.name)
        if placeholder is None:
            raise RuntimeError(f"the package's constant {entry.name} is none of the program's")
        weight = layout.weights.add(
            tensor=exported.describe(entry.name, entry.tensor),
            offset=entry.offset,
            storage_bytes=entry.storage_bytes,
            storage_offset=entry.tensor.storage_offset(),
        )
        if not entry.storage_bytes:
            continue
        storage = torch.frombuffer(
            blob, dtype=torch.uint8, count=entry.storage_bytes, offset=entry.offset
        )
        if not torch.equal(_in_storage(storage, weight), placeholder.detach().cpu()):
            raise RuntimeError(
                f"{entry.name} is not where the recorded layout puts it in the weight blob "
                f"(torch {torch.__version__}): the blob's format changed"
            )
    return layout


def _without(archive: zipfile.ZipFile, path: str) -> bytes:
    """The archive's bytes without the file `path`."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as kept:
        for info in archive.infolist():
            if info.filename != path:
                kept.writestr(info, archive.read(info))
    return out.getvalue()


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
        layout = None
        with (
            tempfile.TemporaryDirectory() as directory,
            autotune_progress.reporting(context.on_stage),
            aoti_weights_blob.recording() as recorded,
        ):
            path = aoti_compile.compile_and_package(
                program, os.path.join(directory, "model.pt2"), configs
            )
            if weights == BLOB:
                with zipfile.ZipFile(path) as archive:
                    layout = _layout(archive, recorded, weights_of(program))
                    package = _without(archive, layout.path)
            else:
                with open(path, "rb") as f:
                    package = f.read()
        return pb.Artifact(
            format=ARTIFACT_FORMAT,
            package=package,
            package_weights=layout,
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


def _storage_bytes(weight: pb.PackageWeight, tensor: torch.Tensor) -> memoryview:
    """`tensor`'s values laid out as the package's weight: its storage's bytes."""
    spec = weight.tensor
    if str(tensor.dtype).removeprefix("torch.") != spec.dtype or list(tensor.shape) != list(
        spec.sizes
    ):
        raise ValueError(
            f"{spec.name}: the package was built for {spec.dtype} {list(spec.sizes)}, "
            f"not {tensor.dtype} {list(tensor.shape)}"
        )
    storage = torch.zeros(weight.storage_bytes, dtype=torch.uint8)
    if weight.storage_bytes:
        _in_storage(storage, weight).copy_(tensor.detach())
    return storage.numpy().data


def write_package(
    path: str,
    artifact: pb.Artifact,
    weights: torch.export.ExportedProgram | Mapping[str, torch.Tensor],
) -> None:
    """Write the artifact's package to `path`, with `weights` (the exported program it was
    built from, or its tensors by name) in its weight blob where the farm left it out:
    a package torch's loaders run as it is. ValueError where a weight is missing or of
    another dtype or shape."""
    layout = artifact.package_weights if artifact.HasField("package_weights") else None
    tensors = weights_of(weights)
    names = [w.tensor.name for w in layout.weights] if layout else []
    missing = [name for name in names if name not in tensors]
    if missing:
        raise ValueError(f"the package needs weights not given: {', '.join(sorted(missing))}")
    with open(path, "w+b") as f:
        f.write(artifact.package)
        if layout is None:
            return
        with zipfile.ZipFile(f, "a") as archive:
            info = zipfile.ZipInfo(layout.path)
            info.file_size = layout.size  # zip64 where the blob needs it
            with archive.open(info, "w") as blob:
                written = 0
                for weight in layout.weights:
                    if not written <= weight.offset <= layout.size - weight.storage_bytes:
                        raise ValueError(f"{weight.tensor.name}: outside the weight blob")
                    blob.write(bytes(weight.offset - written))
                    blob.write(_storage_bytes(weight, tensors[weight.tensor.name]))
                    written = weight.offset + weight.storage_bytes
                blob.write(bytes(layout.size - written))


def load(
    path: str,
    weights: torch.export.ExportedProgram | Mapping[str, torch.Tensor] | None = None,
):
    """The package at `path`, loaded by torch's own loader (without Inductor's CPU probe:
    torch_adapter/load/aoti_load.py); with `weights` (an exported program of the same
    architecture, or its tensors by name), fed those in place of the package's own."""
    compiled = aoti_load.load_package(path)
    if weights is None:
        return compiled
    tensors = weights_of(weights)
    names = compiled.get_constant_fqns()
    missing = [name for name in names if name not in tensors]
    if missing:
        raise ValueError(f"the package needs weights not given: {', '.join(sorted(missing))}")
    compiled.load_constants({name: tensors[name] for name in names}, check_full_update=True)
    return compiled
