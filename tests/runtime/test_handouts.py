"""Outputs handed out without a copy: never overwritten while a caller holds them.

The counting (`Handouts`, `compat.storage_alias`) is tested on the CPU; what a CUDA graph's replays do
with it, on a GPU: each test keeps results the way a caller would and checks them against eager
PyTorch after later calls.
"""

import gc
import random
import threading

import pytest
import torch

import dynaflow_fn as df
from dynaflow_fn.runtime.cudagraph import HANDED_OUT_CAPTURES, Capture
from dynaflow_fn.runtime.handouts import Handouts, is_handout


# --- counting holders, on the CPU -------------------------------------------------------------------

def test_a_handout_and_every_view_of_it_count_as_held_until_the_last_is_gone():
    written = torch.randn(6, 4)
    handouts = Handouts()
    make = handouts.makers([written])[0]
    assert make is not None and not handouts.held()
    out = make()
    assert out.data_ptr() == written.data_ptr() and torch.equal(out, written)
    assert handouts.held()
    row = out[2]
    del out
    assert handouts.held()
    storage = row.untyped_storage()
    del row
    assert handouts.held()                       # a storage object taken from a handout holds it too
    del storage
    assert not handouts.held()


def test_a_handout_and_its_views_are_known_as_handouts_while_the_memory_is_written_by_a_graph():
    written = torch.randn(6, 4)
    handouts = Handouts()
    make = handouts.makers([written])[0]
    out = make()
    assert is_handout(out) and is_handout(out[1:].t()) and is_handout(make())
    assert not is_handout(written) and not is_handout(out.clone()) and not is_handout(torch.randn(6, 4))
    del handouts, make                           # no graph writes it any more: an ordinary tensor
    gc.collect()
    assert not is_handout(out)


def test_handouts_are_fresh_views_so_changing_one_leaves_the_next_intact():
    written = torch.arange(12.0).reshape(3, 4)
    make = Handouts().makers([written])[0]
    first = make()
    first.t_()
    first.data = torch.zeros(2)
    assert make().shape == (3, 4) and torch.equal(make(), written)


def test_outputs_in_one_storage_share_one_alias_and_keep_their_offsets():
    buffer = torch.randn(64)
    a, b = buffer[:16].view(4, 4), buffer[32:40]
    handouts = Handouts()
    make_a, make_b = handouts.makers([a, b])
    kept_b = make_b()
    assert torch.equal(make_a(), a) and torch.equal(kept_b, b) and kept_b.data_ptr() == b.data_ptr()
    assert handouts.held()                       # b is held, which holds the memory a is in as well


def test_memory_of_the_executable_being_replaced_keeps_what_callers_hold_of_it():
    written = torch.randn(8)
    old = Handouts()
    held = old.makers([written])[0]()
    new = Handouts()
    new.makers([written], inherited=old)
    assert new.held()                            # the same alias: the result of the old one is seen
    del held
    assert not new.held()


def test_a_handout_stays_valid_after_the_memory_it_aliases_is_let_go_of():
    written = torch.full((1024,), 3.0)
    handouts = Handouts()
    out = handouts.makers([written])[0]()
    del written, handouts
    gc.collect()
    reused = [torch.zeros(1024) for _ in range(8)]
    assert torch.equal(out, torch.full((1024,), 3.0)) and len(reused) == 8


def test_a_capture_that_hands_out_nothing_itself_waits_while_its_shared_buffer_is_held():
    """A bucket plan whose outputs are all copied out still writes the output buffer the other buckets
    hand out: a result of theirs held there keeps it from replaying."""
    buffer = torch.randn(16)
    shared = Handouts()
    held = shared.makers([buffer[:8]])[0]()
    copying = Capture(None, [buffer[8:]], [0], [None], 0, shared, [None])
    assert not copying.free()
    del held
    assert copying.free() and torch.equal(copying.results([])[0], buffer[8:])


