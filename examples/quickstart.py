"""Quickstart: a small transformer stack, eager PyTorch against df.jit.

Runs on a GPU when there is one (df.jit replays one CUDA graph per call) and on the CPU otherwise
(df.jit interprets its static plan, about as fast as eager). Prints the start of the traced program and of
the plan, how far the results differ, and the time per call of each.

    python examples/quickstart.py
"""

import statistics
import time
from typing import Callable

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


def median_ms(calls: dict[str, Callable[[], object]], rounds: int = 7, repeats: int = 5) -> dict[str, float]:
    """Milliseconds per call of each callable: the median over rounds that take turns, so that other
    work on the machine slows every variant alike instead of skewing the ratio."""
    samples = {name: [] for name in calls}
    for call in calls.values():
        call()                                  # warm up (and, for df.jit, build the plan)
    for _ in range(rounds):
        for name, call in calls.items():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(repeats):
                call()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            samples[name].append((time.perf_counter() - start) / repeats * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def head(text: str, lines: int) -> str:
    """The first `lines` lines of `text`, then how many are left out."""
    all_lines = text.splitlines()
    left_out = len(all_lines) - lines
    return "\n".join(all_lines[:lines] + ([f"    ... ({left_out} more lines)"] if left_out > 0 else []))


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(256, 4) for _ in range(6))).to(device).eval()
    x = torch.randn(4, 64, 256, device=device)

    fn, params = df.pure(model)               # model as a pure function of (params, x)
    program = df.trace(fn, params, x)          # the traced aten program
    print(head(str(program), 14) + "\n")

    fast = df.jit(fn)                          # trace + lower + (on CUDA) capture on first call
    plan = fast.lower(params, x)
    print(head(str(plan), 16) + "\n")

    with torch.no_grad():
        expected = model(x)
    got = fast(params, x)
    print(f"device: {device}   backend: {'cudagraph' if device == 'cuda' else 'eager'}")
    print(f"max |eager - df.jit| = {(expected - got).abs().max().item():.3g}")

    def eager():
        with torch.no_grad():
            return model(x)

    ms = median_ms({"eager": eager, "df.jit": lambda: fast(params, x)})
    print(f"eager   {ms['eager']:8.3f} ms/call")
    print(f"df.jit  {ms['df.jit']:8.3f} ms/call   ({ms['eager'] / ms['df.jit']:.2f}x)")
    if device == "cpu":
        print("On the CPU df.jit interprets the plan op by op, as eager PyTorch runs the model: no speed-up is\n"
              "expected, only the same result. The gain comes on a GPU, where the plan replays as one CUDA graph.")


if __name__ == "__main__":
    main()
