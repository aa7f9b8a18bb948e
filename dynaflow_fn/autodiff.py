"""`df.value_and_grad` and `df.grad`: gradients that trace into the same Program as the forward.

They run `torch.autograd.grad` inside the function, so tracing a training step with `df.trace` or
`df.jit` records the forward and the backward as one aten graph, which lowers to one Plan and replays
as one CUDA graph. Called eagerly they compute what `jax.value_and_grad` would: the differentiated
arguments are not modified and nothing is left requiring grad. A non-scalar loss or a non-floating
tensor among the differentiated arguments is reported by its path.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Sequence

import optree
import torch

from .errors import InputError
from .ir import tree
from .ir.scopes import ScopeKind
from .tracing.regions import active_recorder


def _check_differentiable(fn: Callable[..., Any], args: tuple, argnums: int | Sequence[int]) -> None:
    names = tree.argument_names(fn, len(args))
    for index in (argnums,) if isinstance(argnums, int) else tuple(argnums):
        if not 0 <= index < len(args):
            raise InputError(f"argnums names argument {index}, but the call passes {len(args)} positional arguments")
        paths, leaves, _ = optree.tree_flatten_with_path(args[index])
        for path, leaf in zip(paths, leaves):
            where = tree.path_to_str((0, index, *path), names)
            if not isinstance(leaf, torch.Tensor):
                raise InputError(f"value_and_grad differentiates argument {names[index]}, but {where} is a "
                                 f"{type(leaf).__name__}, not a tensor")
            if not (leaf.is_floating_point() or leaf.is_complex()):
                raise InputError(f"value_and_grad differentiates {where}, a {str(leaf.dtype).replace('torch.', '')} "
                                 f"tensor; gradients need floating-point tensors. Pass integer buffers (step counts, "
                                 f"indices) in another argument.")


def _scalar_loss(fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if has_aux and not (isinstance(out, tuple) and len(out) == 2):
            raise InputError("value_and_grad(has_aux=True) needs the function to return (loss, aux)")
        loss = out[0] if has_aux else out
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            got = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise InputError(f"value_and_grad needs a scalar loss, but {getattr(fn, '__name__', 'fn')} returned "
                             f"{got}; reduce it, e.g. with .mean() or .sum()")
        if not loss.is_floating_point():
            raise InputError(f"value_and_grad needs a floating-point loss, got {loss.dtype}")
        return out
    return checked


def value_and_grad(fn: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False
                   ) -> Callable[..., Any]:
    """`fn`'s value and its gradient with respect to the arguments `argnums` (pytrees of tensors).

    Returns `(loss, grads)`, or `((loss, aux), grads)` with `has_aux`; `grads` has the structure of the
    differentiated argument (a tuple of them when `argnums` is a tuple), like `jax.value_and_grad`.
    Gradients come from `torch.autograd.grad` on fresh leaves, so tracing records exactly the backward
    that eager autograd runs, and model code sees the same tensors it sees in eager mode.

    >>> loss, grads = df.value_and_grad(loss_fn)(params, batch)
    """
    checked = _scalar_loss(fn, has_aux)
    positions = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    @functools.wraps(fn)
    def value_and_grad_fn(*args: Any, **kwargs: Any) -> Any:
        _check_differentiable(fn, args, argnums)
        with torch.enable_grad():
            args = list(args)
            flat = []
            for index in positions:
                leaves, spec = optree.tree_flatten(args[index])
                leaves = [leaf.detach().requires_grad_(True) for leaf in leaves]
                args[index] = optree.tree_unflatten(spec, leaves)
                flat.append((leaves, spec))
            out = checked(*args, **kwargs)
            loss = out[0] if has_aux else out
            every_leaf = [leaf for leaves, _ in flat for leaf in leaves]
            with _backward_scope():
                grads = torch.autograd.grad(loss, every_leaf, allow_unused=True)
        grads = [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, every_leaf)]
        trees, start = [], 0
        for leaves, spec in flat:
            trees.append(optree.tree_unflatten(spec, grads[start:start + len(leaves)]))
            start += len(leaves)
        value = (loss.detach(), optree.tree_map(_detached, out[1])) if has_aux else loss.detach()
        return value, trees[0] if isinstance(argnums, int) else tuple(trees)

    return value_and_grad_fn


def _backward_scope() -> contextlib.AbstractContextManager:
    """While traced, the gradient's nodes in a scope of their own: a transform that rewrites forward
    nodes (`T.substitute`) can tell that the gradient was traced through the original ones."""
    recorder = active_recorder()
    return contextlib.nullcontext() if recorder is None else recorder.scope(ScopeKind.BACKWARD, "grad")


def _detached(leaf: Any) -> Any:
    return leaf.detach() if isinstance(leaf, torch.Tensor) else leaf


def grad(fn: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable[..., Any]:
    """The gradient of a scalar `fn` with respect to the arguments `argnums`; with `has_aux`,
    `(grads, aux)`. As `df.value_and_grad`, without the value."""
    both = value_and_grad(fn, argnums, has_aux)

    @functools.wraps(fn)
    def grad_fn(*args: Any, **kwargs: Any) -> Any:
        value, grads = both(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return grad_fn
