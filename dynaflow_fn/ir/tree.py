"""Pytree handling shared by trace and jit: flatten (args, kwargs), name leaves, classify them.

A leaf is either a tensor (it becomes a Program input) or a *static* value (a hashable Python value
such as an int, a float, a string, None or a dtype). Static values are baked into the trace and are
part of the jit cache key, like `static_argnums` in JAX. Anything else is an error that names the leaf.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import keyword
import math
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import optree
import torch

from ..errors import InputError

_STATIC_TYPES = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device,
                 torch.memory_format, torch.layout, enum.Enum, slice, type(Ellipsis))


def flatten(tree: Any) -> tuple[list[tuple], list[Any], optree.PyTreeSpec]:
    """Flatten with optree; returns (paths, leaves, treespec). None is structure, not a leaf."""
    return optree.tree_flatten_with_path(tree)


@dataclass(frozen=True)
class Flat:
    """A call's `(args, kwargs)`, flattened once: the leaves and their structure, with each leaf's
    path derived from the structure when a message or a name needs it (not on every call)."""

    args: tuple
    kwargs: dict
    leaves: list
    treedef: optree.PyTreeSpec

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> "Flat":
        leaves, treedef = optree.tree_flatten((args, kwargs))
        return cls(args, kwargs, leaves, treedef)

    @functools.cached_property
    def paths(self) -> list[tuple]:
        return self.treedef.paths()


def picker(positions: Sequence[int]) -> Callable[[Sequence[Any]], Sequence[Any]]:
    """`lambda items: [items[i] for i in positions]` as one C call (an `operator.itemgetter`), for
    the per-call path: a tuple of several items, a one-item slice for one, an empty slice for none,
    and a slice of the first n where the positions are 0..n-1 (a graph whose every input is a tensor),
    which copies n pointers instead of looking up n indices."""
    positions = list(positions)
    if len(positions) > 1 and positions == list(range(len(positions))):
        return operator.itemgetter(slice(0, len(positions)))
    if len(positions) == 1:
        return operator.itemgetter(slice(positions[0], positions[0] + 1))
    return operator.itemgetter(*positions) if positions else operator.itemgetter(slice(0, 0))


class StaticKey(NamedTuple):
    """A static leaf's part of a signature: its type and a value equal exactly when tracing would bake
    in the same constant (see `static_key`)."""

    type: type
    value: Any


def static_key(leaf: Any) -> StaticKey:
    """A static leaf's part of a cache key: equal exactly when tracing would bake in the same value.

    `==` is not that: `0.0 == -0.0` (but 1 / -0.0 is -inf) and `nan != nan` (a NaN would never hit).
    Floats are keyed by their bits, complex numbers by their parts, frozen dataclasses field by field
    (their `==` compares floats the same lossy way), everything else by type and value (so True and 1
    differ)."""
    if isinstance(leaf, float):
        return StaticKey(float, leaf.hex() if not math.isnan(leaf) else "nan")
    if isinstance(leaf, complex):
        return StaticKey(complex, (static_key(leaf.real), static_key(leaf.imag)))
    if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
        return StaticKey(type(leaf), tuple(static_key(getattr(leaf, f.name)) for f in dataclasses.fields(leaf)))
    return StaticKey(type(leaf), leaf)


def leaf_key(leaf: Any) -> Any:
    """A leaf's part of a signature: a tensor's (shape, strides, dtype, device), as a plain tuple (it is
    built on every call that misses the fast check), or a static leaf's `StaticKey`."""
    if isinstance(leaf, torch.Tensor):
        return leaf.shape, leaf.stride(), leaf.dtype, leaf.device
    if isinstance(leaf, TensorSpec):
        return torch.Size(leaf.shape), leaf.stride, leaf.dtype, leaf.device
    return static_key(leaf)


def argument_names(fn: Callable, num_args: int) -> list[str]:
    """Names of the first `num_args` positional parameters of `fn`, for readable input names."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = []
    for i in range(num_args):
        if i < len(params) and params[i].kind in (params[i].POSITIONAL_ONLY, params[i].POSITIONAL_OR_KEYWORD):
            names.append(params[i].name)
        else:
            names.append(f"arg{i}")
    return names


def path_to_str(path: tuple, arg_names: Sequence[str]) -> str:
    """Render an optree path of the (args, kwargs) tuple as user code would write it: `params['fc.weight']`."""
    if not path:
        return "<root>"
    head, *rest = path
    if head == 0:
        if not rest:
            return "args"
        index, *rest = rest
        text = arg_names[index] if index < len(arg_names) else f"args[{index}]"
    else:
        if not rest:
            return "kwargs"
        key, *rest = rest
        text = str(key)
    for key in rest:
        text += f"[{key!r}]"
    return text


def output_path_to_str(path: tuple) -> str:
    """Render a path inside the function's return value: `out[0]['logits']`."""
    return "out" + "".join(f"[{key!r}]" for key in path)


