"""Tracing a function on fake tensors to an aten graph: make_fx, FakeTensorMode and their internals.

No public API traces a function on fake tensors to an aten graph; make_fx and FakeTensorMode are
the documented-in-code way torch.export and torch.compile do it, stable across 2.11-2.15.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import fx
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.proxy_tensor import make_fx

from ..errors import KERNEL_ERRORS, InternalError, MetaKernelRejection
from .value_reads import resting_value_read_refusals


class FakeTensorModeWithFallback(FakeTensorMode):
    """A FakeTensorMode in which the real kernel has the last word when a meta kernel rejects its inputs.

    Meta kernels are sometimes stricter than the real ones (in torch 2.13 the meta kernel of
    `_grouped_mm` rejects float32, which the CPU kernel computes, so transformers' MoE experts did
    not trace). When a meta kernel raises, the op runs for real on zero-filled tensors of the fake
    inputs' shapes on their device (FakeTensorMode's own fallback for ops with no meta kernel), and
    its results' shapes and strides become the fake results. If the real kernel rejects the inputs
    too (a genuine error, such as mismatched shapes) or cannot run (the meta device), the error is a
    `MetaKernelRejection` naming the op. Where this torch's FakeTensorMode lacks the hooks, the
    meta kernel's error stands, as a MetaKernelRejection too.
    """

    def _dispatch_impl(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if func._schema.is_mutable:
            args, kwargs = self._fakes_for_real(args, kwargs)
        try:
            return super()._dispatch_impl(func, types, args, kwargs)
        except (MetaKernelRejection, DataDependentOutputException, DynamicOutputShapeException,
                UnsupportedOperatorException):
            raise
        except RuntimeError as rejected:
            return self._ask_the_real_kernel(func, args, kwargs, rejected)

    produced: list[tuple[weakref.ref, Any]] | None = None
    """While `recording_results` runs: a weak reference to every fake tensor an op returned, with the op."""

    if hasattr(FakeTensorMode, "dispatch"):        # the entry of every op, served from the cache or not
        def dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = super().dispatch(func, types, args, kwargs)
            produced = self.produced
            if produced is not None:
                given = {id(arg) for arg in args if isinstance(arg, FakeTensor)}   # `x.to(x.dtype)` returns x itself
                for value in (out if isinstance(out, (tuple, list)) else (out,)):
                    if isinstance(value, FakeTensor) and id(value) not in given:
                        produced.append((weakref.ref(value), func))
            return out

    @contextlib.contextmanager
    def recording_results(self) -> Iterator[list[tuple[weakref.ref, Any]]]:
        """Record the fake tensors ops return meanwhile (weakly, so they die as they would): after a
        trace, those still alive are held by someone. Where this torch's FakeTensorMode has no
        `dispatch` to hook, nothing is recorded."""
        outer, self.produced = self.produced, []
        try:
            yield self.produced
        finally:
            self.produced = outer

    def _fakes_for_real(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """Real tensors among an in-place op's arguments (a closed-over tensor, a module buffer) as
        fakes. FakeTensorMode runs an op whose tensors are all real for real (`c.add_(1)`), which would
        update the caller's tensor once more at trace time, on top of the plan's update on every call."""
        from torch.utils import _pytree

        converter = self.fake_tensor_converter
        return _pytree.tree_map_only(
            torch.Tensor, lambda t: t if isinstance(t, FakeTensor) else converter.from_real_tensor(self, t),
            (args, kwargs))

    def _ask_the_real_kernel(self, func: Any, args: Any, kwargs: Any, rejected: RuntimeError) -> Any:
        from torch._subclasses import fake_tensor
        from torch.utils import _pytree

        run_real = getattr(fake_tensor, "run_fallback_kernel", None)
        can_run = getattr(self, "can_run_unsafe_fallback", None)
        if run_real is None or can_run is None or not can_run(func) or torch.Tag.inplace_view in func.tags:
            raise MetaKernelRejection(func, str(rejected), confirmed=False) from rejected
        flat_args, args_spec = _pytree.tree_flatten((args, kwargs))
        real_device = all(getattr(a, "fake_device", torch.device("cpu")).type != "meta" for a in flat_args
                          if isinstance(a, torch.Tensor))
        try:
            return run_real(self, func, flat_args, args_spec, rejected)
        except KERNEL_ERRORS as real_error:
            raise MetaKernelRejection(func, str(real_error), confirmed=real_device) from rejected


def fake_mode_of(values: Iterable[Any]) -> FakeTensorMode | None:
    """The FakeTensorMode of the first fake tensor among `values` (None if there is none): the mode a
    Program's values were traced in. Nodes added to a Program must carry fake values of that one mode:
    Inductor, and anything else that runs ops on a graph's fake values, refuses inputs from two modes."""
    return next((value.fake_mode for value in values if isinstance(value, FakeTensor)), None)


