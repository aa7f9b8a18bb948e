"""dynaflow_fn.testing catches wrong transforms and schedulers, with messages that say what to fix,
and lets correct ones pass."""

import random
import re
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

import dynaflow_fn as df
from dynaflow_fn import testing as dft
from dynaflow_fn import transforms as T
from dynaflow_fn.errors import InputError, TransformError
from dynaflow_fn.ir.program import copy_graph_module
from dynaflow_fn.transforms.base import apply_transform, record
from example_loader import load_example
from models import MLP


def two_outputs(w, x):
    h = torch.tanh(x @ w)
    return h.relu(), (h * 2).sigmoid()


class DropFirst(T.Pass):
    """Wrong: removes the first node calling `op`, feeding its input to its users."""

    def __init__(self, op):
        self.op = op

    def describe(self):
        return f"drop_first({self.op})"

    def apply(self, program):
        graph_module, _ = copy_graph_module(program.graph_module)
        node = next(n for n in graph_module.graph.nodes if n.op == "call_function" and self.op in str(n.target))
        node.replace_all_uses_with(node.args[0])
        graph_module.graph.erase_node(node)
        graph_module.recompile()
        return record(program, program.with_graph(graph_module), self)


class SwapOutputs(T.Pass):
    """Wrong: returns the first two outputs in each other's place."""

    def describe(self):
        return "swap_outputs"

    def apply(self, program):
        graph_module, _ = copy_graph_module(program.graph_module)
        output = next(n for n in graph_module.graph.nodes if n.op == "output")
        first, second, *rest = output.args[0]
        output.args = ([second, first, *rest],)
        graph_module.recompile()
        return record(program, program.with_graph(graph_module), self)


def naive_mean_of_halves(fn):
    """Wrong for uneven splits: the plain mean of the two halves' means, not weighted by their sizes."""
    return lambda w, x: torch.stack([fn(w, half) for half in x.tensor_split(2)]).mean(0)


def _example():
    return torch.randn(8, 8), torch.randn(4, 8)


def test_correct_schedules_pass():
    w, x = _example()
    for strategy in ["roundrobin", "tbo", "branches"]:
        step = T.overlap(T.microbatch(two_outputs, num=2, in_axes=(None, 0)), strategy=strategy)
        dft.assert_equivalent(two_outputs, step, w, x, draws=4)


@pytest.mark.cuda
def test_exact_comparisons_on_cuda_run_eager_pytorchs_kernels():
    """df.jit's default on CUDA is Inductor's kernels, which round differently from eager PyTorch's: the
    exact comparison of a schedule must not depend on them."""
    w, x = (t.cuda() for t in _example())
    step = T.overlap(T.microbatch(two_outputs, num=2, in_axes=(None, 0)), strategy="roundrobin")
    dft.assert_equivalent(two_outputs, step, w, x, draws=4)


@pytest.mark.cuda
def test_fresh_inputs_are_drawn_on_the_examples_device():
    example = {"w": torch.randn(8, 8, device="cuda") * 3 + 1, "ids": torch.randint(0, 5, (4,), device="cuda")}
    drawn = dft.draw_like(example, torch.Generator().manual_seed(0))
    assert all(leaf.is_cuda for leaf in drawn.values())
    assert 0 <= int(drawn["ids"].min()) and int(drawn["ids"].max()) <= 4


@pytest.mark.cuda
def test_check_scheduler_runs_random_programs_on_cuda_streams():
    dft.check_scheduler(load_example("custom_scheduler").KindPairing, max_examples=5, device="cuda")


@pytest.mark.cuda
def test_check_substitution_takes_cuda_examples():
    def fn(x):
        with df.region("act"):
            y = torch.nn.functional.gelu(x)
        return y * 2

    def erf_gelu(x):
        return 0.5 * x * (1 + torch.erf(x * 0.7071067811865476))

    x = torch.randn(6, 16, device="cuda")
    dft.check_substitution(fn, {T.Region("act"): erf_gelu}, x, in_axes=(0,), tolerances={torch.float32: (1e-5, 1e-6)})


def test_the_default_backend_runs_eager_pytorchs_kernels_where_the_examples_live():
    from dynaflow_fn.testing.equivalence import aten_kernels_for

    assert aten_kernels_for((torch.randn(2),), {}) == "eager"


def test_a_dropped_node_is_caught_and_named():
    w, x = _example()
    wrong = apply_transform(T.microbatch(two_outputs, num=2, in_axes=(None, 0)), DropFirst("tanh"))
    with pytest.raises(AssertionError) as caught:
        dft.assert_equivalent(two_outputs, wrong, w, x, seed=7)
    message = str(caught.value)
    assert "df.jit(transformed) differs from calling transformed eagerly" in message
    assert "out[0] differs (compared bit for bit): largest difference" in message
    assert "draw 0 of 3 (seed=7, batch of 4)" in message


def test_swapped_outputs_name_the_first_swapped_leaf():
    w, x = _example()
    with pytest.raises(AssertionError, match=r"out\[0\] differs .* largest difference [0-9.e-]+ at index \[\d+, \d+\]"):
        dft.assert_equivalent(two_outputs, apply_transform(two_outputs, SwapOutputs()), w, x)


