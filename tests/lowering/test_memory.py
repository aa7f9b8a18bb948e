"""lowering/memory.py: arena placement never gives two buffers whose uses are not ordered one
entirely before the other overlapping bytes, on plans of random programs under random schedules and
on random happens-before orders; and reuse keeps a chain's arena near its peak of live bytes."""

from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dynaflow_fn as df
from dynaflow_fn.lowering import memory
from dynaflow_fn.plan.ordering import Clocks
from dynaflow_fn.plan.plan import StorageKind
from fixtures import RandomScheduler, build, example_inputs, plan_of, recipes, scheduled, step_lists
from models import Block, llama_logits, tiny_llama


def _ordered(clocks, first, second):
    return all(clocks.before(a, b) for a in first for b in second)


def _assert_shared_bytes_are_ordered(plan):
    clocks = Clocks(plan.steps, len(plan.streams))
    accesses = defaultdict(set)
    for step in plan.steps:
        for slot in step.reads() + step.writes():
            accesses[plan.slots[slot].storage].add(step.index)
    arena = [s for s in plan.storages if s.kind is StorageKind.ARENA and accesses[s.index]]
    for i, p in enumerate(arena):
        assert p.offset % memory.ALIGNMENT == 0 and p.offset + p.nbytes <= plan.arena_nbytes
        for q in arena[:i]:
            if p.offset < q.offset + q.nbytes and q.offset < p.offset + p.nbytes:
                first, second = accesses[p.index], accesses[q.index]
                assert _ordered(clocks, first, second) or _ordered(clocks, second, first), (p, q)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=recipes(), seed=st.integers(0, 2**16), streams=st.integers(1, 3), micro_batches=st.booleans())
def test_buffers_sharing_bytes_are_never_in_use_together(recipe, seed, streams, micro_batches):
    inputs, fn = build(recipe)
    step = scheduled(fn, RandomScheduler(seed, streams), inputs, micro_batches)
    args = example_inputs(inputs)
    plan = plan_of(step, *args)
    _assert_shared_bytes_are_ordered(plan)
    for got, expected in zip(df.jit(step, backend="eager")(*args), fn(*args)):
        torch.testing.assert_close(got, expected, equal_nan=True)


@pytest.mark.parametrize("make", [lambda: (*df.pure(Block()), torch.randn(2, 8, 32)),
                                  lambda: (*llama_logits(tiny_llama()), torch.randint(0, 128, (2, 8)))],
                         ids=["block", "llama"])
def test_buffers_of_real_models_sharing_bytes_are_never_in_use_together(make):
    fn, params, x = make()
    _assert_shared_bytes_are_ordered(plan_of(fn, params, x))


@settings(max_examples=80, deadline=None)
@given(plan=step_lists(), data=st.data())
def test_pack_separates_buffers_whose_access_sets_are_unordered(plan, data):
    steps, num_streams = plan
    clocks = Clocks(steps, num_streams)
    indices = list(range(len(steps)))
    buffers = data.draw(st.lists(st.tuples(st.lists(st.sampled_from(indices), min_size=1, max_size=3, unique=True),
                                           st.integers(1, 3000)), min_size=1, max_size=8))
    release = np.array([clocks.release(uses) for uses, _ in buffers])
    acquire = np.array([clocks.acquire(uses) for uses, _ in buffers])
    layout = memory.pack([size for _, size in buffers], release, acquire)
    ends = [offset + memory.align(size) for offset, (_, size) in zip(layout.offsets, buffers)]
    assert layout.nbytes == max(ends)
    for i, ((uses_i, _), start_i, end_i) in enumerate(zip(buffers, layout.offsets, ends)):
        assert start_i % memory.ALIGNMENT == 0
        for (uses_j, _), start_j, end_j in list(zip(buffers, layout.offsets, ends))[:i]:
            if start_i < end_j and start_j < end_i:
                assert _ordered(clocks, uses_i, uses_j) or _ordered(clocks, uses_j, uses_i)


def test_a_chain_reuses_memory_so_the_arena_holds_two_buffers_not_all():
    def chain(x):
        for _ in range(10):
            x = torch.tanh(x)
        return x

    x = torch.randn(64, 64)
    plan = plan_of(chain, x)
    buffer = memory.align(x.numel() * x.element_size())
    arena = [s for s in plan.storages if s.kind is StorageKind.ARENA]
    assert len(arena) >= 8
    assert plan.arena_nbytes <= 2 * buffer
    _assert_shared_bytes_are_ordered(plan)
    torch.testing.assert_close(df.jit(chain, backend="eager")(x), chain(x))


def test_nothing_to_pack_is_an_empty_arena():
    assert memory.pack([], np.zeros((0, 1), np.int64), np.zeros((0, 1), np.int64)) == memory.ArenaLayout((), 0)
    assert memory.align(1) == memory.ALIGNMENT and memory.align(memory.ALIGNMENT) == memory.ALIGNMENT
