"""ir/cost.py: FLOPs and bytes follow the shapes, a big GEMM ranks above a small elementwise op,
views are free, and the compute/memory kind follows the device's ridge point."""

import math

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import dynaflow_fn as df
from dynaflow_fn.ir import cost


def _costs(fn, *args, roofline=cost.H200):
    program = df.trace(fn, *args)
    return {node.target: cost.node_cost(node, roofline) for node in program.ops()}


def test_a_big_matmul_costs_more_than_a_small_elementwise_op_and_is_compute_bound():
    costs = _costs(lambda a, b, c: (a @ b, c + 1), torch.randn(512, 512), torch.randn(512, 512), torch.randn(64))
    matmul, add = costs[torch.ops.aten.mm.default], costs[torch.ops.aten.add.Tensor]
    assert matmul.seconds > add.seconds and matmul.flops > add.flops and matmul.bytes > add.bytes
    assert matmul.kind == "compute" and add.kind == "memory"


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 64), k=st.integers(1, 64), n=st.integers(1, 64), batch=st.integers(1, 4))
def test_matmul_flops_and_bytes_follow_the_shapes(m, k, n, batch):
    costs = _costs(lambda a, b, x, y, bias: (a @ b, torch.bmm(x, y), torch.addmm(bias, a, b)),
                   torch.randn(m, k), torch.randn(k, n), torch.randn(batch, m, k), torch.randn(batch, k, n),
                   torch.randn(n))
    assert costs[torch.ops.aten.mm.default].flops == 2 * m * n * k
    assert costs[torch.ops.aten.bmm.default].flops == 2 * batch * m * n * k
    assert costs[torch.ops.aten.addmm.default].flops == 2 * m * n * k
    assert costs[torch.ops.aten.mm.default].bytes == 4 * (m * k + k * n + m * n)


def test_attention_and_convolution_count_their_multiply_adds():
    q, k, v = torch.randn(2, 3, 16, 8), torch.randn(2, 3, 24, 8), torch.randn(2, 3, 24, 8)
    attention = [c for target, c in _costs(F.scaled_dot_product_attention, q, k, v).items()
                 if "scaled_dot_product" in getattr(target, "__name__", "")]
    assert attention and attention[0].flops == 4 * 2 * 3 * 16 * 24 * 8
    weight = torch.randn(6, 4, 3, 3)
    conv = _costs(lambda x, w: F.conv2d(x, w), torch.randn(1, 4, 10, 10), weight)[torch.ops.aten.convolution.default]
    assert conv.flops == 2 * (1 * 6 * 8 * 8) * math.prod(weight.shape[1:])


def test_views_cost_nothing():
    costs = _costs(lambda x: (x.t(), x.view(-1), x[1:]), torch.randn(8, 8))
    assert costs and all(c == cost.ZERO for c in costs.values())


@settings(max_examples=15, deadline=None)
@given(small=st.integers(1, 1000), factor=st.integers(2, 1000))
def test_elementwise_cost_grows_with_size(small, factor):
    fn = lambda x: x * 2
    little = _costs(fn, torch.randn(small))[torch.ops.aten.mul.Tensor]
    big = _costs(fn, torch.randn(small * factor))[torch.ops.aten.mul.Tensor]
    assert big.bytes == factor * little.bytes and big.seconds >= little.seconds
    assert little.seconds >= cost.H200.launch_seconds


def test_the_kind_follows_the_ridge_point_of_the_roofline():
    """A 256^3 GEMM does about 43 FLOPs per byte: compute bound where the ridge (peak FLOP/s over
    bandwidth) lies below that, memory bound where it lies above."""
    args = torch.randn(256, 256), torch.randn(256, 256)
    for bandwidth in (1e9, 1e11, 1e12, 1e13, 1e18):
        roofline = cost.Roofline(matmul_flops={torch.float32: 60e12}, bandwidth=bandwidth)
        mm = _costs(torch.mm, *args, roofline=roofline)[torch.ops.aten.mm.default]
        intensity = mm.flops / mm.bytes
        assert mm.kind == ("compute" if intensity >= 60e12 / bandwidth else "memory"), bandwidth
        assert mm.seconds >= max(mm.flops / 60e12, mm.bytes / bandwidth)
    kinds = {_costs(torch.mm, *args, roofline=cost.Roofline(matmul_flops={torch.float32: 60e12}, bandwidth=b))[
        torch.ops.aten.mm.default].kind for b in (1e9, 1e18)}
    assert kinds == {"compute", "memory"}


def test_adding_costs_sums_them_and_keeps_the_dominant_kind_or_comm():
    gemm = cost.Cost(10.0, 2.0, 3.0, "compute")
    copy = cost.Cost(1.0, 20.0, 1.0, "memory")
    total = gemm + copy
    assert (total.flops, total.bytes, total.seconds) == (11.0, 22.0, 4.0) and total.kind == "compute"
    assert (copy + cost.Cost(0.0, 1.0, 0.1, "comm")).kind == "comm"
    assert gemm + cost.ZERO == gemm
