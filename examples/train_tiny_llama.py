"""Train a small Llama (random init) to copy sequences, with the whole step under df.jit.

Each example is `x1 .. xn SEP x1 .. xn`; the loss is the next-token cross-entropy on the copy, which a
two-layer model learns in a few hundred steps. Forward, backward and the AdamW update are one traced
program; parameters and optimizer state are donated, so they are updated in place. On a GPU the step
replays as one CUDA graph; on the CPU df.jit interprets the same plan.

    python examples/train_tiny_llama.py            # writes examples/outputs/train_tiny_llama.png (the loss curve)
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

import dynaflow_fn as df
from dynaflow_fn.ir.progress import progress_bar   # tqdm, one line in a log instead of one per step

VOCAB, LENGTH, SEP = 16, 8, 0
DEFAULT_PLOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "outputs", "train_tiny_llama.png")  # git ignores outputs/


def make_model(device: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * LENGTH + 1)
    return LlamaForCausalLM(config).to(device)


def copy_batch(batch: int, device: str, generator: torch.Generator) -> torch.Tensor:
    tokens = torch.randint(1, VOCAB, (batch, LENGTH), generator=generator).to(device)
    separator = torch.full((batch, 1), SEP, device=device)
    return torch.cat([tokens, separator, tokens], dim=1)


def train(steps: int = 300, batch: int = 32, lr: float = 3e-3, device: str | None = None, seed: int = 0,
          plot: str | None = DEFAULT_PLOT, progress: bool = True) -> list[float]:
    """Train and return the loss of every step; draw the loss curve into `plot` unless it is None."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    model = make_model(device)
    forward, state_dict = df.pure(model)
    trained = dict(model.named_parameters())        # the buffers (rotary frequencies) are not trained
    params = {name: p.detach() for name, p in state_dict.items() if name in trained}
    buffers = {name: b for name, b in state_dict.items() if name not in trained}

    def loss_fn(params, ids):
        logits = forward({**params, **buffers}, ids, use_cache=False).logits
        predicted = logits[:, LENGTH:-1]                    # positions that predict the copied tokens
        return F.cross_entropy(predicted.reshape(-1, VOCAB), ids[:, LENGTH + 1:].reshape(-1))

    optimizer = df.optim.adamw(lr=lr, weight_decay=0.0)
    state = optimizer.init(params)

    @df.jit(donate_argnums=(0, 1))
    def train_step(params, state, ids):
        loss, grads = df.value_and_grad(loss_fn)(params, ids)
        params, state = optimizer.update(grads, state, params)
        return params, state, loss

    generator = torch.Generator().manual_seed(seed)
    losses = []
    bar = progress_bar(range(steps), desc="train", disable=not progress)
    for _ in bar:
        params, state, loss = train_step(params, state, copy_batch(batch, device, generator))
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)   # drawn with the next redraw
    if plot:
        _plot(losses, plot)
    return losses


def _plot(losses: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.plot(losses)
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy on the copy")
    axes.set_yscale("log")
    axes.set_title("tiny Llama learning to copy (df.jit train step)")
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device", default=None)
    parser.add_argument("--plot", default=DEFAULT_PLOT,
                        help="where to write the loss curve (default: %(default)s)")
    options = parser.parse_args()
    curve = train(options.steps, device=options.device, plot=options.plot)
    print(f"loss {curve[0]:.3f} -> {curve[-1]:.3f}")
