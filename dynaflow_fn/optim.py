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
    """Adam with decoupled weight decay, computed by torch's fused AdamW kernel (as
    `torch.optim.AdamW(fused=True)`). The step counts are tensors in the state, so every step replays
    the same graph; under `df.jit` with donated parameters and state the kernel updates them in place."""
    beta1, beta2 = betas

    def init(params: Params) -> State:
        def step(p: torch.Tensor) -> torch.Tensor:
            return torch.zeros((), dtype=torch.float32, device=p.device)
        return {"step": optree.tree_map(step, params), "exp_avg": _zeros_like(params),
                "exp_avg_sq": _zeros_like(params)}

    def update(grads: Any, state: State, params: Params) -> tuple[Params, State]:
        g, p, spec = _leaves(grads, params)
        steps = torch._foreach_add(optree.tree_leaves(state["step"]), 1)
        new_params, _, exp_avg, exp_avg_sq, _ = torch.ops.aten._fused_adamw.default(
            p, g, optree.tree_leaves(state["exp_avg"]), optree.tree_leaves(state["exp_avg_sq"]), [], steps,
            lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        new_state = {"step": optree.tree_unflatten(spec, steps), "exp_avg": optree.tree_unflatten(spec, exp_avg),
                     "exp_avg_sq": optree.tree_unflatten(spec, exp_avg_sq)}
        return optree.tree_unflatten(spec, new_params), new_state

    return Optimizer(init, update)
