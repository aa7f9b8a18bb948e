"""T.substitute(check=True): an implementation that only sums in another order is accepted, however
long its reductions; one that computes something else is refused.

The check draws its own random inputs, weights included, from torch's global generator: each test
seeds it, and the accepted cases run over several seeds."""

import pytest
import torch
import torch.nn.functional as F

import dynaflow_fn as df
from dynaflow_fn import transforms as T
from dynaflow_fn.errors import TransformError

SEEDS = range(4)
HEADS = 4


def attention_layer(x, wq, wk, wv, wo, attend):
    """Projections, attention over the sequence, output projection: on the check's random weights the
    scores are large, so the softmax amplifies the rounding of the projections."""
    b, t, d = x.shape
    q, k, v = ((x @ w).view(b, t, HEADS, -1).transpose(1, 2) for w in (wq, wk, wv))
    return attend(q, k, v).transpose(1, 2).reshape(b, t, d) @ wo


def fused_layer(x, wq, wk, wv, wo):
    with df.region("attn"):
        return attention_layer(x, wq, wk, wv, wo, F.scaled_dot_product_attention)


def unfused(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v


def unfused_layer(x, wq, wk, wv, wo):
    return attention_layer(x, wq, wk, wv, wo, unfused)


def layer_inputs():
    """Sequence 512, head dimension 64: the scores sum over 64 products, the outputs over 512."""
    return torch.randn(1, 512, HEADS * 64), *(torch.randn(HEADS * 64, HEADS * 64) / 16 for _ in range(4))


def matmul(x, w):
    with df.region("mm"):
        return x @ w


def split_k(x, w, splits=16):
    """Partial products over 16 slices of the reduction dimension, then their sum."""
    (m, k), n = x.shape, w.shape[1]
    return (x.view(m, splits, k // splits).transpose(0, 1) @ w.view(splits, k // splits, n)).sum(0)


def chunked(x, w, chunk=1000):
    """Chunks of the reduction dimension, the last one shorter, one after the other into one accumulator."""
    out = x[:, :chunk] @ w[:chunk]
    for start in range(chunk, x.shape[1], chunk):
        out = out + x[:, start:start + chunk] @ w[start:start + chunk]
    return out


def matmul_inputs():
    return torch.randn(64, 8192), torch.randn(8192, 64)


def one_element_off(out):
    """`out` with its largest element 1e-3 too large, relative to itself."""
    return out * (1 + 1e-3 * (out.abs() == out.abs().amax()).to(out.dtype))


@pytest.mark.parametrize("seed", SEEDS)
def test_unfused_attention_is_accepted_for_a_fused_kernel_at_long_sequences(seed):
    args = layer_inputs()
    torch.manual_seed(seed)
    substituted = T.substitute(fused_layer, {T.Region("attn"): unfused_layer}, check=True)
    with torch.no_grad():
        got = df.jit(substituted)(*args)
        torch.testing.assert_close(got, unfused_layer(*args), rtol=0, atol=0)
        torch.testing.assert_close(got, fused_layer(*args))


@pytest.mark.parametrize("impl", [split_k, chunked])
@pytest.mark.parametrize("seed", SEEDS)
def test_a_split_reduction_is_accepted_for_a_matmul_over_a_long_dimension(seed, impl):
    args = matmul_inputs()
    torch.manual_seed(seed)
    substituted = T.substitute(matmul, {T.Region("mm"): impl}, check=True)
    with torch.no_grad():
        got = df.jit(substituted)(*args)
        torch.testing.assert_close(got, impl(*args), rtol=0, atol=0)
        torch.testing.assert_close(got, matmul(*args), rtol=1e-4, atol=1e-3)


def without_the_scale(x, wq, wk, wv, wo):
    return attention_layer(x, wq, wk, wv, wo, lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2), -1) @ v)


def with_a_transposed_query_weight(x, wq, wk, wv, wo):
    return unfused_layer(x, wq.T, wk, wv, wo)


def with_one_element_off(x, wq, wk, wv, wo):
    return one_element_off(unfused_layer(x, wq, wk, wv, wo))


@pytest.mark.parametrize("wrong", [without_the_scale, with_a_transposed_query_weight, with_one_element_off])
def test_a_different_attention_is_refused(wrong):
    args = layer_inputs()
    with torch.no_grad():                     # each one computes something else, eagerly too
        assert not torch.allclose(wrong(*args), unfused_layer(*args), rtol=1e-4, atol=0)
    torch.manual_seed(0)
    with pytest.raises(TransformError, match=r"output 0 \(f32\[1, 512, 256\]\) differs by up to"):
        df.trace(T.substitute(fused_layer, {T.Region("attn"): wrong}, check=True), *args)


def test_a_matmul_with_one_element_off_is_refused_and_the_message_says_by_how_much():
    torch.manual_seed(0)
    number = r"-?[0-9.e+-]+"
    with pytest.raises(TransformError, match=(
            rf"output 0 \(f32\[64, 64\]\) differs by up to {number} \(at index \[\d+, \d+\]: {number} returned; the "
            rf"region computes {number}, in float64 {number}\) from the region run in float64, which allows 4 x "
            rf"{number} \(the region's own error\) \+ rtol 0.0001 x {number} \(the output's largest magnitude\) = "
            rf"{number}$")):
        df.trace(T.substitute(matmul, {T.Region("mm"): lambda x, w: one_element_off(split_k(x, w))}, check=True),
                 *matmul_inputs())


@torch.library.custom_op("dynaflow_test::gelu_float32_only", mutates_args=())
def gelu_float32_only(x: torch.Tensor) -> torch.Tensor:
    torch._check(x.dtype == torch.float32, lambda: f"gelu_float32_only takes float32, got {x.dtype}")
    return F.gelu(x)


@gelu_float32_only.register_fake
def _(x):
    return torch.empty_like(x)


def gelu_region(x):
    with df.region("act"):
        return gelu_float32_only(x) * 2


def test_a_region_without_a_float64_kernel_is_compared_elementwise_with_the_dtype_tolerance():
    x = torch.randn(64, 64)
    torch.manual_seed(0)
    df.trace(T.substitute(gelu_region, {T.Region("act"): lambda x: F.gelu(x) * 2}, check=True), x)
    with pytest.raises(TransformError, match=r"differs by up to .*tolerance rtol=0.0001, atol=1e-05"):
        df.trace(T.substitute(gelu_region, {T.Region("act"): lambda x: F.gelu(x, approximate="tanh") * 2},
                              check=True), x)


def masked_scores(q, k):
    scores = q @ k.transpose(-1, -2)
    with df.region("mask"):
        return scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))


def test_infinities_where_the_region_has_them_agree():
    q = torch.randn(2, 128, 64)
    torch.manual_seed(0)
    df.trace(T.substitute(masked_scores, {T.Region("mask"): lambda scores: torch.where(
        torch.ones(128, 128, dtype=torch.bool).tril(), scores, float("-inf"))}, check=True), q, q)
    with pytest.raises(TransformError, match=r"differs by up to inf"):
        df.trace(T.substitute(masked_scores, {T.Region("mask"): lambda scores: torch.where(
            torch.ones(128, 128, dtype=torch.bool).tril(-1), scores, float("-inf"))}, check=True), q, q)


def test_integer_outputs_must_be_equal():
    def argmax(x):
        with df.region("pick"):
            return x.max(-1).indices

    x = torch.randn(16, 100)
    torch.manual_seed(0)
    df.trace(T.substitute(argmax, {T.Region("pick"): lambda x: x.argmax(-1)}, check=True), x)
    with pytest.raises(TransformError, match=r"output 0 \(i64\[16\]\) differs"):
        df.trace(T.substitute(argmax, {T.Region("pick"): lambda x: x.argmin(-1)}, check=True), x)
