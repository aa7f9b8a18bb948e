"""df.compile_backend(buckets=...): a Dynamo graph whose batch size is symbolic pads the tensors the
model is called with to the next bucket, instead of planning every size."""

import warnings

import pytest
import torch
from torch import nn

import dynaflow_fn as df
from dynaflow_fn.errors import InputError
from models import CAUSAL_LMS, Block, causal_lm_inputs, tiny_causal_lm, tiny_moe


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo's caches are global: start and leave them empty so other tests see no stale graphs."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _padded_graphs(backend):
    return [jitted for jitted in backend.graphs if jitted.options.buckets is not None]


def test_a_symbolic_batch_is_padded_to_the_buckets_and_the_parameters_never_are():
    model = nn.Sequential(Block(), Block()).eval()
    backend = df.compile_backend(buckets=(2, 4, 8), progress=False)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for rows in (3, 5, 7, 6, 8, 2, 5):
            x = torch.randn(rows, 6, 32)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    (padded,) = _padded_graphs(backend)                      # Dynamo's graph with a symbolic batch
    assert [axis for axis in padded.options.in_axes if axis is not None] == [0]   # x alone: no parameter
    info = padded.cache_info()
    assert info.real_rows == 5 + 7 + 6 + 8 + 2 + 5                # 3 rows went to Dynamo's first, static graph
    assert info.padded_rows == 3 + 1 + 2 + 0 + 0 + 3 and info.entries == 2   # the plans of 8 and 2 rows
    replayers = [r for rs in padded._cache.values() for r in rs]
    assert len({id(r.memory) for r in replayers}) == 1         # one memory pool for the graph's buckets


def test_a_graph_with_the_batch_inside_another_dimension_is_planned_per_size_after_a_warning():
    class Flattening(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x).reshape(-1, 8)                 # [batch * 3, 8]: no dimension 0 of rows

    model = Flattening().eval()
    backend = df.compile_backend(buckets=(4, 8), progress=False)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad(), pytest.warns(UserWarning, match="cannot pad this graph"):
        for rows in (2, 3, 5):
            x = torch.randn(rows, 3, 8)
            torch.testing.assert_close(compiled(x), model(x))
    assert not _padded_graphs(backend)


