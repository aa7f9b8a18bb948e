"""df.jit(fn, buckets=...): each call padded to the next bucket, run by that bucket's plan, its outputs
cut back to the real rows; the bucket plans of one argument structure share their memory."""

import threading
import warnings

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dynaflow_fn as df
from dynaflow_fn import transforms as T
from dynaflow_fn.errors import InputError, TraceError
from dynaflow_fn.jitting.buckets import SERVING_BUCKETS, BatchLayout
from models import MLP, Block, guided_denoiser


def _features(x, scale):
    """Row-independent and free of GEMMs: exact whatever the batch size its kernels see."""
    return torch.softmax(F.layer_norm(x, x.shape[-1:]) * scale, dim=-1) + F.gelu(x).cumsum(-1)


def _replayers(fast):
    return [replayer for replayers in fast._cache.values() for replayer in replayers]


@pytest.mark.filterwarnings("ignore:_features has been traced")
def test_padding_is_exact_at_every_batch_size():
    fast = df.jit(_features, buckets=(1, 2, 4, 8, 12), in_axes=(0, None), backend="eager")
    exact = df.jit(_features, backend="eager")
    scale = torch.randn(16)
    for rows in range(1, 13):
        x = torch.randn(rows, 5, 16)
        got = fast(x, scale)
        assert got.shape == (rows, 5, 16)
        torch.testing.assert_close(got, exact(x, scale), rtol=0, atol=0)     # bit for bit, the plan at that size
        torch.testing.assert_close(got, _features(x, scale), rtol=0, atol=0)


@pytest.mark.parametrize("model", ["mlp", "block"])
def test_a_model_padded_computes_what_it_computes_on_the_padded_batch(model):
    """GEMM kernels choose their blocking by the row count, so a row's bits can differ between a batch
    of 5 and one of 8 (eager PyTorch alike): padded, a row is what eager computes at the bucket's size,
    bit for bit, and what it computes at the real size within the dtype's tolerance."""
    module, shape = (MLP(), (32,)) if model == "mlp" else (Block(), (6, 32))
    fn, params = df.pure(module.eval())
    fast = df.jit(fn, buckets=(2, 4, 8), in_axes=(None, 0), backend="eager")
    for rows in range(1, 9):
        x = torch.randn(rows, *shape)
        bucket = next(b for b in (2, 4, 8) if b >= rows)
        padded = torch.cat([x, x.new_zeros(bucket - rows, *shape)])
        got = fast(params, x)
        torch.testing.assert_close(got, fn(params, padded)[:rows], rtol=0, atol=0)
        torch.testing.assert_close(got, fn(params, x), rtol=1e-5, atol=1e-5)


def test_outputs_are_cut_along_out_axes_and_unbatched_ones_come_back_whole():
    def fn(w, x, y):                      # x batched on axis 0, y on axis 1
        return {"rows": x @ w, "cols": y * 2, "total": w.sum()}

    fast = df.jit(fn, buckets=(4, 8), in_axes=(None, 0, 1), out_axes={"rows": 0, "cols": 1, "total": None},
                  backend="eager")
    w, x, y = torch.randn(3, 3), torch.randn(5, 3), torch.randn(2, 5)
    got = fast(w, x, y)
    torch.testing.assert_close(got, fn(w, x, y))
    assert got["cols"].shape == (2, 5) and got["total"].shape == ()


def test_padded_rows_hold_the_pad_values_per_leaf():
    def fn(x, extra):
        return x["ids"] * 1, x["slots"] * 1, extra * 1

    fast = df.jit(fn, buckets=(4,), in_axes=(0, None), out_axes=None, pad_value=({"ids": 0, "slots": 7}, None),
                  backend="eager")
    ids, slots = torch.tensor([3, 4]), torch.tensor([1, 2])
    with pytest.warns(UserWarning, match=r"has the batch rows along axis 0, but out_axes None"):
        got_ids, got_slots, _ = fast({"ids": ids, "slots": slots}, torch.ones(2))
    assert got_ids.tolist() == [3, 4, 0, 0] and got_slots.tolist() == [1, 2, 7, 7]   # out_axes=None: as padded


def test_a_call_at_a_bucket_size_pads_and_copies_nothing(monkeypatch):
    fast = df.jit(_features, buckets=(2, 4), in_axes=(0, None), backend="eager")
    scale = torch.randn(8)
    fast(torch.randn(3, 8), scale)                      # plans the buckets
    padded = []
    original = BatchLayout.pad
    monkeypatch.setattr(BatchLayout, "pad", lambda self, *a: padded.append(a[1:]) or original(self, *a))
    x = torch.randn(4, 8)
    assert fast(x, scale).shape == (4, 8) and not padded
    fast(torch.randn(3, 8), scale)
    assert padded == [(3, 4)]


def test_keyword_tensors_are_padded_along_axis_0_as_microbatch_splits_them():
    def fn(w, x, mask):
        return (x @ w) * mask

    fast = df.jit(fn, buckets=(4,), in_axes=(None, 0), backend="eager")
    w, x, mask = torch.randn(3, 3), torch.randn(3, 3), torch.rand(3, 3)
    torch.testing.assert_close(fast(w, x, mask=mask), fn(w, x, mask))


