"""The guarantees of tests/test_guarantees.py on the CUDA-graph backend, where tensors are read in place,
inputs go through static buffers and replays are asynchronous. Eager CUDA may pick other kernels than a
plan (cuDNN batch norm, for one), so results are compared within float32 tolerance: a stale weight, a
wrong mode or another thread's input would be off by far more. Skipped where there is no CUDA device."""

import optree
import pytest
import torch
from torch import nn

import dynaflow_fn as df
from dynaflow_fn.runtime.cudagraph import HANDED_OUT_CAPTURES
from fixtures import run_together
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
    wrong = []

    def work(seed):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        stream = torch.cuda.Stream() if seed % 2 else torch.cuda.current_stream()     # odd threads: their own
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(50):
                x = torch.randn(64, 256, device="cuda", generator=generator)
                y = fast(params, x)
                if not torch.allclose(y, model(x), rtol=1e-4, atol=1e-4):
                    wrong.append(seed)
        stream.synchronize()

    run_together(work, threads=4)
    assert not wrong, f"wrong results in threads {sorted(set(wrong))}"
    assert fast.cache_info().captures <= HANDED_OUT_CAPTURES + 1    # results held by the other threads


def test_aliased_written_arguments_are_refused_on_the_graph_backend():
    def add_into(a, b):
        a.add_(1)
        return a + b

    x = torch.randn(16, device="cuda")
    fast = df.jit(add_into)
    fast(torch.randn(16, device="cuda"), torch.randn(16, device="cuda"))
    with pytest.raises(df.InputError, match=r"share memory"):
        fast(x, x)


def test_a_later_call_whose_copied_input_overlaps_a_resident_written_one_is_refused():
    """The replay compares only the copied-in inputs with the bytes of the resident written ones
    (guard.WrittenBytes); a view of the cache passed as the new token is still caught."""
    def append(cache, x):
        cache[:, 0].add_(x)
        return cache.sum(1)

    cache = torch.zeros(16, 4, device="cuda")
    fast = df.jit(append, donate_argnums=(0,))
    for _ in range(3):
        fast(cache, torch.randn(16, device="cuda"))
    assert fast.cache_info().captures == 1
    for overlapping in (cache.view(-1)[:16], cache.view(-1)[48:], cache[:, 0]):   # the layout of x, then another
        with pytest.raises(df.InputError, match=r"cache and x share memory"):
            fast(cache, overlapping)
    expected, x = cache.clone(), torch.randn(16, device="cuda")
    torch.testing.assert_close(fast(cache, x), append(expected, x), rtol=0, atol=0)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)


def test_backward_through_graph_outputs_is_a_named_error():
    model = nn.Linear(32, 32).cuda()
    fn, params = df.pure(model)
    y = df.jit(fn)(params, torch.randn(4, 32, device="cuda"))
    assert y.requires_grad
    with pytest.raises(RuntimeError, match=r"df\.jit"):
        y.sum().backward()


class _Cached(nn.Module):
    """A model whose state is mostly a buffer (a cache of 64 MiB), read every call and written by it."""

    def __init__(self, rows: int = 1 << 22):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))
        self.register_buffer("cache", torch.randn(rows, 4))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return x * self.scale + self.cache[: x.shape[0]] * self.calls


def _first_call_allocates_mib(call) -> float:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    return (torch.cuda.memory_allocated() - before) / 2**20


@pytest.mark.parametrize("backend", ["cudagraph", "auto"])
def test_module_buffers_are_read_and_written_in_place_like_parameters(backend):
    model, reference = _Cached().cuda(), _Cached().cuda()
    reference.load_state_dict(model.state_dict())
    fn, params = df.pure(model)
    fast = df.jit(fn, backend=backend, progress=False)
    x = torch.randn(8, 4, device="cuda")
    assert _first_call_allocates_mib(lambda: fast(params, x)) < 16        # no 64 MiB static copy of the cache
    reference(x)
    for _ in range(3):
        model.cache[:8].add_(1.0)                       # updated between calls: the graph sees it
        reference.cache[:8].add_(1.0)
        x = torch.randn(8, 4, device="cuda")
        torch.testing.assert_close(fast(params, x), reference(x))
    assert model.calls.item() == reference.calls.item() == 4      # the graph's writes land in the module
    assert fast.cache_info().captures == 1


def test_a_replaced_buffer_is_read_anew():
    model = _Cached(rows=64).cuda()
    fn, params = df.pure(model)
    fast = df.jit(fn, backend="cudagraph")
    x = torch.randn(8, 4, device="cuda")
    fast(params, x)
    params = {**params, "cache": torch.randn(64, 4, device="cuda")}      # a new tensor: copied in, still right
    expected = x * params["scale"] + params["cache"][:8] * (model.calls + 1)
    torch.testing.assert_close(fast(params, x), expected)
    model.cache = torch.randn(64, 4, device="cuda")                     # replaced in the module, handed out again
    fn, params = df.pure(model)
    expected = x * params["scale"] + params["cache"][:8] * (model.calls + 1)
    torch.testing.assert_close(fast(params, x), expected)
    assert model.calls.item() == 3


