"""T.substitute: what a rule matches runs the given implementation, and nothing else changes."""

import warnings

import optree
import pytest
import torch
import torch.nn.functional as F
from models import MLP, Block, llama_logits, tiny_llama
from torch import nn

import dynaflow_fn as df
from dynaflow_fn import transforms as T
from dynaflow_fn.compat import FakeTensor
from dynaflow_fn.errors import InputError, TransformError
from dynaflow_fn.passes import inductor


def doubled_linear(module, x):
    return F.linear(x, module.weight * 2, module.bias)


def test_a_module_rule_runs_the_implementation_for_every_matching_call():
    model = MLP()
    fn, params = df.pure(model)
    substituted = T.substitute(fn, {T.Module(nn.Linear): doubled_linear})
    x = torch.randn(8, 32)

    def reference(x):
        for i, layer in enumerate(model.layers):
            x = doubled_linear(layer, x)
            x = F.gelu(x) if i < len(model.layers) - 1 else x
        return x

    with torch.no_grad():
        expected = reference(x)
        torch.testing.assert_close(df.jit(substituted)(params, x), expected, rtol=0, atol=0)
        torch.testing.assert_close(substituted(params, x), expected, rtol=0, atol=0)   # eager, the same
        torch.testing.assert_close(model(x), MLP.forward(model, x))                 # the model is untouched
    assert "substituted by T.Module(Linear)" in str(df.trace(substituted, params, x))


@pytest.mark.parametrize("pattern", ["mlp", r"layers\.\d+\.mlp$"])
def test_a_module_regex_substitutes_the_outermost_module_it_matches_not_its_submodules_too(pattern):
    """`mlp` is also found in `layers.0.mlp.gate_proj`: the impl of the matched module calls its
    submodules as the original does, so they are not substituted a second time inside it."""
    model = tiny_llama()
    logits, params = llama_logits(model)
    calls = []

    def doubled(module, x):
        calls.append(module)
        return type(module).forward(module, x) * 2

    ids = torch.randint(0, 128, (2, 6))
    hooks = [module.register_forward_hook(lambda module, args, out: out * 2)
             for name, module in model.named_modules() if name.endswith(".mlp")]
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
    for hook in hooks:
        hook.remove()
    substituted = T.substitute(logits, {T.Module(pattern): doubled})
    with torch.no_grad():
        torch.testing.assert_close(substituted(params, ids), expected)
        torch.testing.assert_close(df.jit(substituted)(params, ids), expected)
    assert {type(module).__name__ for module in calls} == {"LlamaMLP"}


