"""What every call of a jitted function reads from torch: the process-wide settings its plan depends
on, whether ops are traced or transformed now, resident addresses, the current CUDA stream, and
outputs whose backward explains itself.

They sit on the per-call path, a few microseconds of host time in all, so each entry resolves its
fastest reader once, at import, to one of torch's C functions where torch has it (and to the public
API otherwise): the call then runs no Python of this module but the entry itself.
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


def _resolve_ops_are_transformed() -> Callable[[], bool]:
    modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
    peek = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
    recording = _recording_mode_active
    if modes is None:
        modes, recording = (lambda: 1), _proxy_mode_active                    # noqa: E731
    if peek is None:
        peek = lambda: None                                                    # noqa: E731

    def ops_are_transformed() -> bool:
        """Whether the ops called now are recorded or transformed rather than only computed: a dispatch
        mode is active (make_fx's proxy and fake-tensor modes while anything traces, any other
        TorchDispatchMode but torch's own passive ones) or a torch.func transform runs (vmap, grad, ...).
        Two C calls of torch's. Fallbacks: without the mode-stack length, only a make_fx trace is seen;
        without functorch's interpreter stack, no transform is (a transform over a jitted function then
        fails inside torch)."""
        return (modes() > 0 and recording()) or peek() is not None
    return ops_are_transformed


ops_are_transformed = _resolve_ops_are_transformed()


# --- CUDA graphs and streams ------------------------------------------------------------------------


def _data_ptrs_equal_in_python(tensors: Sequence[torch.Tensor], data_ptrs: Sequence[int | None],
                               indices: Sequence[int]) -> bool:
    return all(tensors[i].data_ptr() == data_ptrs[i] for i in indices)


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
    """Fallback of `without_backward`: outputs whose backward raises `message`."""

    @staticmethod
    def forward(ctx: Any, message: str, *tensors: torch.Tensor) -> Any:
        ctx.message = message
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        raise BackwardError(ctx.message)


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
