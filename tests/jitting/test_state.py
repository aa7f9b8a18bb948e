"""Which inputs a CUDA graph reads in place by default (module state), and which kernels a plan runs."""

import gc

import pytest
import torch

import dynaflow_fn as df
from dynaflow_fn.jitting import options, state


class WithCache(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(8, 4))

    def forward(self, x):
        return self.linear(x) + self.cache[: x.shape[0]]


def test_parameters_and_the_buffers_pure_hands_out_are_state_wherever_they_go():
    model = WithCache()
    fresh_buffer = torch.zeros(8, 4)
    assert not state.is_state(model.cache)            # not yet handed out by df.pure
    _, params = df.pure(model)
    assert state.is_state(params["cache"]) and state.is_state(params["linear.weight"])
    assert state.is_state({"moved": params["cache"]}["moved"])
    assert not state.is_state(params["cache"].clone()) and not state.is_state(fresh_buffer)


def test_tensors_marked_for_torch_compiles_cuda_graphs_are_state():
    marked, unmarked = torch.zeros(3), torch.zeros(3)
    torch._dynamo.mark_static_address(marked)
    assert state.is_state(marked) and not state.is_state(unmarked)


def test_state_is_forgotten_with_its_tensor():
    model = WithCache()
    fn, params = df.pure(model)
    key = id(model.cache)
    assert key in state._module_state
    del model, fn, params
    gc.collect()
    assert key not in state._module_state          # so a new tensor with a reused id is not taken for it


@pytest.mark.parametrize("backend, triton, expected", [
    ("auto", True, "inductor"), ("auto", False, "aten"), ("inductor", False, "inductor"),
    ("cudagraph", True, "aten"), ("eager", True, "aten"),
])
def test_auto_runs_inductors_kernels_where_triton_serves_the_device(monkeypatch, backend, triton, expected):
    monkeypatch.setattr(options, "triton_available", lambda device: triton)
    assert options.JitOptions(backend=backend).kernels(torch.device("cuda")) == expected


def test_auto_keeps_aten_kernels_on_the_cpu():
    assert not options.triton_available(torch.device("cpu"))
    assert options.JitOptions().kernels(torch.device("cpu")) == "aten"
    plan = df.jit(lambda x: torch.relu(x) * 2).lower(torch.randn(4))
    assert not any("inductor" in line for line in plan.provenance)


def test_timing_runs_decide_what_is_read_in_place_from_the_callers_tensors(monkeypatch):
    """strategy="auto" times a plan on copies of the inputs it writes; the graph it builds must still
    read the caller's state in place, or every later call would copy it."""
    model = WithCache()
    fn, params = df.pure(model)

    def step(params, x):
        params["cache"].mul_(2)                                 # the plan writes the buffer
        return fn(params, x)

    fast = df.jit(step)
    x = torch.randn(3, 4)
    fast(params, x)
    (replayer,) = fast._cache.popitem()[1]
    leaves = [params[k] for k in sorted(params)] + [x]
    seen = []
    monkeypatch.setattr(type(replayer), "run", lambda self, tensors, rebuild_if_moved, resident=None:
                        seen.append((tensors, resident)))
    replayer.benchmark(leaves)()
    (tensors, resident), = seen
    cache = sorted(params).index("cache")
    assert tensors[cache] is not params["cache"]                         # timed on a copy...
    assert resident == replayer.binding.resident(leaves) and resident[cache]     # ...decided on the original
