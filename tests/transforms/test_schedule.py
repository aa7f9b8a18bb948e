"""transforms/schedule.py: every built-in scheduler returns a valid schedule (each stage once, after
what it reads, on a declared stream, paced only after earlier stages), the same one every time, and
plans built from it are race-free and equal eager PyTorch."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dynaflow_fn as df
from dynaflow_fn import transforms as T
from dynaflow_fn.ir.program import info
from dynaflow_fn.transforms.schedule import STRATEGIES, StageGraph, resolve
from fixtures import EachNode, build, example_inputs, plan_of, recipes
from models import Block, TwoBranch


def _stage_graph(program, rules, micro_batches=2, inputs=1):
    if micro_batches:
        program = T.microbatch(program, num=micro_batches, in_axes=(None,) + (0,) * inputs)
    return StageGraph.from_program(T.partition(program, rules=rules))


def _assert_valid(scheduler, graph):
    order = scheduler.schedule(graph)
    streams = scheduler.streams(graph)
    assert [s.index for s in streams] == list(range(len(streams)))
    assert sorted(issue.stage for issue in order) == [stage.index for stage in graph.stages]
    position = {issue.stage: i for i, issue in enumerate(order)}
    for i, issue in enumerate(order):
        assert 0 <= issue.stream < len(streams)
        assert all(position[need] < i for need in graph.stages[issue.stage].needs)
        assert all(position[stage] < i for stage in issue.after)
    return order


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=recipes(), micro_batches=st.sampled_from([None, 2, 3]))
def test_every_built_in_schedule_is_valid_and_deterministic(recipe, micro_batches):
    inputs, fn = build(recipe)
    args = example_inputs(inputs, size=6)
    graph = _stage_graph(df.trace(fn, *args), [EachNode()], micro_batches, inputs)
    again = _stage_graph(df.trace(fn, *args), [EachNode()], micro_batches, inputs)
    for name, scheduler_type in STRATEGIES.items():
        order = _assert_valid(scheduler_type(), graph)
        assert scheduler_type().schedule(graph) == order, name
        assert scheduler_type().schedule(again) == order, name
        assert scheduler_type().streams(again) == scheduler_type().streams(graph), name


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_plans_of_every_strategy_verify_and_equal_eager(strategy):
    model = Block()
    fn, params = df.pure(model)
    step = T.overlap(T.partition(T.microbatch(fn, num=2, in_axes=(None, 0)), rules=[T.Region("attn")]),
                     strategy=strategy)
    x = torch.randn(4, 8, 32)
    first, second = plan_of(step, params, x), plan_of(step, params, x)
    df.verify(first)
    assert str(first) == str(second)
    fresh = torch.randn(4, 8, 32)
    torch.testing.assert_close(df.jit(step, backend="eager")(params, fresh), model(fresh))


def test_sequential_is_trace_order_on_one_stream():
    fn, params = df.pure(Block())
    graph = _stage_graph(df.trace(fn, params, torch.randn(4, 8, 32)), [T.Region("attn")])
    order = T.Sequential().schedule(graph)
    assert [issue.stage for issue in order] == [stage.index for stage in graph.stages]
    assert {issue.stream for issue in order} == {0}


def test_round_robin_puts_each_micro_batch_on_its_own_stream_and_alternates():
    fn, params = df.pure(Block())
    graph = _stage_graph(df.trace(fn, params, torch.randn(4, 8, 32)), [T.Region("attn")], micro_batches=2)
    order = _assert_valid(T.RoundRobin(), graph)
    for issue in order:
        mb = graph.stages[issue.stage].mb
        assert issue.stream == (0 if mb is None else graph.micro_batches.index(mb))
    mbs = [graph.stages[i.stage].mb for i in order if graph.stages[i.stage].mb is not None]
    assert any(a != b for a, b in zip(mbs, mbs[1:]))


def test_tbo_keeps_micro_batch_one_a_stage_behind():
    fn, params = df.pure(Block())
    graph = _stage_graph(df.trace(fn, params, torch.randn(4, 8, 32)), [T.Region("attn")], micro_batches=2)
    order = _assert_valid(T.TBO(), graph)
    first, second = graph.micro_batches
    issued_first = 0
    for issue in order:
        mb = graph.stages[issue.stage].mb
        if mb == first:
            issued_first += 1
        elif mb == second:
            stage_number = [s.index for s in graph.of_micro_batch(second)].index(issue.stage)
            assert issued_first >= min(stage_number + 1, len(graph.of_micro_batch(first)))
    assert any(issue.after for issue in order)
    assert not any(issue.after for issue in T.TBO(pace=False).schedule(graph))


def test_branches_runs_independent_branches_on_different_streams():
    fn, params = df.pure(TwoBranch())
    program = df.trace(fn, params, torch.randn(4, 32), torch.randn(4, 32))
    graph = _stage_graph(program, [T.Module("^left$"), T.Module("^right$")], micro_batches=None)
    order = _assert_valid(T.Branches(), graph)
    stream_of = {issue.stage: issue.stream for issue in order}
    scopes = {node.name: {scope.name for scope in info(node).scopes} for node in program.ops()}

    def streams_of(branch):
        return {stream_of[s.index] for s in graph.stages if any(branch in scopes[name] for name in s.nodes)}

    left, right = streams_of("left"), streams_of("right")
    assert left and right and not left & right
    assert len(T.Branches(max_streams=1).streams(graph)) == 1


def test_strategies_resolve_by_name_class_or_instance():
    for name, scheduler_type in STRATEGIES.items():
        assert type(resolve(name)) is scheduler_type
        assert type(resolve(scheduler_type)) is scheduler_type
    custom = T.RoundRobin(compute_streams=1)
    assert resolve(custom) is custom
    with pytest.raises(df.InputError, match="unknown strategy"):
        resolve("fastest")
    with pytest.raises(df.InputError):
        resolve(3)


class _Stubborn(df.Scheduler):
    def pick(self, ready, graph, issued):
        return ready[-1], 5


def test_a_pick_on_an_undeclared_stream_is_a_schedule_error():
    fn, params = df.pure(Block())
    graph = _stage_graph(df.trace(fn, params, torch.randn(4, 8, 32)), [T.Region("attn")])
    with pytest.raises(df.ScheduleError, match="_Stubborn.pick put stage"):
        _Stubborn().schedule(graph)
