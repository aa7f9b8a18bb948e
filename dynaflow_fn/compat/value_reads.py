"""Refusing reads of the data of tensors a traced function did not receive.

A tensor the function reads without receiving it (a module buffer, a closed-over or global tensor)
is a real tensor inside the trace, not a fake one. FakeTensorMode answers a read of its data as a
Python value from the real data, and keeps tensors of one element as constants through the ops on
them, so the trace would bake in the value the tensor had while being traced: `x * float(s)`,
`k[self.pos] = v`, `torch.arange(n)` of a 0-d buffer, `s.tolist()`. Eager PyTorch reads the tensor
anew on every call (and sees the function's own updates of it, which the fake trace does not).

While `refusing_value_reads_of_outside_tensors` is active on a thread, two hooks watch for such reads:

- a dispatch mode above make_fx's sees every read that reaches an aten op (`_local_scalar_dense`
  behind `float`, `int`, `bool`, `.item()`, an index or a size taken from a 0-d tensor; `equal`;
  `is_nonzero`) and refuses it for a real tensor or a one-element value computed from one;
- `tolist`, `numpy` and `__array__` of a real tensor never reach the dispatcher: for the trace's
  duration, torch.Tensor's methods are wrapped to refuse them on this thread.

dynaflow_fn's own reads of graph constants while a trace runs pass, as does a literal the function
makes itself (`torch.tensor(3.).item()`, lifted by `lift_fresh`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor


def refusing_value_reads_of_outside_tensors(refusal: Callable[[Any], Exception]) -> contextlib.AbstractContextManager:
    """A context to enter inside a make_fx trace in which a read of the data of a tensor the function
    did not receive raises `refusal(op)`. Without Python dispatch modes, nothing is intercepted."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError:
        return contextlib.nullcontext()
    watch = _Watch(refusal)

    class ScalarReads(TorchDispatchMode):
        """Above make_fx's proxy mode, which runs an op on real tensors alone for real: it sees the
        read before that. The check costs a set lookup per op, and a look at the arguments only
        for a read or a result of one element."""

        def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func in _SCALAR_READS and watch.active() and watch.reads_outside(args, kwargs) \
                    and not _called_by_dynaflow():
                raise refusal(func)
            out = func(*args, **kwargs)
            if isinstance(out, FakeTensor) and out.numel() <= 1 and func not in _LITERALS and watch.active() \
                    and watch.reads_outside(args, kwargs):
                watch.derive(out)
            return out

    @contextlib.contextmanager
    def watching() -> Iterator[None]:
        _watches.active = [*_active(), watch]
        try:
            with _wrapped_data_reads(), ScalarReads():
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
    """One trace's refusal, and the one-element values computed from real tensors during it."""

    def __init__(self, refusal: Callable[[Any], Exception]) -> None:
        self.refusal = refusal
        self.derived: dict[int, weakref.ref] = {}

    def active(self) -> bool:
        return any(watch is self for watch in _active())

    def reads_outside(self, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        return any(self.outside(value) for value in _tensors(args, kwargs))

    def outside(self, value: torch.Tensor) -> bool:
        return not isinstance(value, FakeTensor) or (id(value) in self.derived and self.derived[id(value)]() is value)

    def derive(self, value: FakeTensor) -> None:
        self.derived[id(value)] = weakref.ref(value)


def _tensors(args: Sequence[Any], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors among an op's arguments, also inside lists (`cat`'s tensors, `index`'s indices)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (item for item in value if isinstance(item, torch.Tensor))


_wrapping_lock = threading.Lock()
_wrapped_depth = 0


@contextlib.contextmanager
def _wrapped_data_reads() -> Iterator[None]:
    """Wrap torch.Tensor's `tolist`, `numpy` and `__array__` so that, on a thread with an active
    refusal, they refuse a real tensor; other threads and other tensors get the original."""
    global _wrapped_depth
    with _wrapping_lock:
        if _wrapped_depth == 0:
            for name, original in _DATA_READS.items():
                setattr(torch.Tensor, name, _refusing(name, original))
        _wrapped_depth += 1
    try:
        yield
    finally:
        with _wrapping_lock:
            _wrapped_depth -= 1
            if _wrapped_depth == 0:
                for name, original in _DATA_READS.items():
                    if name in _OWN_DATA_READS:
                        setattr(torch.Tensor, name, original)
                    else:
                        delattr(torch.Tensor, name)


def _refusing(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        watches = _active()
        if watches and not isinstance(self, FakeTensor) and not _called_by_dynaflow():
            raise watches[-1].refusal(original)
        return original(self, *args, **kwargs)

    read.__name__ = name
    return read


def _active() -> list[_Watch]:
    return getattr(_watches, "active", [])


def _called_by_dynaflow() -> bool:
    """Whether the code that made the read is dynaflow_fn's own (a transform reading a graph constant
    while the trace runs), not the traced function's or a library's it calls: the first frame above
    torch's own machinery (anything of torch's but its modules, whose code reads like a user's)."""
    frame = sys._getframe(2)                # above the hook that asks
    while frame is not None and _machinery(frame.f_code):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR)


def _machinery(code: Any) -> bool:
    """torch's own frames but its modules', and any mode's hook (dynaflow_fn's own modes watch the
    trace too: `gradients.py`'s torch function mode passes every call on)."""
    if code.co_name in ("__torch_function__", "__torch_dispatch__"):
        return True
    return code.co_filename.startswith(_TORCH_DIR) and not code.co_filename.startswith(_TORCH_MODULES_DIR)


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TORCH_MODULES_DIR = os.path.join(_TORCH_DIR, "nn") + os.sep

_watches = threading.local()
"""`active`: the refusals of this thread's traces in progress that are not resting."""

_OWN_DATA_READS = frozenset(name for name in ("tolist", "numpy", "__array__") if name in vars(torch.Tensor))
"""Which of the data reads torch.Tensor defines itself (the others it inherits from its C base)."""

_DATA_READS = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "__array__")}
"""Reads that hand a real tensor's data to Python without reaching the dispatcher."""

_LITERALS = frozenset({torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default})
"""How a tensor the function makes from data (`torch.tensor(3.)`) enters the trace: its own, not a caller's."""

_SCALAR_READS = frozenset({torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default,
                           torch.ops.aten.is_nonzero.default})
"""The aten ops that hand a tensor's data to Python."""
