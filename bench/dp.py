"""Data-parallel training step on N GPUs: torch DDP against dynaflow_fn's step, side by side.

    torchrun --nproc-per-node 2 -m bench.dp

  ddp        DistributedDataParallel (bucketed all-reduce overlapped with backward by autograd hooks)
             + torch.optim.AdamW(fused=True), eager
  df.dp      one traced step: df.value_and_grad, df.distributed.average (25 MB buckets), df.optim.adamw,
             T.overlap(strategy="roundrobin") putting each bucket's all-reduce on the comm stream;
             parameters and state donated; replayed as one CUDA graph
  df.dp-ctas8  the same with comm_ctas=8: all-reduces on an 8-CTA communicator, the kernels beside them
             leaving 8 SMs free

Model: the plain Llama-like decoder of bench/train.py (8 layers x 2048, bf16). Rank 0 prints medians,
global tokens/s and ratios, and writes bench/results/dp<N>.json.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import dynaflow_fn as df
from bench.common import ONE_RANK_NOTE, finish_distributed, init_distributed, print_table, time_variants, write_results
from bench.train import VOCAB, cross_entropy, make_model
from dynaflow_fn import transforms as T


def ddp_step(ids: torch.Tensor, device: torch.device):
    model = torch.nn.parallel.DistributedDataParallel(make_model(device), device_ids=[device.index])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        loss = cross_entropy(model(ids), ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss
    return step


def df_step(ids: torch.Tensor, device: torch.device, comm_ctas: int | None = None):
    model = make_model(device)
    forward, params = df.pure(model)
    params = {k: v.detach() for k, v in params.items()}
    optimizer = df.optim.adamw(lr=1e-4)
    state = optimizer.init(params)

    def train_step(params, state, ids):
        loss, grads = df.value_and_grad(lambda p: cross_entropy(forward(p, ids), ids))(params)
        params, state = optimizer.update(df.distributed.average(grads), state, params)
        return params, state, loss

    fast = df.jit(T.overlap(train_step, strategy="roundrobin", comm_ctas=comm_ctas), donate_argnums=(0, 1))
    return lambda: fast(params, state, ids)[2]


def main() -> None:
    device = init_distributed()
    world = dist.get_world_size()
    rows = []
    for batch, tokens in ((1, 256), (4, 2048)):
        ids = torch.randint(0, VOCAB, (batch, tokens), device=device, generator=torch.Generator(device).manual_seed(
            dist.get_rank()))
        steps = {"ddp": ddp_step(ids, device), "df.dp": df_step(ids, device),
                 "df.dp-ctas8": df_step(ids, device, comm_ctas=8)}
        timings = time_variants(steps, rounds=3, repeats=5, inner=1)
        for name, timing in timings.items():
            rows.append({"case": f"DP={world}, 8 layers x 2048, {batch} x {tokens} tokens per rank", "variant": name,
                         **timing, "tokens_per_s": world * batch * tokens / timing["median_ms"] * 1e3,
                         "speedup_vs_baseline": timings["ddp"]["median_ms"] / timing["median_ms"]})
        del steps
        torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        print_table(rows, ["case", "variant", "median_ms", "p10_ms", "p90_ms", "tokens_per_s", "speedup_vs_baseline"],
                    f"data-parallel training step ({torch.cuda.get_device_name()})")
        print(f"\nwrote {write_results(f'dp{world}', rows, note=ONE_RANK_NOTE if world == 1 else None)}")
    finish_distributed()


if __name__ == "__main__":
    main()
