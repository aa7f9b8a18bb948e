"""`df.pure`: an `nn.Module` as a pure function of (params, *args)."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn

from .errors import InputError
from .jitting.state import register_module_state

Params = dict[str, torch.Tensor]


def pure(module: nn.Module) -> tuple[Callable[..., Any], Params]:
    """Split a module into a pure function and its state.

    Returns `(fn, params)` where `params` maps each parameter and buffer name to the module's own
    tensor (no copy), and `fn(params, *args, **kwargs)` runs `module(*args, **kwargs)` with those
    tensors swapped in through `torch.func.functional_call`. Tied weights appear once in `params`
    (under the first name) and stay tied: every use reads the one tensor you pass.

    These tensors are the module's state: `df.jit`'s CUDA graphs read them (buffers too: KV caches,
    running statistics) at their own address instead of copying them in before every call.

    >>> fn, params = df.pure(model)
    >>> y = fn(params, x)            # same as model(x)
    """
    if not isinstance(module, nn.Module):
        raise InputError(f"df.pure takes an nn.Module, got {type(module).__qualname__}")
    params: Params = dict(module.named_parameters(remove_duplicate=True))
    params.update(module.named_buffers(remove_duplicate=True))
    register_module_state(params.values())

    forward = module.forward

    @functools.wraps(forward)
    def fn(params: Params, *args: Any, **kwargs: Any) -> Any:
        return torch.func.functional_call(module, params, args, kwargs, tie_weights=True, strict=True)

    fn.__name__ = fn.__qualname__ = type(module).__name__
    fn.__signature__ = _signature_with_params(forward)
    fn.__dynaflow_module__ = module
    return fn, params


def _signature_with_params(forward: Callable[..., Any]):
    """The module's forward signature with a leading `params` parameter, for readable trace names."""
    import inspect

    try:
        sig = inspect.signature(forward)
    except (TypeError, ValueError):
        return None
    first = inspect.Parameter("params", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sig.replace(parameters=[first, *sig.parameters.values()])
