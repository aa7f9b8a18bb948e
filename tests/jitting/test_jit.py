import warnings

import pytest
import torch

import dynaflow_fn as df
from models import MLP, Block, ConvNet, llama_logits, tiny_llama


def _check_against_eager(fast, reference, make_inputs, calls=3, **tolerance):
    for _ in range(calls):
        args = make_inputs()
        torch.testing.assert_close(fast(*args), reference(*args), **tolerance)


@pytest.mark.parametrize("model_name", ["mlp", "convnet", "block"])
def test_jit_matches_eager(model_name):
    model, shape = {"mlp": (MLP(), (8, 32)), "convnet": (ConvNet().eval(), (4, 3, 16, 16)),
                    "block": (Block(), (2, 8, 32))}[model_name]
    fn, params = df.pure(model)
    fast = df.jit(fn)
    _check_against_eager(fast, fn, lambda: (params, torch.randn(shape)))
    assert fast.cache_info().misses == 1 and fast.cache_info().hits == 2


def test_jit_matches_hf_llama():
    model = tiny_llama()
    logits, params = llama_logits(model)
    fast = df.jit(logits)
    _check_against_eager(fast, lambda p, ids: model(ids, use_cache=False).logits,
                         lambda: (params, torch.randint(0, 128, (2, 12))))


def test_training_mode_batchnorm_updates_running_stats_like_eager():
    model = ConvNet().train()
    fn, params = df.pure(model)
    eager_params = {k: v.clone() for k, v in params.items()}
    x = torch.randn(4, 3, 8, 8)
    out = df.jit(fn)(params, x)
    expected = fn(eager_params, x)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(params["bn.running_mean"], eager_params["bn.running_mean"])
    assert params["bn.num_batches_tracked"].item() == 1


def test_new_shape_dtype_rank_or_structure_traces_again():
    fast = df.jit(lambda x: x * 2)
    fast(torch.randn(3))
    fast(torch.randn(3))
    fast(torch.randn(4))
    fast(torch.randn(4, dtype=torch.float64))
    fast(torch.randn(2, 2))
    assert fast.cache_info() == df.CacheInfo(hits=1, misses=4, captures=0, entries=4)
    pair = df.jit(lambda xs: xs[0] + xs[-1])
    torch.testing.assert_close(pair((torch.ones(2), torch.ones(2))), torch.full((2,), 2.0))
    torch.testing.assert_close(pair((torch.ones(2), torch.ones(2), torch.zeros(2))), torch.ones(2))
    assert pair.cache_info().misses == 2


def test_a_tensor_changed_in_place_in_layout_traces_again():
    fast = df.jit(lambda x: x.sum(0))
    x = torch.randn(3, 2)
    torch.testing.assert_close(fast(x), x.sum(0))
    x.t_()
    torch.testing.assert_close(fast(x), x.sum(0))
    assert fast.cache_info().misses == 2


def test_static_leaf_value_is_part_of_the_key():
    fast = df.jit(lambda x, power: x ** power)
    x = torch.randn(5)
    torch.testing.assert_close(fast(x, 2), x ** 2)
    torch.testing.assert_close(fast(x, 3), x ** 3)
    torch.testing.assert_close(fast(x, 2), x ** 2)
    assert fast.cache_info().misses == 2 and fast.cache_info().hits == 1


