"""Quickstart: a small transformer stack, eager PyTorch against df.jit.

Runs on a GPU when there is one (df.jit replays one CUDA graph per call) and on the CPU otherwise
(df.jit interprets its static plan). Prints the traced program, the plan, both results and timings.

    python examples/quickstart.py
"""

import time

import torch
import torch.nn.functional as F
from torch import nn

import dynaflow_fn as df


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        with df.region("attn"):
            q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


def timed(call, repeats=20):
    call()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(256, 4) for _ in range(6))).to(device).eval()
    x = torch.randn(4, 64, 256, device=device)

    fn, params = df.pure(model)               # model as a pure function of (params, x)
    program = df.trace(fn, params, x)          # the traced aten program
    print("\n".join(str(program).splitlines()[:12]), "\n    ...\n")

    fast = df.jit(fn)                          # trace + lower + (on CUDA) capture on first call
    plan = fast.lower(params, x)
    print("\n".join(str(plan).splitlines()[:7]), "\n")

    with torch.no_grad():
        expected = model(x)
    got = fast(params, x)
    print(f"device: {device}   backend: {'cudagraph' if device == 'cuda' else 'eager'}")
    print(f"max |eager - df.jit| = {(expected - got).abs().max().item():.3g}")
    with torch.no_grad():
        eager_ms = timed(lambda: model(x))
    jit_ms = timed(lambda: fast(params, x))
    print(f"eager   {eager_ms:8.3f} ms/call")
    print(f"df.jit  {jit_ms:8.3f} ms/call   ({eager_ms / jit_ms:.2f}x)")


if __name__ == "__main__":
    main()
