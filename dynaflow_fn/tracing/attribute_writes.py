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

import optree
import torch

from ..compat import FakeTensor, module_tensor_dicts
from ..errors import TraceError, warn
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
    TraceError naming them. `called` gives the modules the trace called, once it has run. Python
    values it changed (`self.calls += 1`) are left as the trace made them, with a warning."""
    reachable = _reachable_modules(fn)
    lazy = sorted({type(m).__name__ for m in reachable if isinstance(m, torch.nn.Module) and any(
        torch.nn.parameter.is_lazy(t) for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))})
    if lazy:
        raise TraceError(f"{fn_name} calls {', '.join(lazy)}, whose parameters are not initialized yet (a lazy module "
                         f"infers their shapes on its first call). Call it once eagerly first, then jit it.")
    before: _Snapshot = {id(m): (m, _slots(m)) for m in reachable}
    python_before = {id(m): (m, _python_state(m)) for m in reachable}
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
    changed = [f"{type(m).__name__}.{name}" for m, state in python_before.values()
               for name in _changed(state, _python_state(m))]
    if changed:
        warn(f"{fn_name} changes {', '.join(sorted(set(changed)))} while being traced (self.calls += 1, a list "
             f"appended to, a flag set once). A jitted function replays tensor ops only: later calls will not change "
             f"it again, and what the function computes from it keeps the traced value. Keep such state in a tensor "
             f"updated in place (a buffer: self.calls.add_(1)), or outside the jitted function.")


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


def _python_state(obj: Any) -> dict[str, tuple]:
    """The public Python values an object keeps as attributes, other than tensors and modules, each as
    a fingerprint to compare: numbers, strings and flags by value, lists and dicts by the identity of
    the container and of its items (to see them appended to). The fingerprints hold the items, so
    that no identity is reused while they are compared. Private attributes (`_code`, a cache) are the
    implementation's own: an FX GraphModule, for one, compiles its code on its first call."""
    state = {}
    if isinstance(obj, torch.fx.GraphModule):
        return state
    for name, value in vars(obj).items():
        if name.startswith("_") or name == "training" or isinstance(value, (torch.Tensor, torch.nn.Module)):
            continue
        if isinstance(value, (int, float, bool, str, type(None))):
            state[name] = (type(value), value)
        elif isinstance(value, (list, dict)):
            items = tuple(value.items()) if isinstance(value, dict) else tuple(value)
            state[name] = (type(value), id(value), tuple(map(id, optree.tree_leaves(items, none_is_leaf=True))), items)
    return state


def _changed(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    """The attributes whose fingerprints differ (the items they hold compared by identity only)."""
    return [name for name in before.keys() | after.keys()
            if name not in before or name not in after or before[name][:3] != after[name][:3]]
