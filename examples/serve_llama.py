"""Continuous batching over a transformers Llama: requests arrive and finish, each step's batch is
padded to a bucket and replayed as one CUDA graph, prefill chunks run beside the decode tokens.

The pieces, as a serving engine has them:

* `KVCache`: a static key/value cache of a fixed number of slots, one per running request, plus a
  dummy slot that padded rows write to and read from, so they never touch a real request's cache;
* `RequestScheduler`: admits arriving requests into free slots, and each step picks the decode batch
  (one token of every request past its prompt) and at most one prefill chunk (the next `chunk` prompt
  tokens of the oldest request still reading its prompt); it retires requests once they are done;
* `model_step`: one forward of the model's own modules (embedding, RMSNorms, projections, rotary
  embedding, MLPs, head: the transformers Llama's weights and code) over the step's decode tokens and
  chunk tokens together, with attention over the slot cache: decode attention and prefill attention
  are two `df.region`s, which `T.overlap(strategy="branches")` runs on two streams;
* `df.jit(step, buckets=..., in_axes=..., pad_value=...)`: the decode batch changes every step; it is
  padded to the next bucket (padded rows: token 0, position 0, the dummy slot), one plan per bucket,
  all of them in one memory pool.

At the end the tokens of a few requests are checked against transformers' `generate` (greedy).

    python examples/serve_llama.py                   # CPU: a tiny model, a few seconds
    python examples/serve_llama.py --device cuda     # a GPU: a bigger model, more requests
"""

import argparse
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

import dynaflow_fn as df
from dynaflow_fn import transforms as T
from dynaflow_fn.ir.progress import progress_bar   # tqdm, one line in a log instead of one per step
from dynaflow_fn.jitting.buckets import SERVING_BUCKETS

CONFIGS = {
    "cpu": dict(model=dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2),
                slots=8, chunk=16, requests=12, prompt=(4, 40), new_tokens=(4, 24)),
    "cuda": dict(model=dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                            num_attention_heads=16, num_key_value_heads=4),
                 slots=64, chunk=256, requests=256, prompt=(16, 512), new_tokens=(16, 128)),
}


@dataclass
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    arrival: int                                   # the step at which it arrives
    slot: int | None = None
    prefilled: int = 0                             # prompt tokens in the cache
    generated: list[int] = field(default_factory=list)

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt) and not self.done

    @property
    def done(self) -> bool:
        return len(self.generated) == self.max_new_tokens


class KVCache:
    """Keys and values of every layer: [slots + 1, max_len, kv_heads, head_dim]; slot `dummy` is the padded rows'."""

    def __init__(self, config: Any, slots: int, max_len: int, device: str, dtype: torch.dtype):
        shape = (slots + 1, max_len, config.num_key_value_heads, config.hidden_size // config.num_attention_heads)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.dummy = slots


class RequestScheduler:
    """Which requests run in each step (see the module docstring)."""

    def __init__(self, requests: list[Request], slots: int, chunk: int):
        self.pending = sorted(requests, key=lambda r: r.arrival)
        self.running: list[Request] = []
        self.free = list(range(slots))
        self.chunk = chunk

    def admit(self, step: int) -> None:
        while self.pending and self.pending[0].arrival <= step and self.free:
            request = self.pending.pop(0)
            request.slot = self.free.pop(0)
            self.running.append(request)

    def schedule(self) -> tuple[list[Request], Request | None]:
        """The requests decoding one token each, and the request whose next prompt chunk is prefilled."""
        prefilling = [r for r in self.running if r.prefilled < len(r.prompt)]
        return [r for r in self.running if r.decoding], (prefilling[0] if prefilling else None)

    def retire(self) -> None:
        for request in [r for r in self.running if r.done]:
            self.running.remove(request)
            self.free.append(request.slot)

    def finished(self) -> bool:
        return not self.pending and not self.running


def decode_inputs(batch: list[Request], device: str) -> dict[str, torch.Tensor]:
    """The decode tokens of a step: each request's last token, at its position, in its slot."""
    ints = lambda values: torch.tensor(values, dtype=torch.long, device=device)   # noqa: E731
    return {"tokens": ints([r.generated[-1] for r in batch]),
            "positions": ints([len(r.prompt) + len(r.generated) - 1 for r in batch]),
            "slots": ints([r.slot for r in batch])}


def chunk_inputs(request: Request | None, chunk: int, dummy: int, device: str) -> dict[str, torch.Tensor]:
    """The next `chunk` prompt tokens of `request`; tokens past its prompt (or all, without a request)
    write the dummy slot. `last` is the index of its last real token, whose logits give the next one."""
    start = request.prefilled if request is not None else 0
    tokens = request.prompt[start:start + chunk] if request is not None else []
    real = len(tokens)
    slot = request.slot if request is not None else dummy
    ints = lambda values: torch.tensor(values, dtype=torch.long, device=device)   # noqa: E731
    return {"tokens": ints(tokens + [0] * (chunk - real)),
            "positions": ints([start + i if i < real else i for i in range(chunk)]),
            "slots": ints([slot] * real + [dummy] * (chunk - real)),
            "slot": ints([slot]), "last": ints([max(real - 1, 0)])}


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_positions: torch.Tensor,
           groups: int) -> torch.Tensor:
    """Attention of queries [n, heads, q, dim] over cached keys/values [n, max_len, kv_heads, dim], each
    query seeing the cache up to its own position."""
    keys, values = (t.transpose(1, 2).repeat_interleave(groups, dim=1) for t in (keys, values))
    visible = torch.arange(keys.shape[2], device=q.device) <= query_positions[..., None]   # [n, q, max_len]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None])


