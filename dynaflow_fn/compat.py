"""Every private PyTorch internal dynaflow_fn uses, in one place, each with a fallback.

dynaflow_fn supports every PyTorch from 2.11 to the newest release. Private names move between
releases (2.14 made the fx-tracing flag thread-local, for one), so no other module touches them:
each entry below says what it is for, uses the public API where one exists, and falls back to
something correct (if slower or less precise) when the internal is missing. tests/test_compat.py
runs every entry, and every fallback.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import fx

from .errors import MetaKernelRejection

__all__ = [
    "DataDependentOutputException", "DynamicOutputShapeException", "FakeTensorMode", "OpOverload", "StorageWeakRef",
    "UnsupportedOperatorException", "compile_with_inductor", "default_store", "functional_collectives",
    "fx_tracing_flag_cleared", "get_proxy_mode", "has_internal_overlap", "has_kernel_for", "inductor_compiler", "make_fx",
    "resolve_process_group", "sm_carveout", "sm_carveout_supported",
    "any_autocast_enabled", "torch_function_mode_active", "matmul_settings", "without_backward",
    "data_ptrs_equal", "dynamo_input_origin", "marked_static_address", "clear_cublas_workspaces", "current_stream_id", "stream_from_id", "FakeTensorModeWithFallback",
    "quiet_meta_failures", "outside_current_trace", "observe_module_changes", "ops_are_transformed", "in_backward",
]

# --- fake tensors and make_fx ---------------------------------------------------------------------
# No public API traces a function on fake tensors to an aten graph; make_fx and FakeTensorMode are
# the documented-in-code way torch.export and torch.compile do it, stable across 2.11-2.15.

from torch._subclasses.fake_tensor import (  # noqa: E402
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx  # noqa: E402


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
        try:
            return super()._dispatch_impl(func, types, args, kwargs)
        except (MetaKernelRejection, DataDependentOutputException, DynamicOutputShapeException,
                UnsupportedOperatorException):
            raise
        except RuntimeError as rejected:
            return self._ask_the_real_kernel(func, args, kwargs, rejected)

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
        except Exception as real_error:
            raise MetaKernelRejection(func, str(real_error), confirmed=real_device) from rejected


@contextlib.contextmanager
def outside_current_trace() -> Iterator[None]:
    """Run a block with no dispatch mode of the current thread active (the fake-tensor and proxy modes
    of a make_fx trace in progress), so that it can trace a function of its own; the modes come back
    after it. torch steps out of a trace this way to run real computations inside one."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def _resolve_ops_are_transformed() -> Callable[[], bool]:
    modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
    peek = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
    mode_active = (lambda: modes() > 0) if modes is not None else (lambda: get_proxy_mode() is not None)
    transform_active = (lambda: peek() is not None) if peek is not None else (lambda: False)

    def ops_are_transformed() -> bool:
        """Whether the ops called now are recorded or transformed rather than only computed: a dispatch
        mode is active (make_fx's proxy and fake-tensor modes while anything traces, any other
        TorchDispatchMode) or a torch.func transform runs (vmap, grad, jacrev, ...). Two C calls of
        torch's. Fallbacks: without the mode-stack length, only a make_fx trace is seen; without
        functorch's interpreter stack, no transform is (a transform over a jitted function then fails
        inside torch)."""
        return mode_active() or transform_active()
    return ops_are_transformed


ops_are_transformed = _resolve_ops_are_transformed()


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

from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
"""A hashable, weak handle on a tensor's storage (fake storages included): which tensors alias."""

OpOverload = torch._ops.OpOverload
"""The type of `torch.ops.aten.mm.default`: one overload of an operator, with a schema."""


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


# --- process-wide state a plan depends on -----------------------------------------------------------
# Read on every jitted call, so each has a fast private reader and a public (slower) fallback.


def any_autocast_enabled() -> bool:
    """Whether autocast is on for any device type."""
    query = getattr(torch._C, "_is_any_autocast_enabled", None)
    if query is not None:
        return query()
    return any(torch.is_autocast_enabled(device) for device in ("cuda", "cpu", "xpu", "mps", "hpu"))


def torch_function_mode_active() -> bool:
    """Whether a torch-function mode is active (`torch.set_default_device` installs one)."""
    query = getattr(torch._C, "_len_torch_function_stack", None)
    if query is not None:
        return query() > 0
    from torch.overrides import _get_current_function_mode_stack

    return bool(_get_current_function_mode_stack())


def _public_matmul_settings() -> tuple:
    cuda, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    return (cuda.allow_tf32, cudnn.allow_tf32, cuda.allow_fp16_reduced_precision_reduction,
            cuda.allow_bf16_reduced_precision_reduction, cudnn.deterministic, cudnn.benchmark,
            torch.get_float32_matmul_precision(), str(torch.backends.cuda.preferred_blas_library()))


