"""plan/plan.py: a Plan is consistent data: every step reads and writes declared slots, every slot
lies inside its storage, byte ranges are exactly the bytes a view touches, and printing shows it all."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dynaflow_fn as df
from dynaflow_fn.plan.plan import Layout, Ref, StepKind, StorageKind, step_reads, step_writes
from fixtures import RandomScheduler, build, example_inputs, plan_of, recipes, scheduled
from models import MLP


def _refs(value):
    if isinstance(value, Ref):
        return [value.slot]
    if isinstance(value, (list, tuple)):
        return [slot for item in value for slot in _refs(item)]
    if isinstance(value, dict):
        return [slot for item in value.values() for slot in _refs(item)]
    return []


def _assert_consistent(plan):
    assert [slot.index for slot in plan.slots] == list(range(len(plan.slots)))
    assert [step.index for step in plan.steps] == list(range(len(plan.steps)))
    for step in plan.steps:
        referenced = _refs(step.args) + _refs(step.kwargs)
        assert all(0 <= slot < len(plan.slots) for slot in referenced + list(step.outputs))
        expected_reads = referenced[1:] if step.kind is StepKind.COPY else referenced
        assert set(step.reads()) == set(expected_reads) and len(set(step.reads())) == len(step.reads())
        assert step.reads() is step.reads()           # computed once: every binding (capture) asks again
        if step.kind in (StepKind.KERNEL, StepKind.ALLOC, StepKind.COPY):
            assert step.writes() == step.outputs and step.outputs
        else:
            assert step.writes() == ()
        if step.kind is StepKind.KERNEL and not step.out_names:
            assert step.op._schema.is_mutable and set(step.outputs) <= set(referenced)   # runs in place
        elif step.kind is StepKind.KERNEL:
            assert len(step.out_names) == len(step.outputs)
        assert 0 <= step.stream < len(plan.streams)
        assert all(0 <= event < plan.num_events for event in step.waits + step.records)
    for slot in plan.slots:
        storage = plan.storages[slot.storage]
        start, end = slot.byte_range()
        if storage.kind in (StorageKind.ARENA, StorageKind.OUTPUT):
            assert 0 <= start <= end <= storage.nbytes, slot
    for storage in plan.storages:
        if storage.kind is StorageKind.ARENA:
            assert storage.offset % 256 == 0 and storage.offset + storage.nbytes <= plan.arena_nbytes
    inputs = [plan.storages[plan.slots[slot].storage] for slot in plan.input_slots]
    assert all(s.kind is StorageKind.INPUT for s in inputs)
    assert [s.input_index for s in inputs] == list(range(len(inputs)))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=recipes(), seed=st.integers(0, 2**16), streams=st.integers(1, 3))
def test_steps_read_and_write_declared_slots_that_lie_inside_their_storages(recipe, seed, streams):
    inputs, fn = build(recipe)
    plan = plan_of(scheduled(fn, RandomScheduler(seed, streams), inputs), *example_inputs(inputs))
    _assert_consistent(plan)


def test_a_model_plan_is_consistent_and_prints_every_step():
    fn, params = df.pure(MLP())
    plan = plan_of(fn, params, torch.randn(4, 32))
    _assert_consistent(plan)
    text = str(plan)
    assert f"# {len(plan.steps)} steps, {len(plan.kernel_steps())} launch kernels" in text
    body = text.split("steps:\n")[1].split("arena buffers:")[0].splitlines()
    assert len(body) == len(plan.steps)
    for line, step in zip(body, plan.steps):
        assert line.strip().startswith(f"s{step.stream}")
        assert all(plan.slots[slot].name in line for slot in step.outputs)
    assert repr(plan).startswith(f"<Plan MLP: 1 streams, {len(plan.steps)} steps")


def test_step_kinds_summaries_and_written_inputs():
    def fn(x, y):
        x[1:].add_(1)                                 # a write-back copy (x.add_(1) would run inplace)
        return torch.nn.functional.mse_loss(y, y * 2), x * 2

    plan = plan_of(fn, torch.randn(3), torch.randn(4))
    _assert_consistent(plan)
    assert plan.written_inputs() == [0]
    assert plan.copy_steps() and all(s.kind is StepKind.COPY for s in plan.copy_steps())
    assert plan.allocating_steps() and all(s.kind is StepKind.ALLOC for s in plan.allocating_steps())
    kernels = plan.kernel_steps()
    assert set(map(id, plan.copy_steps() + plan.allocating_steps())) <= set(map(id, kernels))
    assert "[allocates]" in str(plan) and "[copy]" in str(plan)


def test_copy_reads_only_its_source():
    dst, src = Ref(3), Ref(5)
    assert step_reads(StepKind.COPY, (dst, src), {}) == (5,)
    assert step_reads(StepKind.KERNEL, (dst, [src, dst], None), {"w": Ref(7)}) == (3, 5, 7)
    assert step_writes(StepKind.VIEW, (1,)) == () and step_writes(StepKind.FORK, ()) == ()
    assert step_writes(StepKind.ALLOC, (1, 2)) == (1, 2)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), dims=st.integers(0, 3), dtype=st.sampled_from([torch.float32, torch.float16, torch.int64]))
def test_layout_byte_range_is_the_span_of_bytes_the_view_touches(data, dims, dtype):
    shape = tuple(data.draw(st.integers(0, 4)) for _ in range(dims))
    stride = tuple(data.draw(st.integers(0, 6)) for _ in range(dims))
    offset = data.draw(st.integers(0, 5))
    base = torch.zeros(512, dtype=torch.uint8)
    view = base.view(dtype).as_strided(shape, stride, offset)
    layout = Layout.of(view)
    start, end = layout.byte_range()
    if view.numel() == 0:
        assert start == end
        return
    positions = torch.full(shape, offset, dtype=torch.int64)
    for dim, (size, step) in enumerate(zip(shape, stride)):
        positions = positions + torch.arange(size).reshape([-1 if d == dim else 1 for d in range(dims)]) * step
    touched = torch.zeros(512, dtype=torch.bool)
    for position in positions.reshape(-1).tolist():
        touched[position * dtype.itemsize:(position + 1) * dtype.itemsize] = True
    nonzero = touched.nonzero().flatten()
    assert (start, end) == (int(nonzero.min()), int(nonzero.max()) + 1)