def test_memory_that_cannot_be_aliased_gets_no_maker(monkeypatch):
    """A storage that is no whole number of elements cannot be wrapped, and without torch's count of a
    storage's holders nothing can be aliased: such outputs are copied out."""
    odd = torch.empty(0, dtype=torch.float32).set_(torch.UntypedStorage(10), 0, (2,))
    assert Handouts().makers([odd]) == [None]
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    assert Handouts().makers([torch.randn(4)]) == [None]


# --- on a GPU ---------------------------------------------------------------------------------------

def _fn(w, x):
    y = torch.relu(x @ w)
    return y, y.sum(-1)          # the sum allocates its result (no out= kernel is known to fit)


def _jit(**options):
    return df.jit(_fn, backend="cudagraph", progress=False, **options)


def _expected(w, x):
    with torch.no_grad():
        return _fn(w, x)


def _close(got, expected):
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-3)


@pytest.mark.cuda
def test_results_let_go_of_before_the_next_call_are_the_graphs_own_buffers():
    w = torch.randn(64, 64, device="cuda")
    fast = _jit()
    addresses = set()
    for _ in range(4):
        x = torch.randn(32, 64, device="cuda")
        y, total = fast(w, x)
        _close((y, total), _expected(w, x))
        addresses.add((y.data_ptr(), total.data_ptr()))
        del y, total
    assert len(addresses) == 1 and fast.cache_info().captures == 1


@pytest.mark.cuda
def test_results_kept_over_the_next_call_are_not_overwritten_and_two_captures_alternate():
    """`out = fast(x)` in a loop holds the last results while the next call runs."""
    w = torch.randn(64, 64, device="cuda")
    fast = _jit()
    previous, addresses = None, []
    for _ in range(6):
        x = torch.randn(32, 64, device="cuda")
        results = fast(w, x)                     # the last call's results are held here, twice
        if previous is not None:
            _close(*previous)
        previous = (results, _expected(w, x))
        addresses.append(results[0].data_ptr())
    assert fast.cache_info().captures == 2
    assert addresses[0::2] == [addresses[0]] * 3 and addresses[1::2] == [addresses[1]] * 3
    assert addresses[0] != addresses[1]


@pytest.mark.cuda
def test_results_a_caller_collects_are_copies_once_two_captures_are_held():
    w = torch.randn(64, 64, device="cuda")
    fast = _jit()
    xs = [torch.randn(32, 64, device="cuda") for _ in range(6)]
    collected = [fast(w, x) for x in xs]
    for got, x in zip(collected, xs):
        _close(got, _expected(w, x))
    assert fast.cache_info().captures == HANDED_OUT_CAPTURES + 1
    assert len({y.data_ptr() for y, _ in collected}) == len(xs)


