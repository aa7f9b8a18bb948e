"""SharedPool: the memory the plans of one function's buckets share (they never run at once), and the
bound that sharing keeps: the graphs and buffers of 35 buckets up to 256 hold at most 1.5x what the
largest bucket's plan holds alone."""

import gc
import random

import pytest
import torch

import dynaflow_fn as df
from dynaflow_fn import compat
from dynaflow_fn.jitting.buckets import SERVING_BUCKETS
from dynaflow_fn.runtime.cudagraph import CudaGraphExecutable
from dynaflow_fn.runtime.interpreter import BoundPlan
from dynaflow_fn.runtime.shared_pool import SharedPool
from models import MLP

CPU = torch.device("cpu")


def test_a_buffer_is_allocated_by_its_first_request_and_viewed_by_smaller_ones():
    pool = SharedPool(CPU)
    first = pool.buffer("arena", 1000)
    smaller = pool.buffer("arena", 200)
    larger = pool.buffer("arena", 4000)
    assert smaller.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and smaller.numel() == 200
    assert larger.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() and larger.numel() == 4000
    assert pool.buffer("outputs", 10).untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    assert (pool.shared_bytes, pool.own_bytes) == (1000 + 16, 4000)


def test_a_buffer_sized_like_another_is_as_large_as_it_whichever_plan_asks_first():
    """The outputs of a later capture are first asked for by whichever bucket first finds the first
    capture's outputs held: a small one, often. The buffer still fits the largest."""
    pool = SharedPool(CPU)
    pool.buffer("outputs", 4096)
    small_first = pool.buffer("outputs of capture 1", 256, sized_like="outputs")
    largest = pool.buffer("outputs of capture 1", 4096, sized_like="outputs")
    assert small_first.numel() == 256 and largest.numel() == 4096
    assert largest.untyped_storage().data_ptr() == small_first.untyped_storage().data_ptr()
    assert pool.own_bytes == 0


def test_static_inputs_of_smaller_batches_are_views_of_the_first_where_the_layout_fits():
    pool = SharedPool(CPU)
    largest = pool.static_input(0, torch.empty(8, 4))
    rows = pool.static_input(0, torch.empty(3, 4))
    assert rows.untyped_storage().data_ptr() == largest.untyped_storage().data_ptr() and rows.shape == (3, 4)
    assert rows.stride() == (4, 1)
    column_major = pool.static_input(0, torch.empty(4, 3).t())         # (3, 4) with strides (1, 3)
    assert column_major.untyped_storage().data_ptr() != largest.untyped_storage().data_ptr()
    assert column_major.stride() == (1, 3)
    wider = pool.static_input(0, torch.empty(8, 5))
    other_input = pool.static_input(1, torch.empty(3, 4))
    other_dtype = pool.static_input(0, torch.empty(3, 4, dtype=torch.float16))
    shared = largest.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() != shared for t in (wider, other_input, other_dtype))


def test_an_executable_in_shared_memory_binds_every_output_in_the_shared_output_buffer():
    """Binding only (capture needs CUDA): the outputs kernels write and the one an op allocates (a sum
    without a fitting out= kernel, copied there at the end of the graph) each get bytes of their own in
    the pool's output buffer, aligned."""
    w, x = torch.randn(4, 4), torch.randn(3, 4)
    plan = df.jit(lambda w, x: (x @ w, w.sum(), x > 0), backend="eager").lower(w, x)
    pool = SharedPool(CPU)
    executable = object.__new__(CudaGraphExecutable)
    executable.plan, executable.memory = plan, pool
    executable.bound = BoundPlan(plan, CPU)
    env = executable.bound.new_env([w, x])
    copied = executable._bind_outputs(env, "outputs", previous=None)
    assert [slot for slot, _ in copied] == [plan.output_slots[1]]
    outputs = [dict(copied).get(slot, env[slot]) for slot in plan.output_slots]
    assert [(t.shape, t.dtype) for t in outputs] == [((3, 4), torch.float32), ((), torch.float32), ((3, 4), torch.bool)]
    shared = pool.buffer("outputs", 1)
    starts = sorted(t.data_ptr() - shared.data_ptr() for t in outputs)
    assert all(t.untyped_storage().data_ptr() == shared.untyped_storage().data_ptr() for t in outputs)
    assert starts == [0, 256, 512] and pool.shared_bytes >= 768


