"""ir/ops.py: the op facts lowering relies on agree with torch's own schemas and tags, and an `out=`
variant called with the functional call's arguments computes what the functional op computes."""

import pytest
import torch

from dynaflow_fn.ir import ops

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _all_aten_overloads():
    found = []
    for name in sorted(dir(aten)):
        packet = getattr(aten, name, None)
        if name.startswith("__") or not hasattr(packet, "overloads"):
            continue
        found += [getattr(packet, overload) for overload in packet.overloads()]
    return found


OVERLOADS = _all_aten_overloads()


def test_the_sample_of_ops_is_large():
    assert len(OVERLOADS) > 1000


def test_mutation_and_randomness_are_read_from_the_schema_and_tags():
    for op in OVERLOADS:
        assert ops.is_mutating(op) == op._schema.is_mutable, op
        assert ops.is_random(op) == (torch.Tag.nondeterministic_seeded in op.tags), op
        assert not ops.is_collective(op) and not ops.launches_collective(op), op


def test_view_ops_alias_an_input_without_writing_it():
    for op in OVERLOADS:
        returns = op._schema.returns
        expected = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        assert ops.is_view(op) == expected, op
    assert ops.is_view(aten.t.default) and ops.is_view(aten.expand.default)
    assert not ops.is_view(aten.add_.Tensor) and not ops.is_view(aten.add.Tensor)


def test_out_variants_are_the_out_overload_of_the_same_packet_with_the_functional_arguments():
    checked = 0
    for op in OVERLOADS:
        variant = ops.out_variant(op)
        schema = op._schema
        if schema.is_mutable or not schema.returns or any(r.alias_info is not None for r in schema.returns):
            assert variant is None, op
        if variant is None:
            continue
        checked += 1
        out_schema = variant.op._schema
        assert variant.op.overloadpacket is op.overloadpacket and out_schema.is_mutable
        assert variant.out_names == tuple(a.name for a in out_schema.arguments if a.is_out)
        assert len(variant.out_names) == len(schema.returns)
        inputs = [a.name for a in out_schema.arguments if not a.is_out]
        assert list(variant.positional + variant.keyword) == inputs
        dropped = {a.name for a in schema.arguments} - set(inputs)
        assert dropped <= {"dtype", "layout", "device", "pin_memory"}, (op, dropped)
    assert checked > 200


def test_mutating_and_view_ops_have_no_out_variant_and_common_kernels_write_out_directly():
    for op in (aten.add_.Tensor, aten.copy_.default, aten.t.default, aten.view.default):
        assert ops.out_variant(op) is None
    for op in (aten.mm.default, aten.addmm.default, aten.add.Tensor, aten.gelu.default, aten.cat.default):
        variant = ops.out_variant(op)
        assert variant is not None and variant.direct, op
    assert not ops.out_variant(aten.mse_loss.default).direct


CALLS = [
    (aten.mm.default, lambda: (torch.randn(3, 4), torch.randn(4, 5)), {}),
    (aten.addmm.default, lambda: (torch.randn(5), torch.randn(3, 4), torch.randn(4, 5)), {"beta": 0.5}),
    (aten.add.Tensor, lambda: (torch.randn(3, 4), torch.randn(4)), {"alpha": 2}),
    (aten.gelu.default, lambda: (torch.randn(6),), {"approximate": "tanh"}),
    (aten.sum.dim_IntList, lambda: (torch.randn(3, 4), [1], True), {}),
    (aten._softmax.default, lambda: (torch.randn(3, 4), 1, False), {}),
    (aten.cat.default, lambda: ([torch.randn(2, 3), torch.randn(1, 3)],), {}),
    (aten.cumsum.default, lambda: (torch.randn(3, 4), 1), {}),
]


@pytest.mark.parametrize("op, make_args, kwargs", CALLS, ids=[str(c[0]) for c in CALLS])
def test_the_out_variant_called_with_the_functional_arguments_computes_the_same(op, make_args, kwargs):
    args = make_args()
    expected = op(*args, **kwargs)
    variant = ops.out_variant(op)
    positional, keyword = variant.call_arguments(ops.bind_arguments(op, args, kwargs))
    out = torch.full_like(expected, float("nan"))
    variant.op(*positional, **keyword, **{variant.out_names[0]: out})
    torch.testing.assert_close(out, expected)


