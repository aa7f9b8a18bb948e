"""lowering/reinplace.py: an op runs inplace on an argument only when nothing later reads that
argument's old value (nor a view of it), it is not returned, and an input is donated; plans that do
so compute what eager PyTorch computes."""

import operator

import optree
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dynaflow_fn as df
from dynaflow_fn.ir import ops
from dynaflow_fn.ir.ops import inplace_variant
from dynaflow_fn.plan.plan import StepKind
from fixtures import RandomScheduler, build, example_inputs, recipes, scheduled


def _readers(node):
    """The nodes that read `node`'s memory: its users, seen through views of it."""
    found = []
    for user in node.users:
        if ops.is_view(user.target) or (user.target is operator.getitem and ops.is_view(node.target)):
            found += _readers(user)
        found.append(user)
    return found


def _inplace_steps(plan):
    return [step for step in plan.steps if step.kind is StepKind.KERNEL and step.note == "reinplaced"]


def _assert_old_values_are_dead(program, plan, donated=()):
    """Every argument an inplace step overwrites is read by no step after it, is not returned and,
    if it is an input, is a donated one."""
    position = {step.node: step.index for step in plan.steps if step.node}
    nodes = {node.name: node for node in program.graph.nodes}
    donated_names = {program.placeholders()[i].name for i in donated}
    for step in _inplace_steps(plan):
        node = nodes[step.node]
        written = optree.tree_leaves(node.args[:1])
        for argument in written:
            assert argument.op != "get_attr"
            if argument.op == "placeholder":
                assert argument.name in donated_names, (step.node, argument.name)
            for reader in _readers(argument):
                assert reader.op != "output", (step.node, argument.name)
                if reader is node or ops.is_view(reader.target) or reader.target is operator.getitem:
                    continue
                assert position[reader.name] < step.index, (step.node, argument.name, reader.name)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=recipes(), seed=st.integers(0, 2**16), streams=st.integers(1, 3))
def test_inplace_steps_overwrite_only_dead_values_and_plans_equal_eager(recipe, seed, streams):
    inputs, fn = build(recipe)
    step = scheduled(fn, RandomScheduler(seed, streams), inputs)
    args = example_inputs(inputs)
    program = df.trace(step, *args)
    plan = df.verify(df.lower(program))
    _assert_old_values_are_dead(program, plan)
    fresh = example_inputs(inputs)
    for got, expected in zip(df.jit(step, backend="eager")(*fresh), fn(*fresh)):
        torch.testing.assert_close(got, expected, equal_nan=True)


def test_a_donated_update_chain_runs_inplace_and_copies_nothing():
    def update(p, g):
        return p * 0.9 - g * 0.1

    p, g = torch.randn(16), torch.randn(16)
    fast = df.jit(update, donate_argnums=(0,))
    plan = fast.lower(p, g)
    assert len(_inplace_steps(plan)) == 2 and not plan.copy_steps()
    assert plan.written_inputs() == [0]
    _assert_old_values_are_dead(fast.trace(p, g), plan, donated=(0,))
    expected = update(p.clone(), g)
    out = fast(p, g)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(p, expected)


def test_an_argument_read_later_is_not_overwritten():
    def update(ps, g):
        return [x.mul(0.9).sub(g) for x in ps], ps[0].sum()

    ps, g = [torch.randn(8), torch.randn(8)], torch.randn(8)
    fast = df.jit(update, donate_argnums=(0,))
    program, plan = fast.trace(ps, g), fast.lower(ps, g)
    _assert_old_values_are_dead(program, plan, donated=(0, 1))
    overwritten = {program.placeholders()[0].name: False, program.placeholders()[1].name: False}
    nodes = {node.name: node for node in program.graph.nodes}
    for step in _inplace_steps(plan):
        for argument in optree.tree_leaves(nodes[step.node].args[:1]):
            if argument.name in overwritten:
                overwritten[argument.name] = True
    assert list(overwritten.values()) == [False, True]
    expected = update([x.clone() for x in ps], g)
    got = fast(ps, g)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("update", [
    lambda p, g: (p * 0.9 - g * 0.1).exp().relu(),
    lambda p, g: ((p.clamp(-1, 1).relu_() @ g).exp(), g.T),    # an inplace op on an intermediate; an input's view
], ids=["chain", "inplace-op-and-a-view"])
def test_dead_intermediates_are_reinplaced_and_inputs_not_donated_never_overwritten(update):
    p, g = torch.randn(4, 4), torch.randn(4, 4)
    before = p.clone(), g.clone()
    fast = df.jit(update)
    plan = fast.lower(p, g)
    reinplaced = [step for step in plan.steps if step.note == "reinplaced"]
    assert reinplaced and all(step.kind is StepKind.KERNEL for step in reinplaced)
    assert plan.written_inputs() == []
    _assert_old_values_are_dead(fast.trace(p, g), plan)
    torch.testing.assert_close(fast(p, g), update(*(t.clone() for t in before)))
    assert torch.equal(p, before[0]) and torch.equal(g, before[1])


def test_inplace_variants_mirror_the_functional_schema():
    aten = torch.ops.aten
    assert inplace_variant(aten.add.Tensor) is aten.add_.Tensor
    assert inplace_variant(aten.mul.Scalar) is aten.mul_.Scalar
    assert inplace_variant(aten._foreach_mul.List) is aten._foreach_mul_.List
    assert inplace_variant(aten.add_.Tensor) is None
    assert inplace_variant(aten.mm.default) is None
    assert inplace_variant(len) is None