def current_trace_graph() -> fx.Graph:
    """The graph the make_fx trace in progress records into: what reads the nodes a block of model code
    adds (its scopes, a substitution's ops). make_fx keeps it on its proxy mode's tracer; where
    `get_proxy_mode` is gone, that mode is found on the dispatch mode stack."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    mode = _get_proxy_mode() if _get_proxy_mode is not None else next(
        (m for m in reversed(_get_current_dispatch_mode_stack()) if hasattr(m, "tracer")), None)
    if mode is None:
        raise InternalError("current_trace_graph was called with no make_fx trace in progress")
    return mode.tracer.graph


_get_proxy_mode = getattr(proxy_tensor, "get_proxy_mode", None)


@contextlib.contextmanager
def outside_current_trace() -> Iterator[None]:
    """Run a block with no dispatch mode of the current thread active (the fake-tensor and proxy modes
    of a make_fx trace in progress), so that it can trace a function of its own; the modes come back
    after it. torch steps out of a trace this way to run real computations inside one. The trace's
    value-read refusals (`refusing_value_reads_of_outside_tensors`) rest meanwhile too."""
    from torch.utils._python_dispatch import _disable_current_modes

    with resting_value_read_refusals(), _disable_current_modes():
        yield


def refusing_generator_arguments(refusal: Callable[[Any], Exception]) -> contextlib.AbstractContextManager:
    """A context to enter inside a make_fx trace in which an aten op handed a torch.Generator raises
    `refusal(op)` before make_fx records it (torch 2.11's tracer cannot record a Generator and fails
    with "argument of type Generator"; later ones record it as a constant). A dispatch mode entered
    inside the trace sits above make_fx's and sees each op first. Without Python dispatch modes,
    nothing is intercepted."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError:
        return contextlib.nullcontext()

    class RefusingGenerators(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if any(isinstance(value, torch.Generator) for value in (*args, *kwargs.values())):
                raise refusal(func)
            return func(*args, **kwargs)

    return RefusingGenerators()


@contextlib.contextmanager
def quiet_meta_failures() -> Iterator[None]:
    """Keep FakeTensorMode from logging a full traceback with tensor dumps for every meta kernel that
    raises (it logs, then re-raises); the error itself still reaches the caller."""
    import logging

    logger = logging.getLogger("torch._subclasses.fake_tensor")

    def drop(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta")

    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


@contextlib.contextmanager
def fx_tracing_flag_cleared() -> Iterator[None]:
    """Run a block as if no FX symbolic trace were active.

    make_fx marks itself as FX tracing, and libraries (transformers, for one) then take code paths
    meant for Proxies. A Program is specialized to concrete shapes, so model code should see eager
    mode. torch <= 2.13 keeps the flag in a module global, 2.14+ in a thread-local with setters; if
    neither exists the flag cannot be cleared and model code sees what make_fx shows it.
    """
    import torch.fx._symbolic_trace as symbolic_trace

    if hasattr(symbolic_trace, "_set_is_fx_tracing"):
        previous = symbolic_trace._get_is_fx_tracing()
        symbolic_trace._set_is_fx_tracing(False)
        try:
            yield
        finally:
            symbolic_trace._set_is_fx_tracing(previous)
    elif hasattr(symbolic_trace, "_is_fx_tracing_flag"):
        previous = symbolic_trace._is_fx_tracing_flag
        symbolic_trace._is_fx_tracing_flag = False
        try:
            yield
        finally:
            symbolic_trace._is_fx_tracing_flag = previous
    else:
        yield
