"""A call's signature: what df.jit's cache is keyed on, and the warning when it keeps changing.

A plan is built for one `CallSignature`: the arguments' pytree structure, the key order of their
dicts (`guard.DictNodes`: the structure sorts keys), each leaf's key (a tensor's shape, strides,
dtype and device; a static leaf's value, `ir.tree.static_key`) and the process-wide settings tracing
and capture read (`guard.call_state`). Two calls with equal signatures run the same
plan, as `jax.jit` caches by the abstract values of its arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..errors import warn
from ..ir import tree
from ..ir.program import dtype_name
from ..ir.tree import Flat, StaticKey
from .guard import DictNodes

RETRACE_WARNING_ENTRIES = 8
"""Plans a jitted function holds before each further trace warns."""


@dataclass(frozen=True)
class CallSignature:
    """The cache key of a call: structure, one key per leaf, the process-wide settings, and the type and
    key order of each dict (`DictNodes.nodes`)."""

    treedef: Any
    leaves: tuple
    state: tuple
    dicts: tuple

    @classmethod
    def of(cls, flat: Flat, state: tuple) -> "CallSignature | None":
        """The signature of a call, or None if a leaf cannot be keyed (unhashable: tracing names it)."""
        signature = cls(flat.treedef, tuple(map(tree.leaf_key, flat.leaves)), state,
                        DictNodes.of((flat.args, flat.kwargs)).nodes)
        try:
            hash(signature)
        except TypeError:
            return None
        return signature

    def change_from(self, previous: "CallSignature", fn: Callable[..., Any], flat: Flat) -> str:
        """What differs from `previous`, naming the argument by its path."""
        if previous.treedef != self.treedef:
            return f"the argument structure changed from {previous.treedef} to {self.treedef}"
        if previous.dicts != self.dicts:
            return "the key order of a dict argument changed"
        if previous.state != self.state:
            return ("process-wide settings changed (autocast, the default dtype or device, deterministic algorithms "
                    "or matmul precision)")
        names = tree.argument_names(fn, len(flat.args))
        for path, old, new in zip(flat.paths, previous.leaves, self.leaves):
            if old != new:
                return f"{tree.path_to_str(path, names)} changed from {_describe(old)} to {_describe(new)}"
        return "no visible change"


def warn_retracing(fn: Callable[..., Any], previous: CallSignature, signature: CallSignature, flat: Flat,
                   traced: int) -> None:
    """Warn that `fn` is traced for the `traced`-th signature, naming what differs from the `previous` one."""
    warn(f"{getattr(fn, '__name__', 'fn')} has been traced for {traced} different input signatures "
         f"({signature.change_from(previous, fn, flat)}). Each new shape, dtype, device or static value traces "
         f"and captures again; pad inputs to a few fixed shapes, or pass changing scalars as tensors.")


def _describe(key: Any) -> str:
    """A leaf key as messages print it: `f32[8] on cpu`, or the static value."""
    if isinstance(key, StaticKey):
        if key.type is float:
            return "nan" if key.value == "nan" else repr(float.fromhex(key.value))
        return repr(key.value)
    shape, _, dtype, device = key
    return f"{dtype_name(dtype)}{list(shape)} on {device}"
