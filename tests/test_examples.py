"""The scripts of examples/ run and show what they promise: quickstart.py, what a new user sees first
(ops, steps, the same result, and why the CPU is no faster), and compile_hf_llama.py, an unmodified
Hugging Face Llama under torch.compile with df.compile_backend."""

import re

import pytest
import torch

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