class MaskedByIndex(nn.Module):
    """Reads the mask's rows by indexing, as transformers' mask functions do: no op needs the two batch
    sizes equal, so Dynamo leaves them two symbols."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)

    def forward(self, ids, mask):
        rows = mask[torch.arange(ids.shape[0])]
        return (self.embed(ids) * rows[:, :, None]).sum(1)


@pytest.mark.parametrize("fn", [
    lambda x: x * x.shape[0],                                           # the batch size as a factor
    lambda x: torch.full((x.shape[0],), float(x.shape[0])) + x[:, 0],   # ... as a fill value
    lambda x: x + x[x.shape[0] - 1],                                    # ... as the index of the last row
    lambda x: x + torch.arange(x.shape[0], 0, -1)[:, None],             # ... as where a count starts
    lambda x: torch.softmax(x, 0),                                      # rows that read each other
    lambda x: x - x.mean(0),
    lambda x: x.flip(0),
    lambda x: x.repeat(1, x.shape[0]).sum(-1),                          # the batch size sizes a later dimension
    lambda x: x[:, None].expand(x.shape[0], x.shape[0], 4).sum(1),
    lambda x: x * torch.ones(x.shape[0], x.shape[0]).sum(1, keepdim=True),
    lambda x: x * x.new_ones(x.shape[0]).cumsum(0).flip(0)[:, None],    # rows made in the graph, mixed
    lambda x: x + torch.ones(x.shape[0]).sum(),
    lambda x: x + torch.arange(x.shape[0])[-1],
    lambda x: x * (torch.ones(1, x.shape[0]) @ torch.ones(x.shape[0], 1)),
    lambda x: x.T.reshape(x.shape[0], -1),                              # each row takes parts of several rows
    lambda x: torch.nn.functional.group_norm(x.T[None], 1)[0].T,
    lambda x: torch.nn.functional.cross_entropy(x, x.argmax(1)),        # a loss over the rows' targets
    lambda x: torch.cat(torch.split(x, 2), 0) * 2,                      # a graph per count of pieces
], ids=["factor", "fill", "last-row", "arange-start", "softmax-over-rows", "minus-batch-mean", "flip",
        "repeat-then-sum", "expand-then-sum", "ones-square-summed", "made-rows-flipped", "made-rows-summed",
        "made-rows-last", "made-rows-contracted", "transposed-reshape", "group-norm-over-the-batch",
        "cross-entropy", "split-then-cat"])
def test_a_graph_padding_would_change_is_planned_per_size_after_a_warning(fn):
    backend = df.compile_backend(buckets=(2, 4, 8), progress=False)
    compiled = torch.compile(fn, backend=backend)
    with torch.no_grad(), pytest.warns(UserWarning, match="cannot pad this graph"):
        for rows in (2, 3, 5, 3):
            x = torch.randn(rows, 4)
            torch.testing.assert_close(compiled(x), fn(x))
    assert all(jitted.cache_info().padded_rows == 0 for jitted in backend.graphs)


def test_sizes_that_only_shape_tensors_or_count_all_rows_are_padded():
    def fn(x):
        rows = x.shape[0]
        return x.view(rows, 2, -1).sum(1) + torch.arange(rows)[:, None] + torch.zeros(rows, 1) + x[:rows, :2]

    backend = df.compile_backend(buckets=(4, 8), progress=False)
    compiled = torch.compile(fn, backend=backend)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        for rows in (2, 3, 5, 7):
            x = torch.randn(rows, 4)
            torch.testing.assert_close(compiled(x), fn(x))
    (padded,) = _padded_graphs(backend)
    assert padded.cache_info().padded_rows == 1 + 3 + 1


def test_a_tensor_read_by_the_batch_rows_under_a_second_symbol_is_padded_with_the_batch():
    model = MaskedByIndex().eval()
    backend = df.compile_backend(buckets=(4, 8), progress=False)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        for rows in (2, 3, 5, 3, 8):                 # padding the ids alone would index past the mask's rows
            ids, mask = torch.randint(0, 16, (rows, 6)), torch.rand(rows, 6)
            torch.testing.assert_close(compiled(ids, mask), model(ids, mask))
    (padded,) = _padded_graphs(backend)
    assert padded.options.in_axes == (0, 0, None)            # ids, mask, the embedding
    info = padded.cache_info()
    assert info.entries == 2 and info.padded_rows == 1 + 3 + 1 + 0   # 2 rows went to Dynamo's static graph


def test_a_call_whose_second_symbol_has_other_rows_runs_a_plan_of_its_exact_sizes():
    class FirstRowsOfTheMask(MaskedByIndex):
        """Reads as many rows of the mask as the ids have, whatever the mask holds beyond them."""

    model = FirstRowsOfTheMask().eval()
    backend = df.compile_backend(buckets=(4, 8), progress=False)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for rows, mask_rows in ((2, 2), (3, 3), (3, 5), (5, 5), (3, 7)):
            ids, mask = torch.randint(0, 16, (rows, 6)), torch.rand(mask_rows, 6)
            torch.testing.assert_close(compiled(ids, mask), model(ids, mask))
    (padded,) = _padded_graphs(backend)
    assert padded.cache_info().real_rows == 3 + 5                   # the calls whose rows agree
    exact = [jitted for jitted in backend.graphs if jitted.options.buckets is None]
    assert len(exact) == 1 + 2                 # Dynamo's first, static graph; the calls of (3, 5) and (3, 7)


def test_a_second_symbol_read_otherwise_is_not_guessed_the_graph_is_planned_per_size():
    class AveragedImages(nn.Module):
        """Adds the mean of the image embeddings to every row: as many images as rows only by chance, so
        padding them with the batch would change the mean."""

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(16, 8)

        def forward(self, ids, images):
            return self.embed(ids).sum(1) + images.mean(0)

    model = AveragedImages().eval()
    backend = df.compile_backend(buckets=(4, 8), progress=False)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad(), pytest.warns(UserWarning, match="under another symbol.*in_axes="):
        for rows in (2, 3, 5, 3):
            ids, images = torch.randint(0, 16, (rows, 6)), torch.rand(rows, 8)
            torch.testing.assert_close(compiled(ids, images), model(ids, images))
    assert not _padded_graphs(backend)


def test_a_second_symbol_is_not_guessed_even_where_its_rows_differ_when_dynamo_makes_the_graph():
    class SlicedByTheBatch(nn.Module):
        """Reads as many image rows as the batch has, by slicing: padded ids alone would slice past them."""

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(16, 8)

        def forward(self, ids, images):
            return self.embed(ids).sum(1) + images[:ids.shape[0]]

    model = SlicedByTheBatch().eval()
    backend = df.compile_backend(buckets=(4, 8), progress=False)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad(), pytest.warns(UserWarning, match="under another symbol"):
        for rows, images in ((2, 2), (3, 5), (5, 5), (3, 6)):      # Dynamo's symbolic graph is made at (3, 5)
            ids, images = torch.randint(0, 16, (rows, 6)), torch.rand(images, 8)
            torch.testing.assert_close(compiled(ids, images), model(ids, images))
    assert not _padded_graphs(backend)


@pytest.mark.parametrize("name", CAUSAL_LMS)
def test_a_transformers_forward_with_an_attention_mask_is_padded_to_the_buckets(name):
    """Every family makes rows from the batch size (mask and rotary tables) and some mix rows
    (Mixtral sorts its tokens by expert), yet none in a way padding changes: each is padded."""
    model = tiny_causal_lm(name)
    backend = df.compile_backend(buckets=(4, 8), progress=False)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for rows in (2, 3, 5, 7, 3):
            ids, mask = causal_lm_inputs(name, rows)
            expected = model(input_ids=ids, attention_mask=mask).logits
            torch.testing.assert_close(compiled(input_ids=ids, attention_mask=mask).logits, expected)
    (padded,) = _padded_graphs(backend)
    assert sum(axis == 0 for axis in padded.options.in_axes) == 2   # the ids and the mask
    assert padded.cache_info().entries == 2


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_a_mixture_of_experts_with_a_growing_cache_is_padded_to_the_buckets(name):
    """Without a mask, transformers grows each layer's cache from `torch.tensor([])`, which `cat` skips;
    the analysis follows the rows past it, into the experts' dispatch (a sort by expert and back)."""
    model = tiny_moe(name)
    backend = df.compile_backend(buckets=(4, 8), progress=False)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for rows in (2, 3, 5, 7):
            ids = torch.randint(0, 128, (rows, 6))
            torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits)
    assert len(_padded_graphs(backend)) == 1