# --- on a GPU ---------------------------------------------------------------------------------------


def _net():
    torch.manual_seed(0)
    fn, params = df.pure(MLP((512, 2048, 2048, 512)).cuda().eval())

    def net(params, x):
        y = fn(params, x)
        return y, y.sum(-1)           # the sum allocates its result (no out= kernel is known to fit)
    return net, params


def _settled() -> tuple[int, int]:
    """Memory allocated and reserved once nothing is pending: cuBLAS's workspaces of eager GEMMs (the
    reference computations) released, the caching allocator's free blocks returned."""
    torch.cuda.synchronize()
    gc.collect()
    compat.clear_cublas_workspaces()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def _memory_held_by(build):
    """What `build()` leaves allocated and reserved on the device, and what it returns."""
    allocated, reserved = _settled()
    kept = build()
    allocated_after, reserved_after = _settled()
    return kept, allocated_after - allocated, reserved_after - reserved


@pytest.mark.cuda
def test_35_buckets_up_to_256_hold_at_most_one_and_a_half_times_the_largest_alone():
    net, params = _net()

    def every_bucket():
        fast = df.jit(net, buckets="serving", in_axes=(None, 0), out_axes=0, backend="cudagraph")
        for rows in SERVING_BUCKETS:
            x = torch.randn(rows, 512, device="cuda")
            y, total = fast(params, x)
            expected, expected_total = net(params, x)
            torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(total, expected_total, rtol=1e-4, atol=1e-3)
        return fast

    def largest_alone():
        fast = df.jit(net, backend="cudagraph")
        fast(params, torch.randn(256, 512, device="cuda"))
        return fast

    buckets, bucket_allocated, bucket_reserved = _memory_held_by(every_bucket)
    alone, alone_allocated, alone_reserved = _memory_held_by(largest_alone)
    # Each call holds the last call's results: every second call finds the first output buffer held.
    assert buckets.cache_info().captures == 35 + 35 // 2 and alone.cache_info().captures == 1
    assert bucket_allocated <= 1.5 * alone_allocated, (bucket_allocated, alone_allocated)
    assert bucket_reserved <= 1.5 * alone_reserved, (bucket_reserved, alone_reserved)
    assert buckets.cache_info().graph_memory_bytes <= 1.5 * alone.cache_info().graph_memory_bytes
    print(f"35 buckets: {bucket_allocated / 2**20:.1f} MiB allocated, {bucket_reserved / 2**20:.1f} MiB reserved; "
          f"the largest alone: {alone_allocated / 2**20:.1f} / {alone_reserved / 2**20:.1f} MiB; {buckets.cache_info()}")


@pytest.mark.cuda
def test_a_random_walk_over_batch_sizes_captures_each_bucket_it_reaches_once():
    net, params = _net()
    buckets = (1, 2, 4, 8, 16, 32, 64)
    fast = df.jit(net, buckets=buckets, in_axes=(None, 0), backend="cudagraph")
    walk, rows = random.Random(0), 20
    reached = {64}                                         # the largest is built first
    for _ in range(60):
        rows = min(64, max(1, rows + walk.randint(-5, 5)))
        reached.add(next(b for b in buckets if b >= rows))
        x = torch.randn(rows, 512, device="cuda")
        y, total = fast(params, x)
        torch.testing.assert_close(y, net(params, x)[0], rtol=1e-4, atol=1e-4)
    info = fast.cache_info()
    assert info.entries == len(reached) and info.captures <= 2 * info.entries   # y is held over each next call
    static = [r.executable.static_inputs[-1] for rs in fast._cache.values() for r in rs]
    assert len({t.untyped_storage().data_ptr() for t in static}) == 1   # x's static buffer: one, the largest's
    arenas = {r.executable.bound.arena.untyped_storage().data_ptr() for rs in fast._cache.values() for r in rs}
    assert len(arenas) == 1