@pytest.mark.cuda
def test_a_view_kept_of_a_result_keeps_it_from_being_overwritten():
    w = torch.randn(64, 64, device="cuda")
    fast = _jit()
    x = torch.randn(32, 64, device="cuda")
    row = fast(w, x)[0][3]
    expected = _expected(w, x)[0][3]
    for _ in range(3):
        fast(w, torch.randn(32, 64, device="cuda"))
    torch.testing.assert_close(row, expected, rtol=1e-4, atol=1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("donate", [False, True], ids=["copied-in", "donated"])
def test_a_result_passed_back_in_is_read_before_anything_overwrites_it(donate):
    def step(x):
        return torch.tanh(x @ x.T) @ x

    fast = df.jit(step, backend="cudagraph", donate_argnums=(0,) if donate else (), progress=False)
    x = torch.randn(32, 32, device="cuda") / 8
    expected = x.clone()
    for _ in range(5):
        x = fast(x)
        with torch.no_grad():
            expected = step(expected)
        torch.testing.assert_close(x, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
def test_results_read_on_the_stream_of_the_next_call_are_read_before_it_writes_them():
    """A call from another stream first waits for what the last call's stream enqueued (`Turns`), the
    caller's reads of the handed-out results included."""
    w = torch.randn(1024, 1024, device="cuda")
    fast = df.jit(lambda w, x: x @ w, backend="cudagraph", progress=False)
    side = torch.cuda.Stream()
    x = torch.randn(1024, 1024, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = fast(w, x)
        read = y
        for _ in range(20):                      # a long reader of y, queued on the side stream
            read = read @ w / 32
        del y
    fast(w, torch.zeros_like(x))                 # on the default stream: overwrites the buffer y was in
    torch.cuda.current_stream().wait_stream(side)
    expected = x @ w
    for _ in range(20):
        expected = expected @ w / 32
    torch.testing.assert_close(read, expected, rtol=1e-3, atol=1e-3)


@pytest.mark.cuda
def test_outputs_that_alias_each_other_are_handed_out_aliased_as_eager_returns_them():
    fast = df.jit(lambda x: (lambda y: (y, y.T))(x * 2), backend="cudagraph", progress=False)
    x = torch.randn(8, 4, device="cuda")
    y, transposed = fast(x)
    assert transposed.data_ptr() == y.data_ptr() and torch.equal(transposed, (x * 2).T)
    del y
    fast(torch.zeros_like(x))
    torch.testing.assert_close(transposed, (x * 2).T)       # held through the view alone


@pytest.mark.cuda
def test_a_result_of_one_bucket_is_not_overwritten_by_a_call_of_another():
    """Bucket plans share their output buffers: a held result of one holds them for all."""
    w = torch.randn(64, 64, device="cuda")
    fast = df.jit(_fn, buckets=(2, 4, 8, 16), in_axes=(None, 0), backend="cudagraph", progress=False)
    walk, kept = random.Random(0), []
    for _ in range(12):
        x = torch.randn(walk.randint(1, 16), 64, device="cuda")
        kept = (kept + [(fast(w, x), _expected(w, x))])[-2:]
        for got, expected in kept:
            _close(got, expected)
    assert fast.cache_info().captures <= (HANDED_OUT_CAPTURES + 1) * fast.cache_info().entries   # two held: copies


@pytest.mark.cuda
def test_a_result_held_while_a_moved_input_captures_again_is_not_overwritten():
    """A resident input that moved (a new KV cache) captures again, in the same output buffers: the
    result of the call before must survive the new capture and its replays, and the warm-up run that a
    capture on another thread makes first."""
    fast = df.jit(lambda cache, x: (cache * x).sum(0), persistent_argnums=(0,), backend="cudagraph",
                  progress=False)
    x = torch.randn(16, 64, device="cuda")
    caches = [torch.randn(16, 64, device="cuda") for _ in range(3)]
    held = fast(caches[0], x)
    for _ in range(2):
        torch.testing.assert_close(fast(caches[1], x), (caches[1] * x).sum(0))
    on_another_thread = []
    thread = threading.Thread(target=lambda: on_another_thread.append(fast(caches[2], x)))
    thread.start()
    thread.join()
    torch.testing.assert_close(on_another_thread[0], (caches[2] * x).sum(0))
    torch.testing.assert_close(held, (caches[0] * x).sum(0))


@pytest.mark.cuda
def test_a_result_outlives_its_jitted_function():
    w = torch.randn(64, 64, device="cuda")
    fast = _jit()
    x = torch.randn(32, 64, device="cuda")
    y, _ = fast(w, x)
    del fast
    gc.collect()
    filler = [torch.randn(32, 64, device="cuda") for _ in range(64)]
    torch.testing.assert_close(y, _expected(w, x)[0], rtol=1e-4, atol=1e-3)
    assert len(filler) == 64


@pytest.mark.cuda
def test_replays_that_hand_out_their_outputs_allocate_nothing():
    w = torch.randn(64, 64, device="cuda")
    fast = _jit()
    xs = [torch.randn(32, 64, device="cuda") for _ in range(10)]
    fast(w, xs[0])
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    for x in xs:
        fast(w, x)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
