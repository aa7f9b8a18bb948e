"""The guarantees of tests/test_guarantees.py on the CUDA-graph backend, where tensors are read in place,
inputs go through static buffers and replays are asynchronous. Eager CUDA may pick other kernels than a
plan (cuDNN batch norm, for one), so results are compared within float32 tolerance: a stale weight, a
wrong mode or another thread's input would be off by far more. Skipped where there is no CUDA device."""

import threading

import pytest
import torch
from torch import nn

import dynaflow_fn as df
from models import DropoutNet

pytestmark = pytest.mark.cuda


def test_mode_switches_after_capture_are_seen():
    model = DropoutNet(64).cuda().train()
    fn, params = df.pure(model)
    fast = df.jit(fn)
    with torch.no_grad():
        fast(params, torch.randn(32, 64, device="cuda"))
        model.eval()
        x = torch.randn(32, 64, device="cuda")
        torch.testing.assert_close(fast(params, x), model(x))
        model.train()
        assert (fast(params, x) == 0).any()
    assert fast.cache_info().captures == 2


def test_closed_over_tensors_are_read_in_place_and_follow_updates():
    w = torch.randn(64, device="cuda")

    def f(x):
        return x * (w * 2) + (1 + w).to(torch.float64).sum().float()

    fast = df.jit(f)
    for step in range(3):
        x = torch.randn(8, 64, device="cuda")
        torch.testing.assert_close(fast(x), f(x))
        w.add_(torch.randn(64, device="cuda"))
    w.data = torch.randn(64, device="cuda")                           # new memory: captured again
    x = torch.randn(8, 64, device="cuda")
    torch.testing.assert_close(fast(x), f(x))
    assert fast.cache_info().captures == 2 and fast.cache_info().misses == 1


def test_threads_on_one_graph_get_their_own_results():
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)).cuda().eval()
    fn, params = df.pure(model)
    fast = df.jit(fn)
    start = threading.Barrier(4)
    wrong, errors = [], []

    def work(seed, own_stream):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        stream = torch.cuda.Stream() if own_stream else torch.cuda.current_stream()
        try:
            start.wait()
            with torch.cuda.stream(stream), torch.no_grad():
                for _ in range(50):
                    x = torch.randn(64, 256, device="cuda", generator=generator)
                    y = fast(params, x)
                    if not torch.allclose(y, model(x), rtol=1e-4, atol=1e-4):
                        wrong.append(seed)
            stream.synchronize()
        except Exception as error:                                    # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(seed, seed % 2 == 1)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert not wrong, f"wrong results in threads {sorted(set(wrong))}"
    assert fast.cache_info().captures == 1


def test_aliased_written_arguments_are_refused_on_the_graph_backend():
    def add_into(a, b):
        a.add_(1)
        return a + b

    x = torch.randn(16, device="cuda")
    fast = df.jit(add_into)
    fast(torch.randn(16, device="cuda"), torch.randn(16, device="cuda"))
    with pytest.raises(df.InputError, match=r"share memory"):
        fast(x, x)


def test_backward_through_graph_outputs_is_a_named_error():
    model = nn.Linear(32, 32).cuda()
    fn, params = df.pure(model)
    y = df.jit(fn)(params, torch.randn(4, 32, device="cuda"))
    assert y.requires_grad
    with pytest.raises(RuntimeError, match=r"df\.jit"):
        y.sum().backward()
