import pytest
import torch

import dynaflow_fn as df
from dynaflow_fn import testing as dft
from dynaflow_fn import transforms as T
from dynaflow_fn.plan.plan import StepKind
from dynaflow_fn.ir.program import info
from example_loader import load_example
from models import MLP, Block, TwoBranch, llama_logits, tiny_llama

STRATEGIES = ["sequential", "roundrobin", "tbo", "branches"]


def _model(name):
    if name == "mlp":
        fn, params = df.pure(MLP())
        return fn, params, lambda: torch.randn(6, 32), [T.Module(torch.nn.Linear)]
    if name == "block":
        fn, params = df.pure(Block())
        return fn, params, lambda: torch.randn(4, 8, 32), [T.Region("attn")]
    if name == "two-branch":
        fn, params = df.pure(TwoBranch())
        return fn, params, lambda: (torch.randn(6, 32), torch.randn(6, 32)), [T.Module("^left$"), T.Module("^right$")]
    model = tiny_llama()
    fn, params = llama_logits(model)
    from transformers.models.llama.modeling_llama import LlamaAttention
    return fn, params, lambda: torch.randint(0, 128, (4, 10)), [T.Module(LlamaAttention)]


def _strategy(fn, rules, strategy, num=2, inputs=1):
    step = T.microbatch(fn, num=num, in_axes=(None,) + (0,) * inputs)
    return T.overlap(T.partition(step, rules=rules), strategy=strategy)


@pytest.mark.parametrize("model_name", ["mlp", "block", pytest.param("llama", marks=pytest.mark.slow), "two-branch"])
def test_every_strategy_equals_eager_and_the_sequential_microbatched_program(model_name):
    fn, params, make, rules = _model(model_name)
    inputs = 2 if model_name == "two-branch" else 1
    sequential = df.jit(_strategy(fn, rules, "sequential", inputs=inputs))
    strategies = {s: df.jit(_strategy(fn, rules, s, inputs=inputs)) for s in STRATEGIES[1:]}
    for _ in range(2):
        x = make()
        x = x if isinstance(x, tuple) else (x,)
        expected = fn(params, *x)
        reference = sequential(params, *x)
        torch.testing.assert_close(reference, expected)
        for name, fast in strategies.items():
            plan = fast.lower(params, *x)
            assert len({s.stream for s in plan.steps}) >= 2, name
            df.verify(plan)
            torch.testing.assert_close(fast(params, *x), reference, rtol=0, atol=0)


def _stage_order(pace):
    """For a TBO plan of the tiny Llama: per pair of stages (a, b) of different micro-batches, whether
    every step of a happens before every step of b, and the pacing edges the schedule asked for."""
    from dynaflow_fn.plan.ordering import Clocks

    fn, params, make, rules = _model("llama")
    program = df.trace(T.overlap(T.partition(T.microbatch(fn, num=2, in_axes=(None, 0)), rules=rules),
                                 strategy=T.TBO(pace=pace)), params, make())
    plan = df.verify(df.lower(program))
    clocks = Clocks(plan.steps, len(plan.streams))
    stage_of = {n.name: info(n).stage for n in program.ops()}
    steps_of = {}
    for step in plan.steps:
        if step.node in stage_of and step.kind is not StepKind.VIEW:
            steps_of.setdefault(stage_of[step.node], []).append(step.index)
    edges = {(a, info(n).stage) for n in program.ops() for a in info(n).after}
    ordered = lambda a, b: all(clocks.before(x, y) for x in steps_of.get(a, []) for y in steps_of.get(b, []))
    return edges, ordered


def test_tbo_paces_micro_batches_so_the_offset_holds_in_the_plan():
    edges, ordered = _stage_order(pace=True)
    assert edges and all(ordered(a, b) for a, b in edges)
    unpaced_edges, unpaced_ordered = _stage_order(pace=False)
    assert not unpaced_edges
    assert not all(unpaced_ordered(a, b) for a, b in edges)      # without pacing the offset is not kept


