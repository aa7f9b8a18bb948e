"""Which kernels does a plan launch, against eager PyTorch? A diagnostic for "why is my plan slower".

Profiles eager PyTorch and dynaflow_fn's eager interpreter of the same plan (it launches exactly the
kernels the CUDA graph replays) and prints, per kernel, launches per call and microseconds per call
for both, largest differences first.

    python -m bench.kernels             # attention and the launch-bound model
    python -m bench.kernels training    # a training step
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import dynaflow_fn as df
from bench.common import print_table


def kernels(call: Callable[[], Any], iterations: int = 5, grad: bool = False) -> dict[str, tuple[float, float]]:
    """Kernel name -> (launches per call, device microseconds per call)."""
    with torch.set_grad_enabled(grad):
        call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iterations):
                call()
            torch.cuda.synchronize()
    table: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for event in prof.key_averages():
        if event.device_type != DeviceType.CUDA:
            continue
        total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        table[event.key][0] += event.count / iterations
        table[event.key][1] += total / iterations
    return {name: (count, micros) for name, (count, micros) in table.items()}


def compare(title: str, eager: Callable[[], Any], planned: Callable[[], Any], top: int = 15,
            grad: bool = False) -> None:
    a, b = kernels(eager, grad=grad), kernels(planned)
    rows = []
    for name in set(a) | set(b):
        ca, ta = a.get(name, (0.0, 0.0))
        cb, tb = b.get(name, (0.0, 0.0))
        rows.append({"kernel": name[:70], "eager_n": ca, "eager_us": ta, "plan_n": cb, "plan_us": tb,
                     "diff_us": tb - ta})
    rows.sort(key=lambda r: -abs(r["diff_us"]))
    total = {"kernel": "TOTAL", "eager_n": sum(c for c, _ in a.values()), "eager_us": sum(t for _, t in a.values()),
             "plan_n": sum(c for c, _ in b.values()), "plan_us": sum(t for _, t in b.values())}
    total["diff_us"] = total["plan_us"] - total["eager_us"]
    print_table([total] + rows[:top], ["kernel", "eager_n", "eager_us", "plan_n", "plan_us", "diff_us"], title)


def training() -> None:
    from bench.train import VOCAB, df_training, eager_training

    ids = torch.randint(0, VOCAB, (8, 2048), device="cuda")
    eager, planned = eager_training(ids), df_training(ids, backend="eager")
    compare("training step, 8 layers x 2048, batch 8 x 2048", eager, planned, top=25, grad=True)


def main() -> None:
    from bench.overhead import WIDTH, LaunchBound
    from bench.single_gpu import pod
    from bench.llama_layers import DTYPE, HEAD_DIM, KV_HEADS, Q_HEADS

    device = torch.device("cuda")
    r = lambda *shape: torch.randn(*shape, device=device, dtype=DTYPE)
    args = (r(1, Q_HEADS, 2048, HEAD_DIM), r(1, Q_HEADS, 2048, HEAD_DIM), r(1, Q_HEADS, 2048, HEAD_DIM),
            r(128, KV_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM), r(128, KV_HEADS, 2048, HEAD_DIM),
            r(128, KV_HEADS, 2048, HEAD_DIM))
    planned = df.jit(pod, backend="eager")
    compare("prefill 2048 || decode 128x2048 attention", lambda: pod(*args), lambda: planned(*args))
    model = LaunchBound().to(device).eval()
    fn, params = df.pure(model)
    x = torch.randn(1, WIDTH, device=device)
    planned_model = df.jit(fn, backend="eager")
    compare("launch-bound model (16 layers x 512, batch 1)", lambda: model(x), lambda: planned_model(params, x))


if __name__ == "__main__":
    import sys

    training() if sys.argv[1:] == ["training"] else main()
