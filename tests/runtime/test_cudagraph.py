"""CUDA-graph capture and replay. Skipped where there is no CUDA device."""

import gc
import weakref
import warnings

import pytest
import torch

import dynaflow_fn as df
from dynaflow_fn import transforms as T
from dynaflow_fn.compat import clear_cublas_workspaces
from dynaflow_fn.passes.inductor import CompiledRun
from fixtures import training_step
from models import MLP, Block, TwoBranch, llama_logits, tiny_llama

pytestmark = pytest.mark.cuda


def _settled_memory() -> int:
    """Device memory in use once garbage is collected: cycles left by earlier tests, freed whenever the
    collector runs, would otherwise change the count between two readings."""
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _to_cuda(params):
    return {k: v.cuda() for k, v in params.items()}


@pytest.mark.parametrize("model_name", ["mlp", "block", "llama"])
def test_graph_replay_equals_eager_and_the_interpreter(model_name):
    if model_name == "llama":
        model = tiny_llama().cuda()
        fn, params = llama_logits(model)
        make = lambda: torch.randint(0, 128, (2, 12), device="cuda")
    else:
        model, shape = (MLP(), (8, 32)) if model_name == "mlp" else (Block(), (2, 8, 32))
        model = model.cuda()
        fn, params = df.pure(model)
        make = lambda: torch.randn(shape, device="cuda")
    graphed, interpreted = df.jit(fn, backend="cudagraph"), df.jit(fn, backend="eager")
    for _ in range(3):
        x = make()
        y = graphed(params, x)
        torch.testing.assert_close(y, fn(params, x))
        torch.testing.assert_close(y, interpreted(params, x), rtol=0, atol=0)
    assert graphed.cache_info().captures == 2          # y is held over the next call: two captures alternate


@pytest.mark.parametrize("strategy", [None, "tbo"], ids=["one-stream", "microbatch2-tbo"])
def test_replay_allocates_nothing(strategy):
    fn, params = df.pure(Block().cuda())
    if strategy is not None:
        fn = T.overlap(T.partition(T.microbatch(fn, num=2, in_axes=(None, 0)), rules=[T.Region("attn")]), strategy)
    fast = df.jit(fn, static_outputs=True)
    x = torch.randn(4, 16, 32, device="cuda")
    fast(params, x)
    before = _settled_memory()
    for _ in range(10):
        fast(params, torch.randn(4, 16, 32, device="cuda"))
    assert _settled_memory() == before


def test_static_outputs_are_overwritten_and_fresh_outputs_are_not():
    fresh, static = df.jit(lambda x: x * 2), df.jit(lambda x: x * 2, static_outputs=True)
    a, b = torch.ones(4, device="cuda"), torch.zeros(4, device="cuda")
    first_fresh, first_static = fresh(a), static(a)
    fresh(b), static(b)
    assert first_fresh.tolist() == [2.0] * 4
    assert first_static.tolist() == [0.0] * 4


def test_parameters_are_read_in_place_and_not_copied():
    model = MLP().cuda()
    fn, params = df.pure(model)
    fast = df.jit(fn)
    x = torch.randn(8, 32, device="cuda")
    fast(params, x)
    with torch.no_grad():
        params["layers.2.bias"].add_(1.0)
    torch.testing.assert_close(fast(params, x), fn(params, x))
    assert fast.cache_info().captures == 1


def test_a_resident_input_is_not_kept_alive_by_the_graph_that_reads_it():
    fast = df.jit(lambda cache, x: cache * 2 + x, persistent_argnums=(0,), progress=False)
    x = torch.randn(4, 8, device="cuda")
    cache = torch.randn(4, 8, device="cuda")
    torch.testing.assert_close(fast(cache, x), cache * 2 + x)
    freed = weakref.ref(cache)
    del cache
    gc.collect()
    assert freed() is None


def test_new_parameter_tensors_capture_again():
    model = MLP().cuda()
    fn, params = df.pure(model)
    fast = df.jit(fn)
    x = torch.randn(8, 32, device="cuda")
    fast(params, x)
    other = {k: torch.nn.Parameter(torch.randn_like(v)) for k, v in params.items()}
    torch.testing.assert_close(fast(other, x), fn(other, x), rtol=1e-4, atol=1e-4)     # Inductor's rounding
    assert fast.cache_info().captures == 2


