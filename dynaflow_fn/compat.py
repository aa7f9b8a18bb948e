"""Every private PyTorch internal dynaflow_fn uses, in one place, each with a fallback.

dynaflow_fn supports every PyTorch from 2.11 to the newest release. Private names move between
releases (2.14 made the fx-tracing flag thread-local, for one), so no other module touches them:
each entry below says what it is for, uses the public API where one exists, and falls back to
something correct (if slower or less precise) when the internal is missing. tests/test_compat.py
runs every entry, and every fallback.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import fx

__all__ = [
    "DataDependentOutputException", "DynamicOutputShapeException", "FakeTensorMode", "OpOverload", "StorageWeakRef",
    "UnsupportedOperatorException", "compile_with_inductor", "default_store", "functional_collectives",
    "fx_tracing_flag_cleared", "get_proxy_mode", "has_internal_overlap", "has_kernel_for", "make_fx",
    "resolve_process_group", "sm_carveout", "sm_carveout_supported",
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
def sm_carveout(sms: int) -> Iterator[None]:
    """GEMMs launched inside leave `sms` SMs free, through cuBLASLt (the path that honours it).
    Where torch lacks the carveout this does nothing: kernels then take every SM, which is slower
    beside a collective but computes the same."""
    if not sm_carveout_supported():
        yield
        return
    previous = torch._C._get_sm_carveout_experimental()
    previous_blas = torch.backends.cuda.preferred_blas_library()
    torch._C._set_sm_carveout_experimental(sms)
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


def compile_with_inductor(graph_module: fx.GraphModule, example_inputs: list) -> Any:
    """Inductor's compiler for an aten graph (what torch.compile's "inductor" backend calls)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(graph_module, example_inputs)
