import pytest
import torch

import dynaflow_fn as df
from models import MLP, tiny_llama


def test_pure_function_equals_module():
    model = MLP()
    fn, params = df.pure(model)
    x = torch.randn(5, 32)
    torch.testing.assert_close(fn(params, x), model(x), rtol=0, atol=0)


def test_params_are_the_module_tensors_not_copies():
    model = MLP()
    _, params = df.pure(model)
    assert params["layers.0.weight"] is model.layers[0].weight


def test_swapped_params_are_used():
    model = MLP()
    fn, params = df.pure(model)
    doubled = {k: v * 2 for k, v in params.items()}
    x = torch.randn(3, 32)
    assert not torch.allclose(fn(doubled, x), fn(params, x))


def test_tied_weights_stay_tied():
    model = tiny_llama(layers=1, tie=True)
    fn, params = df.pure(model)
    assert "lm_head.weight" not in params
    ids = torch.randint(0, 128, (2, 8))
    changed = dict(params)
    changed["model.embed_tokens.weight"] = torch.randn_like(params["model.embed_tokens.weight"])
    out = fn(changed, ids, use_cache=False).logits
    hidden = fn(changed, ids, use_cache=False, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(out, hidden @ changed["model.embed_tokens.weight"].T)


def test_missing_param_is_an_error():
    model = MLP()
    fn, params = df.pure(model)
    del params["layers.0.bias"]
    with pytest.raises(RuntimeError, match="layers.0.bias"):
        fn(params, torch.randn(2, 32))