def test_tensors_marked_static_for_torch_compile_are_read_in_place():
    cache = torch.randn(1 << 22, 4, device="cuda")
    torch._dynamo.mark_static_address(cache)

    def read(cache, x):
        return x + cache[: x.shape[0]]

    fast = df.jit(read, backend="cudagraph")
    x = torch.randn(8, 4, device="cuda")
    assert _first_call_allocates_mib(lambda: fast(cache, x)) < 16
    cache[:8].mul_(2)
    torch.testing.assert_close(fast(cache, x), read(cache, x))


def test_hooks_and_submodules_changed_after_capture_are_seen():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).cuda()
    fast = df.jit(lambda x: model(x), backend="cudagraph")
    with torch.no_grad():
        fast(torch.randn(8, 64, device="cuda"))
        handle = model[0].register_forward_hook(lambda mod, args, out: out * 3)
        x = torch.randn(8, 64, device="cuda")
        torch.testing.assert_close(fast(x), model(x))
        handle.remove()
        torch.testing.assert_close(fast(x), model(x))
        model[2] = nn.Linear(64, 64).cuda()
        torch.testing.assert_close(fast(x), model(x))
    assert fast.cache_info().misses == 3


def test_jitted_gradients_on_the_device_require_no_grad():
    model = nn.Linear(64, 64).cuda()                            # closed over: its weights require grad
    params = {"w": torch.randn(64, 64, device="cuda", requires_grad=True)}

    def loss(p, x):
        return model(x @ p["w"]).square().mean()

    x = torch.randn(8, 64, device="cuda")
    for transform in (df.grad, df.value_and_grad):
        jitted, eager = df.jit(transform(loss))(params, x), transform(loss)(params, x)
        flat_jitted, flat_eager = optree.tree_leaves(jitted), optree.tree_leaves(eager)
        assert [t.requires_grad for t in flat_jitted] == [t.requires_grad for t in flat_eager] == [False] * len(flat_eager)
        for j, e in zip(flat_jitted, flat_eager):
            torch.testing.assert_close(j, e)


def test_torch_func_transforms_over_a_graph_backed_function():
    fast = df.jit(lambda x: torch.tanh(x) * x.sin(), backend="cudagraph")
    x = torch.randn(5, 3, device="cuda")
    fast(x)
    torch.testing.assert_close(torch.func.vmap(fast)(x), torch.tanh(x) * x.sin())
    expected = torch.func.grad(lambda v: (torch.tanh(v) * v.sin()).sum())(x)
    torch.testing.assert_close(torch.func.grad(lambda v: fast(v).sum())(x), expected)


def test_each_replay_draws_new_random_numbers():
    """Random ops inside a CUDA graph draw from torch's generator at each replay, as eager does: a
    replay that reused its capture's numbers would apply one dropout mask forever."""
    model = DropoutNet(64).cuda().train()
    fn, params = df.pure(model)
    fast = df.jit(lambda params, x: (fn(params, x), torch.rand(4, 64, device="cuda")))
    x = torch.randn(32, 64, device="cuda")
    with torch.no_grad():
        outputs = [tuple(t.clone() for t in fast(params, x)) for _ in range(4)]
    assert fast.cache_info().captures == 1
    for (out, noise), (other_out, other_noise) in zip(outputs, outputs[1:]):
        assert not torch.equal(out == 0, other_out == 0) and not torch.equal(noise, other_noise)
    assert 0.4 < float((outputs[-1][0] == 0).float().mean()) < 0.6          # p = 0.5


def test_training_through_compile_backend_draws_a_new_dropout_mask_each_step_and_differentiates_it():
    weight = nn.Parameter(torch.randn(64, device="cuda"))
    compiled = torch.compile(lambda x: nn.functional.dropout(x, 0.5, training=True) * weight,
                             backend=df.compile_backend(progress=False))
    x = torch.randn(32, 64, device="cuda")
    masks = []
    for _ in range(3):
        weight.grad = None
        y = compiled(x)
        y.sum().backward()
        kept = (y != 0).float()
        torch.testing.assert_close(weight.grad, (kept * x * 2).sum(0))           # the forward's own mask
        masks.append(kept)
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])


@pytest.mark.parametrize("backend", ["auto", "eager"])
@pytest.mark.filterwarnings("ignore:Inductor could not compile")
def test_a_kernel_that_fails_before_capture_is_a_kernel_error_and_the_next_fitting_call_captures(backend):
    """float32 @ float64 passes tracing (meta kernels do not check mm's dtypes) and fails in the run
    before the capture, as eager's mm fails."""
    fn = lambda a, b: (a @ b).relu()   # noqa: E731
    fast = df.jit(fn, backend=backend)
    a, b = torch.randn(8, 8, device="cuda"), torch.randn(8, 8, device="cuda")
    with pytest.raises(RuntimeError) as eager:
        fn(a, b.double())
    for _ in range(2):
        with pytest.raises(df.errors.KernelError) as error:
            fast(a, b.double())
        assert str(eager.value).splitlines()[0] in str(error.value)
    torch.testing.assert_close(fast(a, b), fn(a, b))
