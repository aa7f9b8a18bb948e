"""examples/compile_hf_llama.py: an unmodified Hugging Face Llama under torch.compile with df.compile_backend."""


import pytest
import torch

from example_loader import load_example

pytest.importorskip("transformers")


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches are global: start and leave them empty so other tests see no stale graphs."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()



@pytest.mark.slow
def test_example_runs_llama_through_df_jit_and_matches_eager(fresh_dynamo):
    difference, backend = load_example("compile_hf_llama").main(calls=2)
    assert difference < 1e-3
    assert backend.graphs, "Dynamo handed no graph to df.compile_backend"
    for jitted in backend.graphs:
        info = jitted.cache_info()
        assert info.misses == 1 and info.hits >= 2, info   # planned once, then every call served from the cache
