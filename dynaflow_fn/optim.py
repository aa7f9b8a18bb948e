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

`update` checks its arguments first: the gradients and every entry of the state must have the
structure of the parameters and, leaf by leaf, the shape, dtype and device the optimizer keeps
for that parameter. A mismatch (state built for other parameters or by another optimizer) is an
InputError naming the leaf, not a silently wrong update. Inside a traced step the check reads the
fake tensors' shapes and costs nothing at run time.

To keep using a `torch.optim` optimizer instead, jit only the gradient computation
(`grads = df.jit(df.grad(loss_fn))(params, batch)`), copy the grads into `p.grad` of the module's
parameters and call `optimizer.step()` outside the jitted function.
"""

from __future__ import annotations

import numbers as _numbers
import reprlib as _reprlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import optree as _optree
import torch as _torch
from torch import Tensor

from .errors import InputError
from .ir.program import dtype_name

__all__ = ["Optimizer", "adamw", "sgd"]

Params = Any
State = Any
_LeafLayout = tuple[tuple[int, ...], _torch.dtype, _torch.device]
"""What the optimizer keeps for one parameter in a state entry: (shape, dtype, device)."""


@dataclass(frozen=True)
class Optimizer:
    """`init(params) -> state`; `update(grads, state, params) -> (new_params, new_state)`."""

    init: Callable[[Params], State]
    update: Callable[[Any, State, Params], tuple[Params, State]]


def _like_parameter(p: Tensor) -> _LeafLayout:
    return tuple(p.shape), p.dtype, p.device


def _step_count(p: Tensor) -> _LeafLayout:
    return (), _torch.float32, p.device


def _path_str(path: tuple) -> str:
    return "".join(f"[{key!r}]" for key in path)


def _layout_str(value: Any) -> str:
    if not isinstance(value, Tensor):
        return f"{_reprlib.repr(value)} ({type(value).__name__}), not a tensor"
    return _layout_text(_like_parameter(value))


def _layout_text(layout: _LeafLayout) -> str:
    shape, dtype, device = layout
    return f"{dtype_name(dtype)}{list(shape)} on {device}"


class _Checked:
    """The flat leaves of `update`'s arguments, after checking them against the parameters.

    `state_layout` names each state entry the optimizer keeps and, per parameter, the layout of that
    entry's leaf; `optimizer` (e.g. "adamw") and the way out appear in the messages.
    """

    def __init__(self, optimizer: str, grads: Any, state: Any, params: Params,
                 state_layout: Mapping[str, Callable[[Tensor], _LeafLayout]]):
        self.optimizer = optimizer
        self.paths, self.params, self.spec = _parameter_leaves(f"{optimizer}.update", params)
        self.grads = self._like_params(grads, "grads", _like_parameter,
                                       "pass the gradients of these parameters, e.g. df.grad(loss_fn)(params, ...)")
        init = f"build the state for these parameters with opt.init(params), opt being this {optimizer} optimizer"
        if not isinstance(state, Mapping):
            raise InputError(f"{optimizer}.update: the state is {_reprlib.repr(state)} ({type(state).__name__}), "
                             f"not the dict that opt.init(params) returns; {init}")
        missing = [repr(key) for key in state_layout if key not in state]
        extra = [repr(key) for key in state if key not in state_layout]
        if missing or extra:
            problems = ([f"lacks {', '.join(missing)} (which {optimizer} keeps)"] if missing else []) + (
                [f"has {', '.join(extra)} (which {optimizer} does not keep)"] if extra else [])
            raise InputError(f"{optimizer}.update: the state {' and '.join(problems)}: it was built by another "
                             f"optimizer or with other options; {init}")
        self.state = {key: self._like_params(state[key], f"state[{key!r}]", layout, init)
                      for key, layout in state_layout.items()}

    def _like_params(self, tree: Any, label: str, layout: Callable[[Tensor], _LeafLayout],
                     way_out: str) -> list[Tensor]:
        """The leaves of `tree`, which must have the parameters' structure and, per leaf, `layout(param)`."""
        paths, leaves, spec = _optree.tree_flatten_with_path(tree)
        if spec != self.spec:
            raise InputError(f"{self.optimizer}.update: {label} does not have the structure of the parameters "
                             f"({_structure_difference(paths, self.paths, spec, self.spec)}); {way_out}")
        for path, leaf, param in zip(paths, leaves, self.params):
            expected = layout(param)
            if not isinstance(leaf, Tensor) or _like_parameter(leaf) != expected:
                raise InputError(f"{self.optimizer}.update: {label}{_path_str(path)} is {_layout_str(leaf)}, but for "
                                 f"params{_path_str(path)} ({_layout_str(param)}) it must be {_layout_text(expected)}; "
                                 f"{way_out}")
        return leaves

    def unflatten(self, leaves: list[Tensor]) -> Any:
        return _optree.tree_unflatten(self.spec, leaves)