def identifier(text: str) -> str:
    """A Python identifier derived from a path, for node names: `params['fc.weight']` -> `fc_weight`."""
    text = re.sub(r"^params\[", "[", text)
    name = re.sub(r"[^0-9a-zA-Z_]+", "_", text).strip("_") or "arg"
    if name[0].isdigit() or keyword.iskeyword(name):
        name = "_" + name
    return name


def is_static_leaf(leaf: Any) -> bool:
    """Whether `leaf` can be baked into a trace as a constant (hashable, compared by value).

    Builtin scalars qualify, and so do objects of classes that define value equality (frozen
    dataclasses, for example); plain objects hash by identity and would retrace on every new instance.
    """
    if not isinstance(leaf, _STATIC_TYPES) and type(leaf).__eq__ is object.__eq__:
        return False
    try:
        hash(leaf)
    except TypeError:
        return False
    return True


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous (row-major) tensor of `shape`."""
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class TensorSpec:
    """The abstract value of a tensor: everything tracing needs, no data. Usable in place of a tensor."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensor: "torch.Tensor | TensorSpec") -> "TensorSpec":
        if isinstance(tensor, TensorSpec):
            return tensor
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device)

    def fake(self, mode: Any) -> torch.Tensor:
        """A FakeTensor of this spec in the given FakeTensorMode."""
        with mode:
            return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)


@dataclass(frozen=True)
class LeafKinds:
    """Which flat leaves are tensors; the rest are static values."""

    tensor_positions: tuple[int, ...]
    static_positions: tuple[int, ...]


def tensor_inside(value: Any) -> str | None:
    """The field path of a tensor held by a dataclass static leaf (at any depth), if there is one."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return None
    for field in dataclasses.fields(value):
        inner = getattr(value, field.name)
        if isinstance(inner, torch.Tensor):
            return f".{field.name}"
        deeper = tensor_inside(inner)
        if deeper is not None:
            return f".{field.name}{deeper}"
    return None


OWN_GENERATOR_ADVICE = (
    "A plan's random ops draw from torch's global generator, advanced on every call as eager PyTorch "
    "advances it; a generator of the function's own cannot be replayed. Seed the global generator before "
    "the call (torch.manual_seed), or draw the random tensors outside the function and pass them in.")


def classify_leaves(paths: Sequence[tuple], leaves: Sequence[Any], arg_names: Sequence[str]) -> LeafKinds:
    """Split leaves into tensors and static values; raise InputError naming any other leaf."""
    tensors, statics = [], []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.is_nested:
            raise InputError(f"argument {path_to_str(paths[i], arg_names)} is a nested tensor; plans work on dense "
                             f"tensors of one shape. Pad it (.to_padded_tensor(0)), or keep the nested work outside "
                             f"the jitted function.")
        if isinstance(leaf, torch.Tensor) and leaf.layout != torch.strided:
            raise InputError(f"argument {path_to_str(paths[i], arg_names)} is a {str(leaf.layout).replace('torch.', '')} "
                             f"tensor; plans work on dense (strided) tensors. Convert it with .to_dense(), or keep "
                             f"the sparse work outside the jitted function.")
        if isinstance(leaf, (torch.Tensor, TensorSpec)):
            tensors.append(i)
        elif is_static_leaf(leaf):
            inside = tensor_inside(leaf)
            if inside is not None:
                where = path_to_str(paths[i], arg_names)
                raise InputError(f"argument {where} is a {type(leaf).__name__} holding a tensor at {where}{inside}; "
                                 f"a dataclass argument is a static value, baked into the trace and compared by "
                                 f"value. Pass its tensors as arguments, or register the class with "
                                 f"optree.register_pytree_node so its tensor fields become inputs.")
            statics.append(i)
        else:
            where = path_to_str(paths[i], arg_names)
            kind = type(leaf).__name__
            if type(leaf).__module__ == "numpy":
                hint = "Convert it with torch.as_tensor."
            elif isinstance(leaf, torch.Generator):
                hint = OWN_GENERATOR_ADVICE
            elif getattr(type(leaf), "__hash__", None) is not None and type(leaf).__eq__ is object.__eq__:
                hint = ("It compares by identity, so every new instance would trace again: make it a frozen "
                        "dataclass (value equality) or pass its fields.")
            else:
                hint = ("Pass tensors, hashable Python scalars, or containers (tuple, list, dict) of them; register "
                        "custom containers with optree.register_pytree_node.")
            raise InputError(f"argument {where} is a {kind}, which is neither a tensor nor a hashable static "
                             f"value. {hint}")
    return LeafKinds(tuple(tensors), tuple(statics))


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in a graph node's value, which is a tensor or nested tuples and lists of them (a
    `torch.sort`'s values and indices), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in tensors_in(item)]
    return []