def test_a_scheduler_can_only_pace_after_stages_issued_earlier():
    class Backwards(df.Scheduler):
        def schedule(self, graph):
            last = len(graph.stages) - 1
            return [T.Issue(s.index, 0, after=(last,) if s.index == 0 and last else ()) for s in graph.stages]

    fn, params, make, rules = _model("mlp")
    with pytest.raises(df.ScheduleError, match="can only wait for stages issued earlier"):
        df.trace(T.overlap(T.partition(fn, rules=rules), strategy=Backwards()), params, make())


def test_branches_runs_independent_subgraphs_on_separate_streams():
    model = TwoBranch()
    fn, params = df.pure(model)
    step = T.overlap(T.partition(fn, rules=[T.Module("^left$"), T.Module("^right$")]), strategy="branches")
    x, y = torch.randn(5, 32), torch.randn(5, 32)
    plan = df.jit(step).lower(params, x, y)
    df.verify(plan)
    streams_of = {s.node: s.stream for s in plan.steps if s.node}
    assert streams_of["addmm"] != streams_of["addmm_2"]
    torch.testing.assert_close(df.jit(step)(params, x, y), model(x, y))


def test_transformed_function_runs_eagerly_as_the_microbatched_program():
    fn, params = df.pure(Block())
    step = T.overlap(T.microbatch(fn, num=3, in_axes=(None, 0)), strategy="tbo")
    x = torch.randn(6, 8, 32)
    torch.testing.assert_close(step(params, x), fn(params, x))


def test_split_and_merge_copy_nothing():
    fn, params = df.pure(MLP())
    plan = df.jit(_strategy(fn, [T.Module(torch.nn.Linear)], "roundrobin", num=4)).lower(params, torch.randn(8, 32))
    assert not plan.copy_steps() and not plan.allocating_steps()
    assert not [s for s in plan.steps if s.kind is StepKind.KERNEL and s.op == torch.ops.aten.cat.out]
    slices = [s for s in plan.steps if s.op == torch.ops.aten.slice.Tensor]
    assert len(slices) == 4 and all(s.kind is StepKind.VIEW for s in slices)


def test_uneven_batch_gives_a_smaller_last_micro_batch():
    fn, params = df.pure(MLP())
    step = T.microbatch(fn, num=3, in_axes=(None, 0))
    x = torch.randn(7, 32)
    program = df.trace(step, params, x)
    rows = sorted((info(n).mb, n.meta["val"].shape[0]) for n in program.ops() if n.target == torch.ops.aten.slice.Tensor)
    assert rows == [(0, 3), (1, 2), (2, 2)]
    torch.testing.assert_close(df.jit(T.overlap(step, strategy="roundrobin"))(params, x), fn(params, x))


@pytest.mark.parametrize("batch", [8, 7])
def test_sum_and_mean_merge_like_the_full_batch(batch):
    def losses(w, x):
        y = x @ w
        return {"mean": y.square().mean(), "sum": y.sum(), "rows": y}

    step = T.microbatch(losses, num=3, in_axes=(None, 0), out_axes={"mean": "mean", "sum": "sum", "rows": 0})
    w, x = torch.randn(16, 4), torch.randn(batch, 16)
    got, expected = df.jit(T.overlap(step, strategy="roundrobin"))(w, x), losses(w, x)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key])


def test_in_axes_can_split_other_dimensions_and_keywords():
    def f(x, scale, bias):
        return x * scale + bias.T

    step = T.microbatch(f, num=2, in_axes=(1, None), out_axes=1)
    x, scale, bias = torch.randn(3, 4), torch.randn(()), torch.randn(4, 3)
    torch.testing.assert_close(df.jit(step)(x, scale, bias=bias), f(x, scale, bias))
    with pytest.raises(df.TransformError, match=r"x along axis 1 \(size 4\), bias along axis 0 \(size 5\)"):
        df.jit(step)(x, scale, bias=torch.randn(5, 3))


def test_compose_applies_left_to_right():
    fn, params = df.pure(Block())
    strategy = T.compose(T.microbatch(num=2, in_axes=(None, 0)), T.partition(rules=[T.Region("attn")]),
                         T.overlap(strategy="tbo"))
    program = df.trace(strategy(fn), params, torch.randn(4, 8, 32))
    assert program.provenance == ("trace", "microbatch(num=2, in_axes=(None, 0), out_axes=0)",
                                  "partition(T.Region('attn'))", "overlap(tbo(offset=1))")


