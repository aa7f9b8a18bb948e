"""Which input tensors are a program's *state*: read by a CUDA graph at their own address, never copied.

A CUDA graph reads fixed addresses, so every input it does not read in place is copied into a static
buffer before each replay. For activations that is right (a new `x` arrives every call); for a model's
state it is ruinous (at 64 decode sequences the KV caches alone are 2 GB per call). What counts as
state, without the caller saying so:

* `nn.Parameter`s;
* the tensors `df.pure` hands out: a module's parameters *and* buffers (KV caches, running
  statistics, rotary tables), wherever they are passed afterwards;
* tensors marked with `torch._dynamo.mark_static_address`, the declaration torch.compile's CUDA
  graphs honour, so that one mark serves both.

`persistent_argnums` and `donate_argnums` name more (by position), and closed-over tensors are
always read in place. Reading in place keeps eager semantics: in-place updates between calls are
seen, writes land in the caller's tensor, and a tensor replaced by a new one captures again.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch

from .. import compat

_module_state: dict[int, weakref.ref] = {}
"""id -> weak reference of each tensor `df.pure` handed out (a tensor compares by value, so a
WeakSet cannot be asked about one; the id is confirmed by the reference)."""


def register_module_state(tensors: Iterable[torch.Tensor]) -> None:
    """Remember tensors as module state for as long as they live."""
    for tensor in tensors:
        key = id(tensor)
        _module_state[key] = weakref.ref(tensor, lambda _, key=key: _module_state.pop(key, None))


def is_state(tensor: torch.Tensor) -> bool:
    """Whether a CUDA graph reads this input in place by default (see the module docstring)."""
    if isinstance(tensor, torch.nn.Parameter) or compat.marked_static_address(tensor):
        return True
    reference = _module_state.get(id(tensor))
    return reference is not None and reference() is tensor
