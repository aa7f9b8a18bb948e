"""Every private PyTorch internal dynaflow_fn uses, in one place, each with a fallback.

dynaflow_fn supports every PyTorch from 2.11 to the newest release. Private names move between
releases (2.14 made the fx-tracing flag thread-local, for one), so no other module touches them:
each entry below says what it is for, uses the public API where one exists, and falls back to
something correct (if slower or less precise) when the internal is missing.
tests/compat/test_compat.py runs every entry, and every fallback. Tracing on fake tensors lives in
`compat.tracing`, operator and storage facts in `compat.operators`, what every jitted call reads in
`compat.calls`; every entry is imported from `dynaflow_fn.compat`.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
from torch import fx

from ..errors import InputError
from .calls import (
    any_autocast_enabled,
    current_stream_id,
    data_ptrs_equal,
    dispatch_mode_depth,
    foreach_copy,
    functorch_interpreter,
    matmul_setting_readers,
    no_backward_node,
    recording_mode_active,
    stream_from_id,
    torch_function_modes,
)
from .modules import module_tensor_dicts, observe_module_changes
from .operators import (
    OpOverload,
    StorageAlias,
    StorageWeakRef,
    has_internal_overlap,
    has_kernel_for,
    op_schema,
    storage_alias,
)
from .tracing import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    FakeTensorModeWithFallback,
    UnsupportedOperatorException,
    current_trace_graph,
    fake_mode_of,
    fx_tracing_flag_cleared,
    make_fx,
    outside_current_trace,
    quiet_meta_failures,
    refusing_generator_arguments,
)
from .value_reads import refusing_value_reads_of_outside_tensors

__all__ = [
    "DataDependentOutputException", "DynamicOutputShapeException", "FakeTensor", "FakeTensorMode", "OpOverload",
    "StorageAlias", "StorageWeakRef", "module_tensor_dicts", "storage_alias",
    "UnsupportedOperatorException", "compile_with_inductor", "default_store", "functional_collectives",
    "fx_tracing_flag_cleared", "current_trace_graph", "has_internal_overlap", "has_kernel_for", "inductor_compiler",
    "make_fx", "op_schema",
    "resolve_process_group", "sm_carveout", "sm_carveout_supported",
    "any_autocast_enabled", "torch_function_modes", "matmul_setting_readers", "no_backward_node",
    "data_ptrs_equal", "foreach_copy", "dynamo_input_origin", "dynamo_input_name", "marked_static_address", "clear_cublas_workspaces", "current_stream_id", "stream_from_id", "FakeTensorModeWithFallback",
    "quiet_meta_failures", "refusing_generator_arguments", "refusing_value_reads_of_outside_tensors", "outside_current_trace", "fake_mode_of", "LeafCheck", "leaf_checker",
    "observe_module_changes", "dispatch_mode_depth", "recording_mode_active", "functorch_interpreter", "in_backward",
]


# --- the per-call check of df.jit ------------------------------------------------------------------
# torch.compile checks a frame's inputs with a tree of C++ guards (torch._C._dynamo.guards); df.jit
# checks its flattened arguments with the same ones. Each `add_*_guard` binding takes a `user_stack`
# after the guard's description in recent releases and none before; other changes give None.


class LeafCheck(NamedTuple):
    """One place `leaf_checker` compares: `example[path[0]][path[1]]...`, or its `attribute`."""

    path: tuple[int, ...]
    attribute: str | None = None


def leaf_checker(example: Sequence[Any], checks: Sequence[LeafCheck]) -> Callable[[Sequence[Any]], bool] | None:
    """One C++ call: whether an object holds, at each checked place, what `example` holds there now.

    A tensor matches a tensor of its Python type, dispatch keys, dtype, device, requires_grad, sizes and
    strides (TENSOR_MATCH; the data is not read); anything else matches an object of its exact type that
    is it or `==` to it (EQUALS_MATCH). Containers on a path are indexed as the lists or tuples they are
    in `example`; a place missing from the object does not match. None where this torch's guards are
    missing or built differently: the caller then checks in Python."""
    try:
        from torch._C._dynamo import guards
        from torch._dynamo.guards import GuardManagerType

        plain = GuardManagerType.GUARD_MANAGER
        root = guards.RootGuardManager()
        for check in checks:
            manager, value, source = root, example, "L"
            for index in check.path:
                item_manager = {list: manager.list_getitem_manager, tuple: manager.tuple_getitem_manager}[type(value)]
                source, value = f"{source}[{index}]", value[index]
                manager = item_manager(index, source, value, plain)
            if check.attribute is not None:
                source, value = f"{source}.{check.attribute}", getattr(value, check.attribute)
                manager = manager.getattr_manager(check.attribute, source, value, plain)
            if isinstance(value, torch.Tensor):
                _add_guard(manager.add_tensor_match_guard, (value, list(value.shape), list(value.stride()), source,
                           [source]), (type(value), torch._C._dispatch_keys(value)))
            else:
                _add_guard(manager.add_equals_match_guard, (value, [source]), ())
    except (ImportError, AttributeError, KeyError, TypeError, RuntimeError):
        return None
    return root.check


def _add_guard(add: Callable[..., None], head: tuple, tail: tuple) -> None:
    """Call an `add_*_guard` binding with `user_stack=None` between `head` and `tail`, or without it."""
    try:
        add(*head, None, *tail)
    except TypeError:
        add(*head, *tail)


# --- autograd -----------------------------------------------------------------------------------------


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
    """For a placeholder of a Dynamo graph: True if its value was reached from an argument of the
    compiled frame (`L['kwargs']['cache_position']`, `L['self'].lm_head.weight`), False if from
    elsewhere (a global, a closure), None without a record. Dynamo's `grapharg.source` is a chain of
    sources down to a `LocalSource`, whose `is_input` says whether it is a frame argument."""
    source = _dynamo_source(placeholder)
    while source is not None and hasattr(source, "base"):
        source = source.base
    return None if source is None else getattr(source, "is_input", False) is True


def dynamo_input_name(placeholder: fx.Node) -> str:
    """How the user reaches a Dynamo graph's input, for messages: its source's name, such as
    `L['kwargs']['attention_mask']` (a method in older torch, a property in newer), or the
    placeholder's own name (`l_kwargs_attention_mask_`) without a record."""
    name = getattr(_dynamo_source(placeholder), "name", None)
    name = name() if callable(name) else name
    return name if isinstance(name, str) else placeholder.name


def _dynamo_source(placeholder: fx.Node) -> Any:
    """Dynamo's record of where a graph input came from (`grapharg.source`), or None."""
    return getattr(placeholder.meta.get("grapharg"), "source", None)


def clear_cublas_workspaces() -> None:
    """Drop cuBLAS's cached per-(handle, stream) workspaces; the next GEMM on a stream allocates a new
    one from the caching allocator (inside a capture: from the graph's private pool). See
    runtime/cudagraph.py for why a capture must do this. No-op where torch lacks it or has no CUDA."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_available():
        clear()



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
    raise InputError(f"no process group is named {group_name!r}: the program runs a collective on it, so create it "
                     f"(torch.distributed.new_group) in this process before running the program")


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


from .aot import aot_autograd_backend, boxed, first_unbacked_node, recomputing_partitioner  # noqa: E402

__all__ += ["aot_autograd_backend", "boxed", "first_unbacked_node", "recomputing_partitioner"]