def _resolve_matmul_settings() -> Any:
    getters = [getattr(torch._C, name, None) for name in ("_get_cublas_allow_tf32", "_get_cudnn_allow_tf32",
               "_get_cublas_allow_fp16_reduced_precision_reduction", "_get_cublas_allow_bf16_reduced_precision_reduction",
               "_get_cudnn_deterministic", "_get_cudnn_benchmark", "_get_blas_preferred_backend",
               "_get_float32_matmul_precision")]
    if None in getters:
        return _public_matmul_settings
    tf32, cudnn_tf32, fp16, bf16, deterministic, benchmark, blas, precision = getters

    def matmul_settings() -> tuple:
        """The settings that choose matmul and convolution kernels (TF32, reduced-precision reductions,
        cuDNN determinism and autotuning, the preferred BLAS library, float32 matmul precision). A CUDA
        graph keeps the kernels chosen when it was captured, so a change must capture again. Read on
        every call: torch._C's getters cost a tenth of the torch.backends properties (about 2 us)."""
        return tf32(), cudnn_tf32(), fp16(), bf16(), deterministic(), benchmark(), blas(), precision()
    return matmul_settings


matmul_settings = _resolve_matmul_settings()


# --- changes to modules ---------------------------------------------------------------------------------
# No public API reports that a module's hooks, submodules or attributes changed (torch.compile's guards read
# the dicts on every call). df.jit must know without looking, so nn.Module's own mutators are wrapped once.

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


# --- autograd -----------------------------------------------------------------------------------------


class _NoBackward(torch.autograd.Function):
    """Fallback of `without_backward`: outputs whose backward raises `message`."""

    @staticmethod
    def forward(ctx: Any, message: str, *tensors: torch.Tensor) -> Any:
        ctx.message = message
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        raise RuntimeError(ctx.message)


def without_backward(tensors: list[torch.Tensor], message: bytes) -> list[torch.Tensor]:
    """The same tensors (same memory), now requiring grad, whose backward raises `message`.

    What eager PyTorch would hand back from inputs that require grad is a tensor in the autograd
    graph; a compiled plan has none, so its outputs say so when backward reaches them instead of
    failing far away with "does not require grad". torch's DelayedError node does this in one C++
    call; the fallback is an autograd.Function."""
    if _DelayedError is None:
        return list(_NoBackward.apply(message.decode(), *(_requiring_grad(t) for t in tensors)))
    node = _DelayedError(message, len(tensors))
    results = node(*(_requiring_grad(t) for t in tensors))
    return list(results) if isinstance(results, tuple) else [results]


_DelayedError = getattr(getattr(torch._C, "_functions", None), "DelayedError", None)


def _requiring_grad(tensor: torch.Tensor) -> torch.Tensor:
    alias = tensor.detach()
    alias.requires_grad_(True)
    return alias


def in_backward() -> bool:
    """Whether this thread runs the autograd engine's backward now (its ops run with grad mode at
    `create_graph`): torch's current graph task. Fallback: False, so ops that `torch.autograd.grad`
    records while tracing count as run by the function itself (their outputs are then taken to
    require grad when their inputs do: backward through them still raises df.jit's error)."""
    query = getattr(torch._C, "_current_graph_task_id", None)
    return query is not None and query() != -1


# --- CUDA graphs -----------------------------------------------------------------------------------------


def marked_static_address(tensor: torch.Tensor) -> bool:
    """Whether `torch._dynamo.mark_static_address(tensor)` was called: the public call records it only
    in this attribute (torch 2.3 and later). Without it, marked tensors are copied in like others:
    correct, only slower."""
    return getattr(tensor, "_dynamo_static_input_type", None) is not None


def dynamo_input_origin(placeholder: fx.Node) -> bool | None:
    """For a placeholder of a graph Dynamo captured: True if its value was reached from an argument
    of the compiled frame (`L['input_ids']`, `L['kwargs']['cache_position']`,
    `L['self'].model.embed_tokens.weight`), False if from elsewhere (a global, a closure), None where
    Dynamo kept no record. Dynamo's `grapharg.source` is a chain of sources (attribute, item, ...)
    down to a `LocalSource`, whose `is_input` says whether the local is a frame argument; decorated
    forwards (transformers' `(self, *args, **kwargs)` wrappers) pass every argument through such a
    chain."""
    source = getattr(placeholder.meta.get("grapharg"), "source", None)
    while source is not None and hasattr(source, "base"):
        source = source.base
    if source is None:
        return None
    return getattr(source, "is_input", False) is True


def data_ptrs_equal(tensors: Sequence[torch.Tensor], data_ptrs: Sequence[int | None], indices: Sequence[int]) -> bool:
    """Whether `tensors[i].data_ptr() == data_ptrs[i]` for every i in `indices` (`data_ptrs` has an
    entry per tensor): in C++ on CUDA builds (what torch.compile's CUDA graphs check their static
    inputs with), else in Python."""
    query = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    if query is not None:
        return query(tensors, data_ptrs, indices)
    return all(tensors[i].data_ptr() == data_ptrs[i] for i in indices)


