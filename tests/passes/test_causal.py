"""Constant causal masks become is_causal=True; every other mask stays, and results equal eager."""

import pytest
import torch
import torch.nn.functional as F

import dynaflow_fn as df
from dynaflow_fn.ir import ops
from dynaflow_fn import transforms as T
from models import llama_logits, tiny_llama


def _masks_of(program):
    """(mask argument, is_causal) of every attention op, forward and backward."""
    calls = [ops.bind_arguments(n.target, n.args, n.kwargs) for n in program.ops()
             if "scaled_dot_product" in str(n.target)]
    return [(call.get("attn_mask", call.get("attn_bias")), call.get("is_causal", False)) for call in calls]


def test_transformers_llama_runs_its_causal_mask_as_is_causal():
    model = tiny_llama()
    fn, params = llama_logits(model)
    ids = torch.randint(0, 128, (2, 12))
    fast = df.jit(fn)
    assert _masks_of(fast.trace(params, ids)) == [(None, True)] * 2
    assert fast.lower(params, ids).provenance[:-1] == ("trace", "causal masks(2 attentions made causal)")
    torch.testing.assert_close(fast(params, ids), model(ids, use_cache=False).logits)


def test_the_backward_pass_of_transformers_llama_uses_the_causal_kernel_too():
    """Its gradients are checked against autograd in tests/front_ends/test_training.py (df.jit applies this pass)."""
    fn, params = llama_logits(tiny_llama())
    ids = torch.randint(0, 128, (2, 12))

    def loss(p, ids):
        return F.cross_entropy(fn(p, ids).reshape(-1, 128), ids.reshape(-1))

    program = df.jit(df.value_and_grad(loss)).trace(params, ids)
    assert _masks_of(program) == [(None, True)] * 4        # 2 layers, forward and backward


def test_a_padding_mask_given_as_input_is_kept():
    model = tiny_llama()
    fn, params = df.pure(model)
    ids = torch.randint(0, 128, (2, 12))
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, :3] = 0

    def logits(params, ids, padding):
        return fn(params, ids, attention_mask=padding, use_cache=False).logits

    fast = df.jit(logits)
    assert all(mask is not None and not causal for mask, causal in _masks_of(fast.trace(params, ids, padding)))
    assert not any(line.startswith("causal masks") for line in fast.lower(params, ids, padding).provenance)
    torch.testing.assert_close(fast(params, ids, padding), model(ids, attention_mask=padding, use_cache=False).logits)


def _attend(mask_of):
    def attend(q, k, v):
        positions = torch.arange(q.shape[-2], device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask_of(positions))
    return attend


CAUSAL = {
    "bool": lambda p: p[:, None] >= p[None, :],
    "additive -inf": lambda p: torch.zeros(len(p), len(p)).masked_fill(p[:, None] < p[None, :], float("-inf")),
    "additive lowest": lambda p: torch.zeros(len(p), len(p)).masked_fill(p[:, None] < p[None, :],
                                                                         torch.finfo(torch.float32).min),
    "additive lowest float16": lambda p: torch.zeros(len(p), len(p)).masked_fill(p[:, None] < p[None, :], -65536.0),
}
NOT_CAUSAL = {
    "sliding window": lambda p: (p[:, None] >= p[None, :]) & (p[:, None] - p[None, :] < 3),
    "soft bias": lambda p: torch.zeros(len(p), len(p)).masked_fill(p[:, None] < p[None, :], -1e4),
    "bidirectional": lambda p: torch.ones(len(p), len(p), dtype=torch.bool),
    "anti-causal": lambda p: p[:, None] <= p[None, :],
}


@pytest.mark.parametrize("name", list(CAUSAL) + list(NOT_CAUSAL))
def test_only_a_mask_that_is_exactly_causal_is_replaced(name):
    attend = _attend({**CAUSAL, **NOT_CAUSAL}[name])
    q, k, v = (torch.randn(2, 4, 10, 8) for _ in range(3))
    fast = df.jit(attend)
    (mask, causal), = _masks_of(fast.trace(q, k, v))
    assert (mask is None and causal) == (name in CAUSAL)
    torch.testing.assert_close(fast(q, k, v), attend(q, k, v))


@pytest.mark.slow
def test_each_micro_batch_of_a_scheduled_program_gets_the_causal_kernel():
    model = tiny_llama()
    fn, params = llama_logits(model)
    ids = torch.randint(0, 128, (4, 12))
    step = df.jit(T.overlap(T.microbatch(fn, num=2, in_axes=(None, 0)), strategy="roundrobin"))
    assert _masks_of(step.trace(params, ids)) == [(None, True)] * 4         # 2 layers x 2 micro-batches
    df.verify(step.lower(params, ids))
    torch.testing.assert_close(step(params, ids), model(ids, use_cache=False).logits)


def test_a_mask_that_cannot_be_computed_ahead_is_kept(monkeypatch):
    from dynaflow_fn.passes import causal

    def fails(*args):
        raise RuntimeError("cannot run ahead of time")

    monkeypatch.setattr(causal, "_evaluate", fails)
    attend = _attend(CAUSAL["bool"])
    q, k, v = (torch.randn(2, 4, 10, 8) for _ in range(3))
    fast = df.jit(attend)
    (mask, causal_flag), = _masks_of(fast.trace(q, k, v))
    assert mask is not None and not causal_flag
    torch.testing.assert_close(fast(q, k, v), attend(q, k, v))