def unfused_attention(x, norm_w, norm_b, qkv_w, qkv_b, proj_w, proj_b):
    """The Block's attention region (`x + attn(norm1(x))`) with attention spelled out as matmuls."""
    b, t, d = x.shape
    q, k, v = F.linear(F.layer_norm(x, (d,), norm_w, norm_b), qkv_w, qkv_b).view(b, t, 3, 4, d // 4).permute(
        2, 0, 3, 1, 4)
    scores = (q @ k.transpose(-1, -2)) * (d // 4) ** -0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    y = torch.softmax(scores, -1) @ v
    return x + F.linear(y.transpose(1, 2).reshape(b, t, d), proj_w, proj_b)


def test_a_region_rule_replaces_the_region_by_the_implementation_on_its_inputs():
    model = Block()
    fn, params = df.pure(model)
    substituted = T.substitute(fn, {T.Region("attn"): unfused_attention}, check=True)
    x = torch.randn(2, 6, 32)
    program = df.trace(substituted, params, x)
    assert not any(n.target == torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
                   for n in program.ops())
    assert any("substituted by T.Region('attn')" in line for line in str(program).splitlines())
    with torch.no_grad():
        h = unfused_attention(x, model.norm1.weight, model.norm1.bias, model.attn.qkv.weight,
                              model.attn.qkv.bias, model.attn.proj.weight, model.attn.proj.bias)
        after = h + model.mlp(model.norm2(h))
        torch.testing.assert_close(df.jit(substituted)(params, x), after, rtol=0, atol=0)
        torch.testing.assert_close(df.jit(substituted)(params, x), model(x))


def rms_norm_reference(x, weight, eps):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


@torch.library.custom_op("dynaflow_test::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_reference(x, weight, eps)


@rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@pytest.mark.slow
def test_a_custom_op_replaces_every_rmsnorm_of_a_hugging_face_llama():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    model = tiny_llama()
    logits, params = llama_logits(model)
    substituted = T.substitute(logits, {
        T.Module(LlamaRMSNorm): lambda norm, x: rms_norm_op(x, norm.weight, norm.variance_epsilon)})
    ids = torch.randint(0, 128, (2, 12))
    program = df.trace(substituted, params, ids)
    norms = sum(1 for m in model.modules() if isinstance(m, LlamaRMSNorm))
    assert sum(1 for n in program.ops() if n.target == torch.ops.dynaflow_test.rms_norm.default) == norms
    with torch.no_grad():
        torch.testing.assert_close(df.jit(substituted)(params, ids), model(ids).logits)


def test_substitution_composes_with_microbatch_and_overlap_bit_for_bit():
    model = Block()
    fn, params = df.pure(model)
    x = torch.randn(4, 6, 32)
    split = T.microbatch(T.substitute(fn, {T.Region("attn"): unfused_attention}), num=2, in_axes=(None, 0))
    overlapped = T.overlap(T.partition(split, rules=[T.Region("attn")]), strategy="tbo")
    sequential = df.trace(split, params, x)
    plan = df.jit(overlapped).lower(params, x)
    assert len(plan.streams) > 1
    df.verify(plan)
    with torch.no_grad():
        torch.testing.assert_close(df.jit(overlapped)(params, x), sequential(params, x), rtol=0, atol=0)
        torch.testing.assert_close(df.jit(overlapped)(params, x), model(x))


def fused_attention(x, norm_w, norm_b, qkv_w, qkv_b, proj_w, proj_b):
    """The Block's attention region with one fused kernel (it stays aten under backend="inductor")."""
    b, t, d = x.shape
    q, k, v = F.linear(F.layer_norm(x, (d,), norm_w, norm_b), qkv_w, qkv_b).view(b, t, 3, 4, d // 4).permute(
        2, 0, 3, 1, 4)
    return x + F.linear(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d),
                        proj_w, proj_b)


def attention_written_in_place(x, *weights):
    """unfused_attention, finished by an in-place op on its own result: functionalized when traced."""
    h = unfused_attention(x, *weights).clone()
    return h.mul_(1.0)


def _fake_modes(program):
    values = [v for n in program.graph.nodes for v in optree.tree_leaves(n.meta.get("val"))]
    return {id(v.fake_mode) for v in values if isinstance(v, FakeTensor)}


@pytest.mark.parametrize("impl", [fused_attention, unfused_attention, attention_written_in_place],
                         ids=["fused", "unfused", "in-place"])
def test_a_substituted_program_keeps_one_fake_mode(impl):
    fn, params, x = block_and_input()
    program = df.trace(T.substitute(fn, {T.Region("attn"): impl}), params, x)
    assert len(_fake_modes(program)) == 1, "the replacement's values must be the program's own fakes"


def test_the_stages_next_to_a_substituted_region_compile_with_inductor():
    """The replacement's values share the program's fake mode: Inductor compiles the runs that read
    them (it refuses inputs of two modes, and they ran as aten ops with a warning)."""
    model = Block()
    fn, params = df.pure(model)
    fast = df.jit(T.substitute(fn, {T.Region("attn"): fused_attention}), backend="inductor", progress=False)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        for _ in range(2):
            x = torch.randn(2, 6, 32)
            torch.testing.assert_close(fast(params, x), model(x), rtol=1e-4, atol=1e-5)
        plan = fast.lower(params, x)
    kinds = ["compiled" if isinstance(step.op, inductor.CompiledRun) else
             "attention" if "scaled_dot_product" in str(step.op) else "aten" for step in plan.steps]
    attention = kinds.index("attention")
    assert "compiled" in kinds[:attention] and "compiled" in kinds[attention + 1:], kinds
    assert not {"gelu", "addmm", "native_layer_norm"} & {step.op.overloadpacket.__name__ for step in plan.steps
                                                         if isinstance(step.op, torch._ops.OpOverload)}


# --- what is refused, and how -------------------------------------------------------------------


def block_and_input():
    fn, params = df.pure(Block())
    return fn, params, torch.randn(2, 6, 32)


def test_a_rule_that_matches_nothing_says_what_the_program_has():
    fn, params, x = block_and_input()
    with pytest.raises(TransformError, match=r"T.Region\('mlp'\) matched nothing.*regions entered: attn"):
        df.trace(T.substitute(fn, {T.Region("mlp"): lambda *a: a[0]}), params, x)
    with pytest.raises(TransformError, match=r"T.Module\(Conv2d\).*matched no module call"):
        df.trace(T.substitute(fn, {T.Module(nn.Conv2d): lambda m, x: x}), params, x)


def test_an_implementation_of_the_wrong_shape_is_named_with_both_layouts():
    fn, params, x = block_and_input()
    with pytest.raises(TransformError, match=r"returns f32\[2, 6, 31\] as output 0, where the region produces "
                                             r"f32\[2, 6, 32\]"):
        df.trace(T.substitute(fn, {T.Region("attn"): lambda x, *rest: x[..., :-1] * 2}), params, x)
    with pytest.raises(TransformError, match=r"T.Module\(attn.qkv\) returns f32\[2, 6, 96\]/stride.* where the "
                                             r"module returns f32\[2, 6, 96\]"):
        df.trace(T.substitute(fn, {T.Module("attn.qkv"): lambda m, x: m(x).transpose(0, 1).contiguous()
                                   .transpose(0, 1)}), params, x)


def test_an_implementation_that_cannot_take_what_it_is_called_with_says_what_that_is():
    fn, params, x = block_and_input()
    with pytest.raises(TransformError, match=r"T\.Region\('attn'\) cannot take the region's \d+ inputs \(.*\); it is "
                                             r"called with the tensors the region reads from outside.*f32\[2, 6, 32\]"):
        df.trace(T.substitute(fn, {T.Region("attn"): lambda a: a}), params, x)
    with pytest.raises(TransformError, match=r"T\.Module\(attn\.qkv\) is called as impl\(module, \*args, \*\*kwargs\) "
                                             r"with the Linear and the 1 positional and 0 keyword arguments"):
        df.trace(T.substitute(fn, {T.Module("attn.qkv"): lambda x: x}), params, x)


def test_an_implementation_that_writes_its_inputs_is_refused():
    fn, params, x = block_and_input()
    with pytest.raises(TransformError, match="writes one of its inputs in place"):
        df.trace(T.substitute(fn, {T.Region("attn"): lambda x, *rest: x.mul_(2)}), params, x)
    with pytest.raises(TransformError, match=r"T.Module\(norm1\) writes .* in place"):
        df.trace(T.substitute(fn, {T.Module("norm1"): lambda m, x: x.add_(1)}), params, x)


def test_a_check_that_fails_shows_the_largest_difference():
    fn, params, x = block_and_input()

    def not_causal(x, norm_w, norm_b, qkv_w, qkv_b, proj_w, proj_b):
        b, t, d = x.shape
        q, k, v = F.linear(F.layer_norm(x, (d,), norm_w, norm_b), qkv_w, qkv_b).view(b, t, 3, 4, 8).permute(
            2, 0, 3, 1, 4)
        return x + F.linear(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d), proj_w, proj_b)

    with pytest.raises(TransformError, match=r"disagrees with the region it replaces on random inputs: output 0 "
                                             r"\(f32\[2, 6, 32\]\) differs by up to [0-9.e+-]+ \(at index \[\d, \d, \d+\]"):
        df.trace(T.substitute(fn, {T.Region("attn"): not_causal}, check=True), params, x)
    df.trace(T.substitute(fn, {T.Region("attn"): not_causal}), params, x)       # unchecked, it is your call


