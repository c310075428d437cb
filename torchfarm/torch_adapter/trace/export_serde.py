"""A torch.export program as JSON without its tensors, and back from JSON and given tensors.

torch.export.save pickles the program's weights, constants and example inputs (torch.save)
beside the program's JSON, and torch.export.load reads them with `torch.load`, falling back
to `weights_only=False` (a full unpickle) where that fails. The farm takes neither: the
client sends the JSON alone and describes the tensors itself (compiler/exported.py); the
compile child rebuilds the program from the JSON and tensors it made, so nothing is ever
unpickled. The JSON's symbolic expressions still go through `sympy.sympify` (eval): it is
read in a compile child only.

Stack traces (the user's file paths and line numbers) are left out of the JSON, so one
program exported in any checkout gives the same bytes, hence one key.

Uses torch._export.serde.serialize: `serialize`, with `serialize_torch_artifact` (which
torch.saves the tensors) patched to write nothing (2.11 has no `serialize_state_dict=False`),
`_bytes_to_dataclass` (JSON into its schema) and `ExportedProgramDeserializer.deserialize`
given dicts of tensors (which it takes as they are, never loading any); and
torch.utils._pytree's JSON form of a structure (`treespec_dumps` / `treespec_loads`, whose
enum contexts import the module they name).
Verified: torch 2.11.0, 2.13.0 and 2.15.0 (CPU).
"""

from __future__ import annotations

import json
from unittest import mock

import torch
import torch.utils._pytree as pytree
from torch._export.serde import serialize as serde

# Node metadata that names the user's files, left out of the payload.
_PER_USER_METADATA = ("stack_trace",)


def _without_stack_traces(value: object) -> object:
    """The JSON value with every node's stack trace removed (anywhere it nests: subgraphs of
    torch.cond and the like are graphs inside the graph)."""
    if isinstance(value, dict):
        kept = {k: _without_stack_traces(v) for k, v in value.items()}
        metadata = kept.get("metadata")
        if isinstance(metadata, dict):
            kept["metadata"] = {k: v for k, v in metadata.items() if k not in _PER_USER_METADATA}
        return kept
    if isinstance(value, list):
        return [_without_stack_traces(v) for v in value]
    return value


def program_json(program: torch.export.ExportedProgram) -> bytes:
    """The program's JSON as torch.export writes it, without its tensors or stack traces, in
    canonical form (sorted keys, compact)."""
    with mock.patch.object(serde, "serialize_torch_artifact", lambda *args, **kwargs: b""):
        artifact = serde.serialize(program)
    document = _without_stack_traces(json.loads(artifact.exported_program))
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def program_from_json(
    document: bytes,
    state_dict: dict[str, torch.Tensor],
    constants: dict[str, torch.Tensor],
    example_inputs: tuple[tuple, dict],
) -> torch.export.ExportedProgram:
    """The program of `document` (program_json) over the given tensors. Runs sympify on the
    JSON's expressions: compile child only."""
    program = serde._bytes_to_dataclass(serde.ExportedProgram, document)
    return serde.ExportedProgramDeserializer().deserialize(
        program, state_dict, constants, example_inputs
    )


def flatten_inputs(example_inputs: tuple[tuple, dict]) -> tuple[list[torch.Tensor], str]:
    """The example inputs' leaves and their structure as JSON; ValueError where a leaf is
    not a tensor."""
    leaves, spec = pytree.tree_flatten(example_inputs)
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise ValueError(
                f"example input {i} is a {type(leaf).__name__}: the farm takes programs "
                "whose inputs are tensors"
            )
    return leaves, pytree.treespec_dumps(spec)


def unflatten_inputs(leaves: list[torch.Tensor], spec: str) -> tuple[tuple, dict]:
    """(args, kwargs) from flatten_inputs' leaves and JSON. Node types are pytree's
    registered ones, but a node's context may name an enum by module path, which pytree
    imports (`enum_object_hook`): compile child only, like the program's JSON."""
    inputs = pytree.tree_unflatten(leaves, pytree.treespec_loads(spec))
    if not (isinstance(inputs, tuple) and len(inputs) == 2):
        raise ValueError("example inputs are not (args, kwargs)")
    return inputs
