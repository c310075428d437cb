"""What the graph's descriptor (compiler/descriptor.py) reads beyond public attributes: the
parts of a FakeTensor's MetaTensorDesc (what the payload carries) that have no public name,
and an operator's kind.

Uses Tensor._is_view, Tensor._base, torch._C._autograd._get_creation_meta,
UntypedStorage._cdata, Dynamo's `_dynamo_dynamic_indices`
and `_dynamo_hint_overrides` tensor attributes (what torch._subclasses.meta_utils describes),
torch._ops.OperatorBase and OpOverloadPacket. Verified: torch 2.13.0.
"""

from __future__ import annotations

import torch

__all__ = ["creation_meta", "dynamic_marks", "is_operator", "storage_id", "view_base"]


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor `t` is a view of, else None."""
    return t._base if t._is_view() else None


def creation_meta(t: torch.Tensor) -> str:
    """How autograd made the view `t` (in no_grad, by a multi-output op...): the payload
    carries it, and AOTAutograd refuses some in-place changes by it."""
    return str(torch._C._autograd._get_creation_meta(t))


def storage_id(storage: torch.UntypedStorage) -> int:
    """The identity of the storage behind tensors (two views of one share it)."""
    return storage._cdata


def dynamic_marks(t: torch.Tensor) -> tuple:
    """Dynamo's marks on the tensor (dims marked dynamic, hint overrides): in the payload."""
    overrides = getattr(t, "_dynamo_hint_overrides", None)
    return (
        tuple(getattr(t, "_dynamo_dynamic_indices", ())),
        tuple(sorted(overrides.items())) if overrides else (),
    )


def is_operator(target: object) -> bool:
    """A torch operator (OpOverload, OpOverloadPacket, HigherOrderOperator): named by str."""
    return isinstance(target, (torch._ops.OperatorBase, torch._ops.OpOverloadPacket))
