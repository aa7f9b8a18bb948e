"""A jitted function composes with what transforms its callers' ops: called inside another jitted function,
`df.trace`, a TorchDispatchMode or a torch.func transform, it runs its function so they see its ops, as
jax.jit inside jax.jit is inlined."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import dynaflow_fn as df


def _inner(x):
    return torch.tanh(x) * x.sin()


def test_a_jitted_function_inside_another_is_inlined():
    inner = df.jit(_inner)
    model = nn.Linear(6, 6)
    outer = df.jit(lambda x: model(inner(x)) * 2)
    for _ in range(2):
        x = torch.randn(3, 6)
        torch.testing.assert_close(outer(x), model(_inner(x)) * 2)
    assert inner.cache_info().misses == 0                       # its ops went into the outer plan
    assert "aten.tanh" in str(df.trace(lambda x: inner(x) + 1, torch.randn(3, 6)))


def test_a_jitted_function_inlined_into_another_updates_its_donated_arguments_in_place_as_its_plan_does():
    """Called on its own, a plan writes the outputs paired with donated arguments into them; inlined,
    the outer plan must too, or a caller relying on the update (a training loop calling a donating
    step and reading the parameters it passed) silently trains on stale values."""
    optimizer = df.optim.sgd(lr=0.1)
    step = df.jit(lambda p, x: optimizer.update(df.grad(lambda p: (x @ p["w"]).square().mean())(p), {}, p)[0],
                  donate_argnums=(0,))

    def two_steps(p, x1, x2):                     # reads p's update in place, returns nothing of it
        step(p, x1)
        step(p, x2)
        return (x2 @ p["w"]).sum()

    start, x1, x2 = torch.randn(4, 2), torch.randn(3, 4), torch.randn(3, 4)
    eager, jitted = {"w": start.clone()}, {"w": start.clone()}
    expected = two_steps(eager, x1, x2)
    torch.testing.assert_close(df.jit(two_steps)(jitted, x1, x2), expected)
    torch.testing.assert_close(jitted["w"], eager["w"])
    assert not torch.equal(eager["w"], start)


def test_a_trace_inside_a_traced_function_nests():
    outer = df.jit(lambda x: df.trace(_inner, x)(x) * 2)
    x = torch.randn(4)
    torch.testing.assert_close(outer(x), _inner(x) * 2)


def test_torch_func_transforms_over_a_jitted_function_transform_its_function():
    fast = df.jit(_inner)
    x = torch.randn(5, 3)
    torch.testing.assert_close(torch.func.vmap(fast)(x), torch.func.vmap(_inner)(x))
    torch.testing.assert_close(torch.func.grad(lambda v: fast(v).sum())(x), torch.func.grad(lambda v: _inner(v).sum())(x))
    torch.testing.assert_close(torch.func.jacrev(fast)(x[0]), torch.func.jacrev(_inner)(x[0]))
    torch.testing.assert_close(df.jit(torch.func.vmap(fast))(x), torch.func.vmap(_inner)(x))
    assert fast.cache_info().misses == 0


def test_a_dispatch_mode_sees_the_functions_ops():
    weight = torch.randn(8, 8)
    f = lambda x: F.linear(x, weight).relu()                   # noqa: E731
    fast = df.jit(f)
    x = torch.randn(4, 8)
    fast(x)
    with FlopCounterMode(display=False) as jitted, torch.no_grad():
        fast(x)
    with FlopCounterMode(display=False) as eager, torch.no_grad():
        f(x)
    assert jitted.get_total_flops() == eager.get_total_flops() == 2 * 4 * 8 * 8
