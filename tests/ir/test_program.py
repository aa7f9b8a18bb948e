"""ir/program.py: a Program prints as code naming every input and op, runs as its function, and is
never changed by the functional updates that build new ones."""

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import dynaflow_fn as df
from dynaflow_fn.ir.formatting import SUMMARIZED_ARGUMENT_TENSORS, op_name
from dynaflow_fn.ir.program import info
from fixtures import build, example_inputs, recipes, scheduled
from models import MLP, Block


def _assert_printed_fully(program):
    text = str(program)
    for placeholder in program.placeholders():
        assert re.search(rf"\b{re.escape(placeholder.name)}\b", text), placeholder.name
    for node in program.ops():
        assert re.search(rf"^\s+{re.escape(node.name)}: ", text, re.M), node.name
        if op_name(node.target) != "getitem":
            assert op_name(node.target) + "(" in text
    assert text.splitlines()[0].startswith(f"# Program {program.name}")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=recipes())
def test_printing_names_every_input_and_op_and_calling_equals_the_function(recipe):
    inputs, fn = build(recipe)
    program = df.trace(fn, *example_inputs(inputs))
    _assert_printed_fully(program)
    fresh = example_inputs(inputs)
    for got, expected in zip(program(*fresh), fn(*fresh)):
        torch.testing.assert_close(got, expected, equal_nan=True)


def test_a_module_program_prints_its_module_scopes_and_equals_the_module():
    model = Block()
    fn, params = df.pure(model)
    x = torch.randn(2, 8, 32)
    program = df.trace(fn, params, x)
    _assert_printed_fully(program)
    text = str(program)
    assert "region(attn)" in text and "attn.qkv:Linear" in text and "mlp.0:Linear" in text
    fresh = torch.randn(2, 8, 32)
    torch.testing.assert_close(program(params, fresh), model(fresh))


def test_an_argument_of_many_tensors_prints_as_one_summary_line_above_the_ops():
    sizes = (32,) + (48,) * (SUMMARIZED_ARGUMENT_TENSORS // 2 + 1) + (16,)
    fn, params = df.pure(MLP(sizes=sizes))
    assert len(params) > SUMMARIZED_ARGUMENT_TENSORS
    x = torch.randn(4, 32)
    program = df.trace(fn, params, x)
    _assert_printed_fully(program)
    placeholders = [p.name for p in program.placeholders() if p.name != "x"]
    lines = str(program).splitlines()
    end = lines.index("):")
    assert lines[1:end] == ["def MLP(", lines[2], "    x: f32[4, 32],"]
    summary = re.fullmatch(r"    params: (\d+) tensors \((\w+) \.\.\. (\w+)\), ([\d.]+)k f32 elements,", lines[2])
    assert summary, lines[2]
    assert (int(summary[1]), summary[2], summary[3]) == (len(params), placeholders[0], placeholders[-1])
    assert float(summary[4]) * 1e3 == pytest.approx(sum(p.numel() for p in params.values()), rel=5e-3)
    assert lines[end + 1].lstrip().startswith(program.ops()[0].name + ":")   # the body starts right below

    fewer_params = dict(list(params.items())[:SUMMARIZED_ARGUMENT_TENSORS])   # at most that many: each with its type
    text = str(df.trace(lambda p, x: x @ p["layers.0.weight"].t(), fewer_params, x))
    assert "layers_0_weight: f32[48, 32]" in text and "tensors" not in text


def test_static_and_closed_over_values_appear_in_the_header():
    w = torch.randn(4, 4)
    program = df.trace(lambda x, n: (x @ w) * n, torch.randn(2, 4), 3)
    header = [line for line in str(program).splitlines() if line.startswith("#")]
    assert any("static: n=3" in line for line in header)
    assert any("closed over" in line and "w" in line for line in header)
    x = torch.randn(2, 4)
    torch.testing.assert_close(program(x, 3), (x @ w) * 3)


def test_strides_are_printed_only_for_non_contiguous_values():
    program = df.trace(lambda x, y: (x.t() + 0, x @ y), torch.randn(3, 5), torch.randn(5, 2))
    lines = {node.name: line for node in program.ops() for line in str(program).splitlines()
             if line.strip().startswith(node.name + ":")}
    transposed = next(n for n in program.ops() if n.target is torch.ops.aten.t.default)
    assert "/stride(1, 5)" in lines[transposed.name]
    matmul = next(n for n in program.ops() if n.target is torch.ops.aten.mm.default)
    assert "/stride" not in lines[matmul.name]


def test_annotate_builds_a_new_program_and_leaves_the_original_untouched():
    fn, params = df.pure(MLP())
    program = df.trace(fn, params, torch.randn(2, 32))
    before = str(program)
    tagged = program.annotate(lambda node, node_info: node_info.replace(tags=frozenset({"marked"})))
    assert str(program) == before
    assert all(info(node).tags == frozenset() for node in program.ops())
    assert all(info(node).tags == {"marked"} for node in tagged.ops())
    assert "[marked]" in str(tagged)
    x = torch.randn(2, 32)
    torch.testing.assert_close(tagged(params, x), program(params, x))


def test_issue_order_follows_the_schedule_and_trace_order_without_one():
    inputs, fn = build((1, [("matmul", 0, None), ("tanh", 1, None), ("add", 2, 0)], [3]))
    plain = df.trace(fn, *example_inputs(inputs))
    assert not plain.is_scheduled() and plain.issue_order() == plain.ops()
    program = df.trace(scheduled(fn, "tbo", inputs), *example_inputs(inputs))
    assert program.is_scheduled()
    orders = [info(node).order for node in program.issue_order()]
    assert orders == sorted(orders)
    assert set(program.issue_order()) == set(program.ops())
    assert len(program.streams) > 1 and "# streams: s0=main" in str(program)


def test_repr_counts_ops_and_names_the_passes():
    fn, params = df.pure(MLP())
    program = df.trace(fn, params, torch.randn(2, 32))
    assert repr(program) == f"<Program MLP: {len(program.ops())} ops, passes: trace>"
