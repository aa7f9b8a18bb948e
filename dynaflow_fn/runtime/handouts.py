"""Outputs handed out without a copy, and whether any caller still holds them.

A CUDA graph writes its outputs at fixed addresses. Copying them out on every call costs a kernel
and an allocation per output (about 10 us of host time each) and their bytes in device bandwidth.
Most callers let go of a call's results before the next call: a timing loop, a decoding loop that
keeps only the sampled token, transformers' generate() (which deletes each step's outputs). Others
keep them one call longer (`loss = step(batch)` still holds the last loss while the next call runs),
or keep them all. So `cudagraph` hands out the graph's own output buffers, and replays a graph only
while no caller holds what it writes; a call whose buffers are held replays another capture of the
plan (see the cudagraph module).

"Holds" is counted, not guessed. Each storage an output lives in is handed out through an alias
(`compat.storage_alias`): a second storage over the same memory, which nothing but handouts and
their views share, so the alias is held exactly while its storage's count is above the alias's own.
The alias also keeps the memory alive: a handout kept after its function is gone stays valid (no
graph writes it any more).
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Callable, Sequence

import torch

from .. import compat


class Handouts:
    """The aliases that hand out the memory one set of captures writes: one capture's output memory, or
    an output buffer that the bucket plans of a function share (see `shared_pool`)."""

    def __init__(self) -> None:
        self._aliases: dict[tuple[compat.StorageWeakRef, torch.dtype], _Counted] = {}
        self._lock = threading.Lock()

    def makers(self, tensors: Sequence[torch.Tensor], inherited: Handouts | None = None,
               ) -> list[Callable[[], torch.Tensor] | None]:
        """What makes a handout of each of `tensors`, which a graph writes: a fresh view of its alias on
        each call, so that nothing a caller does to one (a resize, `t.data = ...`) reaches the next; None
        where its memory cannot be aliased, to be copied out instead. Memory that `inherited` (the
        handouts of an executable this one replaces) hands out already keeps its alias, so that what
        callers still hold of it counts here."""
        with self._lock:
            return [self._maker(tensor, inherited) for tensor in tensors]

    def _maker(self, tensor: torch.Tensor, inherited: Handouts | None) -> Callable[[], torch.Tensor] | None:
        key = (compat.StorageWeakRef(tensor.untyped_storage()), tensor.dtype)
        counted = self._aliases.get(key)
        if counted is None and inherited is not None:
            counted = inherited._aliases.get(key)
        if counted is None:
            counted = _Counted.of(tensor)
            if counted is None:
                return None
        self._aliases[key] = counted
        return counted.template(tensor).detach

    def held(self) -> bool:
        """Whether a caller holds any handout (or a view of one, or its storage) of this memory now."""
        for counted in self._aliases.values():
            if counted.held():
                return True
        return False


def is_handout(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is an output a CUDA graph handed out, or a view of one: memory at an address
    that graph writes on every replay of its capture, for as long as the graph lives. A training
    step's backward reads such tensors (the activations its forward saved) in place."""
    return compat.StorageWeakRef(tensor.untyped_storage()) in _HANDED_OUT


_HANDED_OUT: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
"""Every alias handed out from (its storage -> its `_Counted`), while the alias lives."""


class _Counted:
    """An alias, the templates handouts are made from (one per output layout: `detach()` of a template
    is a fresh tensor with its layout, at a third of the host time of `as_strided`), and what holds the
    alias when no caller does: the templates, counted as they are made (each holds the storage once, as
    `compat.storage_alias` checked), and the counts read right after the alias was made. Nothing here
    lets go of a template before the alias goes: the count of what is ours only grows, so a held
    handout can never read as free."""

    def __init__(self, tensors_holding: Callable[[], int], storage: torch.UntypedStorage, whole: torch.Tensor):
        self.tensors_holding, self.storage, self.whole = tensors_holding, storage, whole
        self.tensors = self.objects = 0
        self.templates: dict[tuple, torch.Tensor] = {}

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _Counted | None:
        """The alias of `tensor`'s memory (`compat.storage_alias`), counted once nothing but this holds it."""
        alias = compat.storage_alias(tensor)
        if alias is None:
            return None
        counted = cls(alias.tensors_holding, alias.storage, alias.tensor)
        del alias
        _HANDED_OUT[compat.StorageWeakRef(counted.storage)] = counted
        counted.tensors, counted.objects = counted.tensors_holding(), sys.getrefcount(counted.storage)
        return counted

    def template(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor with `tensor`'s layout on the alias, held as long as the alias is (an executable that
        replaces another makes its handouts from the same templates)."""
        layout = (tensor.size(), tensor.stride(), tensor.storage_offset())
        template = self.templates.get(layout)
        if template is None:
            template = self.templates[layout] = self.whole.as_strided(*layout)
            self.tensors += 1
        return template

    def held(self) -> bool:
        return self.tensors_holding() > self.tensors or sys.getrefcount(self.storage) > self.objects
