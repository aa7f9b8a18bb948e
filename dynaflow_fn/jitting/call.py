"""A call's identity: its signature, what df.jit's cache is keyed on, and the warning when it keeps
changing; its dicts; and a flatten written for its structure, which later calls are flattened by.

A plan is built for one `CallSignature`: the arguments' pytree structure, the type and key order of
their dicts (`DictNodes`: the structure sorts keys), each leaf's key (a tensor's shape, strides,
dtype and device; a static leaf's value, `ir.tree.static_key`) and the process-wide settings tracing
and capture read (`guard.call_state`). Two calls with equal signatures run the same
plan, as `jax.jit` caches by the abstract values of its arguments.

A jitted function is called with the same structure again and again: `fast(params, x)` with the
same dict of 64 weights each time. `treedef.flatten_up_to` flattens by a known structure, but it
sorts every dict's keys on every call and accepts an OrderedDict or a defaultdict where a dict was,
so the guard then looks each dict up again to check its type and insertion order (`DictNodes`).
For a structure of tuples, lists, plain dicts and None, `flattener` writes one function that does
all of it in a single pass: it checks each container's exact type and length and each dict's keys
in insertion order, and picks the leaves in optree's order (a dict's by sorted key, with one
`operator.itemgetter`). For `((params, x), {})` it reads:

    def flatten(call):
        leaves = []
        if type(call) is not tuple or len(call) != 2: return None
        n0, n1 = call
        if type(n0) is not tuple or len(n0) != 2: return None
        n2, n3 = n0
        if type(n2) is not dict or tuple(n2) != keys0: return None
        leaves += pick1(n2)
        leaves.append(n3)
        if type(n1) is not dict or n1: return None
        return leaves

It returns the leaves `flatten_up_to` returns, or None for a call of another structure, which the
caller then flattens anew. A structure holding any other container (a namedtuple, an OrderedDict,
a registered pytree node) gets no flattener: the caller uses `flatten_up_to` and `DictNodes`.
"""

from __future__ import annotations

import collections
import operator
from dataclasses import dataclass
from typing import Any, Callable

import optree
import torch

from ..errors import warn
from ..ir import tree
from ..ir.program import dtype_name
from ..ir.tree import Flat, StaticKey

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
        """The signature of a call, or None if a leaf cannot be keyed (unhashable, or a nested tensor,
        which has no single shape: tracing names it)."""
        try:
            signature = cls(flat.treedef, tuple(map(tree.leaf_key, flat.leaves)), state,
                            DictNodes.of((flat.args, flat.kwargs)).nodes)
            hash(signature)
        except (TypeError, RuntimeError):
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


@dataclass(frozen=True)
class DictNodes:
    """The dicts in a call's `(args, kwargs)`: where each is, its type and its key order.

    optree's structure sorts a dict's keys, so two dicts that differ only in insertion order flatten
    to equal structures. A function that iterates a dict argument (`for w in params.values()`) sees
    that order, and a plan traced with one order must not serve a call with another: the order is
    part of a call's signature. And `treedef.flatten_up_to`, which flattens a call by the structure of
    the last one at a tenth of the cost of a new flatten, takes an OrderedDict or a defaultdict where
    a dict was: the type is checked here too. `nodes` holds (path, type, keys) per dict, the path a
    sequence of subscripts from `(args, kwargs)`, so that a later call is checked by looking up a few
    dicts; a dict below a container that is no tuple, list or dict (a registered pytree node, a
    namedtuple) makes the check walk the whole tree instead (`opaque`). An OrderedDict's own structure
    keeps its order.
    """

    nodes: tuple[tuple[tuple, type, tuple], ...]
    opaque: bool

    @classmethod
    def of(cls, tree: Any) -> "DictNodes":
        nodes: list[tuple[tuple, type, tuple]] = []
        opaque = _collect_dicts(tree, (), nodes, False)
        return cls(tuple(nodes), opaque)

    def match(self, tree: Any) -> bool:
        """Whether `tree`, of the structure of the tree these were taken from, has the same dicts."""
        if self.opaque:
            return DictNodes.of(tree) == self
        for path, kind, keys in self.nodes:
            node = tree
            for step in path:
                node = node[step]
            if type(node) is not kind or tuple(node) != keys:
                return False
        return True


