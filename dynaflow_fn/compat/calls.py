"""What every call of a jitted function reads from torch: the process-wide settings its plan depends
on, whether ops are traced or transformed now, resident addresses, the current CUDA stream, and
outputs whose backward explains itself.

They sit on the per-call path, a few microseconds of host time in all, so each entry resolves its
fastest reader once, at import, to one of torch's C functions where torch has it (and to the public
API otherwise). Where a reading takes several C calls (the matmul settings, whether ops are
transformed, an output without a backward) this module hands out the C functions and the caller
composes them: a call with torch's C readers at hand runs no Python of this module at all.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.fx.experimental import proxy_tensor

from ..errors import BackwardError

# --- process-wide state a plan depends on -----------------------------------------------------------


def _torch_c(name: str, fallback: Callable[..., Any]) -> Callable[..., Any]:
    """torch's C function `torch._C.<name>` where this torch has it, else `fallback`: resolved once, at
    import, so that a call runs no Python of this module."""
    found = getattr(torch._C, name, None)
    return found if found is not None else fallback


def _any_autocast_enabled_in_python() -> bool:
    return any(torch.is_autocast_enabled(device) for device in ("cuda", "cpu", "xpu", "mps", "hpu"))


def _torch_function_modes_in_python() -> int:
    from torch.overrides import _get_current_function_mode_stack

    return len(_get_current_function_mode_stack())


any_autocast_enabled: Callable[[], bool] = _torch_c("_is_any_autocast_enabled", _any_autocast_enabled_in_python)
"""Whether autocast is on for any device type."""

torch_function_modes: Callable[[], int] = _torch_c("_len_torch_function_stack", _torch_function_modes_in_python)
"""How many torch-function modes are active (`torch.set_default_device` installs one)."""


def _public_matmul_settings() -> tuple:
    cuda, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    return (cuda.allow_tf32, cudnn.allow_tf32, cuda.allow_fp16_reduced_precision_reduction,
            cuda.allow_bf16_reduced_precision_reduction, cudnn.deterministic, cudnn.benchmark,
            torch.get_float32_matmul_precision(), str(torch.backends.cuda.preferred_blas_library()))


def _resolve_matmul_setting_readers() -> tuple[Callable[[], Any], ...]:
    getters = tuple(getattr(torch._C, name, None) for name in (
        "_get_cublas_allow_tf32", "_get_cudnn_allow_tf32", "_get_cublas_allow_fp16_reduced_precision_reduction",
        "_get_cublas_allow_bf16_reduced_precision_reduction", "_get_cudnn_deterministic", "_get_cudnn_benchmark",
        "_get_blas_preferred_backend", "_get_float32_matmul_precision"))
    return (_public_matmul_settings,) if None in getters else getters


matmul_setting_readers: tuple[Callable[[], Any], ...] = _resolve_matmul_setting_readers()
"""The readers of the settings that choose matmul and convolution kernels (TF32, reduced-precision
reductions, cuDNN determinism and autotuning, the preferred BLAS library, float32 matmul precision): a CUDA
graph keeps the kernels chosen when it was captured, so a change must capture again, and a call reads them
all (`tuple(read() for read in matmul_setting_readers)`). torch._C's getters, a tenth of the cost of the
torch.backends properties (about 2 us); without them, one reader of all of them through the public API."""


# --- whether a jitted function runs its plan or its Python ------------------------------------------

_PASSIVE_MODES = frozenset({"_AnalyzeCustomOpInputOutputMode"})
"""Dispatch modes torch itself runs compiled code under that only look at ops, changing nothing (AOTAutograd
runs every compiled forward under this one): a jitted function called under them runs its plan."""


def _recording_mode_active() -> bool:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(type(mode).__name__ not in _PASSIVE_MODES for mode in _get_current_dispatch_mode_stack())


def _proxy_mode_active() -> bool:
    get_proxy_mode = getattr(proxy_tensor, "get_proxy_mode", None)
    return get_proxy_mode is not None and get_proxy_mode() is not None


def _resolve_dispatch_mode_readers() -> tuple[Callable[[], int], Callable[[], bool]]:
    depth = getattr(torch._C, "_len_torch_dispatch_stack", None)
    return (depth, _recording_mode_active) if depth is not None else (_one, _proxy_mode_active)


def _one() -> int:
    return 1


def _no_interpreter() -> None:
    return None


dispatch_mode_depth, recording_mode_active = _resolve_dispatch_mode_readers()
"""`dispatch_mode_depth()`: how many TorchDispatchModes are active, in one C call;
`recording_mode_active()`: whether one of them records or changes ops (make_fx's proxy and fake-tensor
modes while anything traces, any other but torch's own passive ones), asked only when the depth is not 0.
Fallback without the C stack length: a depth of 1, and only a make_fx trace is seen as recording."""

functorch_interpreter: Callable[[], Any] = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack",
                                                   None) or _no_interpreter
"""`functorch_interpreter()`: the innermost torch.func transform running now (vmap, grad, ...), or None; a C
call. Fallback: None (a transform over a jitted function then fails inside torch)."""


# --- CUDA graphs and streams ------------------------------------------------------------------------


def _data_ptrs_equal_in_python(tensors: Sequence[torch.Tensor], data_ptrs: Sequence[int | None],
                               indices: Sequence[int]) -> bool:
    return all(tensors[i].data_ptr() == data_ptrs[i] for i in indices)


def _foreach_copy_in_python(destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    for destination, source in zip(destinations, sources):
        destination.copy_(source)


foreach_copy: Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], None] = (
    getattr(torch, "_foreach_copy_", None) or _foreach_copy_in_python)
"""`foreach_copy(destinations, sources)`: `destinations[i].copy_(sources[i])` for every i, in one call
(`torch._foreach_copy_`: on CUDA one kernel for dense tensors of one dtype and device)."""


def _current_stream_id_in_python(device_index: int) -> Any:
    stream = torch.cuda.current_stream(device_index)
    return stream.stream_id, stream.device_index, stream.device_type


data_ptrs_equal: Callable[[Sequence[torch.Tensor], Sequence[int | None], Sequence[int]], bool] = _torch_c(
    "_tensors_data_ptrs_at_indices_equal", _data_ptrs_equal_in_python)
"""`data_ptrs_equal(tensors, data_ptrs, indices)`: whether `tensors[i].data_ptr() == data_ptrs[i]` for every i
in `indices` (`data_ptrs` has an entry per tensor). In C++ on CUDA builds, what torch.compile's CUDA graphs
check their static inputs with."""

current_stream_id: Callable[[int], Any] = _torch_c("_cuda_getCurrentStream", _current_stream_id_in_python)
"""`current_stream_id(device_index)`: a cheap, comparable identity of the current CUDA stream, the triple
(stream id, device index, device type); torch.cuda.current_stream builds a Stream object per call, which
costs a few microseconds."""


def stream_from_id(stream_id: Any) -> "torch.cuda.Stream":
    """The stream that `current_stream_id` identified."""
    return torch.cuda.Stream(stream_id=stream_id[0], device_index=stream_id[1], device_type=stream_id[2])


# --- outputs without a backward ---------------------------------------------------------------------


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, message: str, *tensors: torch.Tensor) -> Any:
        ctx.message = message
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        raise BackwardError(ctx.message)


class _NoBackwardNode:
    """Fallback of `no_backward_node`: the same contract through an autograd.Function."""

    def __init__(self, message: bytes, count: int):
        self.message = message.decode()

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _NoBackward.apply(self.message, *tensors)


no_backward_node: Callable[[bytes, int], Callable[..., Any]] = getattr(
    getattr(torch._C, "_functions", None), "DelayedError", None) or _NoBackwardNode
"""`no_backward_node(message, count)`: an autograd node that takes `count` tensors requiring grad and returns
them (the same memory) as outputs whose backward raises `message`: a tuple, or the one tensor. What a
compiled plan hands back where eager PyTorch would return tensors in the autograd graph: they say so when
backward reaches them, instead of failing far away with "does not require grad". torch's DelayedError node,
one C++ call; the fallback is an autograd.Function, whose error is a `BackwardError`."""
