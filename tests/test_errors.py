"""Wrong inputs to rules, schedulers, df.lower and df.verify are named errors that say what was expected,
and warnings point at the user's line."""

import contextlib
import inspect
import os
import re

import pytest
import torch

import dynaflow_fn as df
from dynaflow_fn import transforms as T
from dynaflow_fn.ir.program import copy_graph_module
from models import MLP, Block


def _mlp():
    fn, params = df.pure(MLP())
    return fn, params, torch.randn(4, 32)


# --- partition rules -----------------------------------------------------------------------------


def _regex_error(pattern):
    with pytest.raises(re.error) as error:
        re.compile(pattern)
    return str(error.value)


@pytest.mark.parametrize("make, rule, pattern", [
    (lambda p: T.Op(p), "T.Op", "all_reduce("),
    (lambda p: T.Op(p), "T.Op", "[mm"),
    (lambda p: T.Module(p), "T.Module", "layers.*)"),
])
def test_an_invalid_regex_is_a_transform_error_at_construction_naming_the_rule(make, rule, pattern):
    with pytest.raises(df.TransformError) as error:
        make(pattern)
    message = str(error.value)
    assert f"{rule}({pattern!r})" in message and _regex_error(pattern) in message


@pytest.mark.parametrize("make, named", [
    (lambda: T.Op(3), "T.Op"),
    (lambda: T.Module(int), "T.Module"),
    (lambda: T.Module(None), "T.Module"),
    (lambda: T.Region(["attn"]), "T.Region"),
    (lambda: T.Region("attn", tags="attn"), "tags"),
    (lambda: T.partition(lambda x: x, rules=T.Region("attn")), "list of rules"),
    (lambda: T.partition(lambda x: x, rules=["attn"]), "'attn'"),
])
def test_a_rule_of_the_wrong_type_is_an_input_error_naming_what_it_takes(make, named):
    with pytest.raises(df.InputError, match=re.escape(named)) as error:
        make()
    assert isinstance(error.value, TypeError)


def test_string_tags_are_refused_not_split_into_characters():
    with pytest.raises(df.InputError, match=r"tags=\{'attn'\}"):
        T.Op("mm", tags="attn")
    assert T.Op("mm", tags={"attn"}).stage_tags() == {"attn"}


def _unmatched_warning(rule, fn, params, x):
    with pytest.warns(UserWarning, match="matched no node") as record:
        T.partition(df.trace(fn, params, x), rules=[rule])
    return str(record[0].message)


def test_each_rule_type_says_why_it_matched_nothing_and_what_the_program_has():
    fn, params, x = _mlp()
    ops = {n.target for n in df.trace(fn, params, x).ops()}
    op_names = sorted(df.ir.formatting.op_name(op) for op in ops)

    region = _unmatched_warning(T.Region("attn"), fn, params, x)
    assert "no `with df.region('attn')` block ran while tracing" in region and "aten." not in region

    op = _unmatched_warning(T.Op(r"conv"), fn, params, x)
    assert all(name in op for name in op_names) and "df.region" not in op

    module = _unmatched_warning(T.Module(torch.nn.Conv2d), fn, params, x)
    assert "no call of a Conv2d module" in module and "layers.0:Linear" in module

    by_name = _unmatched_warning(T.Module("attn"), fn, params, x)
    assert "module names" in by_name and "layers.2:Linear" in by_name

    kind = _unmatched_warning(T.Kind("comm"), fn, params, x)
    assert "no comm work" in kind


def test_a_region_rule_lists_the_regions_that_did_run():
    fn, params = df.pure(Block())
    message = _unmatched_warning(T.Region("mlp_typo"), fn, params, torch.randn(2, 4, 32))
    assert "regions entered: attn" in message


def _next_line():
    """The number of the line after the caller's."""
    return inspect.currentframe().f_back.f_lineno + 1


def test_an_unmatched_rule_warns_at_the_users_line_whatever_the_path():
    fn, params, x = _mlp()
    rule = T.Region("nowhere")
    with pytest.warns(UserWarning, match="matched no node") as record:
        lines = [_next_line()]
        df.trace(T.partition(fn, rules=[rule]), params, x)
        lines.append(_next_line())
        df.jit(T.overlap(T.partition(fn, rules=[rule]), "sequential"))(params, x)
        lines.append(_next_line())
        T.partition(df.trace(fn, params, x), rules=[rule])
        lines.append(_next_line())
        df.trace(T.compose(T.microbatch(num=2, in_axes=(None, 0)), T.partition(rules=[rule]))(fn), params, x)
    assert [(w.filename, w.lineno) for w in record] == [(__file__, line) for line in lines]


