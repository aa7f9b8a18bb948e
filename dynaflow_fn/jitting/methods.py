"""`df.jit` on a method: one jitted function per instance, bound to it, for as long as the instance lives.

    class Sampler:
        @df.jit
        def apply(self, x):
            return x * self.temperature

`sampler.apply` is the jitted function of the bound method, made on first access and kept in the
instance's `__dict__` (as `functools.cached_property` keeps its value), so its plans are reused
across calls and go with the instance. Copies of the instance (`copy.copy`, `copy.deepcopy`,
pickling) do not share it: each binds its own. Tracing reads the instance like a closure: its
tensors (`self.weight`) are read in place and its attributes are watched (`object_watch`), so
`sampler.temperature = other` is seen. `donate_argnums` and `persistent_argnums` count the method's
parameters as written, `self` being 0.
"""

from __future__ import annotations

import dataclasses
import threading
import types
import weakref
from typing import Any

from ..errors import InputError

_binding = threading.Lock()


class _Binding:
    """What the instance's `__dict__` holds: the jitted method, bound to that instance only. A copy of
    the instance gets None in its place (and binds anew), never a method bound to the original."""

    def __init__(self, unbound: Any, method: Any):
        self.unbound, self.method = unbound, method

    def __reduce__(self) -> tuple:
        return type(None), ()

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __copy__(self) -> None:
        return None


_class_bindings: "weakref.WeakKeyDictionary[type, dict[str, _Binding]]" = weakref.WeakKeyDictionary()
"""The jitted methods bound to classes (`@classmethod` stacked on `@df.jit`), whose `__dict__` is read-only."""


def bound(jitted: Any, instance: Any) -> Any:
    """The jitted function of `jitted.fn` bound to `instance` (a `Jitted` of the same options)."""
    key = f"__dynaflow_jit_{getattr(jitted.fn, '__qualname__', jitted.name)}__"
    try:
        attributes = vars(instance)
    except TypeError:
        raise InputError(
            f"df.jit on the method {jitted.name} keeps one compiled function per instance of "
            f"{type(instance).__name__} in the instance's __dict__, which it has none of: add '__dict__' to its "
            f"__slots__, or jit the bound method yourself (fast = df.jit(obj.{jitted.name}) with the method "
            f"undecorated) and keep `fast`.") from None
    if not isinstance(attributes, dict):         # a class's read-only mappingproxy: `@classmethod` over `@df.jit`
        with _binding:
            attributes = _class_bindings.setdefault(instance, {})
    held = attributes.get(key)
    if held is not None and held.unbound is jitted and held.method.fn.__self__ is instance:
        return held.method
    with _binding:
        held = attributes.get(key)
        if held is not None and held.unbound is jitted and held.method.fn.__self__ is instance:
            return held.method
        options = dataclasses.replace(
            jitted.options,
            donate_argnums=_without_self(jitted.options.donate_argnums, "donate_argnums", jitted.name),
            persistent_argnums=_without_self(jitted.options.persistent_argnums, "persistent_argnums", jitted.name))
        method = type(jitted)(types.MethodType(jitted.fn, instance), options)
        attributes[key] = _Binding(jitted, method)
        return method


def _without_self(positions: tuple[int, ...], option: str, name: str) -> tuple[int, ...]:
    """Argument positions of the method as written (`self` is 0) as positions of the bound method."""
    if 0 in positions:
        raise InputError(f"{option} of the method {name} names position 0, which is `self`; positions count "
                         f"the method's parameters as written, so the first argument after self is 1")
    return tuple(i - 1 for i in positions)
