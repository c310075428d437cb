"""torch.export programs compiled on the farm: `torchfarm.aoti_compile_and_package`.

The program goes to the pool of its target as an ExportedProgram payload
(compiler/exported.py), weights left home unless asked, and comes back as the package the
pool's compiler built (AOTInductor's .pt2), signed by a worker and verified here before it is
written. Built without the weights, the package comes without its weight blob: this process
writes the program's own weights into it (compiler/aoti.write_package), so what lands on disk
is self-contained. It is keyed, cached and single-flighted as a Dynamo graph is: the key
hashes the payload, target and options (the compiler's name among them), so a second request
for the same program, from anyone whose weights differ or not, is a hit on the same package.

A farm that cannot answer (none configured, unreachable, failing) leaves the package to a
local AOTInductor compile, with one warning, where the target is this machine's; a package
for another machine's target has no local way and raises.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from google.protobuf import json_format

from torchfarm.client import keywords, remote
from torchfarm.client.progress import ProgressLine
from torchfarm.compiler import aoti, exported
from torchfarm.compiler.exported import BLOB, SENT
from torchfarm.compiler.target import local_target
from torchfarm.contract.cache_key import public_key
from torchfarm.contract.options import AOTI, canonical_options
from torchfarm.errors import FarmError
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import ClientSettings
from torchfarm.torch_adapter.compile import aoti_compile, standalone
from torchfarm.torch_adapter.trace import export_serde

if TYPE_CHECKING:  # typing.Unpack is Python 3.11's; the package supports 3.10
    from typing_extensions import Unpack

log = logging.getLogger("torchfarm.client")


class PackageOptions(TypedDict, total=False):
    """What to build, for which target, through which farm (defaults: DEFAULTS):
    `inductor_configs` as torch's aoti_compile_and_package takes them, torch.compile's `mode`,
    the `target` (a pb.Target, a `torchfarm target` file, or None: this machine's), whether
    to send the `weights`, and the farm's `settings` (None: from the environment)."""

    inductor_configs: Mapping[str, Any] | None
    mode: str
    target: pb.Target | str | None
    weights: bool
    settings: ClientSettings | None


DEFAULTS: PackageOptions = {
    "inductor_configs": None,
    "mode": "default",
    "target": None,
    "weights": False,
    "settings": None,
}


def _device_of(program: torch.export.ExportedProgram) -> str:
    """cuda where any of the program's tensors is on a CUDA device, else cpu."""
    tensors = [*program.state_dict.values(), *program.constants.values()]
    if program.example_inputs is not None:
        tensors += export_serde.flatten_inputs(program.example_inputs)[0]
    cuda = any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in tensors)
    return "cuda" if cuda else "cpu"


def _target(target: pb.Target | str | None, program: torch.export.ExportedProgram) -> pb.Target:
    """The target given, read from a `torchfarm target` file, or this machine's."""
    if isinstance(target, pb.Target):
        return target
    if target:
        with open(target) as f:
            return json_format.Parse(f.read(), pb.Target())
    return local_target(_device_of(program))


def package_artifact(
    program: torch.export.ExportedProgram, compiler: str = AOTI, **options: Unpack[PackageOptions]
) -> tuple[pb.Artifact, str]:
    """The artifact `compiler` built on the farm for `program` (verified), whose `package`
    is the package, and how it came ("hit", "miss", "merged"). ValueError for options the
    compiler refuses; FarmError where the farm could not give one."""
    chosen = keywords.chosen(package_artifact, options, DEFAULTS)
    configs, weights = chosen["inductor_configs"], chosen["weights"]
    farm_options = canonical_options(
        pb.Options(
            mode=chosen["mode"],
            config_patches_json=json.dumps(dict(configs)) if configs else "",
            compiler=compiler,
        )
    )
    if compiler == AOTI:  # what the worker would refuse, refused here
        aoti.inductor_configs(farm_options, SENT if weights else BLOB)
    settings = chosen["settings"] or ClientSettings.from_env()
    if not settings.addr:
        raise FarmError("no farm configured (TORCHFARM_ADDR)")
    job_target = _target(chosen["target"], program)
    payload = exported.dumps(program, weights)
    key = public_key(payload, job_target, farm_options)
    label = "exported program"
    request = pb.CompileRequest(
        graph=payload,
        target=job_target,
        options=farm_options,
        label=label,
        private=settings.private,
    )
    ask = pb.Ask(key=key, private=settings.private, label=label)
    request_id = uuid.uuid4().hex[:16]
    trusted = remote.verifier(settings, request_id)
    progress = ProgressLine(label, settings.progress)
    try:
        received = remote.get(ask, request, settings, remote.Listeners(request_id, progress))
    finally:
        progress.close()
    artifact = remote.verified_artifact(received, key, trusted)
    if not artifact.package:
        raise FarmError(f"the farm's {compiler} entry of key {key[:16]} holds no package")
    if compiler == AOTI and not weights and not artifact.HasField("package_weights"):
        raise FarmError(
            f"the farm's package of key {key[:16]} has no weight blob layout (a worker from "
            "before issue 52?)"
        )
    return artifact, received.header.source


def _package_path(package_path: str | os.PathLike | None) -> str:
    if package_path is None:
        handle, path = tempfile.mkstemp(prefix="torchfarm-", suffix=".pt2")
        os.close(handle)
        return path
    path = os.fspath(package_path)
    if not path.endswith(".pt2"):
        raise ValueError(f"a package path ends in .pt2: {path!r}")
    return path


def aoti_compile_and_package(
    exported_program: torch.export.ExportedProgram,
    package_path: str | os.PathLike | None = None,
    **options: Unpack[PackageOptions],
) -> str:
    """torch._inductor.aoti_compile_and_package on the farm: the path of the .pt2 package
    built for `target`'s pool (a pb.Target, a `torchfarm target` file, or this machine's);
    the other keywords as PackageOptions says.

    The package is self-contained either way: `torch._inductor.aoti_load_package(path)`
    and torch's C++ AOTIModelPackageLoader run it as it is. `weights=False` (the default)
    sends no weights: the farm builds the package without them and this process writes the
    program's own into it. `weights=True` sends them (needed for freezing), and the farm
    builds them in. Dynamic dims the program was exported with (torch.export.Dim) hold."""
    chosen = keywords.chosen(aoti_compile_and_package, options, DEFAULTS)
    path = _package_path(package_path)
    started = time.monotonic()
    try:
        artifact, source = package_artifact(exported_program, **chosen)
    except FarmError as e:
        target = chosen["target"]
        if target is not None and _target(target, exported_program) != local_target(
            _device_of(exported_program)
        ):
            raise
        log.warning("torchfarm: %s; compiling the package locally", e)
        configs = dict(chosen["inductor_configs"] or {})
        if chosen["mode"] != "default":
            configs = {**standalone.mode_options(chosen["mode"]), **configs}
        return aoti_compile.compile_and_package(exported_program, path, configs)
    writing = time.monotonic()
    aoti.write_package(path, artifact, exported_program)
    log.info(
        "torchfarm: package %s from the farm (%s, %.1f s; its weights written in %.2f s)",
        path,
        source,
        time.monotonic() - started,
        time.monotonic() - writing,
    )
    return path


def aoti_load_package(
    path: str | os.PathLike,
    weights: torch.export.ExportedProgram | Mapping[str, torch.Tensor] | None = None,
):
    """The package at `path`, loaded by torch._inductor.aoti_load_package (without
    Inductor's CPU probe); with `weights` (an exported program of the same architecture, or
    its tensors by name), fed those in place of the package's own."""
    return aoti.load(os.fspath(path), weights)