def _structure_difference(paths: list[tuple], expected_paths: list[tuple], spec: Any, expected_spec: Any) -> str:
    present, expected = set(paths), set(expected_paths)
    missing = [p for p in expected_paths if p not in present]
    extra = [p for p in paths if p not in expected]
    if missing:
        return f"it has no leaf {_path_str(missing[0])}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
    if extra:
        return f"it has a leaf {_path_str(extra[0])} that the parameters lack"
    return f"it is {spec}, the parameters are {expected_spec}"


def _parameter_leaves(caller: str, params: Params) -> tuple[list[tuple], list[Tensor], Any]:
    """Paths, leaves and structure of the parameters, which must all be tensors."""
    paths, leaves, spec = _optree.tree_flatten_with_path(params)
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, Tensor):
            raise InputError(f"{caller}: params{_path_str(path)} is {_layout_str(leaf)}; the parameters are a pytree "
                             f"of tensors")
    return paths, leaves, spec


def _zeros_like(params: Params) -> Any:
    return _optree.tree_map(_torch.zeros_like, params)


def _check_numbers(optimizer: str, **hyperparameters: Any) -> None:
    """Refuse a hyperparameter that is no Python number (a tensor learning rate, say): the kernels take
    numbers, which a traced plan holds as constants."""
    for name, value in hyperparameters.items():
        if isinstance(value, bool) or not isinstance(value, _numbers.Real):
            raise InputError(f"df.optim.{optimizer}({name}=...) takes a Python number, got a {type(value).__name__}. A plan "
                             f"holds it as a constant: to change it, make the optimizer with the new value inside the "
                             f"jitted step from a float argument (each value is planned once, and df.jit warns when "
                             f"many are)")


def sgd(lr: float, momentum: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False) -> Optimizer:
    """Stochastic gradient descent with optional momentum and (coupled) weight decay, as torch.optim.SGD."""
    _check_numbers("sgd", lr=lr, momentum=momentum, weight_decay=weight_decay)
    if nesterov and momentum <= 0:
        raise InputError(f"sgd(nesterov=True) needs momentum > 0, got momentum={momentum}")
    state_layout = {"momentum": _like_parameter} if momentum else {}

    def init(params: Params) -> State:
        _parameter_leaves("sgd.init", params)
        return {"momentum": _zeros_like(params)} if momentum else {}

    def update(grads: Any, state: State, params: Params) -> tuple[Params, State]:
        checked = _Checked("sgd", grads, state, params, state_layout)
        g, p = checked.grads, checked.params
        if weight_decay:
            g = _torch._foreach_add(g, p, alpha=weight_decay)
        new_state = {}
        if momentum:
            buffers = _torch._foreach_add(_torch._foreach_mul(checked.state["momentum"], momentum), g)
            new_state["momentum"] = checked.unflatten(buffers)
            g = _torch._foreach_add(g, buffers, alpha=momentum) if nesterov else buffers
        new_params = _torch._foreach_add(p, g, alpha=-lr)
        return checked.unflatten(new_params), new_state

    return Optimizer(init, update)


def adamw(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 1e-2) -> Optimizer:
    """Adam with decoupled weight decay, computed by torch's fused AdamW kernel (as
    `torch.optim.AdamW(fused=True)`). The step counts are tensors in the state, so every step replays
    the same graph; under `df.jit` with donated parameters and state the kernel updates them in place."""
    beta1, beta2 = betas
    _check_numbers("adamw", lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    state_layout = {"step": _step_count, "exp_avg": _like_parameter, "exp_avg_sq": _like_parameter}

    def init(params: Params) -> State:
        _parameter_leaves("adamw.init", params)

        def step(p: Tensor) -> Tensor:
            return _torch.zeros((), dtype=_torch.float32, device=p.device)
        return {"step": _optree.tree_map(step, params), "exp_avg": _zeros_like(params),
                "exp_avg_sq": _zeros_like(params)}

    def update(grads: Any, state: State, params: Params) -> tuple[Params, State]:
        checked = _Checked("adamw", grads, state, params, state_layout)
        steps = _torch._foreach_add(checked.state["step"], 1)
        new_params, _, exp_avg, exp_avg_sq, _ = _torch.ops.aten._fused_adamw.default(
            checked.params, checked.grads, checked.state["exp_avg"], checked.state["exp_avg_sq"], [], steps,
            lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        new_state = {"step": checked.unflatten(steps), "exp_avg": checked.unflatten(exp_avg),
                     "exp_avg_sq": checked.unflatten(exp_avg_sq)}
        return checked.unflatten(new_params), new_state

    return Optimizer(init, update)
