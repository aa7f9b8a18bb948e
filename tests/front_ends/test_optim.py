"""Optimizer updates check the gradients and the state against the parameters: a state built for other
parameters or by another optimizer is an InputError naming the leaf and the way out, eagerly and inside
a jitted training step, never a silently wrong update."""

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dynaflow_fn as df
from fixtures import training_step

OPTIMIZERS = {
    "adamw": lambda: df.optim.adamw(lr=1e-2),
    "sgd": lambda: df.optim.sgd(lr=1e-2, momentum=0.9),
}


def _params(weight_shape=(4, 3)):
    return {"w": torch.randn(weight_shape), "b": torch.randn(4)}


def _grads(params):
    return {k: torch.randn_like(v) for k, v in params.items()}


def _update_error(optimizer, grads, state, params):
    with pytest.raises(df.InputError) as error:
        optimizer.update(grads, state, params)
    return str(error.value)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_built_for_parameters_of_other_shapes_names_the_leaf(name):
    optimizer = OPTIMIZERS[name]()
    params = _params((4, 3))
    state = optimizer.init(_params((3, 4)))            # as many elements, another shape
    message = _update_error(optimizer, _grads(params), state, params)
    entry = "exp_avg" if name == "adamw" else "momentum"
    assert f"state[{entry!r}]['w'] is f32[3, 4]" in message
    assert "params['w']" in message and "opt.init(params)" in message


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_built_for_other_parameter_names_names_the_missing_leaf(name):
    optimizer = OPTIMIZERS[name]()
    params = _params()
    state = optimizer.init({"w": params["w"]})
    message = _update_error(optimizer, _grads(params), state, params)
    assert "does not have the structure of the parameters" in message and "no leaf ['b']" in message
    assert "opt.init(params)" in message


def test_state_on_another_device_names_the_leaf_and_both_devices():
    optimizer = df.optim.adamw()
    params = _params()
    state = optimizer.init({k: v.to("meta") for k, v in params.items()})
    message = _update_error(optimizer, _grads(params), state, params)
    assert "on meta" in message and "on cpu" in message and "state['" in message


def test_adamw_step_counts_must_be_float_scalars():
    optimizer = df.optim.adamw()
    params = _params()
    state = optimizer.init(params)
    state["step"] = {k: torch.zeros((), dtype=torch.int64) for k in params}
    message = _update_error(optimizer, _grads(params), state, params)
    assert re.search(r"state\['step'\]\['\w'\] is i64\[\]", message) and "f32[]" in message


def test_sgd_with_momentum_given_a_state_without_momentum_says_so():
    optimizer = df.optim.sgd(lr=0.1, momentum=0.9)
    params = _params()
    plain = df.optim.sgd(lr=0.1).init(params)
    message = _update_error(optimizer, _grads(params), plain, params)
    assert "lacks 'momentum'" in message and "opt.init(params)" in message


def test_a_state_of_another_optimizer_is_refused():
    params = _params()
    message = _update_error(df.optim.sgd(lr=0.1, momentum=0.9), _grads(params), df.optim.adamw().init(params), params)
    assert "lacks 'momentum'" in message and "'exp_avg'" in message and "does not keep" in message
    message = _update_error(df.optim.adamw(), _grads(params), df.optim.sgd(lr=0.1, momentum=0.9).init(params), params)
    assert "lacks 'step', 'exp_avg', 'exp_avg_sq'" in message and "has 'momentum'" in message


def test_a_state_that_is_not_a_dict_is_refused():
    params = _params()
    message = _update_error(df.optim.adamw(), _grads(params), None, params)
    assert "the state is None" in message and "opt.init(params)" in message


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("change, shown", [
    (lambda g: {**g, "w": g["w"].double()}, "grads['w'] is f64[4, 3]"),
    (lambda g: {**g, "b": g["b"][:2]}, "grads['b'] is f32[2]"),
    (lambda g: {"w": g["w"]}, "no leaf ['b']"),
    (lambda g: {**g, "extra": g["b"]}, "a leaf ['extra'] that the parameters lack"),
    (lambda g: [g["b"], g["w"]], "grads does not have the structure of the parameters"),
])
def test_gradients_that_do_not_fit_the_parameters_name_the_leaf(name, change, shown):
    optimizer = OPTIMIZERS[name]()
    params = _params()
    message = _update_error(optimizer, change(_grads(params)), optimizer.init(params), params)
    assert shown in message and "df.grad(loss_fn)" in message


def test_parameters_must_be_tensors():
    with pytest.raises(df.InputError, match=r"adamw.init: params\['scale'\] is 2.0 \(float\), not a tensor"):
        df.optim.adamw().init({"w": torch.ones(2), "scale": 2.0})


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_check_runs_inside_a_jitted_training_step(name):
    optimizer = OPTIMIZERS[name]()
    params = _params((4, 3))
    train_step = training_step(lambda p, x, y: F.mse_loss(x @ p["w"].t() + p["b"], y), optimizer)
    step = df.jit(train_step, donate_argnums=(0, 1))
    x, y = torch.randn(8, 3), torch.randn(8, 4)
    with pytest.raises(df.InputError, match=r"state\['\w+'\]\['w'\] is f32\[3, 4\]"):
        step(params, optimizer.init(_params((3, 4))), x, y)
    # the state built for these parameters trains exactly as the eager update does
    state, expected_params, expected_state = optimizer.init(params), dict(params), optimizer.init(params)
    for _ in range(2):
        expected_params, expected_state, _ = train_step(expected_params, expected_state, x, y)
    copies = {k: v.clone() for k, v in params.items()}
    for _ in range(2):
        copies, state, _ = step(copies, state, x, y)
    for k in params:
        torch.testing.assert_close(copies[k], expected_params[k])


@pytest.mark.parametrize("make, named", [
    (lambda: df.optim.adamw(lr=torch.tensor(1e-2)), "adamw(lr=...)"),
    (lambda: df.optim.adamw(betas=(torch.tensor(0.9), 0.999)), "adamw(beta1=...)"),
    (lambda: df.optim.sgd(lr=torch.tensor(1e-2)), "sgd(lr=...)"),
], ids=["adamw-lr", "adamw-beta", "sgd-lr"])
def test_a_hyperparameter_that_is_no_python_number_is_refused_when_the_optimizer_is_made(make, named):
    with pytest.raises(df.InputError, match=re.escape(named) + r" takes a Python number, got a Tensor"):
        make()


def test_a_training_step_with_an_optimizer_that_keeps_no_state_may_donate_it():
    optimizer = df.optim.sgd(lr=0.1)                          # its state is {}: nothing to donate, nothing refused

    def train_step(params, state, x):
        loss, grads = df.value_and_grad(lambda p, x: (x @ p["w"]).square().mean())(params, x)
        params, state = optimizer.update(grads, state, params)
        return params, state, loss

    w, x = torch.randn(3, 2), torch.randn(4, 3)
    expected = train_step({"w": w.clone()}, optimizer.init({"w": w}), x)
    params = {"w": w.clone()}
    got = df.jit(train_step, donate_argnums=(0, 1))(params, optimizer.init(params), x)
    torch.testing.assert_close(got, expected)


def test_numpy_scalars_are_python_numbers_to_an_optimizer():
    params = _params()
    grads = _grads(params)
    for make in (lambda lr: df.optim.adamw(lr=lr), lambda lr: df.optim.sgd(lr=lr, momentum=0.9)):
        given, plain = make(np.float32(1e-2)), make(1e-2)
        torch.testing.assert_close(given.update(grads, given.init(params), params),
                                   plain.update(grads, plain.init(params), params))
