"""Refusing a function that assigns a new tensor to a module attribute while it is traced.

`self.step = self.step + 1` or `self.hidden = torch.tanh(...)` in a forward rebinds a Python
attribute. A Plan replays tensor ops only: the assignment happened once, at trace time, and bound
the attribute to a fake tensor of the trace, so later calls read the stale value and the module
held a FakeTensor afterwards. Every module the trace called or can reach through the function
(the module itself, `self`, closed-over modules, their submodules) is checked after the trace for
a fake tensor among its parameters, buffers and attributes (the instance of a jitted method too,
module or not); the attributes are put back as they were and the trace refused with the in-place
form to use instead.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterable, Iterator

import torch

from ..compat import FakeTensor, module_tensor_dicts
from ..errors import TraceError
from .closure import closed_over_objects

_Snapshot = dict[int, tuple[torch.nn.Module, dict[str, dict[str, Any]]]]


def _reachable_modules(fn: Callable[..., Any]) -> list[Any]:
    """The modules whose attributes can be put back: found before the trace, since which modules it
    calls is known only after it has rebound their attributes."""
    roots = [*closed_over_objects(fn), fn, getattr(fn, "__self__", None)] if not inspect.isclass(fn) else []
    found: dict[int, Any] = {}
    for root in roots:
        if isinstance(root, torch.nn.Module):
            found.update((id(m), m) for m in root.modules())
        elif root is not None and hasattr(root, "__dict__") and not inspect.isroutine(root):
            found.setdefault(id(root), root)          # the instance of a jitted method
    return list(found.values())


def _slots(module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Copies of the dicts in which a module keeps its tensors (parameters, buffers, attributes), to
    restore from."""
    return {slot: {k: v for k, v in held.items() if isinstance(v, torch.Tensor)}
            for slot, held in module_tensor_dicts(module).items()}


@contextlib.contextmanager
def refusing_attribute_rebinds(fn: Callable[..., Any], fn_name: str,
                               called: Callable[[], Iterable[torch.nn.Module]]) -> Iterator[None]:
    """Run a trace; afterwards put back tensors it bound to module attributes, and on success raise a
    TraceError naming them. `called` gives the modules the trace called, once it has run."""
    before: _Snapshot = {id(m): (m, _slots(m)) for m in _reachable_modules(fn)}
    rebound: list[str] = []
    try:
        yield
    finally:
        modules = {id(m): m for m in (*(m for m, _ in before.values()), *called())}
        for module in modules.values():
            rebound += _restore(module, before.get(id(module), (module, {}))[1])
    if rebound:
        raise TraceError(
            f"{fn_name} assigns a tensor computed while being traced to {', '.join(sorted(set(rebound)))} "
            f"(self.x = ...). A jitted function replays tensor ops only, so the assignment would happen on the "
            f"first call alone. Update the tensor in place instead (self.x.copy_(new), self.x.add_(1)), or "
            f"return the new value and keep it outside the function.")


def _restore(module: torch.nn.Module, saved: dict[str, dict[str, Any]]) -> list[str]:
    """Put back each fake tensor of `module` from `saved` (or drop it where nothing was saved); the
    attributes, by class name and attribute name."""
    names = []
    for slot, live in module_tensor_dicts(module).items():
        for name, value in list(live.items()):
            if not isinstance(value, FakeTensor):
                continue
            names.append(f"{type(module).__name__}.{name}")
            if name in saved.get(slot, {}):
                live[name] = saved[slot][name]
            else:
                del live[name]
    return names
