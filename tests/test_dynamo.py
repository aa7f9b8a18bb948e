"""`df.compile_backend` behind the clients users already run: transformers' generate() with a static
KV cache, through torch.compile."""

import pytest
import torch

import dynaflow_fn as df
from dynaflow_fn.jitting.jitted import Jitted
from models import tiny_llama


def _static_cache_llama():
    model = tiny_llama(layers=2)
    model.generation_config.cache_implementation = "static"
    model.generation_config.pad_token_id = 0
    return model


def _generate(model, ids, steps):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                              disable_compile=True)


def test_generate_with_a_static_cache_gives_eagers_tokens_and_traces_each_graph_once(monkeypatch):
    model = _static_cache_llama()
    ids = torch.randint(0, 128, (2, 7))
    expected = _generate(model, ids, 8)
    backend = df.compile_backend(progress=False)
    model.forward = torch.compile(model.forward, backend=backend, dynamic=False)
    persistent_inputs: dict[int, list[list[int]]] = {}
    real_call = Jitted.__call__

    def recording_call(jitted, *args):
        persistent_inputs.setdefault(id(jitted), []).append([args[i].data_ptr() for i in jitted.options.persistent_argnums])
        return real_call(jitted, *args)

    monkeypatch.setattr(Jitted, "__call__", recording_call)
    assert torch.equal(_generate(model, ids, 8), expected)
    assert torch.equal(_generate(model, ids, 8), expected)
    assert backend.graphs and [g.cache_info().misses for g in backend.graphs] == [1] * len(backend.graphs)
    for calls in persistent_inputs.values():      # what is read in place is the same tensor every step
        assert all(call == calls[0] for call in calls)
    assert max(len(calls) for calls in persistent_inputs.values()) >= 14


@pytest.mark.cuda
def test_generate_on_cuda_captures_each_graph_once_over_32_steps():
    model = _static_cache_llama().cuda()
    ids = torch.randint(0, 128, (2, 7), device="cuda")
    expected = _generate(model, ids, 32)
    backend = df.compile_backend(progress=False)
    model.forward = torch.compile(model.forward, backend=backend, dynamic=False)
    got = _generate(model, ids, 32)
    assert (got == expected).float().mean() > 0.95                # Inductor's rounding may flip a late argmax
    assert torch.equal(got[:, :ids.shape[1] + 4], expected[:, :ids.shape[1] + 4])
    assert [g.cache_info().captures for g in backend.graphs] == [1] * len(backend.graphs)