def _compiled(directory, source, namespace):
    """The function `call` defined by `source` as if it were written in a file of `directory`."""
    exec(compile(source, os.path.join(directory, "_caller.py"), "exec"), namespace)
    return namespace["call"]


def test_warn_attributes_a_warning_to_the_first_frame_outside_dynaflow_and_torch():
    from dynaflow_fn.errors import warn

    inner = _compiled(os.path.dirname(df.__file__), "def call():\n    warn('deep inside')\n", {"warn": warn})
    outer = _compiled(os.path.dirname(torch.__file__), "def call():\n    inner()\n", {"inner": inner})
    with pytest.warns(UserWarning, match="deep inside") as record:
        line = _next_line()
        outer()
    assert (record[0].filename, record[0].lineno) == (__file__, line)


# --- schedulers ----------------------------------------------------------------------------------


class _BadPick(df.Scheduler):
    def __init__(self, answer):
        self.answer = answer

    def pick(self, ready, graph, issued):
        return self.answer(ready, graph, issued)


def _stage_of_another_batch(ready, graph, issued):
    return next(s for s in graph.stages if s not in ready and s.index not in {i.stage for i in issued}), 0


@pytest.mark.parametrize("answer, shown", [
    (lambda ready, graph, issued: ready[0], "pick returned stage 0"),
    (lambda ready, graph, issued: None, "pick returned None"),
    (lambda ready, graph, issued: (ready[0].index, 0), "returned 0 as the stage"),
    (lambda ready, graph, issued: (ready[0], df.Stream(0, "main")), "on stream Stream("),
    (lambda ready, graph, issued: (ready[0], 2), "on stream 2"),
    (lambda ready, graph, issued: (ready[0], -1), "on stream -1"),
    (lambda ready, graph, issued: (ready[0], True), "on stream True"),
    (lambda ready, graph, issued: (graph.stages[0], 0), "not ready (it was issued already)"),
    (_stage_of_another_batch, "not ready (it reads stage"),
])
def test_a_pick_of_the_wrong_shape_is_a_schedule_error_naming_the_scheduler_and_the_answer(answer, shown):
    fn, params, x = _mlp()
    step = T.overlap(T.partition(fn, rules=[T.Module(torch.nn.Linear)]), strategy=_BadPick(answer))
    with pytest.raises(df.ScheduleError) as error:
        df.trace(step, params, x)
    message = str(error.value)
    assert message.startswith("_BadPick.pick") and shown in message
    assert "expected (stage, stream)" in message and "1 streams" in message


class _BadSchedule(df.Scheduler):
    def __init__(self, answer):
        self.answer = answer

    def schedule(self, graph):
        return self.answer(graph)


@pytest.mark.parametrize("answer, shown", [
    (lambda graph: None, "schedule() returned None"),
    (lambda graph: [(s.index, 0) for s in graph.stages], "returned (0, 0) at position 0"),
    (lambda graph: [T.Issue(s, 0) for s in graph.stages], "names no stage"),
    (lambda graph: [T.Issue(s.index, "main") for s in graph.stages], "on stream 'main'"),
    (lambda graph: [T.Issue(s.index, 0, after=0) for s in graph.stages], "after=0"),
])
def test_a_schedule_of_the_wrong_shape_is_a_schedule_error(answer, shown):
    fn, params, x = _mlp()
    step = T.overlap(T.partition(fn, rules=[T.Module(torch.nn.Linear)]), strategy=_BadSchedule(answer))
    with pytest.raises(df.ScheduleError, match=re.escape(shown)) as error:
        df.trace(step, params, x)
    assert "_BadSchedule" in str(error.value)


def test_a_scheduler_that_overrides_nothing_is_a_schedule_error():
    class Empty(df.Scheduler):
        pass

    fn, params, x = _mlp()
    with pytest.raises(df.ScheduleError, match="Empty must override pick"):
        df.trace(T.overlap(fn, strategy=Empty()), params, x)


@pytest.mark.parametrize("strategy", [3, ["tbo"], None])
def test_a_strategy_of_the_wrong_type_is_an_input_error(strategy):
    with pytest.raises(df.InputError, match="strategy takes a name"):
        T.overlap(lambda x: x, strategy=strategy)