_DICTS = frozenset({dict, collections.OrderedDict, collections.defaultdict})
_NOT_CONTAINERS = frozenset({torch.Tensor, torch.nn.Parameter, int, float, bool, str, type(None)})


def _collect_dicts(node: Any, path: tuple, nodes: list, below_other: bool) -> bool:
    """Append the (path, type, keys) of every dict under `node` to `nodes`; whether one lies below a
    container that is no tuple, list or dict."""
    kind = type(node)
    if kind in _NOT_CONTAINERS:
        return False
    if kind in _DICTS:
        nodes.append((path, kind, tuple(node)))
        opaque = below_other
        for key, value in node.items():
            opaque |= _collect_dicts(value, (*path, key), nodes, below_other)
        return opaque
    if kind is tuple or kind is list:
        opaque = False
        for index, value in enumerate(node):
            opaque |= _collect_dicts(value, (*path, index), nodes, below_other)
        return opaque
    if optree.tree_is_leaf(node):
        return False
    opaque = False
    for child in optree.tree_flatten_one_level(node)[0]:
        opaque |= _collect_dicts(child, path, nodes, True)
    return opaque


Flattener = Callable[[Any], "list[Any] | None"]


class _Writer:
    """The lines of a flatten function, and the constants they name (key tuples, itemgetters)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.constants: dict[str, Any] = {}
        self.names = 0

    def name(self) -> str:
        self.names += 1
        return f"n{self.names - 1}"

    def constant(self, prefix: str, value: Any) -> str:
        name = f"{prefix}{len(self.constants)}"
        self.constants[name] = value
        return name

    def node(self, var: str, node: Any) -> bool:
        """Lines that check `var` against `node`'s container and add its leaves; False where a
        container here is of a kind no flatten is written for."""
        kind = type(node)
        if node is None:
            self.lines.append(f"if {var} is not None: return None")
            return True
        if kind is tuple or kind is list:
            self.lines.append(f"if type({var}) is not {kind.__name__} or len({var}) != {len(node)}: return None")
            return self._children(var, list(node), None)
        if kind is dict:
            keys = self.constant("keys", tuple(node))
            self.lines.append(f"if type({var}) is not dict or {'tuple(' + var + ') != ' + keys if node else var}: "
                              f"return None")
            entries = optree.tree_flatten_one_level(node)[2]     # a plain tuple in optree 0.13: by index
            return self._children(var, entries, node)
        if optree.tree_is_leaf(node):
            self.lines.append(f"leaves.append({var})")
            return True
        return False

    def _children(self, var: str, order: Any, mapping: dict | None) -> bool:
        """The children of container `var` in optree's order (`order`: indices, or a dict's keys)."""
        children = [mapping[key] for key in order] if mapping is not None else order
        if not children:
            return True
        if all(optree.tree_is_leaf(child) for child in children):
            if mapping is None:
                self.lines.append(f"leaves += {var}")
            else:
                pick = self.constant("pick", operator.itemgetter(*order))
                self.lines.append(f"leaves.append({pick}({var}))" if len(order) == 1 else f"leaves += {pick}({var})")
            return True
        names = [self.name() for _ in children]
        if mapping is None:
            self.lines.append(f"{', '.join(names)}{',' if len(names) == 1 else ''} = {var}")
        else:
            for name, key in zip(names, order):
                self.lines.append(f"{name} = {var}[{self.constant('key', key)}]")
        return all(self.node(name, child) for name, child in zip(names, children))


def flattener(call: Any) -> tuple[Flattener, str] | None:
    """The flatten function of `call`'s structure and its source, or None where the structure holds a
    container other than tuples, lists, plain dicts and None (see the module docstring)."""
    writer = _Writer()
    if not writer.node("call", call):
        return None
    body = "\n".join(f"    {line}" for line in writer.lines)
    source = f"def flatten(call):\n    leaves = []\n{body}\n    return leaves\n"
    namespace = dict(writer.constants)
    exec(compile(source, "<dynaflow_fn flatten>", "exec"), namespace)
    return namespace["flatten"], source
