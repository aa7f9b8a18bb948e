"""Training step of a Llama-like model (8 layers, hidden 2048, bf16): eager PyTorch against df.jit.

The model is plain PyTorch (bench/llama_layers.LlamaLike); one more case runs transformers' Llama,
whose masking code cannot skip the causal mask while traced (it cannot read position ids to rule out
packed sequences), so its traced attention carries an explicit mask that eager PyTorch avoids.

  eager      model(ids) -> cross-entropy -> backward -> torch.optim.AdamW(fused=True).step()
  df.jit     one traced program: df.value_and_grad + df.optim.adamw, params and optimizer state
             donated, replayed as one CUDA graph

Cases: a launch-bound batch (1 x 128 tokens) and a large one (8 x 2048 tokens). Prints medians and
ratios; writes bench/results/train.json.   python -m bench.train
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import dynaflow_fn as df
from bench.common import peak_memory_mb, print_table, time_variants, write_results

VOCAB = 32000


def make_model(device: torch.device, kind: str = "plain"):
    """8 layers, hidden 2048, 16/8 heads, FFN 5632, bf16: our plain module or transformers' Llama."""
    torch.manual_seed(0)
    if kind == "plain":
        from bench.llama_layers import LlamaLike

        return LlamaLike(VOCAB, 2048, 8, 16, 8, 5632).to(device=device, dtype=torch.bfloat16)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)
    return LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)


def cross_entropy(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))


def _call(kind: str):
    return {} if kind == "plain" else {"use_cache": False}


def _logits(out):
    return out if isinstance(out, torch.Tensor) else out.logits


def eager_training(ids: torch.Tensor, kind: str = "plain"):
    """The baseline: eager model, autograd, torch.optim.AdamW(fused=True). Returns step()."""
    model = make_model(ids.device, kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        loss = cross_entropy(_logits(model(ids, **_call(kind))), ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss
    return step


def df_training(ids: torch.Tensor, kind: str = "plain", backend: str = "auto"):
    """The same step as one traced program under df.jit, parameters and state donated. Returns step()."""
    model = make_model(ids.device, kind)
    forward, state_dict = df.pure(model)
    names = dict(model.named_parameters())
    params = {k: v.detach() for k, v in state_dict.items() if k in names}
    buffers = {k: v for k, v in state_dict.items() if k not in names}
    optimizer = df.optim.adamw(lr=1e-4)
    state = optimizer.init(params)

    def loss_fn(params, ids):
        return cross_entropy(_logits(forward({**params, **buffers}, ids, **_call(kind))), ids)

    def train_step(params, state, ids):
        loss, grads = df.value_and_grad(loss_fn)(params, ids)
        params, state = optimizer.update(grads, state, params)
        return params, state, loss

    fast = df.jit(train_step, donate_argnums=(0, 1), backend=backend)
    return lambda: fast(params, state, ids)[2]


def rows_for(batch: int, tokens: int, device: torch.device, kind: str = "plain") -> list[dict]:
    case = f"{'transformers ' if kind != 'plain' else ''}8 layers x 2048, batch {batch} x {tokens} tokens"
    ids = torch.randint(0, VOCAB, (batch, tokens), device=device)
    eager_step = eager_training(ids, kind)
    df_step = df_training(ids, kind)
    start = time.perf_counter()
    df_step()
    torch.cuda.synchronize()
    build_s = time.perf_counter() - start

    eager_loss, df_loss = eager_step(), df_step()
    memory = {"eager": peak_memory_mb(eager_step), "df.jit": peak_memory_mb(df_step)}
    inner = 5 if tokens * batch <= 512 else 1
    timings = time_variants({"eager": eager_step, "df.jit": df_step}, rounds=3, repeats=10, inner=inner)
    rows = []
    for name in ("eager", "df.jit"):
        rows.append({"case": case, "variant": name, **timings[name], "peak_mem_mb": memory[name],
                     "tokens_per_s": batch * tokens / timings[name]["median_ms"] * 1e3})
    rows[1]["first_call_s"] = build_s
    rows[1]["loss_after_warmup"] = float(df_loss)
    rows[0]["loss_after_warmup"] = float(eager_loss)
    for row in rows:
        row["speedup_vs_baseline"] = timings["eager"]["median_ms"] / row["median_ms"]
    rows[0]["variant"] = "baseline (eager, AdamW fused)"
    del eager_step, df_step
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    device = torch.device("cuda")
    rows = rows_for(1, 128, device) + rows_for(8, 2048, device) + rows_for(8, 2048, device, kind="hf")
    print_table(rows, ["case", "variant", "median_ms", "p10_ms", "p90_ms", "speedup_vs_baseline", "tokens_per_s",
                       "peak_mem_mb", "first_call_s"], f"training step ({torch.cuda.get_device_name()})")
    print(f"\nwrote {write_results('train', rows)}")


if __name__ == "__main__":
    main()
