"""Refusing reads of the data of tensors a traced function did not receive.

A tensor the function reads without receiving it (a module buffer, a closed-over or global tensor)
is a real tensor inside the trace, not a fake one. FakeTensorMode answers a read of its data as a
Python value from the real data, and keeps tensors of one element as constants through the ops on
them, so the trace would bake in the value the tensor had while being traced: `x * float(s)`,
`k[self.pos] = v`, `torch.arange(n)` of a 0-d buffer, `s.tolist()`. Eager PyTorch reads the tensor
anew on every call (and sees the function's own updates of it, which the fake trace does not).

Two modes entered inside the trace watch for such reads: a dispatch mode sees every read that
reaches an aten op (`_local_scalar_dense` behind `float`, `int`, `bool`, `.item()`, an index or a
size taken from a 0-d tensor; `equal`; `is_nonzero`) on a real tensor or on a one-element value
computed from one; a torch function mode sees the reads that never reach the dispatcher for a real
tensor (`tolist`, `numpy`, `__array__`). dynaflow_fn's own reads of graph constants while a trace runs
pass, as does a literal the function makes itself (`torch.tensor(3.).item()`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from typing import Any, Callable, Iterator, Sequence

import optree
import torch
from torch._subclasses.fake_tensor import FakeTensor


def refusing_value_reads_of_outside_tensors(refusal: Callable[[Any], Exception]) -> contextlib.AbstractContextManager:
    """A context to enter inside a make_fx trace in which a read of the data of a tensor the function
    did not receive raises `refusal(op)`. Without Python dispatch and torch function modes, nothing is
    intercepted."""
    try:
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError:
        return contextlib.nullcontext()
    watch = _Watch()

    class DataReads(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
            if func in _DATA_READS and watch.active() and args and _real(args[0]) and not _called_by_dynaflow():
                raise refusal(func)
            return func(*args, **(kwargs or {}))

    class ScalarReads(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func in _LITERALS or not watch.active() or not any(
                    watch.outside(value) for value in optree.tree_leaves((args, kwargs))):
                return func(*args, **kwargs)
            if func in _SCALAR_READS and not _called_by_dynaflow():
                raise refusal(func)
            result = func(*args, **kwargs)
            watch.derive(result)
            return result

    @contextlib.contextmanager
    def watching() -> Iterator[None]:
        _watches.active = [*_active(), watch]
        try:
            with DataReads(), ScalarReads():
                yield
        finally:
            _watches.active = [other for other in _active() if other is not watch]

    return watching()


@contextlib.contextmanager
def resting_value_read_refusals() -> Iterator[None]:
    """Rest the refusals of this thread for a block that steps out of the trace (to trace a function
    of its own, or to run real computations): they come back after it."""
    resting, _watches.active = _active(), []
    try:
        yield
    finally:
        _watches.active = resting


class _Watch:
    """One trace's refusal: whether it is active, and the one-element values computed from real tensors."""

    def __init__(self) -> None:
        self.derived: dict[int, weakref.ref] = {}

    def active(self) -> bool:
        return any(watch is self for watch in _active())

    def outside(self, value: Any) -> bool:
        if not isinstance(value, torch.Tensor):
            return False
        return _real(value) or (id(value) in self.derived and self.derived[id(value)]() is value)

    def derive(self, result: Any) -> None:
        for value in optree.tree_leaves(result):
            if isinstance(value, FakeTensor) and value.numel() <= 1:
                self.derived[id(value)] = weakref.ref(value)


def _real(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor)


def _active() -> list[_Watch]:
    return getattr(_watches, "active", [])


def _called_by_dynaflow() -> bool:
    """Whether the code that made the read is dynaflow_fn's own (a transform reading a graph constant
    while the trace runs), not the traced function's or a library's it calls: the first frame above
    the mode outside torch's override and dispatch machinery."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename in _MACHINERY:
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR)


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_MACHINERY = frozenset(os.path.join(os.path.dirname(torch.__file__), *name.split("/"))
                       for name in ("overrides.py", "_tensor.py", "_ops.py", "utils/_python_dispatch.py"))

_watches = threading.local()
"""`active`: the refusals of this thread's traces in progress that are not resting."""

_DATA_READS = frozenset({torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__})
"""Reads that hand a real tensor's data to Python without reaching the dispatcher."""

_LITERALS = frozenset({torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default})
"""How a tensor the function makes from data (`torch.tensor(3.)`) enters the trace: its own, not a caller's."""

_SCALAR_READS = frozenset({torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default,
                           torch.ops.aten.is_nonzero.default})
"""The aten ops that hand a tensor's data to Python."""