def model_step(model: Any, keys: list[torch.Tensor], values: list[torch.Tensor], decode: dict[str, torch.Tensor],
               chunk: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One step: the next token of every decode row, and of the chunk's last real token (greedy)."""
    llama, rows = model.model, decode["tokens"].shape[0]
    tokens = torch.cat([decode["tokens"], chunk["tokens"]])
    positions = torch.cat([decode["positions"], chunk["positions"]])
    slots = torch.cat([decode["slots"], chunk["slots"]])
    x = llama.embed_tokens(tokens)
    cos, sin = llama.rotary_emb(x[None], positions[None])
    for layer, layer_keys, layer_values in zip(llama.layers, keys, values):
        attention = layer.self_attn
        heads, dim = attention.config.num_attention_heads, attention.head_dim
        h = layer.input_layernorm(x)
        q = attention.q_proj(h).view(1, -1, heads, dim).transpose(1, 2)
        k = attention.k_proj(h).view(1, -1, attention.config.num_key_value_heads, dim).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        layer_keys[slots, positions] = k[0].transpose(0, 1)            # write this step's keys and values first
        layer_values[slots, positions] = attention.v_proj(h).view(-1, *layer_values.shape[2:])
        groups = attention.num_key_value_groups
        with df.region("decode_attn"):                                  # one query per request
            cached = (layer_keys[decode["slots"]], layer_values[decode["slots"]])
            decoded = attend(q[0, :, :rows].transpose(0, 1)[:, :, None], *cached, decode["positions"][:, None], groups)
            decoded = decoded.reshape(rows, heads * dim)
        with df.region("prefill_attn"):                                 # the chunk's queries, one request
            cached = (layer_keys[chunk["slot"]], layer_values[chunk["slot"]])
            prefilled = attend(q[:, :, rows:], *cached, chunk["positions"][None], groups)
            prefilled = prefilled[0].transpose(0, 1).reshape(-1, heads * dim)
        x = x + attention.o_proj(torch.cat([decoded, prefilled]))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    picked = torch.cat([x[:rows], x[rows:][chunk["last"]]])          # the chunk's rows follow the decode rows
    logits = model.lm_head(llama.norm(picked))
    next_tokens = logits.argmax(-1)
    return next_tokens[:rows], next_tokens[rows:]


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, k, cos, sin)


def decode_buckets(slots: int) -> tuple[int, ...]:
    """The decode batch sizes planned: df's serving buckets below `slots`, and `slots`."""
    return tuple(sorted({b for b in SERVING_BUCKETS if b < slots} | {slots}))


def jitted_step(model: Any, cache: KVCache, slots: int, overlap: str) -> Callable[..., Any]:
    """`model_step` under df.jit, its decode batch padded to buckets up to `slots`."""
    def step(keys, values, decode, chunk):
        return model_step(model, keys, values, decode, chunk)

    if overlap == "branches":
        step = T.overlap(T.partition(step, rules=[T.Region("decode_attn"), T.Region("prefill_attn")]),
                         strategy="branches")
    padded = {"tokens": 0, "positions": 0, "slots": cache.dummy}     # harmless rows: the dummy slot
    return df.jit(step, buckets=decode_buckets(slots), in_axes=(None, None, 0, None), out_axes=(0, None),
                  pad_value=(None, None, padded, None))


