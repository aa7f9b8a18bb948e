"""CUDA-graph capture and replay. Skipped where there is no CUDA device."""

import pytest
import torch

import dynaflow_fn as df
from models import MLP, Block, llama_logits, tiny_llama

pytestmark = pytest.mark.cuda


def _to_cuda(params):
    return {k: v.cuda() for k, v in params.items()}


@pytest.mark.parametrize("model_name", ["mlp", "block", "llama"])
def test_graph_replay_equals_eager_and_the_interpreter(model_name):
    if model_name == "llama":
        model = tiny_llama().cuda()
        fn, params = llama_logits(model)
        make = lambda: torch.randint(0, 128, (2, 12), device="cuda")
    else:
        model, shape = (MLP(), (8, 32)) if model_name == "mlp" else (Block(), (2, 8, 32))
        model = model.cuda()
        fn, params = df.pure(model)
        make = lambda: torch.randn(shape, device="cuda")
    graphed, interpreted = df.jit(fn), df.jit(fn, backend="eager")
    for _ in range(3):
        x = make()
        y = graphed(params, x)
        torch.testing.assert_close(y, fn(params, x))
        torch.testing.assert_close(y, interpreted(params, x), rtol=0, atol=0)
    assert graphed.cache_info().captures == 1


def test_replay_allocates_nothing():
    model = Block().cuda()
    fn, params = df.pure(model)
    fast = df.jit(fn, static_outputs=True)
    x = torch.randn(4, 16, 32, device="cuda")
    fast(params, x)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(10):
        fast(params, torch.randn(4, 16, 32, device="cuda"))
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


def test_static_outputs_are_overwritten_and_fresh_outputs_are_not():
    fresh, static = df.jit(lambda x: x * 2), df.jit(lambda x: x * 2, static_outputs=True)
    a, b = torch.ones(4, device="cuda"), torch.zeros(4, device="cuda")
    first_fresh, first_static = fresh(a), static(a)
    fresh(b), static(b)
    assert first_fresh.tolist() == [2.0] * 4
    assert first_static.tolist() == [0.0] * 4


def test_parameters_are_read_in_place_and_not_copied():
    model = MLP().cuda()
    fn, params = df.pure(model)
    fast = df.jit(fn)
    x = torch.randn(8, 32, device="cuda")
    fast(params, x)
    with torch.no_grad():
        params["layers.2.bias"].add_(1.0)
    torch.testing.assert_close(fast(params, x), fn(params, x))
    assert fast.cache_info().captures == 1


def test_new_parameter_tensors_capture_again():
    model = MLP().cuda()
    fn, params = df.pure(model)
    fast = df.jit(fn)
    x = torch.randn(8, 32, device="cuda")
    fast(params, x)
    other = {k: torch.nn.Parameter(torch.randn_like(v)) for k, v in params.items()}
    torch.testing.assert_close(fast(other, x), fn(other, x))
    assert fast.cache_info().captures == 2


def test_donated_state_is_updated_in_place_on_cuda():
    def step(state, x):
        return {"m": state["m"] * 0.9 + x}, state["m"].sum()

    state = {"m": torch.randn(16, device="cuda")}
    reference = state["m"].clone()
    fast = df.jit(step, donate_argnums=(0,))
    for _ in range(3):
        x = torch.randn(16, device="cuda")
        new_state, total = fast(state, x)
        torch.testing.assert_close(total, reference.sum())
        reference = reference * 0.9 + x
        assert new_state["m"] is state["m"]
        torch.testing.assert_close(state["m"], reference)


def test_mutated_input_is_written_back_to_the_callers_tensor():
    def bump(x):
        x.add_(1)
        return x * 2

    fast = df.jit(bump)
    for _ in range(2):
        x = torch.randn(5, device="cuda")
        expected = x + 1
        torch.testing.assert_close(fast(x), expected * 2)
        torch.testing.assert_close(x, expected)
