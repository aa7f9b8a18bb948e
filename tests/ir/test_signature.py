"""ir/signature.py and ir/formatting.py: a Program and the Plan lowered from it share one Signature,
print one header, and spell values alike; kinds are enums that plain strings still name."""

import pytest
import torch

import dynaflow_fn as df
from dynaflow_fn import transforms as T
from dynaflow_fn.errors import TransformError
from dynaflow_fn.ir.cost import Cost, CostKind
from dynaflow_fn.ir.formatting import format_arg, type_str
from dynaflow_fn.ir.scopes import Scope, ScopeKind
from dynaflow_fn.plan.plan import Layout, Ref, Slot, Step, StepKind, format_step
from dynaflow_fn.transforms.schedule import StageGraph
from models import MLP


def test_a_plan_holds_the_signature_of_its_program_and_rebuilds_its_outputs_alike():
    w = torch.randn(4, 4)

    def f(x, scale, *, y):
        return {"out": x @ w * scale, "pair": (y.relu(), 3)}

    x, y = torch.randn(2, 4), torch.randn(2, 4)
    program = df.trace(f, x, 2.0, y=y)
    plan = df.lower(program)
    assert plan.signature is program.signature
    assert (plan.name, plan.inputs, plan.outputs) == ("f", program.inputs, program.outputs)
    assert plan.device == program.device == torch.device("cpu")
    assert plan.closed_over == program.closed_over and plan.closed_over[0].tensor is w
    flat = [torch.randn(2, 4), torch.randn(2, 4)]
    assert plan.unflatten_outputs(flat) == program.unflatten_outputs(flat)
    assert plan.unflatten_outputs(flat)["pair"][1] == 3


def test_the_device_of_a_program_is_not_that_of_a_leading_zero_dim_cpu_tensor():
    program = df.trace(lambda scale, x: x * scale, torch.tensor(2.0), torch.empty(4, device="meta"))
    assert program.device == torch.device("meta")
    assert df.trace(lambda scale: scale * 2, torch.tensor(2.0)).device == torch.device("cpu")


def test_program_and_plan_print_the_same_header_lines():
    w = torch.randn(8, 8)

    def step(x, n):
        return (x @ w).relu() * n

    program = df.trace(T.overlap(T.microbatch(step, num=2, in_axes=(0, None)), "roundrobin"), torch.randn(4, 8), 3)
    plan = df.lower(program)
    program_lines, plan_lines = str(program).splitlines(), str(plan).splitlines()
    for prefix in ("# streams: ", "# static: ", "# closed over (resident, read every call): "):
        assert [line for line in program_lines if line.startswith(prefix)] == \
            [line for line in plan_lines if line.startswith(prefix)] != []


def test_a_one_stream_header_names_no_streams():
    fn, params = df.pure(MLP())
    program = df.trace(fn, params, torch.randn(2, 32))
    assert "# streams" not in str(program) and "# streams" not in str(df.lower(program))


def test_a_tuple_of_one_prints_as_python_writes_it_in_programs_and_plans():
    assert format_arg((1,)) == "(1,)" and format_arg([1]) == "[1]" and format_arg((1, 2)) == "(1, 2)"
    assert type_str((torch.zeros(2),)) == "(f32[2],)"
    slots = [Slot(0, "x", Layout.of(torch.zeros(2)), 0)]
    step = Step(0, StepKind.ALLOC, 0, torch.ops.aten.cat.default, ((Ref(0),),), {}, (0,))
    assert "aten.cat((x,))" in format_step(step, slots, str)


def test_kinds_are_enums_that_their_strings_still_name():
    assert T.Kind("compute").kind is CostKind.COMPUTE and T.Kind(CostKind.COMM) == T.Kind("comm")
    assert str(T.Kind("memory")) == "T.Kind('memory')" and T.Kind("comm").default_tags() == {"comm"}
    with pytest.raises(TransformError, match=r"T.Kind takes one of \('compute', 'memory', 'comm'\), got 'view'"):
        T.Kind("view")
    assert Cost(1.0, 1.0, 1.0, "memory").kind is CostKind.MEMORY
    assert Scope("module", "fc", 0) == Scope(ScopeKind.MODULE, "fc", 0)
    assert hash(Scope("region", "attn", 1)) == hash(Scope(ScopeKind.REGION, "attn", 1))
    fn, params = df.pure(MLP())
    program = T.partition(df.trace(fn, params, torch.randn(2, 32)), rules=[T.Kind("memory")])
    stages = StageGraph.from_program(program).stages
    assert all(isinstance(stage.kind, CostKind) for stage in stages)
    assert any(" memory [memory]" in str(stage) for stage in stages)     # the value, not CostKind.MEMORY
    assert "CostKind" not in str(program)
