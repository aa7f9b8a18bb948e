"""`df.jit`'s options, checked once, and the two things the `backend` option decides per device.

`backend` names a pair: which **kernels** a plan's steps run (Inductor's fused ones or aten's) and
which **runtime** runs the plan (the eager interpreter or one CUDA graph). "auto" picks per device:
Inductor's kernels in one CUDA graph where Inductor generates Triton kernels (a CUDA device of
compute capability 7.0 or later, with Triton installed), aten's in one CUDA graph on other CUDA
devices, and aten's under the interpreter elsewhere: on the CPU Inductor would compile C++ for
minutes where aten's kernels are already fast.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable

import optree
import torch

from ..errors import InputError
from .buckets import bucket_sizes

BACKENDS = ("auto", "eager", "cudagraph", "inductor")
INDUCTOR, ATEN = "inductor", "aten"                   # kernels
INTERPRETER, CUDAGRAPH = "interpreter", "cudagraph"   # runtimes


@dataclass(frozen=True)
class JitOptions:
    """Everything `df.jit(fn, ...)` was asked for, validated (see `jit` for each option's meaning)."""

    backend: str = "auto"
    donate_argnums: tuple[int, ...] = ()
    persistent_argnums: tuple[int, ...] = ()
    static_outputs: bool = False
    strategy: str | None = None
    in_axes: Any = None
    progress: bool = True
    buckets: Any = None
    out_axes: Any = 0
    pad_value: Any = 0
    refuse_inexact_padding: bool = False
    """With buckets, raise `UnpaddableError` where padding may change the real rows' results, instead of
    warning: for a caller that chose the padding itself and plans each size instead (compile_backend)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise InputError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.strategy not in (None, "auto"):
            raise InputError(f"jit takes strategy=None or 'auto', got {self.strategy!r}; to fix a strategy, "
                             f"transform the function: df.jit(T.overlap(fn, strategy={self.strategy!r}))")
        object.__setattr__(self, "buckets", bucket_sizes(self.buckets))
        if self.buckets is not None and self.in_axes is None:
            raise InputError("buckets pad the batch axes that in_axes names: pass in_axes too, e.g. in_axes=(None, 0) "
                             "for fn(params, x)")
        if self.in_axes is not None and self.strategy != "auto" and self.buckets is None:
            raise InputError("in_axes tells strategy='auto' how to micro-batch and buckets what to pad; pass "
                             "strategy='auto' or buckets with it")
        if self.buckets is None and (self.out_axes != 0 or not self.pads_with_zeros):
            raise InputError("out_axes and pad_value say how buckets pad and cut the batch; pass buckets with them")
        _check_leaves(self.out_axes, "out_axes", lambda leaf: isinstance(leaf, int) and not isinstance(leaf, bool),
                      "an int (the batch axis) or None (not batched)")
        _check_leaves(self.pad_value, "pad_value", lambda leaf: isinstance(leaf, (bool, int, float)),
                      "a Python scalar or None (zeros)")
        object.__setattr__(self, "donate_argnums", argnums(self.donate_argnums, "donate_argnums"))
        object.__setattr__(self, "persistent_argnums", argnums(self.persistent_argnums, "persistent_argnums"))

    @property
    def pads_with_zeros(self) -> bool:
        """Whether every padded row holds zeros (`pad_value` left at 0, or None or 0 for every leaf)."""
        return all(leaf is None or leaf == 0 for leaf in optree.tree_leaves(self.pad_value, none_is_leaf=True))

    def kernels(self, device: torch.device) -> str:
        """The kernels a plan on `device` runs: INDUCTOR or ATEN."""
        if self.backend == "inductor" or (self.backend == "auto" and triton_available(device)):
            return INDUCTOR
        return ATEN

    def runtime(self, device: torch.device) -> str:
        """How a plan on `device` runs: INTERPRETER or CUDAGRAPH."""
        if self.backend == "eager":
            return INTERPRETER
        if device.type == "cuda":
            return CUDAGRAPH
        if self.backend == "cudagraph":
            raise InputError(f"backend='cudagraph' needs CUDA tensors, but the arguments are on {device}; "
                             f"use backend='auto' or 'eager'")
        return INTERPRETER


def _check_leaves(value: Any, option: str, fits: Callable[[Any], bool], expected: str) -> None:
    for leaf in optree.tree_leaves(value, none_is_leaf=True):
        if leaf is not None and not fits(leaf):
            raise InputError(f"{option} leaves are {expected}; got {leaf!r} in {option}={value!r}")


def argnums(value: Any, option: str) -> tuple[int, ...]:
    """`donate_argnums` / `persistent_argnums` as a tuple of ints (one int is accepted, as in JAX)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if not isinstance(value, (tuple, list)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise InputError(f"{option} takes positions of positional arguments (an int or a tuple of ints), got {value!r}")
    return tuple(value)


def triton_available(device: torch.device) -> bool:
    """Whether Inductor can generate Triton kernels for this device."""
    return (device.type == "cuda" and importlib.util.find_spec("triton") is not None
            and torch.cuda.get_device_capability(device)[0] >= 7)
