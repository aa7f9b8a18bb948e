"""Program.python(): the source it writes runs, and computes what the Program and eager PyTorch compute."""

import optree
import pytest
import torch

import dynaflow_fn as df
from dynaflow_fn.errors import TransformError
from dynaflow_fn.ir.tree import identifier
from models import MLP, Block, llama_logits, tiny_llama


def _compiled(program):
    """The function the source of `program` defines, executed in a namespace of its own."""
    namespace = {}
    exec(compile(program.python(), f"<{program.name}.python>", "exec"), namespace)
    return namespace[identifier(program.name)]


def _tensor_inputs(program, *args):
    return [leaf for leaf, spec in zip(optree.tree_leaves((args, {})), program.inputs) if spec.is_tensor]


def _flat(outputs):
    return [leaf for leaf in optree.tree_leaves(outputs) if isinstance(leaf, torch.Tensor)]


def _check_against_program_and_eager(program, eager, make_args):
    """On fresh random inputs: the source's outputs equal the Program's bit for bit, and eager's."""
    fn = _compiled(program)
    for _ in range(2):
        args = make_args()
        from_source = fn(*_tensor_inputs(program, *args), **program.constants())
        assert isinstance(from_source, list)
        from_program = _flat(program(*args))
        assert len(from_source) == len(from_program)
        for a, b in zip(from_source, from_program):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        for a, b in zip(from_source, _flat(eager(*args))):
            torch.testing.assert_close(a, b)


def _pure_model(model, make_input):
    fn, params = df.pure(model)
    program = df.trace(fn, params, make_input())
    return program, (lambda params, x: model(x)), (lambda: (params, make_input()))


def test_an_mlp_runs_from_its_source():
    program, eager, make_args = _pure_model(MLP(), lambda: torch.randn(4, 32))
    _check_against_program_and_eager(program, eager, make_args)


def test_a_transformer_block_runs_from_its_source():
    program, eager, make_args = _pure_model(Block(), lambda: torch.randn(2, 8, 32))
    source = program.python()
    assert "torch.ops.aten.addmm.default(" in source and "native_layer_norm[0]" in source
    _check_against_program_and_eager(program, eager, make_args)


def test_a_hugging_face_llama_runs_from_its_source():
    pytest.importorskip("transformers")
    model = tiny_llama()
    logits, params = llama_logits(model)
    make_args = lambda: (params, torch.randint(0, 128, (2, 10)))     # noqa: E731
    program = df.trace(logits, *make_args())
    _check_against_program_and_eager(program, lambda params, ids: model(ids, use_cache=False).logits, make_args)


def test_the_source_is_the_printed_program_made_runnable():
    program, _, _ = _pure_model(MLP(sizes=(32, 16)), lambda: torch.randn(4, 32))
    source = program.python()
    printed = str(program)
    assert source.splitlines()[0] == printed.splitlines()[0] == "# Program MLP  passes: trace"
    assert "import torch" in source
    assert "def MLP(layers_0_bias, layers_0_weight, x):" in source
    assert "    addmm = torch.ops.aten.addmm.default(layers_0_bias, x, t)" in source
    assert source.rstrip().splitlines()[-1] == "    return [addmm]"
    assert "aten.addmm(layers_0_bias, x, t)" in printed and "torch.ops" not in printed


def test_captured_tensors_and_constants_are_keyword_only_parameters_read_in_place():
    weight = torch.randn(8, 8)

    def closes_over(x):
        scale = torch.tensor([2.0])
        hidden = (x @ weight) * scale
        masked = hidden.masked_fill(hidden < 0, float("-inf"))
        return masked.softmax(-1), torch.full((2,), 3.0, device=x.device)

    program = df.trace(closes_over, torch.randn(4, 8))
    constants = program.constants()
    assert any(value is weight for value in constants.values())
    assert len(constants) == 2
    source = program.python()
    assert "float('-inf')" in source and "torch.device('cpu')" in source
    assert f"def closes_over(x, *, {', '.join(constants)}):" in source
    fn = _compiled(program)
    with pytest.raises(TypeError):
        fn(torch.randn(4, 8), *constants.values())
    for _ in range(2):
        x = torch.randn(4, 8)
        from_source = fn(x, **program.constants())
        for a, b, c in zip(from_source, _flat(program(x)), closes_over(x)):    # a row all masked is NaN
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(a, c, equal_nan=True)
        weight.add_(1.0)


def test_a_program_whose_name_is_not_an_identifier_still_defines_a_function():
    program = df.trace(lambda x: x.sin() + 1, torch.randn(3))
    x = torch.randn(3)
    (result,) = _compiled(program)(x)
    assert torch.equal(result, program(x))


def test_an_argument_without_a_python_spelling_is_a_transform_error():
    program = df.trace(lambda x: x.cos(), torch.randn(3))
    node = program.ops()[0]
    node.args = (node.args[0], object())
    with pytest.raises(TransformError, match="cannot spell"):
        program.python()