def test_many_signatures_warn_and_name_the_change():
    fast = df.jit(lambda x: x + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(1, 11):
            fast(torch.randn(n))
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert "9 different input signatures" in messages[0] and "x changed from f32[8] on cpu to f32[9] on cpu" in messages[0]


def test_unhashable_leaf_on_a_jitted_call_is_an_error():
    fast = df.jit(lambda x, extra: x)
    with pytest.raises(df.InputError, match=r"extra\['k'\] is a set"):
        fast(torch.randn(2), {"k": {1, 2}})


def test_data_dependent_control_flow_fails_at_the_first_call():
    def f(x):
        return x if x.max() > 0 else -x

    with pytest.raises(df.TraceError, match="test_jit.py"):
        df.jit(f)(torch.randn(3))


def test_donated_arguments_are_updated_in_place():
    def sgd(params, x):
        loss = (x @ params["w"]).square().mean()
        return {"w": params["w"] - 0.1 * x.T @ x @ params["w"], "b": params["b"] * 0.5}, loss

    params = {"w": torch.randn(4, 4), "b": torch.randn(4)}
    x = torch.randn(3, 4)
    expected_params, expected_loss = sgd({k: v.clone() for k, v in params.items()}, x)
    step = df.jit(sgd, donate_argnums=(0,))
    new_params, loss = step(params, x)
    assert new_params["w"] is params["w"] and new_params["b"] is params["b"]
    torch.testing.assert_close(params["w"], expected_params["w"])
    torch.testing.assert_close(params["b"], expected_params["b"])
    torch.testing.assert_close(loss, expected_loss)
    plan = step.lower(params, x)
    assert not plan.copy_steps()
    inplace = sorted(str(s.op) for s in plan.steps if s.note == "reinplaced")
    assert inplace == ["aten.mul_.Tensor", "aten.sub_.Tensor"]


def test_donated_argument_whose_old_value_is_still_read_is_copied_back():
    def scale(state):
        return {"w": state["w"] * 2}, state["w"].sum()

    state = {"w": torch.randn(5)}
    old = state["w"].clone()
    step = df.jit(scale, donate_argnums=(0,))
    new_state, total = step(state)
    torch.testing.assert_close(total, old.sum())
    torch.testing.assert_close(state["w"], old * 2)
    assert new_state["w"] is state["w"]
    assert [s.note for s in step.lower(state).copy_steps()] == ["donated output"]


def test_donating_an_argument_with_no_matching_output_warns():
    with pytest.warns(UserWarning, match="donated input x matches no output"):
        df.jit(lambda x: x.sum(), donate_argnums=(0,))(torch.randn(3))


def test_donate_argnums_out_of_range_is_an_error():
    with pytest.raises(df.InputError, match="donate_argnums names argument 2"):
        df.jit(lambda x: x, donate_argnums=(2,))(torch.randn(3))


def test_outputs_are_fresh_tensors():
    fast = df.jit(lambda x: x * 2)
    first = fast(torch.ones(3))
    second = fast(torch.zeros(3))
    assert first.tolist() == [2.0, 2.0, 2.0] and second.tolist() == [0.0, 0.0, 0.0]


def test_lower_returns_the_plan_without_running():
    fast = df.jit(lambda x: x.relu())
    plan = fast.lower(torch.randn(3))
    assert isinstance(plan, df.Plan) and fast.cache_info().misses == 0


def test_unknown_backend_is_an_error():
    with pytest.raises(df.InputError, match="unknown backend 'tpu'"):
        df.jit(lambda x: x, backend="tpu")


def test_cudagraph_backend_needs_cuda_tensors():
    with pytest.raises(df.InputError, match="needs CUDA tensors"):
        df.jit(lambda x: x + 1, backend="cudagraph")(torch.randn(2))


def test_jit_as_decorator_with_options():
    @df.jit(backend="eager")
    def f(x):
        return x.exp()

    x = torch.randn(4)
    torch.testing.assert_close(f(x), x.exp())
    assert f.__name__ == "f"


class _Holder(torch.nn.Module):
    """A module keeping a jitted function of its own submodule, as model code does."""

    def __init__(self):
        super().__init__()
        self.body = MLP((8, 16, 4))
        self.fast = df.jit(self.body)


def test_a_module_holding_a_jitted_function_deep_copies_and_pickles_with_it():
    import copy
    import io

    original = _Holder()
    x = torch.randn(4, 8)
    original.fast(x)                                   # plans built: they must not be copied
    buffer = io.BytesIO()
    torch.save(original, buffer)
    buffer.seek(0)
    for clone in (copy.deepcopy(original), torch.load(buffer, weights_only=False)):
        assert clone.fast.fn is clone.body
        with torch.no_grad():
            for p in clone.body.parameters():
                p.copy_(torch.randn_like(p))
            y = torch.randn(4, 8)
            torch.testing.assert_close(clone.fast(y), clone.body(y))
            torch.testing.assert_close(original.fast(y), original.body(y))
    shallow = copy.copy(original.fast)
    assert shallow.fn is original.body
    with torch.no_grad():
        torch.testing.assert_close(shallow(x), original.body(x))
