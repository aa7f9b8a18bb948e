import inspect

import pytest
import torch

import dynaflow_fn as df
from models import MLP, llama_logits, tiny_llama


def _line_of(fn, text):
    source, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(source) if text in line)


def test_every_node_has_shape_and_dtype():
    fn, params = df.pure(MLP())
    program = df.trace(fn, params, torch.randn(4, 32))
    for node in program.graph.nodes:
        if node.op in ("placeholder", "call_function"):
            value = node.meta["val"]
            values = value if isinstance(value, (list, tuple)) else [value]
            assert all(isinstance(v, torch.Tensor) and v.dtype is not None for v in values if v is not None)


def test_printed_program_reads_like_code():
    fn, params = df.pure(MLP(sizes=(32, 16)))
    program = df.trace(fn, params, torch.randn(4, 32))
    text = str(program)
    assert "def MLP(layers_0_bias: f32[16], layers_0_weight: f32[16, 32], x: f32[4, 32]):" in text
    assert "addmm: f32[4, 16] = aten.addmm(layers_0_bias, x, t)" in text
    assert "layers.0:Linear" in text
    assert "passes: trace" in text
    assert text.rstrip().endswith("return [addmm]")


def test_tracing_uses_no_real_memory_for_a_7b_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).eval()
    logits, params = llama_logits(model)
    assert sum(p.numel() for p in params.values()) > 6.5e9
    program = df.trace(logits, params, torch.empty(1, 16, dtype=torch.long, device="meta"))
    out = program.output_node().args[0][0].meta["val"]
    assert tuple(out.shape) == (1, 16, 32000)
    assert sum(1 for n in program.ops() if n.target == torch.ops.aten.mm.default) == 32 * 7 + 1


def test_static_leaves_are_baked_in():
    def scale(x, factor, mode):
        return x * factor if mode == "mul" else x + factor

    program = df.trace(scale, torch.randn(3), 2.5, "mul")
    assert [s.static_value for s in program.inputs if not s.is_tensor] == [2.5, "mul"]
    x = torch.randn(3)
    torch.testing.assert_close(program(x, 2.5, "mul"), x * 2.5)


def test_outputs_keep_their_pytree_structure():
    def f(x):
        return {"double": x * 2, "pair": (x.sum(), None, 3)}

    x = torch.randn(4)
    out = df.trace(f, x)(x)
    assert set(out) == {"double", "pair"} and out["pair"][1:] == (None, 3)
    torch.testing.assert_close(out["pair"][0], x.sum())


def test_data_dependent_branch_names_the_users_line():
    def branchy(x):
        if x.sum() > 0:
            return x * 2
        return x

    with pytest.raises(df.TraceError) as error:
        df.trace(branchy, torch.randn(3))
    message = str(error.value)
    assert f"{__file__}:{_line_of(branchy, 'if x.sum() > 0')}" in message
    assert "torch.where" in message


def test_data_dependent_shape_names_the_users_line():
    def masked(x):
        return x[x > 0]

    with pytest.raises(df.TraceError, match="output shape depends on tensor data") as error:
        df.trace(masked, torch.randn(3))
    assert f"test_trace.py:{_line_of(masked, 'x[x > 0]')}" in str(error.value)


def test_op_without_fake_kernel_is_reported():
    @torch.library.custom_op("dynaflow_test::opaque_twice", mutates_args=())
    def opaque_twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def f(x):
        return opaque_twice(x) + 1

    with pytest.raises(df.TraceError, match="fake"):
        df.trace(f, torch.randn(3))


def test_input_mutation_becomes_a_write_back():
    def bump(x):
        x.add_(1)
        return x * 2

    program = df.trace(bump, torch.randn(3))
    copies = [n for n in program.ops() if n.target == torch.ops.aten.copy_.default]
    assert len(copies) == 1 and copies[0].args[0].op == "placeholder"


def test_unhashable_leaf_is_an_error_naming_its_path():
    import numpy as np

    with pytest.raises(df.InputError, match=r"options\['table'\].*torch.as_tensor"):
        df.trace(lambda x, options: x, torch.randn(2), {"table": np.ones(2)})


def test_plain_objects_are_not_static_leaves():
    class Config:
        pass

    with pytest.raises(df.InputError, match="config is a Config"):
        df.trace(lambda x, config: x, torch.randn(2), Config())


def test_non_tensor_output_is_an_error():
    class Box:
        pass

    with pytest.raises(df.TraceError, match=r"out\['box'\]"):
        df.trace(lambda x: {"box": Box()}, torch.randn(2))


def test_mixed_devices_are_an_error_naming_both_arguments():
    with pytest.raises(df.InputError, match=r"a on cpu, b on meta"):
        df.trace(lambda a, b: a + b, torch.randn(2), torch.empty(2, device="meta"))


def test_hf_llama_traces():
    model = tiny_llama()
    logits, params = llama_logits(model)
    ids = torch.randint(0, 128, (2, 12))
    program = df.trace(logits, params, ids)
    torch.testing.assert_close(program(params, ids), model(ids, use_cache=False).logits)


def test_model_code_runs_as_in_eager_pytorch():
    from torch.fx._symbolic_trace import is_fx_tracing

    seen = []

    def f(x):
        seen.append((is_fx_tracing(), torch.compiler.is_compiling()))
        return x + 1

    df.trace(f, torch.randn(2))
    assert seen == [(False, False)]

