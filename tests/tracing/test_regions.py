"""tracing/regions.py: a scope owns exactly the nodes traced while it was open, scopes nest outermost
first, two blocks of one name stay two instances, and outside a trace `df.region` does nothing."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dynaflow_fn as df
from dynaflow_fn.ir.program import info
from models import Block

REGION_NAMES = st.sampled_from(["a", "b", "c"])
BODIES = st.recursive(st.just("op"), lambda inner: st.tuples(REGION_NAMES, st.lists(inner, max_size=4)),
                      max_leaves=12)


def _run(body, x, path, expected):
    """Run a nested body: each "op" adds its own number to x; each (name, items) is a region block.
    Records, per op number, the region names open around it."""
    if body == "op":
        number = float(len(expected))
        expected[number] = tuple(path)
        return x + number
    name, items = body
    with df.region(name):
        for item in items:
            x = _run(item, x, path + [name], expected)
    return x


@settings(max_examples=30, deadline=None)
@given(bodies=st.lists(BODIES, min_size=1, max_size=4))
def test_regions_tag_exactly_the_nodes_traced_inside_them(bodies):
    expected = {}

    def fn(x):
        expected.clear()
        for body in bodies:
            x = _run(body, x, [], expected)
        return x * 1.0

    program = df.trace(fn, torch.randn(3))
    adds = [node for node in program.ops() if node.target is torch.ops.aten.add.Tensor]
    assert len(adds) == len(expected)
    for node in adds:
        regions = tuple(scope.name for scope in info(node).scopes if scope.kind == "region")
        assert regions == expected[node.args[1]]
    final = next(node for node in program.ops() if node.target is torch.ops.aten.mul.Tensor)
    assert not [s for s in info(final).scopes if s.kind == "region"]


def test_two_blocks_with_one_name_are_two_instances():
    def fn(x):
        with df.region("r"):
            x = x.sin()
        with df.region("r"):
            x = x.cos()
        return x

    program = df.trace(fn, torch.randn(3))
    instances = {node.target: [s.instance for s in info(node).scopes if s.kind == "region"] for node in program.ops()}
    (first,), (second,) = instances[torch.ops.aten.sin.default], instances[torch.ops.aten.cos.default]
    assert first != second


def test_module_scopes_nest_outermost_first_around_regions():
    fn, params = df.pure(Block())
    program = df.trace(fn, params, torch.randn(2, 8, 32))
    addmm = [node for node in program.ops() if node.target is torch.ops.aten.addmm.default]
    paths = [[str(scope) for scope in info(node).scopes] for node in addmm]
    assert paths[0] == ["Block", "region(attn)", "attn:Attention", "attn.qkv:Linear"]
    assert paths[1] == ["Block", "region(attn)", "attn:Attention", "attn.proj:Linear"]
    assert paths[2] == ["Block", "mlp:Sequential", "mlp.0:Linear"]
    assert paths[3] == ["Block", "mlp:Sequential", "mlp.2:Linear"]
    for node in program.ops():
        scopes = info(node).scopes
        assert scopes and scopes[0].kind == "module" and scopes[0].module_type is Block
        in_attention = any(s.name == "attn" and s.kind == "module" for s in scopes)
        in_region = any(s.kind == "region" for s in scopes)
        assert in_attention <= in_region
        assert not (in_region and "mlp" in str(scopes))                  # the region holds none of the MLP


def test_outside_a_trace_a_region_changes_nothing():
    model = Block()
    x = torch.randn(2, 8, 32)
    fn, params = df.pure(model)
    torch.testing.assert_close(df.trace(fn, params, x)(params, x), model(x))
    with df.region("anything"):
        y = x * 2
    torch.testing.assert_close(y, x * 2)


@pytest.mark.parametrize("name", ["", None, 3])
def test_a_region_needs_a_non_empty_string_name(name):
    with pytest.raises(df.InputError, match="non-empty string"):
        with df.region(name):
            pass

