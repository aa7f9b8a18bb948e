"""What a call must satisfy to run the plan of an earlier call, checked cheaply on every call.

A plan is built from one call's arguments and from Python state that tracing and capture read:

* the arguments' pytree structure, each tensor's shape, strides, dtype and device, and each static
  leaf's value (`signature`; the cache key, as in `jax.jit`);
* process-wide settings that change what is traced or which kernels a CUDA graph captures (autocast,
  the default dtype and device, deterministic algorithms, TF32 and reduced-precision matmuls:
  `call_state`);
* the `training` flag of every module whose flag the trace read (dropout, batch norm: `mode_reads`);
* the tensors the function closes over (their layout; they are read in place);
* the Python state of the modules the trace called or closes over, and of a jitted method's
  instance: hooks, submodules, parameters, attributes (`object_watch`, one counter per call).

Hashing the full key costs about half a microsecond per leaf, as long as a replay for a decode step
with hundreds of weights, so a call first asks the `Guard` of the entry used last: tensors read in
place (parameters, donated and persistent arguments, closed-over tensors) are recognized by identity
and version counter, everything else is compared in full.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Callable, Sequence

import torch

from .. import compat
from ..errors import GradientError, InputError

_VERSION = operator.attrgetter("_version")
_TRAINING = operator.attrgetter("training")


def static_key(leaf: Any) -> Any:
    """A static leaf's part of the cache key: equal exactly when tracing would bake in the same value.

    `==` is not that: `0.0 == -0.0` (but 1 / -0.0 is -inf) and `nan != nan` (a NaN would never hit).
    Floats are keyed by their bits, frozen dataclasses field by field (their `==` compares floats the
    same lossy way), everything else by type and value (so True and 1 differ)."""
    if isinstance(leaf, float):
        return float, leaf.hex() if not math.isnan(leaf) else "nan"
    if isinstance(leaf, complex):
        return complex, static_key(leaf.real), static_key(leaf.imag)
    if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
        return type(leaf), tuple(static_key(getattr(leaf, f.name)) for f in dataclasses.fields(leaf))
    return type(leaf), leaf


def signature(leaves: Sequence[Any]) -> tuple:
    """Per leaf: a tensor's shape, strides, dtype and device (the fields of `TensorSpec`, as a plain
    tuple: this runs on every call that misses the fast check), or a static leaf's key."""
    return tuple([(leaf.shape, leaf.stride(), leaf.dtype, leaf.device) if isinstance(leaf, torch.Tensor)
                  else static_key(leaf) for leaf in leaves])


_AUTOCAST_DEVICES = ("cuda", "cpu")
_default_dtype, _deterministic = torch.get_default_dtype, torch.are_deterministic_algorithms_enabled
_any_autocast, _function_modes, _matmul = compat.any_autocast_enabled, compat.torch_function_mode_active, \
    compat.matmul_settings


def call_state() -> tuple:
    """The process-wide settings a plan depends on besides its arguments, as one comparable tuple.

    Tracing reads autocast (it inserts casts), the default dtype and device (factory calls in the
    function) and any active torch-function mode; a CUDA graph freezes the kernels chosen under the
    matmul precision and determinism settings. Grad mode is not here: tracing always runs without
    gradients, and how a call's outputs relate to autograd is decided per call."""
    autocast = () if not _any_autocast() else tuple(
        (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) for device in _AUTOCAST_DEVICES)
    modes = () if not _function_modes() else (str(torch.get_default_device()),)
    return _default_dtype(), _deterministic(), _matmul(), autocast, modes


def picker(positions: Sequence[int]) -> Callable[[Sequence[Any]], tuple]:
    """A fast `lambda items: tuple(items[i] for i in positions)`."""
    if len(positions) > 1:
        return operator.itemgetter(*positions)
    if positions:
        only = positions[0]
        return lambda items: (items[only],)
    return lambda items: ()


