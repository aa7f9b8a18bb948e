"""An unmodified Hugging Face Llama under torch.compile, with dynaflow_fn as the backend.

Dynamo captures the graphs of `LlamaForCausalLM.forward` and `df.compile_backend` hands each to
df.jit: on a GPU every stage is compiled by TorchInductor and the plan replays as one CUDA graph; on
the CPU df.jit interprets the plan with aten kernels. The model is a tiny random-weight config
(nothing is downloaded). Checks the logits against eager PyTorch and prints the time of each call.

Then batches whose size changes on every call, each with a left-padded attention mask, through
`df.compile_backend(buckets=(2, 4, 8))`: once Dynamo has seen the batch change, it hands over one
graph for every size, and the backend pads the ids and the mask to the next bucket instead of planning
each size. Prints how many plans served how many sizes, and the rows computed for padding.

    python examples/compile_hf_llama.py
"""

import time

import torch

import dynaflow_fn as df

VOCAB = 128


def make_model(device: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).to(device).eval()


def timed_ms(call, device: str) -> float:
    """Milliseconds for one call, waiting for the GPU so that its work is counted."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    call()
    sync()
    return (time.perf_counter() - start) * 1e3


def main(calls: int = 4) -> tuple[float, df.CompileBackend]:
    """Compile, compare with eager and time `calls` calls; returns (max |difference|, the backend)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = make_model(device)
    ids = torch.randint(0, VOCAB, (2, 32), device=device)
    backend = df.compile_backend(backend="inductor" if device == "cuda" else "auto")
    compiled = torch.compile(model, backend=backend, dynamic=False)

    with torch.no_grad():                      # inference: each captured graph is planned as it is
        expected = model(ids, use_cache=False).logits
        got = compiled(ids, use_cache=False).logits
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)
        print(f"device: {device}   graphs captured by Dynamo and run by df.jit: {len(backend.graphs)}")
        print("call   eager ms   compiled ms")
        for index in range(calls):
            eager_ms = timed_ms(lambda: model(ids, use_cache=False), device)
            compiled_ms = timed_ms(lambda: compiled(ids, use_cache=False), device)
            print(f"{index + 1:4d}   {eager_ms:8.2f}   {compiled_ms:11.2f}")
    difference = (got - expected).abs().max().item()
    print(f"max |eager - compiled| = {difference:.3g}")
    return difference, backend


def changing_batches(sizes: tuple[int, ...] = (1, 3, 5, 2, 7, 8, 6)) -> tuple[float, df.CompileBackend]:
    """Call the model at each batch size in `sizes` through a bucketed backend; returns (max |difference|
    from eager, the backend)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = make_model(device)
    backend = df.compile_backend(buckets=(2, 4, 8))
    compiled = torch.compile(model, backend=backend)
    difference = 0.0
    with torch.no_grad():
        for rows in sizes:
            ids = torch.randint(0, VOCAB, (rows, 16), device=device)
            mask = torch.ones(rows, 16, dtype=torch.long, device=device)
            mask[0, :5] = 0                                          # the first prompt is left-padded
            got = compiled(input_ids=ids, attention_mask=mask).logits
            expected = model(input_ids=ids, attention_mask=mask).logits
            difference = max(difference, (got - expected).abs().max().item())
    padded = [jitted.cache_info() for jitted in backend.graphs if jitted.options.buckets is not None]
    plans = sum(info.entries for info in padded)
    waste = sum(info.padded_rows for info in padded) / max(sum(info.real_rows for info in padded), 1)
    print(f"batch sizes {list(sizes)}: {plans} bucket plans for the symbolic graph, padding {waste:.0%} of the rows; "
          f"max |eager - compiled| = {difference:.3g}")
    return difference, backend


if __name__ == "__main__":
    main()
    changing_batches()
