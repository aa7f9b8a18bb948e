"""examples/serve_llama.py: continuous batching over a transformers Llama, its batch padded to buckets."""

import pytest
import torch

import dynaflow_fn as df
from example_loader import load_example

pytest.importorskip("transformers")


def test_the_serving_loop_gives_generates_tokens_with_one_plan_per_bucket():
    numbers = load_example("serve_llama").main(["--requests", "6", "--check", "3", "--no-progress"])
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
