"""Functional optimizers over pytrees, in the style of optax, built on torch's `_foreach` ops.

An optimizer is a pair of pure functions: `init(params) -> state` and
`update(grads, state, params) -> (new_params, new_state)`. Nothing is modified in place, so a whole
training step traces into one Program; with `df.jit(step, donate_argnums=(0, 1))` the new parameters
and state are written back into the donated tensors and the step replays as one CUDA graph.

    opt = df.optim.adamw(lr=1e-3)
    state = opt.init(params)

    @df.jit(donate_argnums=(0, 1))
    def train_step(params, state, batch):
        loss, grads = df.value_and_grad(loss_fn)(params, batch)
        params, state = opt.update(grads, state, params)
        return params, state, loss

To keep using a `torch.optim` optimizer instead, jit only the gradient computation
(`grads = df.jit(df.grad(loss_fn))(params, batch)`), copy the grads into `p.grad` of the module's
parameters and call `optimizer.step()` outside the jitted function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import optree
import torch

from .errors import InputError

Params = Any
State = Any


@dataclass(frozen=True)
class Optimizer:
    """`init(params) -> state`; `update(grads, state, params) -> (new_params, new_state)`."""

    init: Callable[[Params], State]
    update: Callable[[Any, State, Params], tuple[Params, State]]


def _leaves(grads: Any, params: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], optree.PyTreeSpec]:
    param_leaves, spec = optree.tree_flatten(params)
    grad_leaves, grad_spec = optree.tree_flatten(grads)
    if grad_spec != spec:
        raise InputError(f"the gradients' structure {grad_spec} differs from the parameters' {spec}")
    return grad_leaves, param_leaves, spec


def _zeros_like(params: Any) -> Any:
    return optree.tree_map(torch.zeros_like, params)


def sgd(lr: float, momentum: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False) -> Optimizer:
    """Stochastic gradient descent with optional momentum and (coupled) weight decay, as torch.optim.SGD."""
    if nesterov and momentum <= 0:
        raise ValueError("nesterov momentum needs momentum > 0")

    def init(params: Params) -> State:
        return {"momentum": _zeros_like(params)} if momentum else {}

    def update(grads: Any, state: State, params: Params) -> tuple[Params, State]:
        g, p, spec = _leaves(grads, params)
        if weight_decay:
            g = torch._foreach_add(g, p, alpha=weight_decay)
        new_state = {}
        if momentum:
            buffers = torch._foreach_add(torch._foreach_mul(optree.tree_leaves(state["momentum"]), momentum), g)
            new_state["momentum"] = optree.tree_unflatten(spec, buffers)
            g = torch._foreach_add(g, buffers, alpha=momentum) if nesterov else buffers
        new_params = torch._foreach_add(p, g, alpha=-lr)
        return optree.tree_unflatten(spec, new_params), new_state

    return Optimizer(init, update)


def adamw(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 1e-2) -> Optimizer:
    """Adam with decoupled weight decay, as torch.optim.AdamW. The step count is a tensor in the state,
    so every step replays the same graph."""
    beta1, beta2 = betas

    def init(params: Params) -> State:
        leaves = optree.tree_leaves(params)
        device = leaves[0].device if leaves else None
        return {"step": torch.zeros((), device=device), "exp_avg": _zeros_like(params),
                "exp_avg_sq": _zeros_like(params)}

    def update(grads: Any, state: State, params: Params) -> tuple[Params, State]:
        g, p, spec = _leaves(grads, params)
        step = state["step"] + 1
        if weight_decay:
            p = torch._foreach_mul(p, 1.0 - lr * weight_decay)
        m = torch._foreach_lerp(optree.tree_leaves(state["exp_avg"]), g, 1.0 - beta1)
        v = torch._foreach_addcmul(torch._foreach_mul(optree.tree_leaves(state["exp_avg_sq"]), beta2), g, g,
                                   value=1.0 - beta2)
        step_size = lr / (1.0 - torch.pow(beta1, step))
        denom = torch._foreach_add(torch._foreach_div(torch._foreach_sqrt(v), torch.sqrt(1.0 - torch.pow(beta2, step))),
                                   eps)
        new_params = torch._foreach_sub(p, torch._foreach_mul(torch._foreach_div(m, denom), step_size))
        new_state = {"step": step, "exp_avg": optree.tree_unflatten(spec, m),
                     "exp_avg_sq": optree.tree_unflatten(spec, v)}
        return optree.tree_unflatten(spec, new_params), new_state

    return Optimizer(init, update)