def test_rules_and_implementations_are_checked_when_given():
    with pytest.raises(InputError, match="T.Module and T.Region rules"):
        T.substitute(lambda x: x, {T.Op("mm"): lambda x: x})
    with pytest.raises(InputError, match="must be callable"):
        T.substitute(lambda x: x, {T.Region("attn"): "flash"})
    with pytest.raises(InputError, match="a dict of rules"):
        T.substitute(lambda x: x, {})


def test_calling_a_region_substitution_eagerly_computes_what_its_plan_computes():
    fn, params, x = block_and_input()
    substituted = T.substitute(fn, {T.Region("attn"): unfused_attention})
    with torch.no_grad():
        torch.testing.assert_close(substituted(params, x), df.jit(substituted)(params, x), rtol=0, atol=0)
        assert not torch.equal(substituted(params, x), fn(params, x))        # unfused != the fused kernel, bitwise


def _doubled_then_squared(x):
    with df.region("scale"):
        y = x.sin() * 2
    return (y * y).sum()


def _tripled(x):                      # not the region's values: its gradient differs from the region's
    return x.cos() * 3


@pytest.mark.parametrize("eagerly", [False, True], ids=["jitted", "eager"])
def test_a_region_of_a_differentiated_function_is_refused_since_its_gradient_was_traced_through_the_original(
        eagerly):
    """The gradient df.value_and_grad traces goes through the region's own ops; replacing the forward
    nodes alone would pair impl's loss with the original's derivative."""
    substituted = T.substitute(df.value_and_grad(_doubled_then_squared), {T.Region("scale"): _tripled})
    with pytest.raises(TransformError, match=r"T\.Region\('scale'\) is differentiated.*Substitute first, then "
                                             r"differentiate"):
        (substituted if eagerly else df.jit(substituted))(torch.randn(4, 5))


def test_substituting_before_differentiating_gives_the_implementations_gradient():
    x = torch.randn(4, 5)
    loss, grad = df.jit(df.value_and_grad(T.substitute(_doubled_then_squared, {T.Region("scale"): _tripled})))(x)
    leaf = x.clone().requires_grad_(True)
    expected = _tripled(leaf).pow(2).sum()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    torch.testing.assert_close(grad, leaf.grad)


def test_a_region_that_holds_the_gradient_computation_too_can_be_replaced():
    def step(x):
        with df.region("step"):
            return df.value_and_grad(lambda x: (x * 2).pow(2).sum())(x)

    x = torch.randn(4, 5)            # the region computes the gradient first: impl returns (grad, loss)
    loss, grad = df.jit(T.substitute(step, {T.Region("step"): lambda x: (18 * x, (x * 3).pow(2).sum())}))(x)
    torch.testing.assert_close(grad, 18 * x)
    torch.testing.assert_close(loss, (x * 3).pow(2).sum())
