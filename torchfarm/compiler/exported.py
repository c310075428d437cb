"""torch.export program <-> payload bytes (the ExportedProgram message), for AOTInductor.

The client sends the program's JSON (torch_adapter/trace/export_serde.py) and a TensorSpec per
parameter, buffer, constant and example input: names, dtypes, sizes, strides, devices, and
their values only where the user sends the weights. The weights therefore stay on the user's
machine by default, and the payload's bytes (the key) are the same for the same program
whatever its weights. The compile child rebuilds the program over tensors it makes itself:
the values sent, or placeholders, never unpickling anything.

Placeholders hold a small non-uniform pattern rather than zeros, so that nothing in the
compile can take a weight's value for a uniform constant; the compiler keeps every tensor a
constant read at load from the package's weight blob, which the client writes
(compiler/aoti.py), so the package never depends on them.
"""

from __future__ import annotations

import re

import torch

from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.torch_adapter.trace import export_serde

_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in vars(torch).values()
    if isinstance(dtype, torch.dtype)
}
_DEVICE = re.compile(r"cpu|cuda(:\d{1,2})?")
# Where a package's weights come from: sent in the payload (built into the .so), a blob the
# client writes into the package, or fed at load by the client (before issue 52).
SENT, BLOB, FED = "sent", "blob", "fed"


def describe(name: str, tensor: torch.Tensor) -> pb.TensorSpec:
    """The tensor's spec without its values."""
    return pb.TensorSpec(
        name=name,
        dtype=str(tensor.dtype).removeprefix("torch."),
        sizes=tensor.shape,
        strides=tensor.stride(),
        device=str(tensor.device),
        parameter=isinstance(tensor, torch.nn.Parameter),
        requires_grad=tensor.requires_grad,
    )


def dtype_of(spec: pb.TensorSpec) -> torch.dtype:
    """The spec's dtype; ValueError for a name torch does not have."""
    dtype = _DTYPES.get(spec.dtype)
    if dtype is None:
        raise ValueError(f"{spec.name}: unknown dtype {spec.dtype!r}")
    return dtype


def _spec(name: str, tensor: torch.Tensor, weights: bool) -> pb.TensorSpec:
    if not isinstance(tensor, torch.Tensor) or type(tensor) not in (
        torch.Tensor,
        torch.nn.Parameter,
    ):
        raise ValueError(
            f"{name}: the farm takes plain tensors only, not {type(tensor).__name__} "
            "(a script object, tensor subclass or other value)"
        )
    spec = describe(name, tensor)
    if weights:
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        spec.data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return spec


def dumps(program: torch.export.ExportedProgram, weights: bool = False) -> bytes:
    """The payload of `program`: its JSON and its tensors described, their values only with
    `weights`. ValueError for what the farm cannot take (script objects, tensor subclasses,
    example inputs other than tensors)."""
    if program.example_inputs is None:
        raise ValueError("the exported program has no example inputs (torch.export sets them)")
    leaves, inputs_spec = export_serde.flatten_inputs(program.example_inputs)
    payload = pb.ExportedProgram(
        program_json=export_serde.program_json(program),
        state_dict=[_spec(n, t, weights) for n, t in sorted(program.state_dict.items())],
        constants=[_spec(n, t, weights) for n, t in sorted(program.constants.items())],
        example_inputs=[_spec(f"input {i}", t, False) for i, t in enumerate(leaves)],
        example_inputs_spec=inputs_spec,
        weights=weights,
        weights_blob=not weights,
    )
    return payload.SerializeToString(deterministic=True)


def _tensor(spec: pb.TensorSpec, weights: bool) -> torch.Tensor:
    """The tensor a spec describes: its values (`weights`) or the placeholder pattern."""
    dtype = dtype_of(spec)
    if not _DEVICE.fullmatch(spec.device):
        raise ValueError(f"{spec.name}: unknown device {spec.device!r}")
    if len(spec.strides) != len(spec.sizes) or min((*spec.sizes, *spec.strides), default=0) < 0:
        raise ValueError(f"{spec.name}: malformed sizes {spec.sizes} or strides {spec.strides}")
    numel = 1
    for size in spec.sizes:
        numel *= size
    if weights:
        expected = numel * dtype.itemsize
        if len(spec.data) != expected:
            raise ValueError(f"{spec.name}: {len(spec.data)} bytes of values, not {expected}")
        values = (
            torch.frombuffer(bytearray(spec.data), dtype=dtype)
            if numel
            else torch.empty(0, dtype=dtype)
        )
    else:
        pattern = torch.arange(numel) % 7 + 1
        values = (pattern % 2 if dtype == torch.bool else pattern).to(dtype)
    tensor = torch.empty_strided(tuple(spec.sizes), tuple(spec.strides), dtype=dtype)
    tensor.copy_(values.reshape(tuple(spec.sizes)))
    tensor = tensor.to(spec.device)
    if spec.parameter:
        return torch.nn.Parameter(tensor, requires_grad=spec.requires_grad)
    return tensor.requires_grad_(spec.requires_grad)


def loads(payload: bytes) -> tuple[torch.export.ExportedProgram, str]:
    """The program of a payload over tensors made here, and where the package's weights
    come from: SENT (the tensors hold the user's), BLOB or FED (placeholders; see the
    message). Parses the program's JSON (sympify): compile child only."""
    message = pb.ExportedProgram.FromString(payload)
    weights = message.weights
    state_dict = {s.name: _tensor(s, weights) for s in message.state_dict}
    constants = {s.name: _tensor(s, weights) for s in message.constants}
    leaves = [_tensor(s, False) for s in message.example_inputs]
    example_inputs = export_serde.unflatten_inputs(leaves, message.example_inputs_spec)
    program = export_serde.program_from_json(
        message.program_json, state_dict, constants, example_inputs
    )
    return program, SENT if weights else BLOB if message.weights_blob else FED
