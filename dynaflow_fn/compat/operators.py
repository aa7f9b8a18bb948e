"""Operator and storage facts: schemas, registered kernels, which tensors share memory."""

from __future__ import annotations

import functools
import sys
from typing import Callable, NamedTuple

import torch
import torch.utils.dlpack

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


class StorageAlias(NamedTuple):
    """All of a storage's memory as one flat `tensor` on a storage of its own, that storage's one Python
    object (`storage`: what `untyped_storage()` of any tensor on it returns), and `tensors_holding()`:
    how many tensors hold that storage now (a C function)."""

    tensor: torch.Tensor
    storage: torch.UntypedStorage
    tensors_holding: Callable[[], int]


def storage_alias(tensor: torch.Tensor) -> StorageAlias | None:
    """A second storage over the memory of `tensor`'s storage, whose holders can be counted: the only
    storage that shares memory with another without sharing its reference count.

    The alias comes from DLPack (public): `from_dlpack` wraps the memory in a new storage whose deleter
    keeps the original alive, so a view of the alias stays valid however long it is kept. Its holders
    are counted two ways, both needed: tensors by `torch._C._storage_Use_Count` (private: what
    torch.compile's CUDA graphs count their outputs' holders with), and the storage's Python object,
    which that count does not see, by its Python reference count. Both are seen to rise, by one for a
    view and for the storage object, before the alias is handed back. None where the count is missing or
    the memory cannot be wrapped (a dtype DLPack lacks, a storage not a whole number of elements):
    callers then copy instead."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    storage = tensor.untyped_storage()
    itemsize = tensor.element_size()
    if use_count is None or storage.nbytes() == 0 or storage.nbytes() % itemsize:
        return None
    whole = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(storage, 0, (storage.nbytes() // itemsize,))
    try:
        alias = torch.utils.dlpack.from_dlpack(whole)
    except (RuntimeError, TypeError, ValueError, BufferError):
        return None
    own = alias.untyped_storage()
    if own._cdata == storage._cdata or alias.data_ptr() != storage.data_ptr():
        return None
    del whole, storage
    tensors_holding = functools.partial(use_count, own._cdata)
    tensors, objects = tensors_holding(), sys.getrefcount(own)
    probe = alias[:1]
    seen_view = tensors_holding() == tensors + 1
    probe = probe.untyped_storage()
    seen_storage = sys.getrefcount(own) > objects
    del probe
    if not (seen_view and seen_storage) or (tensors_holding(), sys.getrefcount(own)) != (tensors, objects):
        return None
    return StorageAlias(alias, own, tensors_holding)