def test_donated_state_is_updated_in_place_on_cuda():
    def step(state, x):
        return {"m": state["m"] * 0.9 + x}, state["m"].sum()

    state = {"m": torch.randn(16, device="cuda")}
    reference = state["m"].clone()
    fast = df.jit(step, donate_argnums=(0,))
    for _ in range(3):
        x = torch.randn(16, device="cuda")
        new_state, total = fast(state, x)
        torch.testing.assert_close(total, reference.sum())
        reference = reference * 0.9 + x
        assert new_state["m"] is state["m"]
        torch.testing.assert_close(state["m"], reference)


def test_mutated_input_is_written_back_to_the_callers_tensor():
    def bump(x):
        x.add_(1)
        return x * 2

    fast = df.jit(bump)
    for _ in range(2):
        x = torch.randn(5, device="cuda")
        expected = x + 1
        torch.testing.assert_close(fast(x), expected * 2)
        torch.testing.assert_close(x, expected)


def test_persistent_arguments_are_read_in_place():
    def scale(state, x):
        return x * state["factor"]

    state = {"factor": torch.full((4,), 2.0, device="cuda")}
    fast = df.jit(scale, persistent_argnums=(0,))
    x = torch.ones(4, device="cuda")
    assert fast(state, x).tolist() == [2.0] * 4
    state["factor"].fill_(3.0)
    assert fast(state, x).tolist() == [3.0] * 4
    assert fast.cache_info().captures == 1


def test_a_persistent_tensor_given_a_new_layout_or_new_memory_is_noticed():
    def scale(state, x):
        return x * state["factor"]

    factor = torch.arange(4.0, device="cuda")
    state = {"factor": factor}
    fast = df.jit(scale, persistent_argnums=(0,))
    x = torch.randn(4, 4, device="cuda")
    fast(state, x)
    torch.testing.assert_close(fast(state, x), x * factor)
    factor.unsqueeze_(1)                        # same tensor and memory, new layout
    torch.testing.assert_close(fast(state, x), x * factor)
    factor.data = torch.randn(4, 1, device="cuda", dtype=torch.float64)   # new memory and dtype, same version
    torch.testing.assert_close(fast(state, x), x * factor)
    assert fast.cache_info().misses == 3 and fast.cache_info().hits == 1


def _microbatched(fn, rules, strategy):
    """Aten kernels: the comparison is of schedules, and every plan runs the kernels eager PyTorch does."""
    return df.jit(T.overlap(T.partition(T.microbatch(fn, num=2, in_axes=(None, 0)), rules=rules), strategy=strategy),
                  backend="cudagraph")


@pytest.mark.parametrize("strategy", ["roundrobin", "tbo"])
@pytest.mark.parametrize("model_name", ["block", "llama"])
def test_multi_stream_graph_equals_the_sequential_plan_bit_for_bit(strategy, model_name):
    if model_name == "llama":
        from transformers.models.llama.modeling_llama import LlamaAttention

        fn, params = llama_logits(tiny_llama().cuda())
        rules, make = [T.Module(LlamaAttention)], lambda: torch.randint(0, 128, (4, 12), device="cuda")
    else:
        fn, params = df.pure(Block().cuda())
        rules, make = [T.Region("attn")], lambda: torch.randn(4, 16, 32, device="cuda")
    sequential, overlapped = _microbatched(fn, rules, "sequential"), _microbatched(fn, rules, strategy)
    for _ in range(3):
        x = make()
        expected = sequential(params, x)
        torch.testing.assert_close(overlapped(params, x), expected, rtol=0, atol=0)
        torch.testing.assert_close(expected, fn(params, x))
    plan = df.verify(overlapped.lower(params, x))
    assert len({s.stream for s in plan.steps}) == 2 and plan.num_events >= 2
    assert overlapped.cache_info().captures == 1


def test_branches_graph_equals_sequential_bit_for_bit():
    model = TwoBranch().cuda()
    fn, params = df.pure(model)
    rules = [T.Module("^left$"), T.Module("^right$")]
    sequential = df.jit(T.overlap(T.partition(fn, rules=rules), strategy="sequential"), backend="cudagraph")
    branches = df.jit(T.overlap(T.partition(fn, rules=rules), strategy="branches"), backend="cudagraph")
    interpreted = df.jit(T.overlap(T.partition(fn, rules=rules), strategy="branches"), backend="eager")
    for _ in range(3):
        x, y = torch.randn(64, 32, device="cuda"), torch.randn(64, 32, device="cuda")
        expected = sequential(params, x, y)
        torch.testing.assert_close(branches(params, x, y), expected, rtol=0, atol=0)
        torch.testing.assert_close(interpreted(params, x, y), expected, rtol=0, atol=0)
    assert len(df.verify(branches.lower(params, x, y)).streams) == 2