def current_stream_id(device_index: int) -> Any:
    """A cheap, comparable identity of the current CUDA stream (torch.cuda.current_stream builds a
    Stream object per call, which costs a few microseconds)."""
    query = getattr(torch._C, "_cuda_getCurrentStream", None)
    if query is not None:
        return query(device_index)
    stream = torch.cuda.current_stream(device_index)
    return stream.stream_id, stream.device_index, stream.device_type


def stream_from_id(stream_id: Any) -> "torch.cuda.Stream":
    """The stream that `current_stream_id` identified."""
    return torch.cuda.Stream(stream_id=stream_id[0], device_index=stream_id[1], device_type=stream_id[2])


def clear_cublas_workspaces() -> None:
    """Drop cuBLAS's cached per-(handle, stream) workspaces; the next GEMM on a stream allocates a new
    one from the caching allocator (inside a capture: from the graph's private pool). See
    runtime/cudagraph.py for why a capture must do this. No-op where torch lacks it or has no CUDA."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_available():
        clear()


# --- operator facts -------------------------------------------------------------------------------


def has_kernel_for(op: OpOverload, dispatch_key: str) -> bool:
    """Whether `op` registers a kernel for `dispatch_key` (e.g. "CompositeExplicitAutograd").

    Without the dispatcher query, answer True: callers use it to rule kernels out, and ruling one
    out only costs speed (an allocation instead of an out= write)."""
    query = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
    return True if query is None else bool(query(op.name(), dispatch_key))


def has_internal_overlap(tensor: torch.Tensor) -> bool:
    """Whether some elements of `tensor` share memory (an expanded or overlapping-stride view).

    Fallback: True unless each stride (smallest first) steps past every element the smaller ones
    reach, which is conservative (callers then keep an op out of place)."""
    query = getattr(torch, "_debug_has_internal_overlap", None)
    if query is not None:
        return query(tensor) == 1
    reach = 0
    for stride, size in sorted((s, n) for s, n in zip(tensor.stride(), tensor.shape) if n > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


# --- SM carveout ------------------------------------------------------------------------------------


def sm_carveout_supported() -> bool:
    """Whether cuBLAS can be asked to leave SMs free (torch's experimental SM carveout, CUDA builds)."""
    return (torch.version.cuda is not None and hasattr(torch._C, "_set_sm_carveout_experimental")
            and hasattr(torch._C, "_get_sm_carveout_experimental"))


@contextlib.contextmanager
def sm_carveout(carveout: int) -> Iterator[None]:
    """GEMMs launched inside leave `carveout` SMs free, through cuBLASLt (the path that honours it).
    Where torch lacks the carveout this does nothing: kernels then take every SM, which is slower
    beside a collective but computes the same."""
    if not sm_carveout_supported():
        yield
        return
    previous = torch._C._get_sm_carveout_experimental()
    previous_blas = torch.backends.cuda.preferred_blas_library()
    torch._C._set_sm_carveout_experimental(carveout)
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(previous)
        torch.backends.cuda.preferred_blas_library(previous_blas)


# --- distributed --------------------------------------------------------------------------------------


def functional_collectives() -> Any:
    """torch.distributed._functional_collectives: collectives that trace into graphs (no public home)."""
    import torch.distributed._functional_collectives as funcol

    return funcol


def resolve_process_group(group_name: str) -> Any:
    """The ProcessGroup that functional collectives name by `group_name`."""
    from torch.distributed import distributed_c10d

    resolve = getattr(distributed_c10d, "_resolve_process_group", None)
    if resolve is not None:
        return resolve(group_name)
    for group in distributed_c10d._world.pg_map:
        if getattr(group, "group_name", None) == group_name:
            return group
    raise ValueError(f"no process group is named {group_name!r}")


def default_store() -> Any:
    """The store of the default process group, through which ranks compare their plans."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


# --- Inductor ----------------------------------------------------------------------------------------


def inductor_compiler() -> Callable[[fx.GraphModule, list], Any]:
    """Inductor's compiler for an aten graph (`compile_fx`, what torch.compile's "inductor" backend calls).

    Importing Inductor imports torch.utils.mkldnn, whose classes, on torch <= 2.13, apply the deprecated
    `torch.jit.script_method` when the module is executed: a dozen deprecation warnings about torch's own
    code that no caller can act on. They are ignored for that one import, and only they (torch 2.14+
    defines those classes lazily, so there is nothing to ignore; a torch without the module skips it).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated")
        with contextlib.suppress(ModuleNotFoundError):
            importlib.import_module("torch.utils.mkldnn")
    from torch._inductor.compile_fx import compile_fx

    return compile_fx


def compile_with_inductor(graph_module: fx.GraphModule, example_inputs: list) -> Any:
    """Compile an aten graph with Inductor: a callable that runs its fused kernels."""
    return inductor_compiler()(graph_module, example_inputs)
