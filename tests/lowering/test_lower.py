import pytest
import torch

import dynaflow_fn as df
from dynaflow_fn import transforms as T
from dynaflow_fn.plan.plan import StepKind, StorageKind
from fixtures import plan_of
from models import MLP


def test_mlp_plan_allocates_and_copies_nothing():
    fn, params = df.pure(MLP(sizes=(32, 64, 64, 64, 16)))
    plan = plan_of(fn, params, torch.randn(8, 32))
    assert not plan.allocating_steps() and not plan.copy_steps()
    kernels = [s for s in plan.steps if s.kind is StepKind.KERNEL]
    assert kernels and all(s.op._overloadname.endswith("out") for s in kernels)


def test_arena_reuses_memory_of_dead_buffers():
    fn, params = df.pure(MLP(sizes=(32,) + (64,) * 8 + (16,)))
    plan = plan_of(fn, params, torch.randn(8, 32))
    arena = [s for s in plan.storages if s.kind is StorageKind.ARENA]
    assert plan.arena_nbytes < sum(s.nbytes for s in arena) / 3


def test_op_without_out_overload_still_runs_and_is_reported():
    @torch.library.custom_op("dynaflow_test::shifted", mutates_args=())
    def shifted(x: torch.Tensor) -> torch.Tensor:
        return x + 3

    @shifted.register_fake
    def _(x):
        return torch.empty_like(x)

    def f(x):
        return shifted(x * 2) * 5

    plan = plan_of(f, torch.randn(4))
    allocating = plan.allocating_steps()
    assert [s.op for s in allocating] == [torch.ops.dynaflow_test.shifted.default]
    assert allocating[0].note == "no out= overload"
    assert "allocates: 1 steps (dynaflow_test.shifted)" in str(plan)
    x = torch.randn(4)
    torch.testing.assert_close(df.jit(f)(x), (x * 2 + 3) * 5)


def test_concatenated_kernel_results_are_written_in_place():
    def halves(w, a, b):
        return torch.cat([a @ w, b @ w])

    w, a, b = torch.randn(16, 8), torch.randn(4, 16), torch.randn(3, 16)
    plan = plan_of(halves, w, a, b)
    assert not any(s.node.startswith("cat") for s in plan.steps)
    assert not plan.copy_steps() and not plan.allocating_steps()
    output = plan.storages[plan.slots[plan.output_slots[0]].storage]
    assert output.kind is StorageKind.OUTPUT
    written = {plan.slots[s.outputs[0]].storage for s in plan.steps if s.kind is StepKind.KERNEL}
    assert written == {output.index}
    torch.testing.assert_close(df.jit(halves)(w, a, b), torch.cat([a @ w, b @ w]), rtol=0, atol=0)


def test_work_that_depends_on_no_input_runs_once_at_setup():
    def f(x):
        return x + torch.arange(x.shape[0], dtype=x.dtype).sin()

    plan = plan_of(f, torch.randn(6))
    assert {s.node for s in plan.setup} >= {"arange", "sin"}
    assert [s.node for s in plan.steps] == ["add"]


def test_random_ops_are_not_hoisted():
    def f(x):
        return x + torch.rand(x.shape)

    plan = plan_of(f, torch.randn(6))
    assert not plan.setup


def test_input_mutation_is_written_back():
    def bump(x, y):
        x[1:].mul_(2)                     # traced as x' = slice_scatter(x, ...), then copy_(x, x')
        return x + y

    plan = plan_of(bump, torch.randn(3), torch.randn(3))
    copies = plan.copy_steps()
    assert len(copies) == 1 and copies[0].note == "input mutation write-back"
    assert plan.storages[plan.slots[copies[0].outputs[0]].storage].kind is StorageKind.INPUT
    x, y = torch.randn(3), torch.randn(3)
    expected_x = torch.cat([x[:1], x[1:] * 2])
    expected = expected_x + y
    torch.testing.assert_close(df.jit(bump)(x, y), expected)
    torch.testing.assert_close(x, expected_x)


def test_output_that_aliases_an_input_is_copied_out():
    def reshape(x):
        return x.view(2, 3), x * 1

    plan = plan_of(reshape, torch.randn(6))
    assert [s.note for s in plan.copy_steps()] == ["output aliases an input or constant"]
    x = torch.randn(6)
    view, _ = df.jit(reshape)(x)
    torch.testing.assert_close(view, x.view(2, 3))
    assert view.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_plan_prints_steps_buffers_and_totals():
    fn, params = df.pure(MLP())
    text = str(plan_of(fn, params, torch.randn(8, 32)))
    assert "# Plan MLP on cpu  passes: trace -> lower" in text
    assert "aten.addmm.out(layers_0_bias, x, t)  -> arena@0" in text
    # A hidden activation is 8 x 64 float32 = 2 KiB; a linear's output and its GELU are live together.
    assert "arena: 4.0 KiB" in text and "arena buffers:" in text
    assert "allocates: 0 steps" in text and "copies: 0 steps" in text