# --- df.lower and df.verify ----------------------------------------------------------------------


def _program_and_plan():
    fn, params, x = _mlp()
    program = df.trace(fn, params, x)
    return fn, params, x, program, df.lower(program)


@pytest.mark.parametrize("argument, way_out", [
    ("program", "df.verify(df.lower(program))"),
    ("function", "df.verify(df.lower(df.trace(fn, *args)))"),
    ("jitted", "df.verify(fast.lower(*args))"),
    ("number", "df.lower(program)"),
])
def test_verify_of_something_other_than_a_plan_says_how_to_get_one(argument, way_out):
    fn, params, x, program, _ = _program_and_plan()
    value = {"program": program, "function": fn, "jitted": df.jit(fn), "number": 3}[argument]
    with pytest.raises(df.InputError, match=re.escape(way_out)) as error:
        df.verify(value)
    assert isinstance(error.value, TypeError) and "df.verify takes a Plan" in str(error.value)


@pytest.mark.parametrize("argument, way_out", [
    ("function", "df.lower(df.trace(fn, *args))"),
    ("jitted", "fast.lower(*args)"),
    ("module", "df.pure(model)"),
    ("plan", "lowered already"),
])
def test_lower_of_something_other_than_a_program_says_how_to_get_one(argument, way_out):
    fn, params, x, _, plan = _program_and_plan()
    value = {"function": fn, "jitted": df.jit(fn), "module": MLP(), "plan": plan}[argument]
    with pytest.raises(df.InputError, match=re.escape(way_out)) as error:
        df.lower(value)
    assert isinstance(error.value, TypeError) and "df.lower takes a Program" in str(error.value)


def _donation_program():
    def step(a, b):
        return a + 1, b.t() * 2, b.sum()

    return df.trace(step, torch.randn(4, 3), torch.randn(3, 3))


@pytest.mark.parametrize("donate, named", [
    ({3: 0}, "donate={3: 0} names output 3, but step returns 3 tensors"),
    ({0: 2}, "donate={0: 2} names input 2, but step takes 2 tensors"),
    ({-1: 0}, "donate={-1: 0} names output -1"),
    ({"0": 0}, "donate={'0': 0}: donate maps a flat output index (an int)"),
    ({0: True}, "donate={0: True}: donate maps"),
    ([(0, 0)], "donate maps output indices to input indices"),
    ({1: 1}, "donate={1: 1}: output 1 (out[1]) is f32[3, 3] strides (1, 3) on cpu but input 1 (b) is f32[3, 3] "
             "strides (3, 1)"),
    ({2: 0}, "donate={2: 0}: output 2 (out[2]) is f32[] strides () on cpu but input 0 (a) is f32[4, 3]"),
    ({0: 0, 1: 0}, "donate writes output 0 (out[0]) and output 1 (out[1]) both into input 0 (a)"),
])
def test_a_bad_donation_is_an_input_error_naming_the_pair(donate, named):
    with pytest.raises(df.InputError, match=re.escape(named)):
        df.lower(_donation_program(), donate=donate)


def test_a_good_donation_writes_the_output_into_the_input():
    from dynaflow_fn.runtime.eager import EagerExecutable

    program = _donation_program()
    plan = df.lower(program, donate={0: 0})
    a, b = torch.randn(4, 3), torch.randn(3, 3)
    expected = program(a, b)
    donated = a.clone()
    outputs = plan.unflatten_outputs(EagerExecutable(plan, plan.device)([donated, b]))
    torch.testing.assert_close(donated, expected[0])
    for out, reference in zip(outputs, expected):
        torch.testing.assert_close(out, reference)


# --- every error is a class of dynaflow_fn.errors --------------------------------------------------


