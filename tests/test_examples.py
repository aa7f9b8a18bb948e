"""The scripts of examples/ run and show what they promise: quickstart.py, what a new user sees first
(ops, steps, the same result, and why the CPU is no faster), compile_hf_llama.py, an unmodified
Hugging Face Llama under torch.compile with df.compile_backend, and serve_llama.py, continuous
batching over a transformers Llama with its batch padded to buckets."""

import re
import warnings

import pytest
import torch

import dynaflow_fn as df
from example_loader import load_example


@pytest.mark.slow
def test_quickstart_prints_ops_and_steps_and_matches_eager(capsys):
    load_example("quickstart").main()
    printed = capsys.readouterr().out
    program, plan = printed.split("# Plan ", 1)
    assert re.search(r"^    \w+: \S.* = aten\.\w+", program, re.MULTILINE), program      # an op of the program
    assert re.search(r"^steps:\n    s0 \w+", plan, re.MULTILINE), plan                  # a step of the plan
    difference = float(re.search(r"max \|eager - df\.jit\| = (\S+)", printed)[1])
    assert difference < 1e-5
    if not torch.cuda.is_available():
        assert "no speed-up is\nexpected" in printed


@pytest.mark.slow
def test_compile_hf_llama_runs_llama_through_df_jit_and_matches_eager(fresh_dynamo):
    pytest.importorskip("transformers")
    difference, backend = load_example("compile_hf_llama").main(calls=2)
    assert difference < 1e-3
    assert backend.graphs, "Dynamo handed no graph to df.compile_backend"
    for jitted in backend.graphs:
        info = jitted.cache_info()
        assert info.misses == 1 and info.hits >= 2, info   # planned once, then every call served from the cache


@pytest.mark.slow
def test_compile_hf_llama_pads_changing_batches_with_their_masks_to_the_buckets(fresh_dynamo):
    pytest.importorskip("transformers")
    difference, backend = load_example("compile_hf_llama").changing_batches((1, 3, 5, 2, 7))
    assert difference < 1e-3
    (padded,) = [jitted for jitted in backend.graphs if jitted.options.buckets is not None]
    info = padded.cache_info()
    assert info.entries == 3 and info.real_rows == 3 + 5 + 2 + 7       # Dynamo gives a batch of 1 a graph of its own
    assert sum(axis == 0 for axis in padded.options.in_axes) == 2       # the ids and the attention mask


# --- examples/serve_llama.py: continuous batching, the batch padded to buckets --------------------------


def test_the_serving_loop_gives_generates_tokens_with_one_plan_per_bucket():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        numbers = load_example("serve_llama").main(["--requests", "6", "--check", "3", "--no-progress"])
    assert not [str(w.message) for w in caught if "with buckets" in str(w.message)]   # padding is exact
    assert numbers["mismatched"] == []                        # greedy tokens equal transformers' generate()
    info = numbers["cache_info"]
    assert info.entries == info.misses <= 4                   # the buckets 1, 2, 4, 8: each planned once
    assert info.hits > 4 * info.misses                         # every later step replays its bucket's plan
    assert info.real_rows > 0 and info.padded_rows < info.real_rows
    for plan in numbers["step"].plans():
        assert len(plan.streams) >= 2                          # decode and prefill attention beside each other
        df.verify(plan)


def test_requests_arrive_over_time_and_slots_are_reused():
    example = load_example("serve_llama")
    requests = example.make_requests(20, (4, 12), (2, 6), vocab=128, seed=1)
    scheduler = example.RequestScheduler(requests, slots=4, chunk=8)
    seen_slots, step = set(), 0
    while not scheduler.finished():
        scheduler.admit(step)
        assert len(scheduler.running) <= 4
        batch, prefilling = scheduler.schedule()
        for request in batch:                                   # what a step of the model would return
            request.generated.append(0)
        if prefilling is not None:
            prefilling.prefilled = min(len(prefilling.prompt), prefilling.prefilled + 8)
            if prefilling.prefilled == len(prefilling.prompt):
                prefilling.generated.append(0)
        seen_slots |= {r.slot for r in scheduler.running}
        scheduler.retire()
        step += 1
    assert all(r.done for r in requests) and seen_slots == {0, 1, 2, 3}
    assert torch.tensor([r.arrival for r in requests]).diff().ge(0).all()