def test_parts_of_a_concatenation_are_not_overwritten_in_place():
    import dataclasses

    from dynaflow_fn import transforms as T

    @dataclasses.dataclass(frozen=True)
    class EachNode(T.Rule):
        def match(self, node, node_info):
            return node.name

    class LatestFirst(df.Scheduler):
        """Issue the most recently traced ready stage: concatenations run before other readers."""

        def pick(self, ready, graph, issued):
            return ready[-1], 0

    def f(w, x):
        y = x @ w
        return y, y.relu()

    step = T.overlap(T.partition(T.microbatch(f, num=2, in_axes=(None, 0)), rules=[EachNode()]),
                     strategy=LatestFirst())
    w, x = torch.randn(8, 8), torch.randn(8, 8)
    order = [s.node for s in df.jit(step).lower(w, x).steps]
    assert order.index("relu") > order.index("mm")
    for got, expected in zip(df.jit(step)(w, x), f(w, x)):
        torch.testing.assert_close(got, expected)


def test_a_step_marked_to_leave_sms_runs_under_the_carveout_and_restores_it(monkeypatch):
    from dynaflow_fn.plan.plan import Step
    from dynaflow_fn.runtime.interpreter import compile_step

    carveout = {"value": None}
    blas = {"value": "cublas"}
    monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "13.0")    # a CUDA build's carveout
    monkeypatch.setattr(torch._C, "_get_sm_carveout_experimental", lambda: carveout["value"], raising=False)
    monkeypatch.setattr(torch._C, "_set_sm_carveout_experimental", lambda v: carveout.update(value=v), raising=False)
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library",
                        lambda backend=None: blas["value"] if backend is None else blas.update(value=backend))
    seen = []

    def kernel(x, out):
        seen.append((carveout["value"], blas["value"]))
        if carveout["value"] is not None:
            raise RuntimeError("failed kernel")

    step = Step(0, StepKind.KERNEL, 1, kernel, (None,), {}, (0,), ("out",), sm_carveout=8)
    env = [torch.zeros(1)]
    compile_step(step, carveout=False)(env)                       # CPU: the settings are not touched
    with pytest.raises(RuntimeError, match="failed kernel"):
        compile_step(step, carveout=True)(env)
    assert seen == [(None, "cublas"), (8, "cublaslt")]            # only cuBLASLt honours the carveout
    assert carveout["value"] is None and blas["value"] == "cublas"  # restored even when the kernel fails


def test_plan_provenance_lists_the_lowering_sub_passes_that_changed_something_in_order(monkeypatch):
    import dataclasses
    import importlib

    lowering = importlib.import_module("dynaflow_fn.lowering.lower")
    ran = []
    monkeypatch.setattr(lowering, "SUB_PASSES", tuple(
        dataclasses.replace(s, run=lambda draft, s=s: (ran.append(s.name), s(draft))[1]) for s in lowering.SUB_PASSES))
    fn, params = df.pure(MLP())
    program = df.trace(fn, params, torch.randn(4, 32))
    plan = df.lower(program)
    assert ran == ["bind", "issue order", "reinplace", "emit steps", "outputs", "elide copies", "synchronize",
                   "sm budget", "place buffers"]
    changed = ["bind", "emit steps", "outputs", "place buffers"]     # one stream, no schedule, nothing to reinplace
    assert plan.provenance == (*program.provenance, "lower: " + " -> ".join(changed))
    assert str(plan).splitlines()[0].endswith("passes: trace -> lower: bind -> emit steps -> outputs -> place buffers")


def test_a_plan_header_names_the_optional_sub_passes_only_where_they_did_something():
    def step(w, x):
        return (x @ w).relu().exp()

    w, x = torch.randn(8, 8), torch.randn(8, 8)
    single = plan_of(step, w, x).provenance[-1]
    scheduled = plan_of(T.overlap(T.microbatch(step, num=2, in_axes=(None, 0)), "roundrobin"), w, x)
    assert "reinplace" in single and "synchronize" not in single and "issue order" not in single
    assert "issue order" in scheduled.provenance[-1] and "synchronize" in scheduled.provenance[-1]
    assert "sm budget" not in single + scheduled.provenance[-1]       # no collective to leave SMs to
    torch.testing.assert_close(df.jit(step)(w, x), step(w, x))


@pytest.mark.parametrize("annotate, match", [
    (lambda i, n, count: n.replace(order=count - i), "before its input"),
    (lambda i, n, count: n.replace(order=i, stream=1), "streams the program does not declare"),
    (lambda i, n, count: n.replace(order=i if i else None), "no issue position"),
])
def test_lowering_rejects_a_program_whose_node_schedule_is_no_issue_order(annotate, match):
    fn, params = df.pure(MLP(sizes=(32, 16, 16)))
    program = df.trace(fn, params, torch.randn(4, 32))
    names = [n.name for n in program.ops()]
    scheduled = program.annotate(lambda node, node_info: annotate(names.index(node.name), node_info, len(names))
                                 if node.name in names else node_info)
    with pytest.raises(df.ScheduleError, match=match):
        df.lower(scheduled)