class Guard:
    """Whether a call fits the call that made this guard, cheaply.

    Leaves read in place are tensors read in place: recognized by identity and version counter, which every
    in-place change of shape or layout bumps (resize_, set_, t_, unsqueeze_, ...); the executable
    checks their addresses. What this cannot see is `t.data = v` with `v` at t's own address in
    another layout. Every other leaf is compared in full, as in the cache key, and so are the call
    state and the training flags the trace read. Tensors the function closes over
    are the same objects on every call: those read in place (`captured_in_place`) are checked by
    version, the others (`captured_compared`) in full. The `watch` (an `object_watch.ObjectWatch`)
    says whether the modules' Python state is still as traced.
    """

    def __init__(self, treedef: Any, leaves: Sequence[Any], in_place: Sequence[int], state: tuple,
                 modules: Sequence[torch.nn.Module] = (), captured_in_place: Sequence[torch.Tensor] = (),
                 captured_compared: Sequence[torch.Tensor] = (), watch: Any = None):
        self.treedef = treedef
        self.state = state
        self.pick_in_place = picker(in_place)
        chosen = set(in_place)
        self.pick_rest = picker([i for i in range(len(leaves)) if i not in chosen])
        self.in_place = self.pick_in_place(leaves)
        self.versions = list(map(_VERSION, self.in_place))
        self.rest = signature(self.pick_rest(leaves))
        self.modules = list(modules)
        self.training = list(map(_TRAINING, self.modules))
        self.captured_in_place = list(captured_in_place)
        self.captured_versions = list(map(_VERSION, self.captured_in_place))
        self.captured_compared = list(captured_compared)
        self.captured_signature = signature(self.captured_compared)
        self.watch = watch if watch is not None and watch.watches_anything else None

    def admits(self, treedef: Any, leaves: Sequence[Any], state: tuple) -> bool:
        if treedef != self.treedef or state != self.state:
            return False
        in_place = self.pick_in_place(leaves)
        return (all(map(operator.is_, in_place, self.in_place)) and list(map(_VERSION, in_place)) == self.versions
                and signature(self.pick_rest(leaves)) == self.rest
                and list(map(_TRAINING, self.modules)) == self.training
                and list(map(_VERSION, self.captured_in_place)) == self.captured_versions
                and signature(self.captured_compared) == self.captured_signature
                and (self.watch is None or self.watch.unchanged()))


def modes_unchanged(module_modes: Sequence[tuple[torch.nn.Module, bool]]) -> bool:
    """Whether every module whose flag a trace read is still in the train/eval mode it was traced in."""
    return all(module.training == training for module, training in module_modes)


def check_no_aliasing(tensors: Sequence[torch.Tensor], written: Sequence[int], names: Sequence[str]) -> None:
    """Refuse a call in which a tensor the plan writes shares memory with another input.

    A trace sees each argument as a tensor of its own. If `fn` writes `x` (an in-place update, or a
    donated argument) and `y` is `x`, or a view overlapping it, eager PyTorch would read the new
    values through `y` and the plan reads the old ones (or a half-written buffer): a different result.
    Read-only aliasing is harmless and allowed. Memory is compared by byte range within a storage,
    so two interleaved views (x[::2], x[1::2]) count as overlapping: pass a copy then."""
    by_storage: dict[int, list[tuple[int, int, int]]] = {}
    span_of: dict[int, tuple[int, int, int]] = {}
    for index, tensor in enumerate(tensors):
        if tensor.numel() == 0:
            continue
        start = tensor.storage_offset() * tensor.element_size()
        extent = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) + 1
        span_of[index] = (tensor.untyped_storage().data_ptr(), start, start + extent * tensor.element_size())
        by_storage.setdefault(span_of[index][0], []).append((*span_of[index][1:], index))
    for index in written:
        if index not in span_of:
            continue
        storage, start, end = span_of[index]
        for other_start, other_end, other in by_storage[storage]:
            if other != index and other_start < end and start < other_end:
                raise InputError(
                    f"{names[index]} and {names[other]} share memory, and the function writes {names[index]} "
                    f"(an in-place update or a donated argument). A traced program sees them as separate "
                    f"tensors, so it would not compute what eager PyTorch computes. Pass a copy "
                    f"({names[other]}.clone()) or pass the tensor once.")


def check_updates_allowed(tensors: Sequence[torch.Tensor], updated: Sequence[int], names: Sequence[str],
                          fn_name: str) -> None:
    """Refuse a call, with grad mode on, that would update in place a tensor requiring grad: the function
    does so outside its own `torch.no_grad()` (`gradients.GradientFlow.updated`). Eager PyTorch refuses a
    leaf (a parameter) or a view of one; for any other such tensor it records the update in the autograd
    graph, which a compiled plan cannot."""
    for index in updated:
        tensor = tensors[index]
        if not tensor.requires_grad:
            continue
        name = names[index]
        what = (f"{name} is a leaf tensor that requires grad, and for the same call eager PyTorch raises \"a leaf "
                f"Variable that requires grad is being used in an in-place operation\"" if tensor.is_leaf else
                f"{name} requires grad and is no leaf: a view of one, which eager PyTorch refuses too (\"a view of a "
                f"leaf Variable that requires grad is being used in an in-place operation\"), or the result of an "
                f"op, whose in-place update eager PyTorch records in the autograd graph and a compiled plan cannot")
        raise GradientError(
            f"df.jit({fn_name}) updates {name} in place while gradients are recorded: {what}. Update it under "
            f"torch.no_grad() (inside the function, or around the call), or pass {name}.detach() if the update "
            f"need not reach the autograd graph.")