@pytest.mark.parametrize("call, error, message", [
    (lambda: T.compose(T.microbatch(num=2), 3), df.InputError, "compose takes transforms"),
    (lambda: T.microbatch(3, num=2), df.InputError, "transforms take a function or a Program, got int"),
    (lambda: df.optim.sgd(lr=0.1, nesterov=True), df.InputError, r"nesterov=True\) needs momentum > 0"),
    (lambda: df.pure(lambda x: x), df.InputError, "df.pure takes an nn.Module"),
    (lambda: T.overlap(strategy="fastest"), df.InputError, "unknown strategy 'fastest'"),
])
def test_a_bad_option_is_an_input_error_naming_it(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_regions_that_do_not_nest_are_a_trace_error_saying_how_to_write_them():
    def interleaved(x):
        outer, inner = df.region("outer"), df.region("inner")
        outer.__enter__()
        inner.__enter__()
        y = x * 2
        try:
            outer.__exit__(None, None, None)          # before the inner block it opened later
        finally:
            with contextlib.suppress(df.TraceError):
                inner.__exit__(None, None, None)
        return y

    with pytest.raises(df.TraceError, match="must nest.*`with` statement"):
        df.trace(interleaved, torch.randn(3))


def test_a_pass_or_rule_that_leaves_out_an_abstract_method_cannot_be_made():
    class NoDescription(T.Pass):
        def apply(self, program):
            return program

    class NoMatch(T.Rule):
        pass

    with pytest.raises(TypeError, match="describe"):
        NoDescription()
    with pytest.raises(TypeError, match="match"):
        NoMatch()


def _graph_edit(name, edit):
    """A user's T.Pass named `name` that runs `edit(graph)` on a copy of the program's graph."""
    class GraphEdit(T.Pass):
        def describe(self):
            return name

        def apply(self, program):
            graph_module, _ = copy_graph_module(program.graph_module)
            edit(graph_module.graph)
            graph_module.recompile()
            return T.record(program, program.with_graph(graph_module), self)
    return GraphEdit()


def _first(graph, target):
    return next(node for node in graph.nodes if node.target is target)


def test_an_in_place_op_left_in_a_program_is_a_transform_error_naming_the_node():
    def write_in_place(graph):                     # wrong: relu_ writes an intermediate in place
        _first(graph, torch.ops.aten.relu.default).target = torch.ops.aten.relu_.default

    program = T.apply_transform(df.trace(lambda x: (x * 2).relu() + 1, torch.randn(3)),
                                _graph_edit("write_in_place", write_in_place))
    with pytest.raises(df.TransformError, match=r"relu = aten.relu_\(...\) writes mul in place.*functional op"):
        df.lower(program)


def test_a_pass_that_adds_a_node_without_its_fake_value_is_a_transform_error_naming_the_node():
    def scale_gelu(graph):                         # wrong: the new node has no meta['val']
        gelu = _first(graph, torch.ops.aten.gelu.default)
        with graph.inserting_after(gelu):
            scaled = graph.call_function(torch.ops.aten.mul.Tensor, (gelu, 2.0))
        gelu.replace_all_uses_with(scaled)
        scaled.args = (gelu, 2.0)

    program = df.trace(lambda x: torch.nn.functional.gelu(x) + 1, torch.randn(3))
    with pytest.raises(df.TransformError, match=r"scale_gelu left node mul.* without node.meta\['val'\]"):
        T.apply_transform(program, _graph_edit("scale_gelu", scale_gelu))


def test_writing_an_inference_tensor_outside_inference_mode_is_refused_naming_it():
    def bump(x):
        doubled = x * 2
        x.add_(1)
        return doubled

    with torch.inference_mode():
        x, other = torch.randn(3), torch.randn(3)
    before = x.clone()
    with pytest.raises(RuntimeError):
        bump(other)                                       # eager refuses as well
    fast = df.jit(bump)
    with pytest.raises(df.errors.InputError, match=r"writes x .*an inference tensor.*torch\.inference_mode\(\)"):
        fast(x)
    assert torch.equal(x, before)
    with torch.inference_mode():
        expected = x.clone()
        torch.testing.assert_close(fast(x), bump(expected))
        torch.testing.assert_close(x, expected)


@pytest.mark.parametrize("guard_built", ["outside inference mode", "inside inference mode"])
@pytest.mark.parametrize("python_guard", [False, True], ids=["native guard", "python guard"])
def test_an_inference_tensor_written_by_a_call_the_guard_admits_is_refused_too(guard_built, python_guard, monkeypatch):
    """Later calls skip the full cache lookup; the inference tensor is refused on that path too."""
    if python_guard:
        monkeypatch.setenv(df.jitting.guard.PYTHON_GUARD_ENV, "1")

    def bump(x):
        x.add_(1)
        return x * 2

    fast = df.jit(bump)
    normal = torch.randn(3)
    with torch.inference_mode(guard_built == "inside inference mode"):
        for _ in range(3):
            fast(normal)
    with torch.inference_mode():
        x = torch.randn(3)
    before = x.clone()
    with pytest.raises(df.errors.InputError, match=r"writes x .*an inference tensor"):
        fast(x)
    assert torch.equal(x, before)
