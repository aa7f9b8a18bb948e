"""Changes to modules: no public API reports that a module's hooks, submodules or attributes changed
(torch.compile's guards read the dicts on every call). df.jit must know without looking, so
nn.Module's own mutators are wrapped once."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

_MODULE_MUTATORS = ("__setattr__", "__delattr__", "add_module", "register_parameter", "register_buffer", "_apply")
_module_observer: list[Callable[[Any, Any], None]] = []


def observe_module_changes(on_change: Callable[[Any, Any], None]) -> bool:
    """Call `on_change(owner, attribute)` after every change that torch's own functions make to the Python
    state of modules, for the rest of the process: `(module, name)` after `setattr`/`delattr` on a module,
    `(module, None)` after it registers a submodule, parameter, buffer or hook (`register_*hook`) or
    converts its tensors (`_apply`, behind `.to()`), `(None, None)` after a global module hook is
    registered (`register_module_forward_hook`, ...), and `(hooks, None)` after a `RemovableHandle`
    removes a hook from the dict `hooks`. Changes made to those dicts directly are not seen.

    Returns False, observing nothing, where this torch lacks one of the names wrapped (then callers
    must compare the state themselves). Called again, it replaces `on_change`."""
    from torch.nn.modules import module as module_file
    from torch.utils.hooks import RemovableHandle

    hooks = [name for name in vars(torch.nn.Module) if name.startswith("register_") and name.endswith("hook")]
    global_hooks = [name for name in vars(module_file) if name.startswith("register_module_")]
    if (not all(hasattr(torch.nn.Module, name) for name in _MODULE_MUTATORS) or len(hooks) < 5
            or len(global_hooks) < 5 or not hasattr(RemovableHandle, "remove")):
        return False
    if not _module_observer:
        for name in (*_MODULE_MUTATORS, *hooks):
            setattr(torch.nn.Module, name, _notifying(getattr(torch.nn.Module, name), name))
        for name in global_hooks:
            setattr(module_file, name, _notifying(getattr(module_file, name), None))
        RemovableHandle.remove = _notifying_removal(RemovableHandle.remove)
    _module_observer[:] = [on_change]
    return True


def _notifying(method: Callable[..., Any], name: str | None) -> Callable[..., Any]:
    """`method`, then a call of the observer: with the attribute name for setattr and delattr."""
    if name in ("__setattr__", "__delattr__"):
        def attribute_changer(self: Any, attribute: str, *value: Any) -> None:
            try:
                method(self, attribute, *value)
            finally:
                _module_observer[0](self, attribute)
        return functools.wraps(method)(attribute_changer)

    def changer(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        finally:
            _module_observer[0](args[0] if name is not None else None, None)
    return functools.wraps(method)(changer)


def _notifying_removal(remove: Callable[[Any], None]) -> Callable[[Any], None]:
    def removing(handle: Any) -> None:
        try:
            remove(handle)
        finally:
            for ref in (getattr(handle, "hooks_dict_ref", None), *getattr(handle, "extra_dict_ref", ())):
                _module_observer[0](ref() if ref is not None else None, None)
    return functools.wraps(remove)(removing)


def module_tensor_dicts(module: Any) -> dict[str, dict[str, Any]]:
    """The live dicts in which `module` keeps its tensors: its parameters, its buffers and its plain
    attributes (`vars`), by role. No public API hands out the first two for writing; where this
    torch keeps them elsewhere, only the plain attributes are given."""
    dicts = {"__dict__": vars(module)}
    for slot in ("_parameters", "_buffers"):
        held = vars(module).get(slot)
        if isinstance(held, dict):
            dicts[slot] = held
    return dicts