def test_a_mis_merged_uneven_split_is_caught_at_the_uneven_batch_size():
    def batch_mean(w, x):
        return torch.tanh(x @ w).mean(0)

    w, x = _example()
    wrong = naive_mean_of_halves(batch_mean)
    torch.testing.assert_close(wrong(w, x), batch_mean(w, x))      # the even example hides the bug
    with pytest.raises(AssertionError) as caught:
        dft.assert_equivalent(batch_mean, wrong, w, x, in_axes=(None, 0), num=2, seed=3)
    message = str(caught.value)
    assert "df.jit(transformed) differs from fn: out differs (compared within the dtype's tolerance)" in message
    assert "(seed=5, batch of 3)" in message                         # draws: 4 rows, 2 rows, then 3


def test_the_correct_mean_merge_passes_uneven_splits():
    def batch_mean(w, x):
        return torch.tanh(x @ w).mean(0)

    step = T.microbatch(batch_mean, num=2, in_axes=(None, 0), out_axes="mean")
    dft.assert_equivalent(batch_mean, step, *_example())


def test_a_different_structure_is_reported():
    w, x = _example()
    with pytest.raises(AssertionError, match="the result has structure"):
        dft.assert_equivalent(two_outputs, lambda w, x: list(two_outputs(w, x)), w, x)


def test_fresh_inputs_keep_structure_kinds_and_scale_and_resize_batch_axes():
    params = {"w": torch.nn.Parameter(torch.randn(3, 5) * 0.02), "ids": torch.randint(0, 10, (4,))}
    args = (params, torch.randn(6, 3), 2)
    axes = dft.batch_axes((None, 0, None), args, {})
    drawn = dft.draw_like((args, {}), torch.Generator().manual_seed(0), axes, rows=7)
    (fresh_params, fresh_x, static), _ = drawn
    assert isinstance(fresh_params["w"], torch.nn.Parameter) and fresh_params["w"].std() < 0.1
    assert not torch.equal(fresh_params["w"], params["w"])
    assert fresh_params["ids"].dtype == torch.int64 and 0 <= fresh_params["ids"].min() <= fresh_params["ids"].max() <= 9
    assert fresh_x.shape == (7, 3) and static == 2
    assert dft.edge_batch_sizes(8, 2) == [8, 2, 3] and dft.edge_batch_sizes(4, 1) == [4, 1]


def _masked_softmax(x, mask):
    return torch.softmax(x + mask, -1)


def test_a_wrong_transform_fails_when_an_example_holds_infinities():
    """A causal mask of -inf: statistics over all its values are NaN, and all-NaN fresh inputs would
    make any two functions agree."""
    mask = torch.triu(torch.full((4, 4), float("-inf")), 1)
    wrong = lambda x, mask: torch.softmax(2 * x + mask, -1)   # noqa: E731
    with pytest.raises(AssertionError, match="differs from fn"):
        dft.assert_equivalent(_masked_softmax, wrong, torch.randn(2, 4, 4), mask, exact=False)
    drawn = dft.draw_like(torch.tensor([float("-inf"), 1.0, 3.0, float("nan")]), torch.Generator().manual_seed(0))
    assert torch.isfinite(drawn).all()


@pytest.mark.parametrize("example", [
    torch.tensor([0, 2**63 - 1]), torch.tensor([-2**63, 2**63 - 1]), torch.tensor([0, 2**31 - 1], dtype=torch.int32),
    torch.randn(4).to(torch.float8_e4m3fn), torch.randn(3, dtype=torch.complex64) * 4 + 1j,
], ids=["int64-max", "int64-full-range", "int32-max", "float8", "complex"])
def test_fresh_inputs_of_any_dtype_and_range_keep_dtype_and_range(example):
    drawn = dft.draw_like(example, torch.Generator().manual_seed(0))
    assert drawn.dtype == example.dtype and drawn.shape == example.shape
    if not example.dtype.is_floating_point and not example.dtype.is_complex:
        assert example.min() <= drawn.min() and drawn.max() <= example.max()


def test_a_batch_axis_on_a_tensor_without_it_is_an_input_error():
    with pytest.raises(df.errors.InputError, match="batch axis 0 for a tensor of shape"):
        dft.draw_like(torch.tensor(3.0), torch.Generator(), [0], 2)


@pytest.mark.parametrize("got, expected, message", [
    (torch.tensor([1, 2]), 3, r"out is a tensor int64\[2\], expected int 3"),
    (3, torch.tensor([1, 2]), r"out is int 3, expected a tensor int64\[2\]"),
    (torch.tensor(3.0), 3.0, r"out is a tensor float32\[\], expected float 3\.0"),
    (torch.tensor([1 + 1j]), torch.tensor([1 + 2j]), r"largest difference 1 at index \[0\], got 1\+1j, expected 1\+2j"),
], ids=["tensor-vs-int", "int-vs-tensor", "0-dim-vs-float", "complex"])
def test_differences_between_tensors_and_other_values_are_named(got, expected, message):
    assert re.search(message, dft.first_difference(got, expected, exact=True))