def test_moving_an_input_to_another_device_traces_again():
    fast = df.jit(lambda x: x * 2)
    cpu, gpu = torch.randn(3), torch.randn(3, device="cuda")
    torch.testing.assert_close(fast(cpu), cpu * 2)
    torch.testing.assert_close(fast(gpu), gpu * 2)
    assert fast.cache_info().misses == 2 and fast.cache_info().captures == 1


@pytest.mark.parametrize("backend", ["cudagraph", "auto"])
def test_train_step_graph_updates_parameters_in_place(backend):
    model = MLP().cuda()
    fn, params = df.pure(model)
    params = {k: v.detach().clone() for k, v in params.items()}
    reference_params = {k: v.clone() for k, v in params.items()}
    optimizer = df.optim.adamw(lr=1e-2)
    state, reference_state = optimizer.init(params), optimizer.init(reference_params)
    train_step = training_step(lambda p, x, y: torch.nn.functional.mse_loss(fn(p, x), y), optimizer)
    step = df.jit(train_step, donate_argnums=(0, 1), backend=backend, progress=False)
    addresses = {k: v.data_ptr() for k, v in params.items()}
    for i in range(4):
        x, y = torch.randn(16, 32, device="cuda"), torch.randn(16, 16, device="cuda")
        _, _, loss = step(params, state, x, y)
        reference_params, reference_state, reference_loss = train_step(reference_params, reference_state, x, y)
        torch.testing.assert_close(loss, reference_loss, rtol=1e-4, atol=1e-5)
        if i == 1:
            memory = _settled_memory()
    for k in params:
        torch.testing.assert_close(params[k], reference_params[k], rtol=1e-4, atol=1e-5)
        assert params[k].data_ptr() == addresses[k]
    assert _settled_memory() == memory
    assert step.cache_info().captures == 2             # the loss is held over the next call
    assert not step.lower(params, state, x, y).copy_steps()


@pytest.mark.parametrize("strategy", [None, "roundrobin", "tbo"])
def test_inductor_stages_in_one_multi_stream_graph_equal_eager(strategy):
    """Inductor's kernels are the default on a CUDA device Triton serves."""
    model = tiny_llama().cuda()
    fn, params = llama_logits(model)
    step = fn if strategy is None else T.overlap(T.microbatch(fn, num=2, in_axes=(None, 0)), strategy)
    fast = df.jit(step, progress=False)
    for _ in range(3):
        ids = torch.randint(0, 128, (4, 12), device="cuda")
        torch.testing.assert_close(fast(params, ids), fn(params, ids), rtol=1e-3, atol=1e-3)
    plan = fast.lower(params, ids)
    df.verify(plan)
    assert fast.cache_info().captures == 1
    assert any(type(step.op).__name__ == "CompiledRun" for step in plan.steps)


def test_compile_backend_with_inductor_on_cuda_equals_eager():
    model = tiny_llama().cuda()
    compile_backend = df.compile_backend(backend="inductor", progress=False)
    compiled = torch.compile(model, backend=compile_backend, dynamic=False)
    with torch.no_grad():
        for _ in range(3):
            ids = torch.randint(0, 128, (2, 10), device="cuda")
            torch.testing.assert_close(compiled(ids, use_cache=False).logits, model(ids, use_cache=False).logits,
                                       rtol=1e-3, atol=1e-3)
    assert sum(jitted.cache_info().captures for jitted in compile_backend.graphs) >= 1


def scaled(cache, x):
    return cache * 2 + x


def test_a_resident_input_that_keeps_moving_is_copied_in_after_its_second_move():
    fast = df.jit(scaled, backend="cudagraph", persistent_argnums=(0,))
    x = torch.randn(4, 8, device="cuda")
    caches = [torch.randn(4, 8, device="cuda") for _ in range(5)]   # all alive: each at an address of its own
    with pytest.warns(UserWarning, match=r"cache is resident .* copied in on every call from now on") as caught:
        for cache in caches:                                  # a new tensor where a persistent one was declared
            torch.testing.assert_close(fast(cache, x), scaled(cache, x))
    assert fast.cache_info().captures == 3                    # first call, first move, second move; then copied
    assert len([w for w in caught if "is resident" in str(w.message)]) == 1