def test_a_batch_past_the_largest_bucket_runs_a_plan_of_its_own_size_and_warns_once():
    fast = df.jit(_features, buckets=(2, 4), in_axes=(0, None), backend="eager")
    scale = torch.randn(8)
    with pytest.warns(UserWarning, match="more than its largest bucket"):
        torch.testing.assert_close(fast(torch.randn(6, 8), scale).shape, torch.Size([6, 8]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x = torch.randn(7, 8)
        torch.testing.assert_close(fast(x, scale), _features(x, scale))
    shapes = [tuple(r.plan.slots[r.plan.input_slots[0]].layout.shape) for r in _replayers(fast)]
    assert shapes == [(6, 8), (7, 8)]                     # each its own plan; no bucket plan was needed


def test_trace_and_lower_show_the_plan_of_the_bucket():
    fast = df.jit(_features, buckets=(8,), in_axes=(0, None), backend="eager")
    x, scale = torch.randn(3, 8), torch.randn(8)
    assert "f32[8, 8]" in str(fast.trace(x, scale))
    assert fast.lower(x, scale).signature == fast.trace(x, scale).signature


def test_serving_buckets_are_vllms_list_up_to_256():
    assert SERVING_BUCKETS == (1, 2, 4) + tuple(range(8, 256, 8)) + (256,)
    assert len(SERVING_BUCKETS) == 35
    fast = df.jit(_features, buckets="serving", in_axes=(0, None), backend="eager")
    assert fast.options.buckets == SERVING_BUCKETS


@pytest.mark.parametrize("options, message", [
    (dict(buckets=(4, 2), in_axes=0), "sorted"),
    (dict(buckets=(2, 2, 4), in_axes=0), "more than once"),
    (dict(buckets=(0, 2), in_axes=0), "positive"),
    (dict(buckets=(1, -4), in_axes=0), "positive"),
    (dict(buckets=(1, True), in_axes=0), "positive"),
    (dict(buckets=(), in_axes=0), "empty"),
    (dict(buckets="vllm", in_axes=0), "'serving'"),
    (dict(buckets=(1, 2)), "pass in_axes"),
    (dict(in_axes=0), "strategy='auto' or buckets"),
    (dict(out_axes=1), "pass buckets"),
    (dict(pad_value=1.0), "pass buckets"),
    (dict(buckets=(2,), in_axes=0, out_axes="mean"), "out_axes leaves"),
    (dict(buckets=(2,), in_axes=0, pad_value="x"), "pad_value leaves"),
])
def test_bad_bucket_options_are_input_errors(options, message):
    with pytest.raises(InputError, match=message):
        df.jit(_features, **options)


@pytest.mark.parametrize("call, message", [
    (lambda fast, p, x: fast(p, x, x[:2]), "disagree on the batch size"),
    (lambda fast, p, x: fast(p, x), "no pytree prefix"),
])
def test_calls_that_do_not_fit_in_axes_are_input_errors(call, message):
    fast = df.jit(lambda p, x, y=None: x * 2, buckets=(4,), in_axes=(None, 0, 0), backend="eager")
    with pytest.raises(InputError, match=message):
        call(fast, {"w": torch.randn(3)}, torch.randn(3, 3))


@pytest.mark.parametrize("dtype, pad_value", [(torch.uint8, 300), (torch.int64, 2**70), (torch.bool, 2),
                                             (torch.float16, 1e6)])
def test_a_pad_value_its_dtype_cannot_hold_is_an_input_error(dtype, pad_value):
    fast = df.jit(lambda x: x * 1, buckets=(4,), in_axes=0, pad_value=pad_value, backend="eager")
    with pytest.raises(InputError, match=rf"pad_value {pad_value!r} for x does not fit its dtype {dtype}"):
        fast(torch.zeros(3, 2, dtype=dtype))


def test_pad_values_at_the_edges_of_their_dtype_pad_exactly():
    for dtype, pad_value in [(torch.uint8, 255), (torch.int8, -128), (torch.bool, True), (torch.float16, 65504.0),
                             (torch.float32, float("-inf"))]:
        fast = df.jit(lambda x: x.clone(), buckets=(4,), in_axes=0, out_axes=None, pad_value=pad_value,
                      backend="eager")
        with pytest.warns(UserWarning, match=r"out has the batch rows along axis 0, but out_axes None"):
            got = fast(torch.zeros(3, 2, dtype=dtype))
        assert got.dtype == dtype and got[3].eq(torch.tensor(pad_value, dtype=dtype)).all()


def test_model_state_and_donated_arguments_are_never_padded():
    fn, params = df.pure(nn.Linear(3, 3))
    with pytest.raises(InputError, match="model state"):
        df.jit(fn, buckets=(4,), in_axes=0, backend="eager")(params, torch.randn(3, 3))
    donated = df.jit(lambda x: x + 1, buckets=(4,), in_axes=0, donate_argnums=0, backend="eager")
    with pytest.raises(InputError, match="donate_argnums"):
        donated(torch.randn(3, 3))


def test_a_batched_input_the_function_updates_in_place_is_refused():
    def fn(x):
        x.add_(1)
        return x * 2

    fast = df.jit(fn, buckets=(4,), in_axes=0, backend="eager")
    for _ in range(2):                                     # refused again, never run on a padded copy
        with pytest.raises(InputError, match="updates x in place"):
            fast(torch.zeros(3, 2))


@pytest.mark.parametrize("make, expected", [
    (lambda: nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).train(), "batch norm in train mode"),
    (lambda: nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).eval(), None),
    (lambda: MLP((8, 16, 8)), None),
])
def test_functions_whose_rows_interact_warn_as_microbatching_does(make, expected):
    fn, params = df.pure(make())
    fast = df.jit(fn, buckets=(4, 8), in_axes=(None, 0), backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast(params, torch.randn(3, 8))
        fast(params, torch.randn(5, 8))
    texts = [str(w.message) for w in caught if "with buckets" in str(w.message)]
    assert (texts == []) if expected is None else (len(texts) == 1 and expected in texts[0]), texts


@pytest.mark.parametrize("fn, op", [
    (lambda x: x.flip(0) * 2, "aten.flip"),
    (lambda x: x.roll(1, 0), "aten.roll"),
    (lambda x: x.sort(0).values, "aten.sort"),
    (lambda x: x.gather(0, torch.full_like(x, x.shape[0] - 1, dtype=torch.long)), "aten.gather"),
], ids=["flip", "roll", "sort", "gather-last-row"])
def test_functions_that_move_rows_along_the_batch_axis_warn(fn, op):
    """Padded rows land among the real ones: a flipped batch of 3 padded to 4 starts with the padded row."""
    fast = df.jit(fn, buckets=(4,), in_axes=0, backend="eager")
    x = torch.randn(3, 5)
    with pytest.warns(UserWarning, match=f"{op} works along the batch axis"):
        got = fast(x)
    assert not torch.equal(got, fn(x))                     # what the warning is about
    torch.testing.assert_close(got, fn(F.pad(x, (0, 0, 0, 1)))[:3])


def test_rows_scattered_into_rows_at_positions_an_index_holds_warn():
    """A padded row's index (0) writes over the real row that index 0 names."""
    fn = lambda x, index: torch.zeros_like(x).scatter(0, index[:, None].expand_as(x), x)   # noqa: E731
    fast = df.jit(fn, buckets=(4,), in_axes=(0, 0), backend="eager")
    x, index = torch.randn(3, 5), torch.tensor([2, 1, 0])
    with pytest.warns(UserWarning, match=r"aten\.scatter\.src writes along the batch axis at positions an index tensor"):
        got = fast(x, index)
    assert not torch.equal(got, fn(x, index))


@pytest.mark.parametrize("fn", [lambda x: x.flip(1), lambda x: x.sort(1).values, lambda x: x.topk(2, 1).values,
                                lambda x: x[:, torch.tensor([3, 1])]], ids=["flip", "sort", "topk", "index"])
def test_functions_that_move_values_along_another_axis_pad_exactly_without_a_warning(fn):
    fast = df.jit(fn, buckets=(4, 8), in_axes=0, backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for rows in (3, 5, 1):
            x = torch.randn(rows, 5)
            torch.testing.assert_close(fast(x), fn(x))


@pytest.mark.parametrize("fn", [lambda x: (x * 2, x.shape[0]), lambda x: (x * 2, x.shape),
                                lambda x: {"y": x * 2, "scale": 1.0 / x.shape[0]}], ids=["rows", "shape", "float"])
def test_a_number_computed_from_the_batch_size_is_refused(fn):
    """Baked into the padded trace, it would be the bucket's size, not the real batch's."""
    fast = df.jit(fn, buckets=(4,), in_axes=0, backend="eager")
    for _ in range(2):
        with pytest.raises(InputError, match=r"returns out(\[1\]|\['scale'\]) = .* computed from the batch size"):
            fast(torch.randn(3, 2))


def test_a_padded_call_that_cannot_be_traced_says_it_was_padded():
    """Eager PyTorch takes the call of 5 rows; the trace at the bucket's 8 slices the images past their rows."""
    fast = df.jit(lambda ids, images: ids.sum(1, keepdim=True) + images[:ids.shape[0]], buckets=(4, 8),
                  in_axes=(0, None), backend="eager")
    with pytest.raises(TraceError, match=r"padded to a bucket: this one, of 5 rows, at 8 rows\. .*rejects these inputs "
                                         r"too.* give such tensors an axis in in_axes"):
        fast(torch.randn(5, 6), torch.randn(5, 1))


@pytest.mark.parametrize("fn, message", [
    (lambda x: x * x.shape[0], r"aten.mul.Tensor reads the batch size as a number \(8 at a batch of 8 rows, 9 at 9\)"),
    (lambda x: x + torch.tensor(x.shape[0]), "reads the batch size in a tensor constant"),
    (lambda x: x + torch.full((x.shape[0], 1), float(x.shape[0])), "aten.full reads the batch size as a number"),
    (lambda x: x.repeat(1, x.shape[0]).sum(-1, keepdim=True), r"batch size in dimensions \[0, 1\]"),
    (lambda x: x * torch.ones(x.shape[0], x.shape[0]).sum(1, keepdim=True), r"batch size in dimensions \[0, 1\]"),
    (lambda x: x + torch.arange(x.shape[0]).flip(0)[:, None], "aten.flip reads rows that the graph makes"),
    (lambda x: x + torch.ones(x.shape[0]).sum(), "aten.sum reduces or indexes rows that the graph makes"),
    (lambda x: x * 2 if x.shape[0] % 2 == 0 else x - 1, "takes another path at another batch size"),
], ids=["factor", "tensor-constant", "fill", "repeat-then-sum", "ones-square-summed", "made-rows-flipped",
        "made-rows-summed", "branch"])
def test_a_function_that_reads_its_batch_size_other_than_as_a_size_warns(fn, message):
    """Traced at the bucket's 8 rows, each computes with 8 where the call of 5 rows computes with 5."""
    fast = df.jit(fn, buckets=(4, 8), in_axes=0, backend="eager")
    x = torch.randn(5, 4)
    with pytest.warns(UserWarning, match=message):
        got = fast(x)
    assert not torch.equal(got, fn(x))                     # what the warning is about


@pytest.mark.parametrize("fn, out_axes, message", [
    (lambda x: (x[:, None, 0] > x[None, :, 0]).sum(1), 0, r"aten\.gt\.Tensor pairs every row of the batch"),
    (lambda x: F.max_pool1d(-x.abs().T[None], 3, 1, 1)[0].T, 0, r"aten\.max_pool2d_with_indices pools, resamples or pads"),
    (lambda x: F.pad(x, (0, 0, 0, 1), value=1.0)[1:] + x, 0, r"aten\.constant_pad_nd pads the batch axis"),
    (lambda x: x.chunk(2, 0)[0].sum(0), None, r"aten\.split\.Tensor cuts the batch axis into pieces"),
    (lambda x: torch.zeros(3, 4).index_add(0, torch.arange(x.shape[0]) % 3, x.exp()), None,
     r"out is reduced over the batch rows \(by aten\.index_add\), so the padded rows enter it"),
], ids=["pairs-by-broadcasting", "max-pool-over-the-batch", "padded-batch-axis", "chunked-batch", "rows-added-into-slots"])
def test_functions_that_pair_pool_shift_cut_or_add_up_the_rows_warn(fn, out_axes, message):
    """Padded rows join the pairs, windows, pieces and slots of the real rows; each returned other values silently."""
    x = torch.randn(5, 4)
    with pytest.warns(UserWarning, match=message):
        got = df.jit(fn, buckets=(2, 4, 8), in_axes=0, out_axes=out_axes, backend="eager")(x)
    assert got.shape != fn(x).shape or not torch.allclose(got, fn(x))


@pytest.mark.parametrize("fn, message", [
    (lambda x, y: F.cross_entropy(x, y), r"out is reduced over the batch rows \(by aten.nll_loss_forward\)"),
    (lambda x, y: x * 2, r"out has the batch rows along axis 0, but out_axes None returns it"),
], ids=["cross-entropy", "rows"])
def test_an_output_returned_whole_that_reads_the_batch_rows_warns(fn, message):
    """Returned as computed on the padded batch, it holds the padded rows' losses or the rows themselves."""
    fast = df.jit(fn, buckets=(4, 8), in_axes=0, out_axes=None, backend="eager")
    x, y = torch.randn(5, 4), torch.randint(1, 4, (5,))
    with pytest.warns(UserWarning, match=message):
        got = fast(x, y)
    assert got.shape != fn(x, y).shape or not torch.allclose(got, fn(x, y))


@pytest.mark.parametrize("take_apart", ["chunk", "split", "slice"])
def test_classifier_free_guidance_pads_exactly_without_a_warning(take_apart):
    guided = guided_denoiser(take_apart)
    fast = df.jit(guided, buckets=(8,), in_axes=0)
    x, cond = torch.randn(5, 8), torch.randn(5, 8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = fast(x, cond)
    torch.testing.assert_close(got, guided(x, cond))


def test_a_function_that_draws_random_numbers_warns_that_the_padded_rows_draw_too():
    """The padded rows' draws advance torch's generator as for the bucket: the next call's dropout mask
    differs from eager's, silently before."""
    fast = df.jit(lambda x: F.dropout(x, 0.5, training=True), buckets=(4, 8), in_axes=0)
    with pytest.warns(UserWarning, match=r"aten\.bernoulli\.p draws random numbers for the padded rows too"):
        fast(torch.ones(3, 5))


def test_linspace_over_the_batch_size_warns():
    fn = lambda x: x * torch.linspace(0, 1, x.shape[0])[:, None]   # noqa: E731
    with pytest.warns(UserWarning, match=r"aten\.linspace reads the batch size as a number"):
        df.jit(fn, buckets=(4, 8), in_axes=0, backend="eager")(torch.randn(5, 3))


def test_sizes_that_shape_tensors_or_bound_all_rows_pad_exactly_without_a_warning():
    def fn(x, tail):
        rows = x.shape[0]
        both = torch.cat([x, tail])
        return (x.view(rows, 2, -1).sum(1) + torch.arange(rows)[:, None] + torch.zeros(rows, 1) + both[:rows, :2]
                + both[rows:].sum(0)[:2])

    fast = df.jit(fn, buckets=(4, 8), in_axes=(0, None), backend="eager")
    tail = torch.randn(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for rows in (2, 3, 5, 7):
            x = torch.randn(rows, 4)
            torch.testing.assert_close(fast(x, tail), fn(x, tail))


def _write_slots(cache, slots, values):
    return cache.index_copy(0, slots, values), values * 2


def test_an_output_cut_along_an_axis_that_is_not_the_batch_is_refused_at_every_bucket():
    """The cache returned whole has 4 slots: at the bucket of 4 it was cut to the real rows silently."""
    fast = df.jit(_write_slots, buckets=(2, 4), in_axes=(None, 0, 0), pad_value=(None, 3, 0.0), backend="eager")
    for rows in (3, 1):
        with pytest.raises(InputError, match=r"out_axes gives axis 0 for out\[0\], but its size along it \(4 at a "
                                             r"batch of 4, 4 at 5\) does not follow the batch size"):
            fast(torch.zeros(4, 2), torch.arange(rows), torch.randn(rows, 2))


def test_an_output_returned_whole_with_out_axes_none_pads_exactly():
    fast = df.jit(_write_slots, buckets=(2, 4), in_axes=(None, 0, 0), pad_value=(None, 3, 0.0),
                  out_axes=(None, 0), backend="eager")
    for rows in (3, 1, 2):
        cache, slots, values = torch.randn(4, 2), torch.randperm(3)[:rows], torch.randn(rows, 2)
        (got_cache, got), (cache_expected, expected) = fast(cache, slots, values), _write_slots(cache, slots, values)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(got_cache[:3], cache_expected[:3])     # slot 3 is the padded rows' dummy


def test_numbers_that_do_not_depend_on_the_batch_size_come_back_as_traced():
    fn = lambda x: (x * 2, x.shape[1], x.shape[1:], 0.5, None)   # noqa: E731
    fast = df.jit(fn, buckets=(4,), in_axes=0, backend="eager")
    x = torch.randn(3, 2)
    got, expected = fast(x), fn(x)
    torch.testing.assert_close(got[0], expected[0])
    assert got[1:] == expected[1:]


def _pair_sums(x):
    """Rows come in pairs: the function cannot be traced at an odd batch."""
    sums = x.view(-1, 2, x.shape[1]).sum(1)
    return sums.repeat_interleave(2, 0), x.shape[1]


def _four_rows(x):
    """Its shape is written out: the function can be traced at a batch of 4 rows only."""
    return x.view(2, 2, x.shape[1]).flatten(0, 1) * 2, x.shape[1]


def test_a_function_whose_rows_come_in_pairs_is_checked_at_twice_its_rows():
    fast = df.jit(_pair_sums, buckets=(2, 4), in_axes=0, backend="eager")
    x = torch.randn(4, 3)
    with pytest.warns(UserWarning) as caught:
        got = fast(x)
    assert not any("could not be checked" in str(w.message) for w in caught)
    torch.testing.assert_close(got[0], _pair_sums(x)[0])
    assert got[1] == 3


def test_a_function_that_cannot_be_traced_at_another_batch_size_warns_and_runs():
    fast = df.jit(_four_rows, buckets=(2, 4), in_axes=0, backend="eager")
    x = torch.randn(4, 3)
    with pytest.warns(UserWarning, match=r"reads of the batch size could not be checked: tracing at 5 and at 8 rows "
                                         r"failed"):
        got = fast(x)
    torch.testing.assert_close(got[0], _four_rows(x)[0])
    assert got[1] == 3


def test_a_batch_mean_used_with_the_rows_and_an_output_summed_over_the_batch_warn():
    fast = df.jit(lambda x: (x - x.mean(0), x.sum(0)), buckets=(4,), in_axes=0, out_axes=(0, None), backend="eager")
    with pytest.warns(UserWarning) as caught:
        fast(torch.randn(3, 5))
    texts = " | ".join(str(w.message) for w in caught)
    assert "per-row data" in texts and "out[1] is reduced over the batch rows" in texts


def test_an_update_of_shared_state_from_the_rows_warns_unless_pad_values_are_given():
    def write(cache, slots, values):
        cache.index_put_((slots,), values)
        return values * 2

    cache = torch.zeros(8, 3)
    with pytest.warns(UserWarning, match="updates cache in place from the batch rows"):
        df.jit(write, buckets=(4,), in_axes=(None, 0, 0), backend="eager")(cache, torch.tensor([1, 2]),
                                                                             torch.ones(2, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guarded = df.jit(write, buckets=(4,), in_axes=(None, 0, 0), pad_value=(None, 7, 0.0), backend="eager")
        cache = torch.zeros(8, 3)
        guarded(cache, torch.tensor([1, 2]), torch.ones(2, 3))
    assert cache[1:3].eq(1).all() and cache[[0, 3, 4, 5, 6]].eq(0).all()   # padded rows wrote the dummy slot 7


def test_cache_info_counts_plans_and_padding_waste():
    fast = df.jit(_features, buckets=(2, 4, 8), in_axes=(0, None), backend="eager")
    scale = torch.randn(4)
    for rows in (1, 3, 5, 8, 3):
        fast(torch.randn(rows, 4), scale)
    info = fast.cache_info()
    assert (info.padded_rows, info.real_rows) == (1 + 1 + 3 + 0 + 1, 20)
    assert info.entries == 3 and info.misses == 3 and info.captures == 0   # 8 (first: the largest), 2, 4
    assert info.padding_waste == pytest.approx(6 / 20)
    assert "padding waste 30.0% (6 padded rows for 20 real ones)" in str(info)


def test_the_largest_bucket_is_planned_first_and_every_plan_runs_in_its_arena():
    fast = df.jit(_features, buckets=(2, 4, 8), in_axes=(0, None), backend="eager")
    scale = torch.randn(16)
    fast(torch.randn(3, 16), scale)
    assert [tuple(r.plan.slots[r.plan.input_slots[0]].layout.shape) for r in _replayers(fast)] == [(8, 16), (4, 16)]
    fast(torch.randn(1, 16), scale)
    replayers = _replayers(fast)
    assert len({id(r.memory) for r in replayers}) == 1
    arenas = {r.executable.bound.arena.untyped_storage().data_ptr() for r in replayers if r.executable is not None}
    assert len(arenas) == 1 and len(replayers) == 3
    assert len({id(r.executable.turns) for r in replayers if r.executable is not None}) == 1


def test_bucket_plans_sharing_an_arena_take_turns_across_threads():
    fn, params = df.pure(MLP((64, 256, 256, 64)).eval())
    fast = df.jit(fn, buckets=(2, 16), in_axes=(None, 0), backend="eager")
    inputs = {rows: torch.randn(rows, 64) for rows in (2, 16)}
    expected = {rows: fast(params, x) for rows, x in inputs.items()}
    failures = []

    def hammer(rows):
        for _ in range(40):
            if not torch.equal(fast(params, inputs[rows]), expected[rows]):
                failures.append(rows)

    threads = [threading.Thread(target=hammer, args=(rows,)) for rows in (2, 16, 2, 16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


def test_strategy_auto_decides_per_bucket(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAFLOW_CACHE_DIR", str(tmp_path))
    fn, params = df.pure(Block().eval())
    fast = df.jit(fn, strategy="auto", buckets=(1, 4), in_axes=(None, 0), progress=False, backend="eager")
    for rows in (1, 3):
        x = torch.randn(rows, 6, 32)
        torch.testing.assert_close(fast(params, x), fn(params, x), rtol=1e-5, atol=1e-5)
    assert len(fast.choices) == 2                               # one decision per bucket, each its own signature
    small, large = sorted(fast.choices.values(), key=lambda choice: "microbatch2-tbo" in choice.median_ms)
    assert not [name for name in small.median_ms if "microbatch" in name] and not small.skipped
    assert {"microbatch2-tbo", "microbatch4-roundrobin"} <= set(large.median_ms)


def test_buckets_compose_with_a_transformed_function():
    fn, params = df.pure(Block().eval())
    step = T.overlap(T.partition(fn, rules=[T.Region("attn")]), strategy="branches")
    fast = df.jit(step, buckets=(2, 4), in_axes=(None, 0), backend="eager")
    for rows in (1, 3):
        x = torch.randn(rows, 6, 32)
        torch.testing.assert_close(fast(params, x), fn(params, x), rtol=1e-5, atol=1e-5)
    for plan in fast.plans():
        df.verify(plan)


@pytest.mark.parametrize("fn", [lambda x: x.cumsum(0), lambda x: x.cummax(0).values * 2,
                                lambda x: x.logcumsumexp(0) - x], ids=["cumsum", "cummax", "logcumsumexp"])
def test_cumulative_ops_along_the_batch_pad_exactly_without_a_warning_and_still_warn_when_micro_batched(fn):
    """Row b of a cumulative sum reads rows up to b: rows padded after the real ones change none of
    theirs. A micro-batch restarts the sum at its first row."""
    x = torch.randn(5, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(df.jit(fn, buckets=(4, 8), in_axes=0, backend="eager")(x), fn(x))
    with pytest.warns(UserWarning, match=r"works along the batch axis"):
        df.jit(T.microbatch(fn, num=2))(torch.randn(6, 3))
    with pytest.warns(UserWarning, match=r"aten\.flip works along the batch axis"):
        got = df.jit(lambda x: fn(x).flip(0), buckets=(4, 8), in_axes=0, backend="eager")(x)
    assert not torch.allclose(got, fn(x).flip(0))


@pytest.mark.parametrize("split", [
    lambda fn: T.microbatch(fn, num=2, in_axes=(None, 0)),
    lambda fn: T.overlap(T.microbatch(fn, num=2, in_axes=(None, 0)), strategy="tbo"),
    lambda fn: T.microbatch(T.microbatch(fn, num=2, in_axes=(None, 0)), num=2, in_axes=(None, 0)),
], ids=["microbatch", "tbo", "microbatch-twice"])
def test_an_explicitly_micro_batched_function_pads_without_warnings(split):
    """Micro-batching's own slices and merge are no rows picked and no batch size read: the padding
    check studies what the function computes, its body on the whole batch."""
    fn, params = df.pure(MLP())
    fast = df.jit(split(fn), buckets=(4, 8, 16), in_axes=(None, 0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (5, 7, 13):
            x = torch.randn(rows, 32)
            torch.testing.assert_close(fast(params, x), fn(params, x))
    assert [str(w.message) for w in caught] == []


def test_a_micro_batched_function_whose_rows_interact_still_warns_under_buckets():
    centered = lambda x: x - x.mean(0)   # noqa: E731
    fast = df.jit(T.microbatch(centered, num=2), buckets=(8,), in_axes=0)
    with pytest.warns(UserWarning, match=r"with buckets: aten\.sub\.Tensor combines a value mixed across the batch "
                                         r"rows \(by aten\.mean\.dim\)"):
        fast(torch.randn(7, 3))


@pytest.mark.parametrize("fn, out_axes", [(lambda x: x - x[0], 0), (lambda x: x * x[0].sum(), 0),
                                          (lambda x: (x * 2, x[0]), (0, None)), (lambda x: x - x[:1], 0),
                                          (lambda x: x - x.narrow(0, 0, 1), 0), (lambda x: x - x.unbind(0)[0], 0),
                                          (lambda x: (x * 2, x.split(1)[0]), (0, None))],
                         ids=["minus-row-0", "times-row-0-sum", "returns-row-0", "minus-slice-to-1", "minus-narrow",
                              "minus-unbound-0", "returns-split-0"])
def test_the_first_row_picked_pads_without_warnings(fn, out_axes):
    """Padded rows come after the real ones, so `x[0]` is the real row 0 in the padded batch too."""
    fast = df.jit(fn, buckets=(8,), in_axes=0, out_axes=out_axes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (3, 5):
            x = torch.randn(rows, 3)
            for got, want in zip(optree.tree_leaves(fast(x)), optree.tree_leaves(fn(x))):
                assert torch.equal(got, want)
    assert [str(w.message) for w in caught] == []


@pytest.mark.parametrize("fn", [lambda x: x - x[-1], lambda x: x - x[3], lambda x: x - torch.cat([x, x])[3],
                                lambda x: x - x[:2].sum(0)],
                         ids=["last", "past-the-real-rows", "second-copy", "first-two"])
def test_other_rows_picked_warn_under_buckets_and_the_first_under_micro_batching(fn):
    """`x[-1]` is a padded row of the padded batch; so is `x[3]` of three rows (which eager refuses),
    row 3 of `cat([x, x])` (eager's `x[0]`), and the second of `x[:2]` at one row. Each micro-batch's
    `x[0]` is a row of its own."""
    with pytest.warns(UserWarning, match=r"with buckets: aten\.sub\.Tensor combines a value mixed across the batch "
                                         r"rows \(by aten\.(select\.int|slice\.Tensor)\)"):
        got = df.jit(fn, buckets=(8,), in_axes=0)(torch.randn(5, 3))
    with pytest.warns(UserWarning, match=r"microbatch: aten\.sub\.Tensor combines a value mixed across the batch "
                                         r"rows \(by aten\.select\.int\)"):
        df.jit(T.microbatch(lambda x: x - x[0], num=2))(torch.randn(6, 3))
    assert got.shape == (5, 3)


@pytest.mark.parametrize("fn", [lambda x: x - x.unbind(0)[1], lambda x: x - x.split(1)[-1],
                                lambda x: x - x.split(2)[0].sum(0), lambda x: x - x.unbind(0)[0] - x.unbind(0)[1]],
                         ids=["second", "last", "first-two", "first-and-second"])
def test_pieces_of_the_batch_other_than_its_first_row_warn_under_buckets(fn):
    with pytest.warns(UserWarning, match=r"with buckets: aten\.(unbind\.int|split\.Tensor) cuts the batch axis into "
                                         r"pieces"):
        df.jit(fn, buckets=(8,), in_axes=0)(torch.randn(5, 3))


def test_rows_joined_to_an_empty_cache_are_followed_and_a_mix_after_it_warns():
    """cat skips a 1-D empty tensor (the first `torch.tensor([])` of a growing cache) beside tensors of
    any rank: the rows go on, and a softmax over them after it warns, micro-batched or padded."""
    def fn(x):
        return torch.cat([torch.tensor([]), x], dim=-1).softmax(0)

    with pytest.warns(UserWarning, match=r"with buckets: aten\._softmax works along the batch axis"):
        got = df.jit(fn, buckets=(8,), in_axes=0)(x := torch.randn(5, 3))
    assert not torch.allclose(got, fn(x))
    with pytest.warns(UserWarning, match=r"microbatch: aten\._softmax works along the batch axis"):
        df.jit(T.microbatch(fn, num=2))(torch.randn(6, 3))


def _masked(x, mask, along):
    """transformers' mask builders read the mask row by row: `mask[arange(b)[:, None], positions]`."""
    rows, positions = torch.arange(x.shape[0])[:, None], torch.arange(mask.shape[1])[None, :]
    return (x * mask[rows, positions]).softmax(along)


def test_rows_read_by_their_own_numbers_are_followed_past_the_mask():
    x, mask = torch.randn(5, 4), torch.rand(5, 4)
    exact = df.jit(lambda x, m: _masked(x, m, 1), buckets=(8,), in_axes=(0, 0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(exact(x, mask), _masked(x, mask, 1))
    assert [str(w.message) for w in caught] == []
    with pytest.warns(UserWarning, match=r"with buckets: aten\._softmax works along the batch axis"):
        got = df.jit(lambda x, m: _masked(x, m, 0), buckets=(8,), in_axes=(0, 0))(x, mask)
    assert not torch.allclose(got, _masked(x, mask, 0))


def test_a_returned_nan_is_the_same_number_at_every_batch_size():
    """NaN differs from itself; returned by both traces it is no number computed from the batch size."""
    fn = lambda x: (x * 2, float("nan"))   # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        padded = df.jit(fn, buckets=(8,), in_axes=0, out_axes=(0, None))(torch.randn(5, 3))
        split = df.jit(T.microbatch(fn, num=2, out_axes=(0, None)))(torch.randn(6, 3))
    assert [str(w.message) for w in caught] == []
    assert padded[1] != padded[1] and split[1] != split[1]


def test_rows_placed_by_an_index_into_a_tensor_the_function_makes_warn():
    """A padded row's index (0) places a padded row over the real row 0."""
    def placed(x, index):
        out = torch.zeros(x.shape[0], x.shape[1])
        out[index] = x
        return out

    x, index = torch.randn(3, 5), torch.tensor([2, 0, 1])
    with pytest.warns(UserWarning, match=r"with buckets: out is reduced over the batch rows \(by aten\.index_put"):
        got = df.jit(placed, buckets=(4,), in_axes=(0, 0))(x, index)
    assert not torch.equal(got, placed(x, index))


@pytest.mark.parametrize("fn", [lambda x: x.cumsum(0), lambda x: x - x[0]], ids=["cumsum", "minus-row-0"])
def test_a_micro_batched_function_whose_rows_read_earlier_rows_warns_under_buckets(fn):
    """Exact for padding alone, but padding moves where T.microbatch splits: 5 rows split 3 + 2, their
    bucket of 8 splits 4 + 4."""
    split = T.microbatch(fn, num=2)
    x = torch.randn(5, 3)
    with pytest.warns(UserWarning, match=r"with buckets: .*T\.microbatch splits the padded batch elsewhere"):
        got = df.jit(split, buckets=(8,), in_axes=0)(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert not torch.allclose(got, split(x))


@pytest.mark.parametrize("fn", [
    lambda x, index: torch.zeros_like(x).put(index[:, None] * x.shape[1] + torch.arange(x.shape[1]), x),
    lambda x, index: x.take(index[:, None] * x.shape[1]),
], ids=["put", "take"])
def test_flat_positions_held_by_the_rows_warn(fn):
    """put and take index the tensor as one flat vector: positions number the elements of all rows."""
    x, index = torch.randn(6, 4), torch.tensor([2, 1, 0, 2, 1, 0])
    with pytest.warns(UserWarning, match=r"indexes the tensor as one flat vector"):
        got = df.jit(T.microbatch(fn, num=2, in_axes=(0, 0)))(x, index)
    assert not torch.allclose(got, fn(x, index))
    with pytest.warns(UserWarning, match=r"with buckets: .*indexes the tensor as one flat vector"):
        df.jit(fn, buckets=(8,), in_axes=(0, 0))(x[:5], index[:5])


def test_masked_scatter_warns_where_the_source_order_changes():
    """The source's elements go to the mask's positions in order across all the rows: each micro-batch
    starts at the source's first; padding along axis 0 adds positions after the real ones (exact),
    along axis 1 between them."""
    fn = lambda x: torch.zeros_like(x).masked_scatter(x > 0, x * 2)   # noqa: E731
    x = torch.randn(6, 4)
    with pytest.warns(UserWarning, match=r"microbatch: aten\.masked_scatter takes the source's elements"):
        df.jit(T.microbatch(fn, num=2))(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(df.jit(fn, buckets=(8,), in_axes=0)(x[:5]), fn(x[:5]))
    assert [str(w.message) for w in caught] == []
    with pytest.warns(UserWarning, match=r"with buckets: aten\.masked_scatter takes the source's elements"):
        df.jit(fn, buckets=(8,), in_axes=1, out_axes=1)(x[:, :3])