def test_transforms_apply_to_programs_and_leave_the_input_untouched():
    fn, params = df.pure(Block())
    x = torch.randn(4, 8, 32)
    program = df.trace(fn, params, x)
    partitioned = T.partition(program, rules=[T.Region("attn")])
    assert all(info(n).stage is None for n in program.ops())
    split = T.microbatch(partitioned, num=2, in_axes=(None, 0))
    assert split.provenance[-1].startswith("microbatch") and "partition" in split.provenance[-2]
    assert {info(n).mb for n in split.ops()} == {0, 1, None}
    assert all(info(n).stage is not None for n in split.ops())
    scheduled = T.overlap(split, strategy="roundrobin")
    plan = df.verify(df.lower(scheduled))
    torch.testing.assert_close(scheduled(params, x), fn(params, x))
    assert len(plan.streams) == 2


def test_microbatch_after_overlap_is_an_error():
    fn, params = df.pure(MLP())
    scheduled = df.trace(T.overlap(fn, strategy="roundrobin"), params, torch.randn(4, 32))
    with pytest.raises(df.TransformError, match="Apply microbatch before overlap"):
        T.microbatch(scheduled, num=2, in_axes=(None, 0))


@pytest.mark.parametrize("strategy", ["sequential", "roundrobin", "tbo", "branches"])
def test_overlap_of_micro_batches_nested_in_micro_batches_says_to_split_once(strategy):
    """Before, every strategy failed with a cycle between stages blamed on a merge=True rule the user
    never wrote."""
    fn, params = df.pure(MLP())
    nested = T.microbatch(T.microbatch(fn, num=2, in_axes=(None, 0)), num=2, in_axes=(None, 0))
    with pytest.raises(df.TransformError, match="split once instead, with num the product of the two"):
        df.trace(T.overlap(nested, strategy=strategy), params, torch.randn(8, 32))


def test_partition_rules_label_stages_and_tags():
    fn, params = df.pure(Block())
    program = T.partition(df.trace(fn, params, torch.randn(2, 8, 32)),
                          rules=[T.Region("attn"), T.Module(r"mlp\.0"), T.Op(r"aten\.gelu")])
    by_name = {n.name: info(n) for n in program.ops()}
    attn = {i.stage for i in by_name.values() if "attn" in i.tags}
    assert len(attn) == 1
    assert by_name["gelu"].tags == {"aten\\.gelu"}
    assert by_name["addmm_2"].tags == {"mlp\\.0"}
    assert len({i.stage for i in by_name.values()}) == 5
    assert "stage=" in str(program) and "[attn]" in str(program)


def test_kind_rule_uses_the_cost_model():
    def f(a, b, c):
        return (a @ b).relu() + c

    program = T.partition(df.trace(f, torch.randn(512, 512), torch.randn(512, 512), torch.randn(512, 512)),
                          rules=[T.Kind("compute")])
    kinds = {n.name: info(n).kind for n in program.ops()}
    assert kinds == {"mm": "compute", "relu": "memory", "add": "memory"}
    assert info(next(n for n in program.ops() if n.name == "mm")).tags == {"compute"}


def test_rule_that_matches_nothing_warns_with_its_name():
    fn, params = df.pure(MLP())
    with pytest.warns(UserWarning, match=r"T.Region\('nowhere'\) matched no node"):
        T.partition(df.trace(fn, params, torch.randn(2, 32)), rules=[T.Region("nowhere")])


def test_merged_rule_that_forms_a_cycle_names_the_nodes():
    def f(x):
        with df.region("a"):
            y = x.sin()
        z = y.cos()
        with df.region("a"):
            return z.exp()

    program = df.trace(f, torch.randn(4))
    with pytest.raises(df.TransformError, match=r"cycle: stage 0 \[a\] \(sin, exp\) -> stage 1 \[\] \(cos\)"):
        T.partition(program, rules=[T.Region("a", merge=True)])
    T.partition(program, rules=[T.Region("a")])


