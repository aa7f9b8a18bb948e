"""Whether the Python objects a trace read are still as they were: a plan depends on them too.

Tracing runs the function's Python once, so whatever it read of a module is baked into the plan: its
forward hooks and pre-hooks (LoRA adapters, quantization wrappers, activation capture), the global
module hooks, which submodule sits under each name (`model.fc1 = LoRALinear(...)`), which tensor
each parameter and buffer name holds, the class and plain attributes (`self.scale = 0.5`). The
watched objects are the modules the trace called or found in the function's closure, with every
module under them, and the instance of a jitted method (`Program.objects_read`).

Checking all of that on every call would cost a loop over every module (a decode step has ~20 us of
host time in all). Instead nn.Module's own mutators report each change (`compat.observe_module_changes`)
and a change to a watched module, or to a global hook, moves one process-wide counter. A call
compares that counter with the one its watch saw: one integer comparison. Only after it moved is
the state fingerprinted again (every watched module's `__dict__`, one level into its dicts) and
compared with the trace's; an unrelated change costs that one comparison once. `training` is left
out: `mode_reads` checks only the flags a trace read.

A jitted method's instance is usually no module, and no mutator reports changes to it: its own
attributes are compared by identity on every call (a few objects, so a few hundred nanoseconds).
Changes made past the mutators (`module._forward_hooks[k] = f`, `module.__dict__[name] = v`) and
changes inside containers other than a module's own dicts are not seen; `Jitted.clear_cache()` after
those.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from typing import Any, Iterable, Sequence

import torch
from torch.nn.modules import module as module_file

from .. import compat
from ..ir.tree import static_key
from ..tracing.tracer import no_trace_running

_SCALARS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)
_GLOBAL_HOOKS = tuple(name for name in vars(module_file) if name.startswith("_global_") and name.endswith("hooks"))


class _Changes:
    """The process-wide counter. Each change stores a fresh value from `itertools.count`, so a value once
    read is never stored again: a watch that saw it sees every change after."""

    tick = 0


changes = _Changes()
_ticks = itertools.count(1)
_watched: dict[int, Any] = {}
"""id -> a watched module (a weak reference) or one of its dicts: the owners whose changes move the counter.
Only `_watch` changes it: Dynamo reads it when it traces a mutator (below), so a module that dies only
queues its ids in `_dead`, which the next `_watch` removes. (Until then a new object given a dead id
counts as watched: a needless fingerprint, never a missed change.)"""
_dead: list[int] = []
_tracing = torch.compiler.is_dynamo_compiling          # true only while Dynamo traces symbolically


def _note_change(owner: Any, attribute: Any) -> None:
    """nn.Module's mutators report here. Dynamo runs them symbolically when it traces a compiled forward
    that changes a module: the change of a module the trace builds (transformers' `self.layers[:n]`
    slices a ModuleList) is nobody's business, and that of a watched one must not put the counter into
    Dynamo's guards (a recompile on every call), so it breaks the graph there (`_changed_outside_the_trace`),
    and the change runs, and is reported here, as Python."""
    if attribute == "training" or not (owner is None or id(owner) in _watched):
        return
    if _tracing():
        _changed_outside_the_trace()
    else:
        changes.tick = next(_ticks)


@torch.compiler.disable
def _changed_outside_the_trace() -> None:
    """A call Dynamo does not trace: where a traced forward changes a watched module, the graph breaks."""
    changes.tick = next(_ticks)


_observed = compat.observe_module_changes(_note_change)


def _watch(module: torch.nn.Module) -> None:
    """Let changes of `module` and of its dicts (hooks a handle removes) move the counter while it lives."""
    while _dead:
        _watched.pop(_dead.pop(), None)
    key = id(module)
    dicts = [id(value) for value in vars(module).values() if isinstance(value, dict)]
    for owned in dicts:
        _watched.setdefault(owned, True)
    if key not in _watched:
        _watched[key] = weakref.ref(module, lambda _: _dead.extend((key, *dicts)))


for _name in _GLOBAL_HOOKS:
    _watched[id(getattr(module_file, _name))] = True


def _fingerprint(objects: Sequence[Any], keep: list) -> tuple:
    """The Python state of `objects`: per object its class and each attribute (`training` aside), a
    scalar by value, a dict by its items (a hook dict by its handle ids, which are never reused), any
    other value by identity (`methods`' bindings aside). `keep` receives what the identities refer to, so that no id is reused
    while the fingerprint lives. About 5 us a module: it runs only after a change. Its callers hold
    `no_trace_running`: another thread's trace swaps parameters for fakes and adds global hooks."""
    parts: list[Any] = []
    for obj in objects:
        keep.append(obj)
        parts.append(id(type(obj)))
        for name, value in vars(obj).items():
            kind = type(value)
            if kind in _SCALARS:
                if name != "training":
                    parts.append((name, kind, value.hex() if kind is float else
                                  static_key(value) if kind is complex else value))
            elif isinstance(value, dict):
                if not value or "hooks" in name:
                    parts.append((name, tuple(value)))
                else:
                    keep.append(value.copy())
                    parts.append((name, tuple(value), tuple(map(id, value.values()))))
            elif not name.startswith("__dynaflow_"):         # a jitted method's binding is no state
                keep.append(value)
                parts.append((name, id(value)))
    return tuple(parts)


def _global_hooks() -> tuple:
    return tuple(tuple(getattr(module_file, name)) for name in _GLOBAL_HOOKS)


class ObjectWatch:
    """The Python state a plan was traced under, and whether it still holds (`unchanged`)."""

    def __init__(self, objects_read: Iterable[Any]):
        roots = list(objects_read)
        modules: dict[int, torch.nn.Module] = {}
        for root in roots:
            if isinstance(root, torch.nn.Module):
                modules.update((id(m), m) for m in root.modules())
        self.modules = tuple(modules.values())
        self.instances = tuple(o for o in roots if not isinstance(o, torch.nn.Module) and hasattr(o, "__dict__"))
        for module in self.modules:
            _watch(module)
        self._differs_at: int | None = None                # a tick at which the modules were found changed
        self._keep: list[Any] = []
        with no_trace_running():                           # not another thread's trace's fakes and hooks
            self.tick = changes.tick if _observed else None   # read before the fingerprint: later changes are seen
            self._modules = self._modules_now(self._keep)
            self._instances = _fingerprint(self.instances, self._keep)
            self._identities = [list(vars(o).values()) for o in self.instances]
            self._hooks = [(owner, name, tuple(hooks)) for owner in (*self.modules, module_file) if self.modules
                           for name, hooks in vars(owner).items()
                           if "hooks" in name and isinstance(hooks, dict) and hooks]

    @property
    def watches_anything(self) -> bool:
        return bool(self.modules or self.instances)

    def unchanged(self) -> bool:
        """Whether the watched state is as traced: the counter's comparison, then the instances'
        attributes by identity; fingerprinted again only when either differs."""
        return ((self.tick == changes.tick or self._modules_unchanged())
                and (not self.instances or self._same_instances() or self._instances_unchanged()))

    def dead(self) -> bool:
        """Whether the state can never again be as traced: a hook registered then has been removed
        (handle ids are never reused), so the plan's entry can go."""
        return any(any(i not in getattr(owner, name, ()) for i in ids) for owner, name, ids in self._hooks)

    def _modules_unchanged(self) -> bool:
        tick = changes.tick
        if tick == self._differs_at and _observed:
            return False
        if self._modules_now([]) != self._modules:
            self._differs_at = tick
            return False
        for module in self.modules:
            _watch(module)
        self.tick = tick if _observed else None             # equal ids: the very objects `_keep` holds
        return True

    def _same_instances(self) -> bool:
        for instance, values in zip(self.instances, self._identities):
            attributes = vars(instance)
            if len(attributes) != len(values) or not all(map(operator.is_, attributes.values(), values)):
                return False
        return True

    def _instances_unchanged(self) -> bool:
        with no_trace_running():
            if _fingerprint(self.instances, []) != self._instances:
                return False
        self._identities = [list(vars(o).values()) for o in self.instances]
        return True

    def _modules_now(self, keep: list) -> tuple:
        with no_trace_running():
            return (_fingerprint(self.modules, keep), _global_hooks()) if self.modules else ()