def make_requests(count: int, prompt: tuple[int, int], new_tokens: tuple[int, int], vocab: int,
                  seed: int) -> list[Request]:
    """Requests with random prompts and lengths, arriving a few steps apart."""
    rng, arrival, requests = random.Random(seed), 0, []
    for index in range(count):
        length = rng.randint(*prompt)
        requests.append(Request(index, [rng.randrange(1, vocab) for _ in range(length)], rng.randint(*new_tokens),
                                arrival))
        arrival += rng.choice((0, 0, 1, 2, 4))
    return requests


def serve(requests: list[Request], step: Callable[..., Any], cache: KVCache, slots: int, chunk: int,
          device: str, progress: bool = True) -> dict[str, float]:
    """The decode loop: every step admits, schedules, runs `step` and retires, until all requests are done."""
    scheduler = RequestScheduler(requests, slots, chunk)
    bar = progress_bar(total=sum(r.max_new_tokens for r in requests), desc="serve", unit="tok", disable=not progress)
    steps = generated = 0
    start = time.perf_counter()
    while not scheduler.finished():
        scheduler.admit(steps)
        batch, prefilling = scheduler.schedule()
        steps += 1
        if not batch and prefilling is None:
            continue
        decoded, chunk_next = step(cache.keys, cache.values, decode_inputs(batch, device),
                                   chunk_inputs(prefilling, chunk, cache.dummy, device))
        for request, token in zip(batch, decoded.tolist()):
            request.generated.append(token)
        new = len(batch)
        if prefilling is not None:
            prefilling.prefilled = min(len(prefilling.prompt), prefilling.prefilled + chunk)
            if prefilling.prefilled == len(prefilling.prompt):
                prefilling.generated.append(int(chunk_next.item()))      # its prompt's last logits
                new += 1
        generated += new
        bar.update(new)
        bar.set_postfix_str(f"batch {len(batch)}", refresh=False)
        scheduler.retire()
    bar.close()
    seconds = time.perf_counter() - start
    return {"steps": steps, "tokens": generated, "seconds": seconds, "tokens_per_s": generated / seconds}


def check_against_generate(model: Any, requests: list[Request], count: int) -> list[int]:
    """The ids of the first `count` requests whose tokens differ from transformers' greedy `generate`."""
    wrong = []
    for request in requests[:count]:
        ids = torch.tensor([request.prompt], device=model.device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=request.max_new_tokens,
                                 do_sample=False)
        if out[0, ids.shape[1]:].tolist() != request.generated:
            wrong.append(request.id)
    return wrong


def build_model(config: dict[str, Any], max_len: int, device: str, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config, max_position_embeddings=max_len)).to(device, dtype).eval()
    model.generation_config.eos_token_id = None           # generate as many tokens as asked, as the loop does
    model.generation_config.pad_token_id = 0
    return model


def main(argv: list[str] | None = None, make_step: Callable[..., Callable[..., Any]] | None = None) -> dict[str, Any]:
    """Serve the requests, check a few against `generate`; returns the numbers printed and the `step`.
    `make_step(model, cache, slots, overlap)` replaces df.jit's step (a benchmark's peer)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--requests", type=int, help="how many requests (default: per device)")
    parser.add_argument("--overlap", default="branches", choices=("branches", "none"),
                        help="run decode and prefill attention on two streams (pays on a GPU)")
    parser.add_argument("--check", type=int, default=3, help="requests checked against transformers' generate")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    setup = CONFIGS[args.device]
    requests = make_requests(args.requests or setup["requests"], setup["prompt"], setup["new_tokens"],
                             setup["model"]["vocab_size"], seed=0)
    max_len = setup["prompt"][1] + setup["new_tokens"][1] + setup["chunk"]
    model = build_model(setup["model"], max_len, args.device, torch.float32)
    cache = KVCache(model.config, setup["slots"], max_len, args.device, torch.float32)
    step = (make_step or jitted_step)(model, cache, setup["slots"], args.overlap)
    with torch.no_grad():
        numbers = serve(requests, step, cache, setup["slots"], setup["chunk"], args.device, not args.no_progress)
    numbers["mismatched"] = check_against_generate(model, requests, args.check)
    numbers["cache_info"] = step.cache_info() if isinstance(step, df.Jitted) else None
    print(f"{numbers['tokens']} tokens in {numbers['steps']} steps, {numbers['tokens_per_s']:.0f} tokens/s; "
          f"{numbers['cache_info']}")
    print(f"tokens of {args.check} requests against transformers' generate: "
          + ("all equal" if not numbers["mismatched"] else f"requests {numbers['mismatched']} differ"))
    return {**numbers, "step": step}


if __name__ == "__main__":
    raise SystemExit(1 if main()["mismatched"] else 0)
