"""df.jit's CUDA graphs coexist with every other CUDA-graph user in one process.

torch.compile(mode="reduce-overhead") clears cuBLAS's cached workspaces around each of its captures;
a df.jit graph that had captured GEMMs into such a workspace then wrote into freed memory, and the
next replay failed with "unspecified launch failure" (runtime/cudagraph.py says how graphs now own
theirs). These tests interleave df.jit graphs of several kinds with torch.compile's graphs,
hand-captured graphs, empty_cache() and workspace clears, and check every result against eager.
Skipped where there is no CUDA device.
"""

import pytest
import torch
from torch import nn

import dynaflow_fn as df
from bench.llama_layers import LLAMA3_8B, Shape, decoder_layer, make_layer
from bench.overhead import hand_graph
from dynaflow_fn import transforms as T
from fixtures import training_step
from models import MLP, TwoBranch

pytestmark = [pytest.mark.cuda, pytest.mark.slow]


class DecodeStack(nn.Module):
    """Llama-like decode layers as a module: weights are parameters, KV caches registered buffers."""

    def __init__(self, batch: int, context: int, layers: int = 4, shape: Shape = LLAMA3_8B):
        super().__init__()
        self.weights = nn.ModuleList()
        for index in range(layers):
            holder = nn.Module()
            for name, tensor in make_layer(torch.device("cuda"), seed=index, shape=shape).items():
                holder.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
            self.weights.append(holder)
            for cache in ("k", "v"):
                self.register_buffer(f"{cache}{index}", torch.randn(batch, shape.kv_heads, context, shape.head_dim,
                                                                    device="cuda", dtype=torch.bfloat16))
        self.shape, self.layers = shape, layers

    def forward(self, x):
        for index, holder in enumerate(self.weights):
            x = decoder_layer(dict(holder.named_parameters()), x, getattr(self, f"k{index}"),
                              getattr(self, f"v{index}"), shape=self.shape)
        return x


def _close(got, expected):
    """bf16 through 2-4 layers: torch.compile's fused kernels round differently from eager, so compare
    relative norms; a graph writing into freed memory is off by far more, or faults."""
    error = (got.float() - expected.float()).norm() / expected.float().norm()
    assert error < 2e-2, f"relative error {error.item():.3g}"


def test_decode_graphs_survive_torch_compile_reduce_overhead_rounds():
    """The reported case: 4 Llama-3-8B-like decode layers, 64 sequences of 2048 cached tokens, df.jit
    and torch.compile's CUDA graphs called in turns of 4, 20 rounds."""
    torch.manual_seed(0)
    model = DecodeStack(batch=64, context=2048).eval()
    fn, params = df.pure(model)
    fast = df.jit(fn)
    compiled = torch.compile(model, mode="reduce-overhead")
    x = torch.randn(64, model.shape.hidden, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        expected = model(x)
        for _ in range(20):
            for call in (lambda: compiled(x), lambda: fast(params, x)):
                for _ in range(4):
                    _close(call(), expected)
                    torch.cuda.synchronize()


def test_graphs_of_every_kind_interleaved_with_other_graph_users():
    torch.manual_seed(0)
    small = Shape(hidden=512, q_heads=8, kv_heads=2, head_dim=64, ffn=1024)
    decode = DecodeStack(batch=8, context=256, layers=2, shape=small).eval()
    decode_fn, decode_params = df.pure(decode)
    branches_model = TwoBranch().cuda()
    branches_fn, branches_params = df.pure(branches_model)
    mlp = MLP().cuda()
    mlp_fn, mlp_params = df.pure(mlp)
    opt = df.optim.adamw(lr=1e-2)

    train_step = training_step(lambda params, x, y: (mlp_fn(params, x) - y).square().mean(), opt)
    train_params = {k: v.detach().clone() for k, v in mlp_params.items()}
    train_state = opt.init(train_params)
    eager_params = {k: v.clone() for k, v in train_params.items()}
    eager_state = opt.init(eager_params)
    jitted = {
        "aten": df.jit(decode_fn, backend="cudagraph"),
        "inductor": df.jit(decode_fn, backend="inductor", progress=False),
        "branches": df.jit(T.overlap(branches_fn, strategy="branches")),
        "roundrobin": df.jit(T.overlap(T.microbatch(mlp_fn, num=2, in_axes=(None, 0)), "roundrobin")),
        "train": df.jit(train_step, donate_argnums=(0, 1)),
    }
    compiled = torch.compile(decode, mode="reduce-overhead")
    x_decode = torch.randn(8, small.hidden, device="cuda", dtype=torch.bfloat16)
    hand = hand_graph(decode, x_decode)

    def other_users():
        yield lambda: _close(compiled(x_decode), decode(x_decode))
        yield lambda: _close(hand(x_decode), decode(x_decode))
        yield torch.cuda.empty_cache
        yield torch._C._cuda_clearCublasWorkspaces

    for round_ in range(6):
        for name, fast in jitted.items():
            with torch.no_grad():
                if name == "train":
                    x, y = torch.randn(16, 32, device="cuda"), torch.randn(16, 16, device="cuda")
                    train_params, train_state, loss = fast(train_params, train_state, x, y)
                    eager_params, eager_state, eager_loss = train_step(eager_params, eager_state, x, y)
                    torch.testing.assert_close(loss, eager_loss, rtol=1e-4, atol=1e-5)
                    for key in eager_params:
                        torch.testing.assert_close(train_params[key], eager_params[key], rtol=1e-4, atol=1e-5)
                elif name == "branches":
                    a, b = torch.randn(8, 32, device="cuda"), torch.randn(8, 32, device="cuda")
                    torch.testing.assert_close(fast(branches_params, a, b), branches_model(a, b))
                elif name == "roundrobin":
                    a = torch.randn(16, 32, device="cuda")
                    torch.testing.assert_close(fast(mlp_params, a), mlp(a))
                else:
                    x = torch.randn(8, small.hidden, device="cuda", dtype=torch.bfloat16)
                    _close(fast(decode_params, x), decode(x))
            for disturb in other_users():
                with torch.no_grad():
                    disturb()
            torch.cuda.synchronize()
