"""Operator and storage facts: schemas, registered kernels, which tensors share memory."""

from __future__ import annotations

import torch

from torch.multiprocessing.reductions import StorageWeakRef
"""A hashable, weak handle on a tensor's storage (fake storages included): which tensors alias."""

OpOverload = torch._ops.OpOverload
"""The type of `torch.ops.aten.mm.default`: one overload of an operator, with a schema."""


def op_schema(op: OpOverload) -> torch.FunctionSchema:
    """The schema of an op overload: its arguments and results, and which of them alias or are written
    (`aten::add_.Tensor(Tensor(a!) self, Tensor other, *, Scalar alpha=1) -> Tensor(a!)`). OpOverload
    keeps it in `_schema`; without that, the dispatcher's registry is asked by the public `op.name()`."""
    schema = getattr(op, "_schema", None)
    if schema is not None:
        return schema
    name, _, overload = op.name().partition(".")
    return torch._C._get_schema(name, overload)


def has_kernel_for(op: OpOverload, dispatch_key: str) -> bool:
    """Whether `op` registers a kernel for `dispatch_key` (e.g. "CompositeExplicitAutograd").

    Without the dispatcher query, answer True: callers use it to rule kernels out, and ruling one
    out only costs speed (an allocation instead of an out= write)."""
    query = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
    return True if query is None else bool(query(op.name(), dispatch_key))


def has_internal_overlap(tensor: torch.Tensor) -> bool:
    """Whether some elements of `tensor` share memory (an expanded or overlapping-stride view).

    Fallback: True unless each stride (smallest first) steps past every element the smaller ones
    reach, which is conservative (callers then keep an op out of place)."""
    query = getattr(torch, "_debug_has_internal_overlap", None)
    if query is not None:
        return query(tensor) == 1
    reach = 0
    for stride, size in sorted((s, n) for s, n in zip(tensor.stride(), tensor.shape) if n > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False
