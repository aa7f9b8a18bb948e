"""Which outputs eager autograd would connect to which inputs, and which inputs the function updates in
place while gradients are recorded: what a call with tensors that require grad must honour.

A trace runs under `torch.no_grad()` (a plan records no autograd graph), so it cannot simply look at
`requires_grad`. It records instead, per node, whether eager PyTorch would record the op in the
autograd graph if the caller had grad mode on (`recording_grad_modes`):

* yes where grad mode is on during the trace (inside the function's own `torch.enable_grad()`, the
  forward of `df.value_and_grad`);
* no inside the autograd engine's backward (`torch.autograd.grad` without `create_graph`, so the
  gradients `df.grad` returns);
* no inside the function's own `torch.no_grad()`, `torch.set_grad_enabled(False)` or
  `torch.inference_mode()` blocks: while a trace runs, those context managers count how deep the
  tracing thread is in them (other threads pass through unchanged; `torch.set_grad_enabled(False)`
  called as a plain function, not as a block, is not seen);
* no for what `Tensor.detach()` records: some torch releases trace it as `aten.alias`, an op that
  autograd connects, so the call itself is watched (a torch-function mode), not the op it leaves;
* yes everywhere else: the function's body as the caller runs it.

`gradient_flow` then follows the functional graph: an output depends on an input through the nodes
recorded, where the op itself connects its output to its inputs (`detach`, `zeros_like` and integer
results do not: each op is asked once, on meta tensors, what eager autograd does). At call time an
output requires grad exactly when grad mode is on and one of its inputs requires grad, as in eager
PyTorch; and an input updated in place while recorded must not require grad (eager refuses leaves,
and a plan cannot record the update of any other tensor).
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import fx
from torch.overrides import TorchFunctionMode

from ..compat import in_backward, outside_current_trace
from ..ir import ops
from ..ir.analyses import fake_storage


@dataclass(frozen=True)
class GradientFlow:
    """`outputs`: per tensor output, the tensor inputs (placeholder positions) it depends on through
    ops eager autograd records; `updated`: the inputs the function updates in place while recorded."""

    outputs: tuple[tuple[int, ...], ...]
    updated: tuple[int, ...]


class _Depth(threading.local):
    recording = False
    disabled = 0           # how many of the function's own grad-disabling blocks are open
    detaching = 0          # how many `detach` calls are running


_DETACHING = frozenset({torch.Tensor.detach, torch.detach})


class _WatchingDetach(TorchFunctionMode):
    """Counts the `detach` calls running on the tracing thread (see the module docstring)."""

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        detaching = func in _DETACHING
        _depth.detaching += detaching
        try:
            return func(*args, **(kwargs or {}))
        finally:
            _depth.detaching -= detaching


_depth = _Depth()
_patched: list[tuple[type, str, Any]] = []
_installed = 0
_install_lock = threading.Lock()


def _counting(method: Any, step: int, disables: Any) -> Any:
    """`method` of a grad-mode context manager, counting on the tracing thread how deep it is in blocks
    that disable gradients (`disables(self)` says whether this one does)."""
    @functools.wraps(method)
    def counted(self: Any, *args: Any) -> Any:
        if _depth.recording and disables(self):
            _depth.disabled += step
        return method(self, *args)
    return counted


def _grad_mode_methods() -> list[tuple[type, str, int, Any]]:
    """The blocks counted: `with torch.no_grad()`, `with torch.set_grad_enabled(False)` and `with
    torch.inference_mode()`, as decorators too (they enter a copy of themselves). `set_grad_enabled`
    called as a plain function is not a block, and is not counted."""
    grad_mode = torch.autograd.grad_mode
    turns_off = lambda self: not self.mode                              # noqa: E731
    always, inference = (lambda self: True), (lambda self: self.mode)    # noqa: E731
    return [(grad_mode.no_grad, "__enter__", 1, always), (grad_mode.no_grad, "__exit__", -1, always),
            (grad_mode.set_grad_enabled, "__enter__", 1, turns_off),
            (grad_mode.set_grad_enabled, "__exit__", -1, turns_off),
            (grad_mode.inference_mode, "__enter__", 1, inference),
            (grad_mode.inference_mode, "__exit__", -1, inference)]


@contextlib.contextmanager
def _counting_grad_modes() -> Iterator[None]:
    """While the block runs, torch's grad-mode context managers count on the tracing thread."""
    global _installed
    with _install_lock:
        if _installed == 0:
            for cls, name, step, disables in _grad_mode_methods():
                original = cls.__dict__[name]
                _patched.append((cls, name, original))
                setattr(cls, name, _counting(original, step, disables))
        _installed += 1
    outer = _depth.recording, _depth.disabled, _depth.detaching
    _depth.recording, _depth.disabled, _depth.detaching = True, 0, 0
    try:
        with _WatchingDetach():
            yield
    finally:
        _depth.recording, _depth.disabled, _depth.detaching = outer
        with _install_lock:
            _installed -= 1
            if _installed == 0:
                for cls, name, original in reversed(_patched):
                    setattr(cls, name, original)
                _patched.clear()


def _recorded_by_autograd() -> bool:
    """Whether eager autograd would record an op run now, had the caller grad mode on."""
    if _depth.detaching:
        return False
    if torch.is_grad_enabled():
        return True
    return _depth.disabled == 0 and not in_backward()


