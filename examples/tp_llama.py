"""Tensor-parallel Llama-style decoder stack with communication overlap, checked against one device.

Each rank holds a column slice of the QKV and gate/up projections and a row slice of the output and
down projections; two all-reduces per layer combine the partial sums. The step is micro-batched in
two and scheduled round-robin, so one micro-batch's all-reduce runs on the comm stream while the
other computes. Rank 0 compares the result with the unsharded model.

    torchrun --nproc-per-node 2 examples/tp_llama.py                  # NCCL with a GPU per rank, else gloo on CPUs
    torchrun --nproc-per-node 2 examples/tp_llama.py --comm-ctas 8    # all-reduces on 8 thread blocks (NCCL)
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dynaflow_fn as df
from dynaflow_fn import transforms as T


def make_weights(hidden: int, heads: int, ffn: int, layers: int, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=generator) * hidden ** -0.5
    return [{"wqkv": r(hidden, 3 * hidden), "wo": r(hidden, hidden), "wgu": r(hidden, 2 * ffn),
             "wd": r(ffn, hidden) * (hidden / ffn) ** 0.5} for _ in range(layers)]


def shard_layer(w: dict, heads: int) -> dict:
    """Column-parallel QKV and gate/up (split by head and by FFN channel), row-parallel out and down."""
    hidden = w["wo"].shape[0]
    q, k, v = w["wqkv"].split(hidden, dim=1)
    gate, up = w["wgu"].chunk(2, dim=1)
    column = lambda t: df.distributed.shard(t, dim=1)
    return {"wqkv": torch.cat([column(q), column(k), column(v)], dim=1), "wo": df.distributed.shard(w["wo"], dim=0),
            "wgu": torch.cat([column(gate), column(up)], dim=1), "wd": df.distributed.shard(w["wd"], dim=0)}


def decoder(layers: list[dict], x: torch.Tensor, heads: int, all_reduce=None) -> torch.Tensor:
    """Pre-norm causal decoder layers over x [batch, length, hidden]; heads are this rank's heads."""
    batch, length, _ = x.shape
    for w in layers:
        q, k, v = (F.rms_norm(x, x.shape[-1:]) @ w["wqkv"]).chunk(3, dim=-1)
        split = lambda t: t.view(batch, length, heads, -1).transpose(1, 2)
        with df.region("attn"):
            a = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        o = a.transpose(1, 2).reshape(batch, length, -1) @ w["wo"]
        x = x + (all_reduce(o) if all_reduce else o)
        gate, up = (F.rms_norm(x, x.shape[-1:]) @ w["wgu"]).chunk(2, dim=-1)
        d = (F.silu(gate) * up) @ w["wd"]
        x = x + (all_reduce(d) if all_reduce else d)
    return x


def run(hidden: int = 256, heads: int = 8, ffn: int = 512, layers: int = 2, batch: int = 4, length: int = 64,
        device: torch.device | None = None, comm_ctas: int | None = None) -> float:
    """Run the tensor-parallel step on every rank; return the relative error against one device.
    `comm_ctas` puts the all-reduces on a communicator of that many thread blocks (NCCL)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    device = device or torch.device("cpu")
    full = make_weights(hidden, heads, ffn, layers)
    local = [{k: v.to(device) for k, v in shard_layer(w, heads).items()} for w in full]
    x = torch.randn(batch, length, hidden, generator=torch.Generator().manual_seed(1)).to(device)

    def tensor_parallel(layers, x):
        return decoder(layers, x, heads // world, df.distributed.all_reduce)

    step = T.overlap(T.microbatch(tensor_parallel, num=2, in_axes=(None, 0)), "roundrobin", comm_ctas=comm_ctas)
    fast = df.jit(step, persistent_argnums=(0,))
    out = fast(local, x)
    start = time.perf_counter()
    for _ in range(5):
        out = fast(local, x)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / 5
    reference = decoder([{k: v.to(device) for k, v in w.items()} for w in full], x, heads)
    error = ((out - reference).norm() / reference.norm()).item()
    plan = df.verify(fast.lower(local, x))        # raises VerificationError if two streams could race
    if rank == 0:
        print(f"TP={world} on {device}: {elapsed * 1e3:.2f} ms/step, relative error vs one device {error:.2e}")
        print(f"plan verified race-free: {len(plan.steps)} steps on {len(plan.streams)} streams "
              f"({', '.join(s.name for s in plan.streams)}), ordered by {plan.num_events} events")
    return error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--comm-ctas", type=int, default=None,
                        help="run the all-reduces on a dedicated communicator of this many thread blocks "
                             "(NCCL only: needs GPUs)")
    options = parser.parse_args()
    if torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1)):     # a GPU for each rank
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    comm_ctas = options.comm_ctas
    if comm_ctas is not None and dist.get_backend() != "nccl":
        if dist.get_rank() == 0:
            print(f"--comm-ctas {comm_ctas} is ignored: it bounds the thread blocks of NCCL's collectives and "
                  f"applies only on NCCL (GPUs); this run uses {dist.get_backend()}.")
        comm_ctas = None
    run(hidden=options.hidden, heads=16, ffn=4 * options.hidden, layers=options.layers, device=device,
        comm_ctas=comm_ctas)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
