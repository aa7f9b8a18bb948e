"""runtime/interpreter.py and runtime/eager.py: a bound plan, interpreted step by step, computes what
eager PyTorch computes; outputs are fresh on every call; setup work runs once at binding."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dynaflow_fn as df
from dynaflow_fn.plan.plan import StorageKind
from dynaflow_fn.runtime.eager import EagerExecutable
from dynaflow_fn.runtime.interpreter import BoundPlan, kernel_error
from fixtures import RandomScheduler, build, example_inputs, flat_tensors, plan_of, recipes, scheduled
from models import MLP, Block, ConvNet

CPU = torch.device("cpu")


def _executable(fn, *args):
    plan = plan_of(fn, *args)
    return plan, EagerExecutable(plan, CPU)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=recipes(), seed=st.integers(0, 2**16), streams=st.integers(1, 3), micro_batches=st.booleans())
def test_interpreting_a_plan_equals_eager(recipe, seed, streams, micro_batches):
    inputs, fn = build(recipe)
    plan, executable = _executable(scheduled(fn, RandomScheduler(seed, streams), inputs, micro_batches),
                                   *example_inputs(inputs))
    for _ in range(2):
        fresh = example_inputs(inputs)
        got = plan.unflatten_outputs(executable(flat_tensors(*fresh)))
        for a, b in zip(got, fn(*fresh)):
            torch.testing.assert_close(a, b, equal_nan=True)


def test_models_equal_eager_through_the_executable():
    for model, shape in ((MLP(), (4, 32)), (ConvNet().eval(), (2, 3, 8, 8)), (Block(), (2, 8, 32))):
        fn, params = df.pure(model)
        plan, executable = _executable(fn, params, torch.randn(shape))
        x = torch.randn(shape)
        got = plan.unflatten_outputs(executable(flat_tensors(params, x)))
        torch.testing.assert_close(got, model(x))


def test_outputs_are_fresh_tensors_on_every_call():
    fn, params = df.pure(MLP())
    plan, executable = _executable(fn, params, torch.randn(4, 32))
    assert plan.storage_bytes(StorageKind.OUTPUT) > 0
    x, y = torch.randn(4, 32), torch.randn(4, 32)
    first = executable(flat_tensors(params, x))[0]
    kept = first.clone()
    second = executable(flat_tensors(params, y))[0]
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    assert torch.equal(first, kept)
    torch.testing.assert_close(second, fn(params, y))


@pytest.mark.parametrize("mutation", ["whole", "slice"])
def test_input_mutations_are_written_back_to_the_callers_tensor(mutation):
    """`x.mul_(2)` runs inplace on the caller's tensor; `x[1:].mul_(2)`, traced as a new `x` made by
    `slice_scatter`, is copied back into it."""
    def fn(x, y):
        (x if mutation == "whole" else x[1:]).mul_(2)
        return x + y

    plan, executable = _executable(fn, torch.randn(5), torch.randn(5))
    assert plan.written_inputs() == [0] and bool(plan.copy_steps()) == (mutation == "slice")
    x, y = torch.randn(5), torch.randn(5)
    expected_x = x.clone()
    (expected_x if mutation == "whole" else expected_x[1:]).mul_(2)
    out = executable(flat_tensors(x, y))[0]
    torch.testing.assert_close(x, expected_x)
    torch.testing.assert_close(out, expected_x + y)


def test_setup_runs_once_when_bound_and_every_call_reads_its_result():
    def fn(x):
        positions = torch.arange(x.shape[-1], dtype=x.dtype)
        return x * positions.exp()

    plan = plan_of(fn, torch.randn(3, 6))
    assert plan.setup
    bound = BoundPlan(plan, CPU)
    setup_slots = [slot for step in plan.setup for slot in step.outputs]
    precomputed = [bound.template[slot] for slot in setup_slots]
    assert all(isinstance(t, torch.Tensor) for t in precomputed)
    for _ in range(3):
        x = torch.randn(3, 6)
        env = bound.new_env(flat_tensors(x))
        bound.allocate_outputs(env)
        bound.run(env)
        torch.testing.assert_close(bound.outputs(env)[0], fn(x))
    assert all(bound.template[slot] is tensor for slot, tensor in zip(setup_slots, precomputed))


def test_jit_on_the_eager_backend_equals_eager():
    model = Block()
    fn, params = df.pure(model)
    fast = df.jit(fn, backend="eager")
    for _ in range(2):
        x = torch.randn(2, 8, 32)
        torch.testing.assert_close(fast(params, x), model(x))


@pytest.mark.parametrize("case", ["matmul of float32 and float64", "float64 into a float32 Linear",
                                  "index past the table", "token past the embedding"])
def test_a_kernel_that_fails_where_tracing_passed_raises_a_kernel_error_naming_the_op(case):
    """Meta kernels do not check the dtypes of mm/addmm, and no trace sees the values of an index: the
    plan's kernel is the first to fail. Its error names the op, the node and the operands, carries
    eager's error as its cause, and comes again on the next call, as eager's would."""
    linear, embedding = torch.nn.Linear(4, 4), torch.nn.Embedding(4, 4)
    fn, args, op = {
        "matmul of float32 and float64": (lambda a, b: (a @ b).relu(), (torch.randn(4, 4), torch.randn(4, 4).double()),
                                          "aten.mm"),
        "float64 into a float32 Linear": (lambda x: linear(x), (torch.randn(2, 4).double(),), "aten.addmm"),
        "index past the table": (lambda x, ids: x.gather(0, ids), (torch.randn(4), torch.tensor([1, 9])),
                                 "aten.gather"),
        "token past the embedding": (lambda ids: embedding(ids), (torch.tensor([1, 9]),), "aten.embedding"),
    }[case]
    with pytest.raises((RuntimeError, IndexError)) as raised:
        fn(*args)
    eager = str(raised.value)
    jitted = df.jit(fn)
    for _ in range(2):
        with pytest.raises(df.errors.KernelError) as error:
            jitted(*args)
        message = str(error.value)
        assert message.startswith("df.jit(<lambda>): " + op) and "(node " in message
        assert eager.splitlines()[0] in message and str(error.value.__cause__) == eager
        assert isinstance(error.value, raised.type)          # caught where eager's error is caught


def test_after_a_kernel_error_a_call_with_fitting_dtypes_equals_eager():
    fn = lambda a, b: (a @ b).relu()   # noqa: E731
    jitted = df.jit(fn)
    with pytest.raises(df.errors.KernelError):
        jitted(torch.randn(4, 4), torch.randn(4, 4).double())
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    assert torch.equal(jitted(a, b), fn(a, b))


def test_a_kernel_that_fails_only_inside_a_capture_says_so(monkeypatch):
    """A kernel error raised while the plan's stream captures names the capture, not tracing."""
    fn = lambda a, b: (a @ b).relu()   # noqa: E731
    plan = plan_of(fn, torch.randn(4, 4), torch.randn(4, 4))
    step = next(s for s in plan.steps if "mm" in str(s.op))
    env = [torch.randn(4, 4)] * len(plan.slots)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    error = kernel_error(plan, step, env, RuntimeError("operation not permitted when stream is capturing"))
    assert isinstance(error, df.errors.KernelError)
    assert "failed only inside the plan's CUDA graph capture" in str(error) and "meta" not in str(error)


class _OwnError(RuntimeError):
    pass


@torch.library.custom_op("dynaflow_test::refuse_negatives", mutates_args=())
def _refuse_negatives(x: torch.Tensor) -> torch.Tensor:
    if (x < 0).any():
        raise _OwnError("negative input")
    if (x > 100).any():
        raise NotImplementedError("large inputs")
    return x.clone()


@_refuse_negatives.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.mark.parametrize("x, raised", [(-torch.ones(2), _OwnError), (1000 * torch.ones(2), NotImplementedError)])
def test_an_error_of_a_class_of_its_own_passes_through_a_plan_unchanged(x, raised):
    """Only torch's plain kernel checks become KernelErrors: a custom op's own error class, or
    NotImplementedError (a RuntimeError too), is caught by its class as in eager PyTorch."""
    with pytest.raises(raised):
        df.jit(lambda x: _refuse_negatives(x) * 2)(x)