@contextlib.contextmanager
def recording_grad_modes(graph: fx.Graph) -> Iterator[dict[fx.Node, bool]]:
    """Record, for each node appended to `graph` inside the block, whether autograd would record it
    (see the module docstring)."""
    recorded: dict[fx.Node, bool] = {}
    create_node = graph.create_node

    def creating(*args: Any, **kwargs: Any) -> fx.Node:
        node = create_node(*args, **kwargs)
        recorded[node] = _recorded_by_autograd()
        return node

    graph.create_node = creating
    try:
        with _counting_grad_modes():
            yield recorded
    finally:
        del graph.create_node


def gradient_flow(graph: fx.Graph, recorded: dict[fx.Node, bool]) -> GradientFlow:
    """The flow of a trace, read from the graph as traced (after closed-over tensors became placeholders,
    before functionalization, so in-place updates are still in it).

    Autograd follows tensors, not values: an update in place under `torch.no_grad()` leaves a tensor's
    place in the graph as it was, one recorded adds what it read. So dependencies (bit sets of input
    positions) are kept per node and, for updates, per storage (all views of a tensor: conservative for
    disjoint views). Nodes with no record count as recorded."""
    position = {n: k for k, n in enumerate(n for n in graph.nodes if n.op == "placeholder")}
    depends: dict[fx.Node, Any] = {n: 1 << k for n, k in position.items()}
    added: dict[Any, int] = {}                              # storage -> what updates in place added
    updated = 0

    def reads(node: fx.Node) -> int:
        mask = depends.get(node, 0)
        mask = functools.reduce(operator.or_, mask, 0) if isinstance(mask, tuple) else mask
        storage = fake_storage(node)
        return mask | added.get(storage, 0) if storage is not None else mask

    for node in graph.nodes:
        if node.op == "output":
            return GradientFlow(tuple(_positions(reads(a)) for a in _nodes_in(node.args[0])), _positions(updated))
        if node.op != "call_function":
            continue
        if node.target is operator.getitem and isinstance(depends.get(node.args[0]), tuple):
            depends[node] = depends[node.args[0]][node.args[1]]
            continue
        inputs = functools.reduce(operator.or_, map(reads, node.all_input_nodes), 0)
        on = recorded.get(node, True)
        written = _nodes_in(ops.written_arguments(node.target, node.args, node.kwargs))
        for target in written if on else ():
            storage = fake_storage(target)
            if storage is None:
                continue
            added[storage] = added.get(storage, 0) | inputs
            updated |= functools.reduce(operator.or_, (1 << k for n, k in position.items() if fake_storage(n) == storage), 0)
        if written:                                         # the updated tensor itself, in the graph as before
            depends[node] = reads(written[0]) | (inputs if on else 0)
        else:
            connected = _connects(node) if on and inputs else False
            depends[node] = (tuple(inputs if c else 0 for c in connected) if isinstance(connected, tuple)
                             else inputs if connected else 0)
    return GradientFlow((), _positions(updated))


def _positions(mask: int) -> tuple[int, ...]:
    return tuple(k for k in range(mask.bit_length()) if mask >> k & 1)


def _nodes_in(value: Any) -> list[fx.Node]:
    """The nodes in a node's argument (lists of them included), in order."""
    found: list[fx.Node] = []
    fx.node.map_arg(value, found.append)
    return found


def _connects(node: fx.Node) -> bool | tuple[bool, ...]:
    """Whether eager autograd connects the node's result (per result, for several) to its inputs: never
    for results that are not floating point, else as the op does on meta tensors that require grad."""
    value = node.meta.get("val")
    results = value if isinstance(value, (tuple, list)) else (value,)
    floating = tuple(isinstance(r, torch.Tensor) and (r.is_floating_point() or r.is_complex()) for r in results)
    if not any(floating):
        return False if not isinstance(value, (tuple, list)) else floating
    probed = _probe(node.target, node.args, node.kwargs)
    if probed is None or len(probed) != len(floating):
        return floating if isinstance(value, (tuple, list)) else True
    connected = tuple(f and p for f, p in zip(floating, probed))
    return connected if isinstance(value, (tuple, list)) else connected[0]


_probed: dict[Any, tuple[bool, ...] | None] = {}


def _probe(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[bool, ...] | None:
    """Per result, whether `op` run by eager autograd on meta tensors that require grad (built from
    the traced values) returns one that requires grad; None where the op cannot run so. Once per op."""
    if op in _probed:
        return _probed[op]
    def meta(a: Any) -> Any:
        value = a.meta.get("val") if isinstance(a, fx.Node) else a
        if not isinstance(value, torch.Tensor):
            return value
        tensor = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
        return tensor.requires_grad_() if tensor.is_floating_point() or tensor.is_complex() else tensor
    try:
        with outside_current_trace(), torch.enable_grad():
            result = op(*fx.node.map_aggregate(args, meta), **fx.node.map_aggregate(kwargs, meta))
        results = result if isinstance(result, (tuple, list)) else (result,)
        _probed[op] = tuple(isinstance(r, torch.Tensor) and r.requires_grad for r in results)
    except Exception:
        _probed[op] = None
    return _probed[op]