def test_df_jit_pads_what_in_axes_names_where_the_backend_cannot_tell():
    model = MaskedByIndex().eval()
    fast = df.jit(model, buckets=(4, 8), in_axes=(0, 0), progress=False)
    with torch.no_grad():
        for rows in (2, 3, 5, 3):
            ids, mask = torch.randint(0, 16, (rows, 6)), torch.rand(rows, 6)
            torch.testing.assert_close(fast(ids, mask), model(ids, mask))
    info = fast.cache_info()
    assert info.entries == 2 and info.padded_rows == 2 + 1 + 3 + 1


def test_a_second_symbol_that_sizes_another_dimension_is_no_batch_and_the_batch_is_padded():
    class Positions(nn.Module):
        def forward(self, x, positions):                 # positions: [length], x: [batch, length]
            return x * positions

    model = Positions()
    backend = df.compile_backend(buckets=(4, 8), progress=False)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for rows, length in ((2, 2), (3, 3), (5, 3), (3, 5)):     # the length equals the batch at times
            x, positions = torch.randn(rows, length), torch.randn(length)
            torch.testing.assert_close(compiled(x, positions), model(x, positions))
    assert _padded_graphs(backend)


def test_a_graph_that_updates_a_tensor_of_the_batch_in_place_is_planned_per_size_after_a_warning():
    class WritesItsCache(nn.Module):
        """Writes the rows into a cache made for each batch, as transformers' StaticCache is: a padded copy
        of the cache would take the update instead."""

        def forward(self, x, cache):
            cache[:, 0] = x
            return cache.sum(1)

    model = WritesItsCache()
    backend = df.compile_backend(buckets=(4, 8), progress=False)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad(), pytest.warns(UserWarning, match="cannot pad this graph: it updates .*cache.* in place"):
        for rows in (2, 3, 5, 3):
            x = torch.randn(rows, 8)
            cache, expected_cache = torch.zeros(rows, 4, 8), torch.zeros(rows, 4, 8)
            torch.testing.assert_close(compiled(x, cache), model(x, expected_cache))
            torch.testing.assert_close(cache, expected_cache)
    assert all(jitted.cache_info().entries == 0 for jitted in _padded_graphs(backend))


def test_bad_buckets_are_refused_when_the_backend_is_made():
    with pytest.raises(InputError, match="sorted"):
        df.compile_backend(buckets=(8, 4))