@pytest.mark.parametrize("got, expected, exact, message", [
    (np.array([1.0, 2.0]), np.array([1.0, 3.0]), True, r"out differs \(compared bit for bit\): largest difference 1"),
    (np.array([1.0, 2.0]), np.array([1.0, 2.0]), True, None),
    (1.0, 1.0 + 1e-12, False, None),
    (1.0, 1.0 + 1e-12, True, r"out is 1\.0, expected 1\.000000000001"),
    (float("nan"), float("nan"), True, None),
    (torch.empty(2, device="meta"), torch.empty(2, device="meta"), True, None),
    (torch.empty(2, device="meta"), torch.zeros(2), True, r"out is a meta tensor, expected a cpu one"),
], ids=["arrays-differ", "arrays-equal", "floats-within-tolerance", "floats-bit-for-bit", "nan-floats",
        "meta-tensors", "meta-against-cpu"])
def test_numpy_arrays_floats_and_meta_tensors_compare_as_tensors_do(got, expected, exact, message):
    """Before: numpy leaves raised numpy's "truth value of an array is ambiguous", meta tensors
    "Cannot copy out of meta tensor", and floats were compared bit for bit even with exact=False."""
    found = dft.first_difference([got], [expected], exact=exact)
    assert (found is None) if message is None else re.search(message.replace("out", r"out\[0\]"), found), found


def test_assert_equivalent_refuses_to_compare_nothing():
    with pytest.raises(InputError, match=r"draws of at least 1, got 0"):
        dft.assert_equivalent(lambda x: x * 2, lambda x: x * 2, torch.randn(3), draws=0)


class Nondeterministic(df.Scheduler):
    """Wrong: draws from the unseeded global random module, so two ranks build different plans."""

    def streams(self, graph):
        return [df.Stream(0, "a"), df.Stream(1, "b")]

    def pick(self, ready, graph, issued):
        return random.choice(ready), random.randrange(2)


def test_a_nondeterministic_scheduler_is_caught():
    with pytest.raises(AssertionError) as caught:
        dft.check_scheduler(Nondeterministic(), max_examples=10)
    message = str(caught.value)
    assert "overlap(Nondeterministic) is not deterministic: planning the same program twice placed node" in message
    assert "seed any randomness" in message and "def program(w" in message


class IssuesBeforeInputs(df.Scheduler):
    """Wrong: issues the stages in reverse, each before the stages whose results it reads."""

    def schedule(self, graph):
        return [T.Issue(stage.index, 0) for stage in reversed(graph.stages)]


def test_an_invalid_schedule_names_the_stage_and_shows_the_program():
    with pytest.raises(df.ScheduleError, match=r"(?s)IssuesBeforeInputs issued stage \d+ .* before stage .*"
                                               r"the program, micro-batched \d ways"):
        dft.check_scheduler(IssuesBeforeInputs, max_examples=5)


def test_correct_schedulers_pass():
    dft.check_scheduler(T.RoundRobin, max_examples=10)
    dft.check_scheduler(dft.RandomScheduler(seed=1, streams=3), max_examples=10)


def test_the_example_transform_is_exact_and_race_free():
    example = load_example("custom_transform")
    fn, params = df.pure(MLP())
    step = T.partition(T.microbatch(fn, num=2, in_axes=(None, 0)), rules=[T.Module(torch.nn.Linear)])
    step = example.memory_stages_aside(T.overlap(step, strategy="roundrobin"), mb=1)
    plan = df.verify(df.jit(step).lower(params, torch.randn(6, 32)))
    assert [s.name for s in plan.streams][-1] == "mb1-memory"
    assert any(s.stream == 2 for s in plan.steps)
    dft.assert_equivalent(fn, step, params, torch.randn(6, 32))


def test_the_plugin_seeds_each_test_from_its_id(request, seed):
    assert seed == zlib.crc32(request.node.nodeid.encode()) == torch.initial_seed()


def test_the_toolkit_imports_without_hypothesis_and_says_how_to_get_it():
    code = ("import sys; sys.modules['hypothesis'] = None\n"
            "import dynaflow_fn.testing as dft\n"
            "try:\n    dft.check_scheduler(dft.RandomScheduler(0, 2))\n"
            "except Exception as error:\n    print(type(error).__name__, error)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.startswith("DynaflowError") and "pip install hypothesis" in result.stdout


# --- check_substitution -------------------------------------------------------------------------


def _scaled_rows(x, w):
    with df.region("scale"):
        y = x * w
    return y.sum(-1)


def test_check_substitution_passes_an_implementation_that_agrees():
    x, w = torch.randn(4, 8), torch.randn(8)
    dft.check_substitution(_scaled_rows, {T.Region("scale"): torch.mul}, x, w, in_axes=(0, None))


def test_check_substitution_catches_an_implementation_wrong_only_on_odd_batches():
    def even_only(x, w):
        return x * w if x.shape[0] % 2 == 0 else x * w * 1.01

    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(TransformError, match=r"T.Region\('scale'\) disagrees .* differs by up to"):
        dft.check_substitution(_scaled_rows, {T.Region("scale"): even_only}, x, w, in_axes=(0, None))
