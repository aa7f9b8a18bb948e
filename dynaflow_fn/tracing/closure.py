"""Tensors a traced function closes over become inputs of its Program, read as they are on every call.

`make_fx` records a tensor that the function reads without receiving it as an argument (a weight
in a closure, a module attribute, a global) as a graph constant holding the tensor itself. Treated as
a constant, work derived from it would be computed once and go stale when the caller updates the
tensor in place (an optimizer step, `w.add_(1)`), while direct reads of it see the update: a
silently half-updated result. So every such tensor is lifted to a *closed-over input*: a
placeholder after the argument placeholders, bound on every call to the same tensor object, as JAX's
closure conversion does. Nothing derived from it is setup work; the cudagraph runtime keeps it
resident (reads it at its own address); jit's per-call check sees its version counter and address
like a parameter's.

Only the tensors `make_fx` creates itself stay constants: a literal such as `torch.tensor([1., 2.])`
inside the function is recorded as a constant read through `lift_fresh_copy`, and no caller holds it.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterator

import torch
from torch import fx

from ..ir import ops, tree
from ..ir.signature import ClosedOver

_LIFT_FRESH = frozenset({"aten.lift_fresh_copy", "aten.lift_fresh"})



def _is_lift_fresh(target: object) -> bool:
    info = ops.op_info(target)
    return info is not None and info.packet in _LIFT_FRESH


def lift_closed_over(graph_module: fx.GraphModule, fn: Callable[..., Any]) -> tuple[ClosedOver, ...]:
    """Turn the graph's constants that hold caller tensors into placeholders after the existing ones,
    one per distinct tensor, in order of first use. Mutates `graph_module`; returns what was lifted."""
    graph = graph_module.graph
    lifted: dict[int, tuple[torch.Tensor, list[fx.Node]]] = {}
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        value = getattr(graph_module, node.target)
        if isinstance(value, torch.Tensor) and not all(_is_lift_fresh(user.target) for user in node.users):
            lifted.setdefault(id(value), (value, []))[1].append(node)
    if not lifted:
        return ()
    names = _names_of(fn, [tensor for tensor, _ in lifted.values()])
    last = [n for n in graph.nodes if n.op == "placeholder"]
    closed_over = []
    for (tensor, constants), name in zip(lifted.values(), names):
        anchor = last[-1].next if last else next(iter(graph.nodes))
        with graph.inserting_before(anchor):
            placeholder = graph.placeholder(tree.identifier(name))
        placeholder.meta = dict(constants[0].meta)
        last.append(placeholder)
        for constant in constants:
            constant.replace_all_uses_with(placeholder)
            graph.erase_node(constant)
            if hasattr(graph_module, constant.target):
                delattr(graph_module, constant.target)
        closed_over.append(ClosedOver(name, tensor))
    graph_module.recompile()
    return tuple(closed_over)


def closed_over_objects(fn: Callable[..., Any]) -> tuple[Any, ...]:
    """The modules among the variables `fn` reads from outside (closure cells, the globals it names, the
    module of `df.pure`) and the instance `self` it is bound to or closes over (a class, for a jitted
    classmethod): objects whose Python attributes a trace of `fn` reads besides those of the modules it
    calls."""
    found: dict[int, Any] = {}
    for name, value in closure_variables(fn):
        if isinstance(value, torch.nn.Module) or (name == "self" and hasattr(value, "__dict__")):
            found.setdefault(id(value), value)
    return tuple(found.values())


def _names_of(fn: Callable[..., Any], tensors: list[torch.Tensor]) -> list[str]:
    """Readable names for closed-over tensors: where the function's closure or globals hold them
    (`params['fc.weight']`, `model.norm.weight`, `scale`), else `closed_over{k}`. Names are unique."""
    wanted = {id(t): None for t in tensors}
    for name, value in closure_variables(fn):
        for path, tensor in _tensors_in(name, value, depth=2):
            if id(tensor) in wanted and wanted[id(tensor)] is None:
                wanted[id(tensor)] = path
    names, used = [], set()
    for k, tensor in enumerate(tensors):
        name = wanted[id(tensor)] or f"closed_over{k}"
        while name in used:
            name += "_"
        used.add(name)
        names.append(name)
    return names


def closure_variables(fn: Callable[..., Any]) -> Iterator[tuple[str, Any]]:
    """(name, value) of the variables a function reads from outside: closure cells, then the globals
    its code names; for wrappers (functools.wraps, transforms, df.pure), the wrapped function's too."""
    seen: set[int] = set()
    stack = [fn]
    while stack:
        current = stack.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        module = getattr(current, "__dynaflow_module__", None)
        if module is not None:
            yield "", module
        code = getattr(current, "__code__", None)
        if code is not None:
            for name, cell in zip(code.co_freevars, getattr(current, "__closure__", None) or ()):
                try:
                    value = cell.cell_contents
                except ValueError:
                    continue
                yield name, value
                if callable(value):
                    stack.append(value)
            for name in code.co_names:
                if name in getattr(current, "__globals__", {}):
                    yield name, current.__globals__[name]
        for attribute in ("__wrapped__", "fn", "func"):
            inner = getattr(current, attribute, None)
            if callable(inner):
                stack.append(inner)
        if inspect.ismethod(current):
            yield "self", current.__self__


def _tensors_in(name: str, value: Any, depth: int) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, torch.nn.Module):
        prefix = f"{name}." if name else ""
        for key, tensor in (*value.named_parameters(remove_duplicate=False), *value.named_buffers(remove_duplicate=False)):
            yield prefix + key, tensor
        for key, tensor in vars(value).items():
            if isinstance(tensor, torch.Tensor):
                yield prefix + key, tensor
    elif depth > 0 and isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors_in(f"{name}[{key!r}]", item, depth - 1)
    elif depth > 0 and isinstance(value, (list, tuple)):
        for key, item in enumerate(value):
            yield from _tensors_in(f"{name}[{key}]", item, depth - 1)
