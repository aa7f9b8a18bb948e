"""When a resident input arrives at a new address: captured again, and copied in once it moves on two
calls in a row. The CUDA-graph runtime is stood in for on the CPU by an interpreter that, as a
captured graph is, stays bound to the addresses of its resident inputs; the same cases run on the
real runtime in tests/runtime/test_cudagraph.py."""

import warnings

import pytest
import torch

import dynaflow_fn as df
from dynaflow_fn.errors import ResidentInputMoved
from dynaflow_fn.jitting import options, replayer
from dynaflow_fn.runtime.eager import EagerExecutable


class AddressBoundExecutable(EagerExecutable):
    """Interprets the plan, but refuses resident inputs at other addresses than the ones it was built on."""

    held_bytes = private_bytes = 0

    def __init__(self, plan, device, inputs, resident, static_outputs=False, memory=None, previous=None,
                 on_capture=None):
        super().__init__(plan, device, memory)
        self.resident = [i for i, is_resident in enumerate(resident) if is_resident]
        self.addresses = {i: inputs[i].data_ptr() for i in self.resident}

    def at_captured_addresses(self, inputs):
        return all(inputs[i].data_ptr() == address for i, address in self.addresses.items())

    def __call__(self, inputs):
        if not self.at_captured_addresses(inputs):
            raise ResidentInputMoved()
        return super().__call__(inputs)


@pytest.fixture
def address_bound_runtime(monkeypatch):
    monkeypatch.setattr(replayer, "CudaGraphExecutable", AddressBoundExecutable)
    monkeypatch.setattr(options.JitOptions, "runtime", lambda self, device: options.CUDAGRAPH)


def scaled(cache, x):
    return cache * 2 + x


def test_a_resident_input_new_on_every_call_is_copied_in_after_its_second_move(address_bound_runtime):
    fast = df.jit(scaled, persistent_argnums=(0,), progress=False)
    x = torch.randn(4, 8)
    caches = [torch.randn(4, 8) for _ in range(5)]           # all alive: every call's cache has its own address
    with pytest.warns(UserWarning, match=r"cache is resident .* copied in on every call from now on") as caught:
        for cache in caches:
            torch.testing.assert_close(fast(cache, x), scaled(cache, x))
    assert fast.cache_info().captures == 3                    # first call, first move, second move; then copied
    assert len([w for w in caught if "is resident" in str(w.message)]) == 1


def test_a_resident_input_replaced_now_and_then_stays_resident(address_bound_runtime):
    fast = df.jit(scaled, persistent_argnums=(0,), progress=False)
    x = torch.randn(4, 8)
    caches = [torch.randn(4, 8) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")                        # no demotion warning
        for cache in caches:
            for _ in range(3):
                torch.testing.assert_close(fast(cache, x), scaled(cache, x))
    assert fast.cache_info().captures == 3


def test_a_resident_input_taking_turns_between_two_tensors_finds_its_capture_again(address_bound_runtime):
    """The activations a training step's forward saves for its backward live in the outputs of whichever
    of the forward's two captures was free: they take turns between two addresses."""
    fast = df.jit(scaled, persistent_argnums=(0,), progress=False)
    x = torch.randn(4, 8)
    caches = [torch.randn(4, 8) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")                        # no demotion warning
        for step in range(6):
            cache = caches[step % 2]
            cache.add_(1)
            torch.testing.assert_close(fast(cache, x), scaled(cache, x))
    assert fast.cache_info().captures == 2
    third = torch.randn(4, 8)                                 # neither address: no spare kept from now on
    torch.testing.assert_close(fast(third, x), scaled(third, x))
    torch.testing.assert_close(fast(caches[0], x), scaled(caches[0], x))
    assert fast.cache_info().captures == 4


def test_a_call_whose_resident_input_moved_keeps_its_guard_and_measures_the_new_bytes(address_bound_runtime):
    """The first decoding step on a new KV cache: captured again, with the guard it had (the layouts are
    the same), and an input that overlaps the new cache is still refused."""
    def append(cache, x):
        cache.add_(x)
        return cache * 2

    fast = df.jit(append, persistent_argnums=(0,), progress=False)
    old, new, x = torch.zeros(4, 8), torch.zeros(4, 8), torch.randn(4, 8)
    fast(old, x)
    fast(old, x)
    guard = fast._last.guard
    expected = new.clone()
    torch.testing.assert_close(fast(new, x), append(expected, x), rtol=0, atol=0)
    assert fast._last.guard is guard and fast.cache_info().captures == 2
    with pytest.raises(df.InputError, match="cache and x share memory"):
        fast(new, new)
    torch.testing.assert_close(new, expected, rtol=0, atol=0)


class HoldingExecutable(AddressBoundExecutable):
    """Holds 3 MiB: 1 MiB of bound buffers (a replacement takes them over) and 2 MiB its capture added to
    its private pool (which goes with it)."""

    def __init__(self, plan, device, inputs, resident, static_outputs=False, memory=None, previous=None,
                 on_capture=None):
        super().__init__(plan, device, inputs, resident, static_outputs, memory, previous)
        self.private_bytes = 2 << 20
        self.held_bytes = self.private_bytes + (0 if previous is not None else 1 << 20)


def test_graph_memory_counts_a_replaced_capture_once(address_bound_runtime, monkeypatch):
    monkeypatch.setattr(replayer, "CudaGraphExecutable", HoldingExecutable)
    fast = df.jit(scaled, persistent_argnums=(0,), progress=False)
    x = torch.randn(4, 8)
    caches = [torch.randn(4, 8) for _ in range(3)]
    for cache in caches[:2]:
        fast(cache, x)
    assert fast.cache_info().captures == 2
    assert fast.cache_info().graph_memory_bytes == 5 << 20     # the replaced capture, kept in case it comes back
    fast(caches[2], x)
    assert fast.cache_info().captures == 3
    assert fast.cache_info().graph_memory_bytes == 3 << 20     # moved on: neither earlier capture is kept