def test_bind_and_replace_arguments_follow_the_schema_names():
    bias, a, b = torch.randn(5), torch.randn(3, 4), torch.randn(4, 5)
    bound = ops.bind_arguments(aten.addmm.default, (bias, a, b), {"alpha": 3})
    assert bound["self"] is bias and bound["mat1"] is a and bound["mat2"] is b and bound["alpha"] == 3
    other = torch.randn(4, 5)
    args, kwargs = ops.replace_arguments(aten.addmm.default, (bias, a, b), {}, {"mat2": other, "beta": 2})
    assert args[2] is other and kwargs == {"beta": 2}
    torch.testing.assert_close(aten.addmm.default(*args, **kwargs), 2 * bias + a @ other)


def test_collective_facts():
    all_reduce, wait = c10d.all_reduce.default, c10d.wait_tensor.default
    assert ops.is_collective(all_reduce) and ops.launches_collective(all_reduce)
    assert ops.is_collective(wait) and ops.is_collective_wait(wait) and not ops.launches_collective(wait)
    assert ops.is_view(wait)
    assert not ops.is_pure(all_reduce)


def test_only_pure_deterministic_local_ops_can_be_precomputed():
    assert ops.is_pure(aten.add.Tensor) and ops.is_pure(aten.arange.start)
    assert not ops.is_pure(aten.bernoulli.default)
    assert not ops.is_pure(aten.native_dropout.default)
    assert not ops.is_pure(aten.add_.Tensor)
    assert not ops.is_mutating(len) and not ops.is_view(len) and not ops.is_random(len)


def test_op_info_is_read_once_per_overload_and_none_for_other_targets():
    assert ops.op_info(aten.mm.default) is ops.op_info(aten.mm.default)
    assert ops.op_info(len) is None and ops.op_info("placeholder_name") is None


def test_op_info_names_are_the_printed_names_and_the_path_evaluates_to_the_overload():
    assert ops.op_info(aten.mm.default).name == "aten.mm"
    assert ops.op_info(aten.add.Tensor).name == "aten.add.Tensor"
    assert ops.op_info(c10d.all_reduce.default).name == "_c10d_functional.all_reduce"
    assert ops.op_info(aten.add.Tensor).packet == "aten.add"
    for op in OVERLOADS + [c10d.all_reduce.default, c10d.wait_tensor.default]:
        info = ops.op_info(op)
        assert info.name == str(op).removesuffix(".default"), op          # torch's own spelling, less ".default"
        assert eval(info.path, {"torch": torch}) is op, op


def test_op_info_arguments_and_results_are_the_schema_as_plain_data():
    for op in OVERLOADS:
        info, schema = ops.op_info(op), op._schema
        for plain, argument in zip(info.arguments + info.returns, list(schema.arguments) + list(schema.returns)):
            alias = argument.alias_info
            assert (plain.name, plain.type, plain.kwarg_only, plain.is_out) == (
                argument.name, str(argument.type), argument.kwarg_only, argument.is_out), op
            assert plain.aliased == (alias is not None) and plain.written == (alias is not None and alias.is_write), op
        assert len(info.arguments) == len(schema.arguments) and len(info.returns) == len(schema.returns), op
    written = ops.op_info(aten.add_.Tensor)
    assert written.is_mutable and written.arguments[0].written and written.returns[0].aliased


def _op_table_keys():
    """Every op table of the package, keyed by `OpInfo.packet`."""
    from dynaflow_fn.ir import cost
    from dynaflow_fn.runtime import interpreter
    from dynaflow_fn.tracing import closure
    from dynaflow_fn.transforms import row_rules

    return {"row_rules._RULES": set(row_rules._RULES), "row_rules._SHAPE_ONLY": set(row_rules._SHAPE_ONLY),
            "cost._MATMULS": set(cost._MATMULS), "cost._MATMULS_WITH_BIAS": set(cost._MATMULS_WITH_BIAS),
            "ops._VETTED_OUT_KERNELS": set(ops._VETTED_OUT_KERNELS), "closure._LIFT_FRESH": set(closure._LIFT_FRESH),
            "interpreter._RUN_AS": set(interpreter._RUN_AS), "cost._CONVOLUTION": {cost._CONVOLUTION}}


@pytest.mark.parametrize("table", sorted(_op_table_keys()))
def test_every_op_table_key_is_the_packet_of_an_operator(table):
    """A table keyed by a misspelt name would silently never match: every key names a real operator."""
    for key in _op_table_keys()[table]:
        namespace, name = key.split(".", 1)
        packet = getattr(getattr(torch.ops, namespace), name, None)
        assert packet is not None and ops.op_info(getattr(packet, packet.overloads()[0])).packet == key, key