@pytest.mark.parametrize("num, match", [(0, "positive integer"), (9, r"at least 9 rows.*batch has 8 \(x")])
def test_bad_micro_batch_count(num, match):
    fn, params = df.pure(MLP())
    with pytest.raises(df.TransformError, match=match):
        df.trace(T.microbatch(fn, num=num, in_axes=(None, 0)), params, torch.randn(8, 32))


def test_in_axes_naming_a_missing_dimension():
    with pytest.raises(df.TransformError, match=r"axis 2 for x, which has 2 dimensions \(shape \[8, 3\]\)"):
        df.trace(T.microbatch(lambda x: x * 2, num=2, in_axes=2), torch.randn(8, 3))


def test_out_axes_int_for_a_scalar_output():
    with pytest.raises(df.TransformError, match=r"out_axes gives axis 0 for out\[1\].*\"sum\" or \"mean\""):
        df.trace(T.microbatch(lambda x: (x * 2, x.sum()), num=2), torch.randn(8))


def test_bad_axes_values_fail_at_transform_time():
    with pytest.raises(df.TransformError, match="in_axes leaves must be an int axis"):
        T.microbatch(num=2, in_axes=("sum",))


class _Broken(df.Scheduler):
    def __init__(self, mode):
        self.mode = mode

    def schedule(self, graph):
        order = [T.Issue(s.index, 0) for s in graph.stages]
        if self.mode == "reversed":
            return order[::-1]
        if self.mode == "stream":
            return [T.Issue(i.stage, 3) for i in order]
        if self.mode == "duplicate":
            return order + order[:1]
        return order[:-1]


@pytest.mark.parametrize("mode, match", [("reversed", "before stage"), ("stream", "declared only 1 streams"),
                                         ("duplicate", "twice"), ("missing", "never issued")])
def test_invalid_schedules_fail_before_anything_runs(mode, match):
    fn, params = df.pure(MLP())
    step = T.overlap(T.microbatch(fn, num=2, in_axes=(None, 0)), strategy=_Broken(mode))
    with pytest.raises(df.ScheduleError, match=match):
        df.jit(step)(params, torch.randn(4, 32))


def test_comm_ctas_must_be_positive():
    with pytest.raises(df.TransformError, match="comm_ctas must be a positive number of thread blocks, got 0"):
        T.overlap(strategy="roundrobin", comm_ctas=0)


def test_example_policy_interleaves_micro_batches():
    example = load_example("custom_scheduler")
    fn, params = df.pure(MLP())
    step = T.overlap(T.partition(T.microbatch(fn, num=2, in_axes=(None, 0)), rules=[T.Module(torch.nn.Linear)]),
                     strategy=example.KindPairing())
    plan = df.verify(df.jit(step).lower(params, torch.randn(6, 32)))
    streams = [s.stream for s in plan.steps if s.kind is StepKind.KERNEL]
    assert streams[:2] == [0, 1]
    dft.assert_equivalent(fn, step, params, torch.randn(6, 32))


def test_example_policy_is_valid_exact_and_deterministic_on_random_programs():
    """KindPairing gives every micro-batch a stream, so it is meant for micro-batched programs only."""
    dft.check_scheduler(load_example("custom_scheduler").KindPairing, max_examples=15)


def test_a_pass_that_changes_nothing_adds_no_provenance_line_but_is_remembered():
    from dynaflow_fn.passes.causal import CausalKernelPass
    from dynaflow_fn.passes.inductor import InductorPass

    class Unchanged(T.Pass):
        def describe(self):
            return "unchanged"

        def apply(self, program):
            return T.record(program, program, self)

    program = df.trace(lambda x: x.t().relu(), torch.randn(3, 4))
    views = df.trace(lambda x: x.t(), torch.randn(3, 4))                  # nothing for Inductor to compile
    for p, given in ((Unchanged(), program), (CausalKernelPass(), program), (InductorPass(progress=False), views)):
        after = p.apply(given)
        assert after.provenance == ("trace",) and after.passes[-1] is p, p
    changed = T.partition(program, rules=[T.Kind("memory")])
    assert changed.provenance == ("trace", "partition(T.Kind('memory'))")