def test_a_resident_input_replaced_now_and_then_stays_resident():
    """A KV cache made anew for each generate() call and then read by many steps: each replacement
    captures once, and the input is never demoted to a copy per call."""
    fast = df.jit(scaled, backend="cudagraph", persistent_argnums=(0,))
    x = torch.randn(4, 8, device="cuda")
    caches = [torch.randn(4, 8, device="cuda") for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")                       # no demotion warning
        for cache in caches:
            for _ in range(3):
                torch.testing.assert_close(fast(cache, x), scaled(cache, x))
    assert fast.cache_info().captures == 3


def test_a_resident_input_taking_turns_between_two_tensors_is_captured_twice():
    fast = df.jit(scaled, backend="cudagraph", persistent_argnums=(0,))
    x = torch.randn(4, 8, device="cuda")
    caches = [torch.randn(4, 8, device="cuda") for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(6):
            cache = caches[step % 2]
            cache.add_(1)
            torch.testing.assert_close(fast(cache, x), scaled(cache, x))
    assert fast.cache_info().captures == 2


def _counting_runs(monkeypatch):
    """The BoundPlan of every interpreter run (warm-up or capture) from now on."""
    from dynaflow_fn.runtime.interpreter import BoundPlan

    runs, run = [], BoundPlan.run
    monkeypatch.setattr(BoundPlan, "run", lambda self, *args, **kwargs: runs.append(self) or run(self, *args, **kwargs))
    return runs


def _decode_like(cache, w, x):
    """Reads a cache, as a decode step does, and updates it in place."""
    y = torch.tanh(x @ w) + cache[: x.shape[0]]
    cache[: x.shape[0]].add_(y)
    return y * 2


@pytest.mark.parametrize("strategy", [None, "tbo"], ids=["one-stream", "microbatch2-tbo"])
def test_a_capture_after_a_move_reuses_the_plans_memory_and_leaves_out_the_warm_up(monkeypatch, strategy):
    """generate() makes a new KV cache per call: the decode graph is captured again for it. The new
    capture runs in the same arena and buffers on the same streams, with one interpreter run (the
    capture) instead of two, and computes what eager PyTorch does."""
    import threading

    if strategy is None:
        plain = fn = _decode_like
    else:
        plain = lambda cache, w, x: torch.tanh(x @ w) * cache.sum()                     # noqa: E731
        fn = T.overlap(T.microbatch(plain, num=2, in_axes=(None, None, 0)), strategy=strategy)
    fast = df.jit(fn, persistent_argnums=(0,), progress=False)
    runs = _counting_runs(monkeypatch)
    w, x = torch.randn(16, 16, device="cuda"), torch.randn(8, 16, device="cuda")
    caches = [torch.randn(8, 16, device="cuda") for _ in range(4)]
    expected = [c.clone() for c in caches]
    for cache, mirror in zip(caches[:3], expected):
        for _ in range(2):
            xs = torch.randn(8, 16, device="cuda")
            torch.testing.assert_close(fast(cache, w, xs), plain(mirror, w, xs), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(cache, mirror, rtol=1e-5, atol=1e-5)
    assert fast.cache_info().captures == 3
    assert len(runs) == 2 + 1 + 1 and all(bound is runs[0] for bound in runs)
    memory = fast.cache_info().graph_memory_bytes
    other_thread = threading.Thread(target=lambda: fast(caches[3], w, x))
    other_thread.start()
    other_thread.join()
    plain(expected[3], w, x)
    torch.testing.assert_close(caches[3], expected[3], rtol=1e-5, atol=1e-5)
    assert len(runs) == 4 + 2                              # another thread warms up first
    assert fast.cache_info().graph_memory_bytes <= memory + (1 << 20)


def test_graph_memory_counts_buffers_and_pool_and_not_workspaces_freed_around_the_capture():
    """cuBLAS workspaces the caller's GEMMs left in the general pool are freed when the capture starts,
    and torch.cuda.graph empties the allocator's cache of free blocks: neither must be subtracted from
    the graph's memory (both once were, down to a negative count), and what the capture added to the
    graph's pool (its own workspace) must be counted. Measured from a device with nothing cached and
    no workspace, reserved memory can only grow by what the graph holds and more."""
    torch.cuda.synchronize()
    clear_cublas_workspaces()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    a = torch.randn(512, 512, device="cuda")
    for stream in (torch.cuda.current_stream(), torch.cuda.Stream()):
        with torch.cuda.stream(stream):
            a @ a                                          # a workspace per stream, in the general pool
    del a
    fast = df.jit(lambda w, x: torch.relu(x @ w) @ w, backend="cudagraph", progress=False)
    w, x = torch.randn(256, 256, device="cuda"), torch.randn(64, 256, device="cuda")
    torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # 64 MiB freed at once: cached, reserved
    out = fast(w, x)
    torch.testing.assert_close(out, torch.relu(x @ w) @ w, rtol=1e-4, atol=1e-4)
    held = fast.cache_info().graph_memory_bytes
    assert held >= x.nbytes + out.nbytes                   # its static input and output buffers at least
    assert held <= torch.cuda.memory_reserved() - before + (2 << 20)


@pytest.mark.parametrize("persistent", [(0,), ()], ids=["resident-cache", "copied-in-cache"])
def test_a_cache_updated_by_each_call_equals_eager_under_the_default_backend(persistent):
    """`cache[slots] = x` runs inplace (no whole-cache copies): on the caller's cache where it is
    resident, on its static buffer, written back after each replay, where it is copied in. Under the
    default backend the update is one Inductor run with the ops around it, and the graph holds no
    copy of the cache (a resident one: a copied-in cache's static buffer is the graph's)."""
    def step(cache, slots, new, w):
        cache[slots] = torch.tanh(new @ w)
        return cache[slots].sum(-1), cache.sum(0)

    fast = df.jit(step, persistent_argnums=persistent, progress=False)
    w = torch.randn(64, 64, device="cuda")
    caches = [torch.randn(1 << 20, 64, device="cuda") for _ in range(2)]      # 256 MiB each
    for call in range(4):
        cache = caches[call % 2] if not persistent else caches[0]
        slots = torch.randperm(32, device="cuda")[:8]
        new = torch.randn(8, 64, device="cuda")
        expected_cache = cache.clone()
        expected = step(expected_cache, slots, new, w)
        rows, total = fast(cache, slots, new, w)
        torch.testing.assert_close(rows, expected[0], rtol=1e-4, atol=1e-4)
        # a sum over 2**20 rows, in another order than eager's: its rounding reaches 1e-4; a missed or
        # misplaced update of 8 rows would move it by about 1
        torch.testing.assert_close(total, expected[1], rtol=1e-4, atol=1e-2)
        torch.testing.assert_close(cache, expected_cache, rtol=1e-5, atol=1e-5)
    plan = df.verify(fast.lower(cache, slots, new, w))
    [update] = [s for s in plan.steps if plan.input_slots[0] in s.writes()]
    assert isinstance(update.op, CompiledRun) and not plan.copy_steps()
    if persistent:                                  # its buffers and cuBLAS's workspace, no copy of the cache
        assert fast.cache_info().graph_memory_bytes < cache.nbytes // 2


def test_a_graph_left_in_a_reference_cycle_is_not_destroyed_during_another_capture(monkeypatch):
    """The cyclic collector runs wherever enough objects were allocated, a capture among them; a CUDA
    graph it destroyed there would invalidate the capture. Here a graph becomes cyclic garbage as the
    capture begins, and the collector may run on every allocation from then on."""
    x = torch.randn(16, 16, device="cuda")
    held = [torch.cuda.CUDAGraph()]
    with torch.cuda.graph(held[0]):
        x * 2
    graph = weakref.ref(held[0])
    begin, thresholds = torch.cuda.CUDAGraph.capture_begin, gc.get_threshold()

    def begin_with_fresh_garbage(self, *args, **kwargs):
        if held:
            cycle = [held.pop()]
            cycle.append(cycle)
            del cycle
        begin(self, *args, **kwargs)
        gc.set_threshold(1, 1, 1)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", begin_with_fresh_garbage)
    fast = df.jit(lambda a: torch.relu(a @ a.T) + 1, backend="cudagraph")
    try:
        result = fast(x)
    finally:
        gc.set_threshold(*thresholds)
    gc.collect()
    assert not held and graph() is None             # the garbage was there, and held by nothing else
    torch.testing.assert_close(result, torch.relu(x @ x.T) + 1)
    torch.testing.assert_close(fast(x * 2), torch.relu(4 * x @ x.T) + 1)


def test_a_dropped_jitted_function_collected_inside_a_capture_not_ours_leaves_that_capture_intact():
    """A dropped jitted function is cyclic garbage, and the collector also runs inside captures that do
    not pause it (torch.compile's, a hand-written one): its graph is destroyed after, not there."""
    gc.collect()                                    # earlier tests' graphs, which would break the capture below
    x = torch.randn(16, 16, device="cuda")
    dropped = df.jit(lambda a: a @ a, backend="cudagraph")
    dropped(x)
    graph = weakref.ref(dropped._last.executable.captures[0].graph)
    del dropped
    assert graph() is not None                      # garbage that only the collector frees
    theirs = torch.cuda.CUDAGraph()
    with torch.cuda.graph(theirs):
        doubled = x * 2
        gc.collect()                                # what an allocation inside this capture may start
    theirs.replay()
    torch.testing.assert_close(doubled, x * 2)
    fast = df.jit(lambda a: a + 1, backend="cudagraph")
    torch.testing.assert_close(fast(x), x + 1)
    assert graph() is None                          # destroyed by the next capture of ours
