"""Serving clients, side by side on one GPU: transformers' generate() with a static KV cache.

Each case generates greedily from a batch of prompts with `generation_config.cache_implementation =
"static"`, and every variant runs the same generate() call:

  eager          generate(..., disable_compile=True): the model's own PyTorch code
  hf-compile-ro  generate() as transformers runs it by default for a static cache: the forward compiled
                 by torch.compile(mode="reduce-overhead") (CUDA graphs of Inductor kernels)
  df             model.forward = torch.compile(model.forward, backend=df.compile_backend(), dynamic=False),
                 generate(..., disable_compile=True): every Dynamo graph through df.jit, default settings
  df-auto        the same with df.compile_backend(strategy="auto")

Reported per variant: tokens/s (new tokens of the whole batch over the median generate() time of
`--repeats` calls after the first), the first generate() in seconds (compilation and capture included)
and, for df, the CUDA-graph captures of all its graphs. Every variant's first-step logits are checked
against eager's (relative error under MAX_REL_ERR, bf16), and its tokens compared.

    python -m bench.serving [--cases llama qwen2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch

import dynaflow_fn as df

from .common import print_table, relative_error, release, write_results

MAX_REL_ERR = 5e-2
"""bf16 logits of a random-weight model through 8-28 layers differ by 1e-2 to 3e-2 between kernel choices
(Inductor's fusions against eager's kernels)."""
BATCH, PROMPT, NEW_TOKENS = 8, 128, 64

CONFIGS = {
    "llama": dict(family="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=8, vocab_size=32000),
    "qwen2": dict(family="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, vocab_size=32000),
}


def build_model(name: str) -> torch.nn.Module:
    import transformers as hf

    config = dict(CONFIGS[name])
    family = config.pop("family")
    classes = {"llama": (hf.LlamaConfig, hf.LlamaForCausalLM), "qwen2": (hf.Qwen2Config, hf.Qwen2ForCausalLM)}
    config_class, model_class = classes[family]
    torch.manual_seed(0)
    model = model_class(config_class(**config, max_position_embeddings=PROMPT + NEW_TOKENS + 64))
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    model.generation_config.cache_implementation = "static"
    model.generation_config.pad_token_id = 0
    return model


def generate(model: torch.nn.Module, ids: torch.Tensor, disable_compile: bool) -> Any:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, disable_compile=disable_compile, return_dict_in_generate=True,
                              output_logits=True)


def measure(model: torch.nn.Module, ids: torch.Tensor, disable_compile: bool, repeats: int) -> dict[str, Any]:
    """The first generate()'s seconds, then the median of `repeats` more; the last call's output."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = generate(model, ids, disable_compile)
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    seconds = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = generate(model, ids, disable_compile)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    return {"first_generate_s": first, "generate_s": median, "tokens_per_s": ids.shape[0] * NEW_TOKENS / median,
            "out": out}


def variants() -> dict[str, Callable[[torch.nn.Module], tuple[bool, Any]]]:
    """Per variant: prepare the model, returning (disable_compile, the df backend or None)."""
    def eager(model):
        return True, None

    def hf_compile(model):
        return False, None

    def with_backend(**options):
        def prepare(model):
            backend = df.compile_backend(progress=False, **options)
            model.forward = torch.compile(model.forward, backend=backend, dynamic=False)
            return True, backend
        return prepare

    return {"eager": eager, "hf-compile-ro": hf_compile, "df": with_backend(), "df-auto": with_backend(strategy="auto")}


def run_case(name: str, repeats: int) -> list[dict[str, Any]]:
    case = f"generate {name} ({CONFIGS[name]['num_hidden_layers']} layers), batch {BATCH}, prompt {PROMPT}, " \
           f"{NEW_TOKENS} new tokens"
    ids = torch.randint(1, CONFIGS[name]["vocab_size"], (BATCH, PROMPT), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    rows, reference = [], None
    for variant, prepare in variants().items():
        model = build_model(name)
        disable_compile, backend = prepare(model)
        result = measure(model, ids, disable_compile, repeats)
        out = result.pop("out")
        if reference is None:
            reference = out
        captures = sum(g.cache_info().captures for g in backend.graphs) if backend is not None else None
        rows.append({"case": case, "variant": variant, "tokens_per_s": result["tokens_per_s"],
                     "median_ms": result["generate_s"] * 1e3, "first_generate_s": result["first_generate_s"],
                     "captures": captures, "graphs": len(backend.graphs) if backend is not None else None,
                     "first_logits_rel_err": relative_error(out.logits[0], reference.logits[0]),
                     "tokens_match": float((out.sequences == reference.sequences).float().mean())})
        del model, backend, out
        release()
    peer = next(row["tokens_per_s"] for row in rows if row["variant"] == "hf-compile-ro")
    for row in rows:
        row["vs_hf_compile_ro"] = row["tokens_per_s"] / peer
        row["logits_ok"] = row["first_logits_rel_err"] <= MAX_REL_ERR
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", choices=sorted(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench.serving needs a CUDA device; skipped")
        return
    rows = []
    for name in args.cases:
        rows += run_case(name, args.repeats)
    print_table(rows, ["case", "variant", "tokens_per_s", "vs_hf_compile_ro", "first_generate_s", "captures",
                       "graphs", "first_logits_rel_err", "tokens_match"], title="transformers generate(), static cache")
    path = write_results("serving", rows, batch=BATCH, prompt=PROMPT, new_tokens=NEW_TOKENS, max_rel_err=MAX_REL_ERR)
    print(f"wrote {path}")
    wrong = [f"{row['case']} {row['variant']}: {row['first_logits_rel_err']:.3g}" for row in rows if not row["logits_ok"]]
    if wrong:
        raise SystemExit(f"first-step logits differ from eager's by more than {MAX_REL_ERR} (relative): {wrong}")


if __name__ == "__main__":
    main()
