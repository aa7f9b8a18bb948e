"""T.microbatch never silently changes what a function computes: it equals the unsplit function, or
it says why not (an error naming the argument, or a warning naming the op)."""

import re
import warnings

import optree
import pytest
import torch
from torch import nn

import dynaflow_fn as df
from dynaflow_fn import testing as dft
from dynaflow_fn import transforms as T
from dynaflow_fn.transforms import microbatch_body
from models import MLP, Block, ConvNet, TwoBranch, guided_denoiser, llama_logits, tiny_llama


def _assert_equals_the_unsplit_function(fn, step, *args):
    """df.jit(step) equals step called eagerly bit for bit and fn itself, on fresh inputs of the edge
    batch sizes (dft.assert_equivalent), and so does calling step's traced Program."""
    dft.assert_equivalent(fn, step, *args)
    problem = dft.first_difference(df.trace(step, *args)(*args), fn(*args), exact=False)
    assert problem is None, f"the traced Program differs from fn: {problem}"


def _microbatch_warnings(record):
    return [str(w.message) for w in record if str(w.message).startswith("microbatch")]


@pytest.fixture
def no_microbatch_warnings():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        yield
    assert _microbatch_warnings(record) == []


# --- 1. in_axes and parameters -----------------------------------------------------------------------


def test_default_in_axes_refuses_to_split_parameters():
    model = nn.Linear(4, 4)           # every parameter has 4 rows, as does the batch: splitting them "fits"
    fn, params = df.pure(model)
    x = torch.randn(4, 4)
    step = T.microbatch(fn, num=2)
    match = r"splits params\['(weight|bias)'\] \(and 1 more parameters\) along axis 0, but it is an nn\.Parameter.*" \
            r"in_axes=\(None, 0\)"
    with pytest.raises(df.TransformError, match=match):
        step(params, x)
    with pytest.raises(df.TransformError, match=match):
        df.trace(step, params, x)
    with pytest.raises(df.TransformError, match=match):
        df.jit(step)(params, x)
    torch.testing.assert_close(T.microbatch(fn, num=2, in_axes=(None, 0))(params, x), model(x))


def test_a_parameter_is_split_when_in_axes_reaches_its_own_leaf():
    def scaled(params, x):
        return (x * params["scale"]) @ params["w"]

    params = {"scale": nn.Parameter(torch.randn(6, 3)), "w": nn.Parameter(torch.randn(3, 3))}
    x = torch.randn(6, 3)
    with torch.no_grad():
        _assert_equals_the_unsplit_function(scaled, T.microbatch(scaled, num=2, in_axes=({"scale": 0, "w": None}, 0)),
                                            params, x)
    with pytest.raises(df.TransformError, match=r"in_axes=\(0, 0\) splits params\['scale'\].*pass in_axes=\(None, 0\)"):
        T.microbatch(scaled, num=2, in_axes=(0, 0))(params, x)


def test_a_parameter_passed_by_keyword_is_refused():
    def f(x, w):
        return x @ w

    with pytest.raises(df.TransformError, match=r"w is an nn\.Parameter passed by keyword.*positionally"):
        T.microbatch(f, num=2)(torch.randn(4, 3), w=nn.Parameter(torch.randn(3, 3)))


def test_split_inputs_that_disagree_on_the_batch_size_point_at_in_axes():
    def f(w, x):
        return x @ w

    with pytest.raises(df.TransformError, match=r"w along axis 0 \(size 5\), x along axis 0 \(size 6\)\. .*"
                                                 r"in_axes=\(None, 0\) for fn\(params, x\)"):
        df.trace(T.microbatch(f, num=2), torch.randn(5, 3), torch.randn(6, 5))


def test_a_long_disagreement_lists_a_few_inputs_per_size():
    params = {f"w{i}": torch.randn(5, 5) for i in range(6)}
    with pytest.raises(df.TransformError, match=r"params\['w0'\] along axis 0 \(size 5\), params\['w1'\] along axis 0 "
                                                 r"\(size 5\), x along axis 0 \(size 8\) and 4 more\."):
        df.trace(T.microbatch(lambda params, x: x, num=2), params, torch.randn(8, 5))


def test_a_broadcast_axis_on_a_scalar_points_at_in_axes():
    with pytest.raises(df.TransformError, match=r"axis 0 for scale, which has 0 dimensions.*in_axes=\(None, 0\)"):
        df.trace(T.microbatch(lambda scale, x: x * scale, num=2), torch.randn(()), torch.randn(4))


def test_in_axes_of_the_wrong_length_says_one_entry_per_argument():
    with pytest.raises(df.TransformError, match=r"in_axes=\(None, 0, 0\) does not match the positional arguments.*"
                                                 r"one entry per argument \(a tuple of 2\)"):
        df.trace(T.microbatch(lambda w, x: x * w, num=2, in_axes=(None, 0, 0)), torch.randn(3), torch.randn(4, 3))


# --- 2. outputs that read no split input -------------------------------------------------------------


@pytest.mark.parametrize("batch", [8, 7])
def test_outputs_that_read_no_split_input_equal_the_unsplit_value(batch):
    def f(w, x):
        return {"rows": x @ w, "double": w * 2, "total": w.sum(), "norm": w.norm(), "zeros": x.new_zeros(3)}

    w, x = torch.randn(5, 3), torch.randn(batch, 5)
    step = T.microbatch(f, num=3, in_axes=(None, 0),
                        out_axes={"rows": 0, "double": 0, "total": "sum", "norm": "mean", "zeros": 0})
    _assert_equals_the_unsplit_function(f, step, w, x)


def test_outputs_built_from_the_batch_size_are_merged_as_batch_outputs():
    def f(x):
        return torch.ones(x.shape[0]), torch.tensor(float(x.shape[0])), torch.zeros_like(x)

    _assert_equals_the_unsplit_function(f, T.microbatch(f, num=3, out_axes=(0, "sum", 0)), torch.randn(6, 2))


def test_a_micro_batched_function_inside_a_traced_function_merges_the_same_way():
    def f(w, x):
        return x @ w, w * 2

    step = T.microbatch(f, num=2, in_axes=(None, 0))

    def outer(w, x):
        rows, double = step(w, x)
        return rows.relu(), double + 1

    w, x = torch.randn(5, 3), torch.randn(4, 5)
    expected = (torch.relu(x @ w), w * 2 + 1)
    for name, got in {"eager": outer(w, x), "jit": df.jit(outer)(w, x)}.items():
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, msg=name)


def test_the_body_is_studied_on_the_callers_default_device():
    def f(w, x):
        return x @ w, w * 2 + torch.ones(w.shape)       # torch.ones on the default device

    with torch.device("meta"):
        w, x = torch.randn(5, 3), torch.randn(4, 5)
        program = df.trace(T.microbatch(f, num=2, in_axes=(None, 0)), w, x)
    assert [list(n.meta["val"].shape) for n in program.output_node().args[0]] == [[4, 3], [5, 3]]


def test_the_body_is_studied_once_per_input_signature(monkeypatch):
    traced = []
    original = microbatch_body.trace_function
    monkeypatch.setattr(microbatch_body, "trace_function", lambda *a, **k: traced.append(a[0]) or original(*a, **k))
    step = T.microbatch(lambda w, x: (x @ w, w * 2), num=2, in_axes=(None, 0))
    w = torch.randn(5, 3)
    for _ in range(3):
        step(w, torch.randn(4, 5))
    assert len(traced) == 2          # the micro-batch body and the unsplit body, for the output reading only w
    step(w, torch.randn(6, 5))
    assert len(traced) == 4


def test_the_body_study_keys_static_floats_by_their_bits(monkeypatch, no_microbatch_warnings):
    """A NaN static argument is the same signature on every call (`nan != nan` would never hit), and
    0.0 and -0.0 are two (`0.0 == -0.0`, but they trace to different constants). A NaN in both traces
    is the same number, not one read from the batch size."""
    traced = []
    original = microbatch_body.trace_function
    monkeypatch.setattr(microbatch_body, "trace_function", lambda *a, **k: traced.append(a[0]) or original(*a, **k))
    step = T.microbatch(lambda w, x, scale: (x @ w * scale, w * 2), num=2, in_axes=(None, 0, None))
    w, x = torch.randn(5, 3), torch.randn(4, 5)
    studies = []
    for scale in (float("nan"), float("nan"), 0.0, -0.0):
        step(w, x, scale)
        studies.append(len(traced))
    assert studies == [2, 2, 4, 6]        # two studies per distinct value: nan, 0.0, -0.0


# --- 3. ops that couple the rows of the batch ----------------------------------------------------------


def test_train_mode_batch_norm_warns_and_eval_mode_does_not():
    model = ConvNet()
    fn, params = df.pure(model)
    step = T.microbatch(fn, num=2, in_axes=(None, 0))
    x = torch.randn(4, 3, 8, 8)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        df.trace(step, params, x)
    texts = _microbatch_warnings(record)
    assert any(re.search(r"aten\.\w*batch_norm\w* in bn \(BatchNorm2d\) is batch norm in train mode.*eval mode", t)
               for t in texts)
    assert any("updates params['bn.num_batches_tracked'] in place" in t for t in texts)
    model.eval()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = df.jit(step)(params, x)
    assert _microbatch_warnings(record) == []
    torch.testing.assert_close(got, model(x))


class _Center(nn.Module):
    def forward(self, x):
        return x - x.mean(0, keepdim=True)


_MOVING_ROWS = [
    (lambda x: (x[:, None, 0] > x[None, :, 0]).sum(1) * x[:, 0],
     r"aten\.gt\.Tensor pairs every row of the batch with every other"),
    (lambda x: nn.functional.max_pool1d(x.T[None], 3, 1, 1)[0].T,
     r"aten\.max_pool2d_with_indices pools, resamples or pads along the batch axis \(axis 3 of its input\)"),
    (lambda x: nn.functional.pad(x, (0, 0, 1, 0))[:-1] + x, r"aten\.constant_pad_nd pads the batch axis"),
    (lambda x: torch.cat([torch.zeros(1, 3), x])[:-1] + x, r"aten\.cat concatenates along the batch axis"),
    (lambda x: x.chunk(2, 0)[0].sum(0) + x, r"aten\.split\.Tensor cuts the batch axis into pieces"),
    (lambda x: x.unbind(0)[0] + x, r"aten\.add\.Tensor combines a value mixed across the batch rows \(by "
                                   r"aten\.unbind\.int\)"),
    (lambda x: x.unbind(0)[1] + x, r"aten\.unbind\.int cuts the batch axis into pieces"),
]
"""Ops that pair, pool, shift or cut the rows: each returned other values than the unsplit function silently."""
_MOVING_ROWS_IDS = ["pairs-by-broadcasting", "max-pool-over-the-batch", "padded-batch-axis", "concatenated-on-the-batch",
                    "chunked-batch", "first-row-unbound", "unbound-batch"]


@pytest.mark.parametrize("fn, match", _MOVING_ROWS, ids=_MOVING_ROWS_IDS)
def test_ops_that_pair_pool_shift_or_cut_the_rows_give_other_values_than_the_unsplit_function(fn, match):
    x = torch.randn(6, 3)
    with pytest.warns(UserWarning, match=match):
        got = df.jit(T.microbatch(fn, num=2))(x)
    assert got.shape != fn(x).shape or not torch.allclose(got, fn(x))


@pytest.mark.parametrize("take_apart", ["chunk", "split", "slice"])
def test_classifier_free_guidance_splits_exactly_without_a_warning(take_apart, no_microbatch_warnings):
    """`cat([x, x])` along the batch holds two copies of the rows; `chunk`, `split` or a slice at the
    batch size gives each copy back, row for row."""
    guided = guided_denoiser(take_apart)
    x, cond = torch.randn(6, 8), torch.randn(6, 8)
    with torch.no_grad():
        torch.testing.assert_close(df.jit(T.microbatch(guided, num=2))(x, cond), guided(x, cond))


@pytest.mark.parametrize("fn, match", [
    (lambda x: torch.cat([x, x * 2]) + 1, r"out interleaves the batch rows with another dimension in axis 0"),
    (lambda x: torch.cat([x, x * 2]).chunk(3)[0] + 1, r"aten\.split\.Tensor cuts the batch axis into pieces"),
    (lambda x: torch.cat([x, x * 2])[1:7] + 1, r"out is reduced over the batch rows \(by aten\.slice\.Tensor\)"),
], ids=["copies-returned", "chunked-across-copies", "sliced-across-copies"])
def test_copies_of_the_batch_cut_or_returned_otherwise_than_copy_by_copy_warn(fn, match):
    x = torch.randn(6, 3)
    with pytest.warns(UserWarning, match=match):
        got = df.jit(T.microbatch(fn, num=2))(x)
    assert got.shape != fn(x).shape or not torch.allclose(got, fn(x))


@pytest.mark.parametrize("fn, match", [
    (nn.Sequential(nn.Linear(3, 3), _Center()),
     (r"aten\.sub\.Tensor in 1 \(_Center\) combines a value mixed across the batch rows \(by aten\.mean\.dim in 1 "
      r"\(_Center\)\) with per-row data")),
    (lambda x: x.softmax(0), r"aten\._softmax works along the batch axis"),
    (lambda x: x @ x.T, r"aten\.mm multiplies rows of the batch with other rows"),
    (lambda x: x / x.norm(),
     r"aten\.div\.Tensor combines a value mixed across the batch rows \(by aten\.linalg_vector_norm\)"),
    (lambda x: x.flip(0), r"aten\.flip works along the batch axis \(dims=\[0\]\)"),
    (lambda x: x.roll(1, 0), r"aten\.roll works along the batch axis"),
    (lambda x: x.gather(0, torch.zeros_like(x, dtype=torch.long)), r"aten\.gather works along the batch axis"),
    (lambda x: x[torch.tensor([1, 0])], r"aten\.index\.Tensor works along the batch axis"),
    (lambda x: x.repeat(2, 1), r"aten\.repeat works along the batch axis"),
    (lambda x: x.sort(0).values, r"aten\.sort works along the batch axis"),
    (lambda x: x.topk(2, 0).values, r"aten\.topk works along the batch axis"),
    (lambda x: torch.cat([x, x[:, :1]], 1).T.reshape(x.shape[0], -1) * 2,
     r"reshapes the batch rows across other axes"),
    (lambda x: torch.cat([x, x[:, :1]], 1).view(-1, 2, 2).permute(1, 0, 2).reshape(-1, 4) * 2,
     r"reshapes the batch rows across other axes"),
    (lambda x: nn.functional.group_norm(x.T[None], 1)[0].T,
     r"aten\.native_group_norm normalizes across the batch axis \(axis 2 of its input\)"),
    (lambda x: nn.functional.conv1d(x.T[None], torch.ones(1, 3, 2))[0],
     r"aten\.convolution convolves across the batch axis \(axis 2 of its input\)"),
    *_MOVING_ROWS,
], ids=["centering-module", "softmax-over-batch", "rows-times-rows", "global-norm", "flip", "roll", "gather",
        "index", "repeat", "sort-several-results", "topk", "transposed-reshape", "permuted-reshape",
        "group-norm-over-the-batch", "convolution-over-the-batch", *_MOVING_ROWS_IDS])
def test_ops_that_mix_the_rows_of_the_batch_warn(fn, match):
    if isinstance(fn, nn.Module):
        fn, params = df.pure(fn)
        step, args = T.microbatch(fn, num=2, in_axes=(None, 0)), (params, torch.randn(6, 3))
    else:
        step, args = T.microbatch(fn, num=2), (torch.randn(6, 3),)
    with pytest.warns(UserWarning, match=match):
        df.trace(step, *args)


@pytest.mark.parametrize("fn, out_axes, match", [
    (lambda x: (x * 2, x.sum(0)), 0,
     (r"out\[1\] is reduced over the batch rows \(by aten\.sum\.dim_IntList\), but out_axes concatenates it along "
      r"axis 0.*\"mean\" or \"sum\"")),
    (lambda x: x.T * 2, 0,
     r"out has the batch rows along axis 1, but out_axes concatenates it along axis 0\. Give it out_axes=1"),
    (lambda x: x.T.reshape(-1), 0, r"out interleaves the batch rows with another dimension"),
    (lambda x: x * 2, "mean", r"out has one row per batch row \(along axis 0\), but out_axes \"mean\" adds"),
], ids=["reduction-concatenated", "rows-on-another-axis", "rows-interleaved", "rows-averaged"])
def test_outputs_merged_against_their_rows_warn(fn, out_axes, match):
    with pytest.warns(UserWarning, match=match):
        df.trace(T.microbatch(fn, num=2, out_axes=out_axes), torch.randn(6, 3))


@pytest.mark.parametrize("fn, out_axes", [
    (lambda x: x.reshape(-1) * 2, 0), (lambda x: x.T * 2, -1),
    (lambda x: nn.functional.cross_entropy(x, x.argmax(1), reduction="none"), 0),
    (lambda x: nn.functional.cross_entropy(x, x.argmax(1), reduction="sum"), "sum"),
    (lambda x: torch.zeros_like(x).scatter(1, x.argmax(1, keepdim=True), 1.0), 0),
    (lambda x: nn.functional.pad(x, (1, 1)) * 2, 0),
    (lambda x: nn.functional.max_pool1d(x[:, None], 2)[:, 0], 0),
], ids=["flattened", "transposed", "per-sample-loss", "summed-loss", "one-hot", "padded-columns", "pooled-per-row"])
def test_outputs_merged_along_their_rows_do_not_warn(fn, out_axes, no_microbatch_warnings):
    x = torch.randn(6, 3)
    torch.testing.assert_close(df.jit(T.microbatch(fn, num=2, out_axes=out_axes))(x), fn(x))


@pytest.mark.parametrize("fn", [lambda x: x.flip(1), lambda x: x.roll(1, 1), lambda x: x.sort(1).values,
                                lambda x: x.topk(2, 1).values, lambda x: x[:, torch.tensor([2, 0])],
                                lambda x: x.repeat(1, 2), lambda x: x.kthvalue(2, 1).values],
                         ids=["flip", "roll", "sort", "topk", "index", "repeat", "kthvalue"])
def test_ops_along_another_axis_than_the_batch_split_exactly_and_do_not_warn(fn, no_microbatch_warnings):
    x = torch.randn(6, 3)
    torch.testing.assert_close(df.jit(T.microbatch(fn, num=2))(x), fn(x))


def test_indexing_each_row_by_an_arange_of_the_batch_splits_exactly_and_does_not_warn(no_microbatch_warnings):
    """transformers' mask builders index `mask[torch.arange(batch)[:, None, None, None], ...]`: row b reads row b."""
    fn = lambda x: x[torch.arange(x.shape[0])[:, None], torch.arange(x.shape[1])] * 2   # noqa: E731
    x = torch.randn(6, 3)
    torch.testing.assert_close(df.jit(T.microbatch(fn, num=2))(x), fn(x))


def test_a_number_computed_from_the_batch_size_warns():
    """The micro-batched function returns the micro-batch's `x.shape[0]`, not the batch's."""
    fn = lambda x: (x.sum(1), x.shape[0], x.shape[1], 0.5)   # noqa: E731
    x = torch.randn(4, 3)
    with pytest.warns(UserWarning, match=r"out\[1\] is 2 for a micro-batch but 4 for the whole batch") as caught:
        got = df.jit(T.microbatch(fn, num=2))(x)
    assert len([w for w in caught if "microbatch:" in str(w.message)]) == 1      # x.shape[1] and 0.5 are fine
    assert got[1] != fn(x)[1] and got[2:] == fn(x)[2:]


def test_a_python_bool_computed_from_the_batch_size_warns():
    fn = lambda x: (x * 2, x.shape[0] > 4)   # noqa: E731
    with pytest.warns(UserWarning, match=r"out\[1\] is False for a micro-batch but True for the whole batch"):
        got = df.jit(T.microbatch(fn, num=2, out_axes=(0, None)))(torch.randn(6, 3))
    assert got[1] is False


def test_rows_added_into_slots_are_a_sum_over_the_rows():
    """index_add and scatter_add into a table that reads no row: exact merged by "sum", not concatenated."""
    fn = lambda x, slots: torch.zeros(3, 4).index_add(0, slots, x)   # noqa: E731
    x, slots = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = df.jit(T.microbatch(fn, num=2, in_axes=(0, 0), out_axes="sum"))(x, slots)
    assert _microbatch_warnings(record) == []
    torch.testing.assert_close(got, fn(x, slots))
    with pytest.warns(UserWarning, match=r"out is reduced over the batch rows \(by aten\.index_add\), but out_axes "
                                         r"concatenates it"):
        df.jit(T.microbatch(fn, num=2, in_axes=(0, 0), out_axes=0))(x, slots)
    amax = lambda x, slots: torch.zeros(3, 4).scatter_reduce(0, slots[:, None].expand(-1, 4), x, "amax")  # noqa: E731
    with pytest.warns(UserWarning, match=r"by aten\.scatter_reduce\.two, which is not a sum or mean over them"):
        got = df.jit(T.microbatch(amax, num=2, in_axes=(0, 0), out_axes="sum"))(x, slots)
    assert not torch.allclose(got, amax(x, slots))


@pytest.mark.parametrize("fn", [
    lambda x, index: torch.zeros_like(x).index_add(0, index, x),
    lambda x, index: torch.zeros_like(x).scatter_add(0, index[:, None].expand_as(x), x),
    lambda x, index: x.index_add(0, index, x * 2),
], ids=["index_add", "scatter_add", "index_add-into-x"])
def test_rows_written_into_the_rows_at_positions_an_index_holds_warn(fn):
    """Data picks which row of the result takes each row (`zeros_like(x).index_add(0, index, x)`): a
    micro-batch picks among its own rows only, and numbers them from 0."""
    x, index = torch.randn(6, 4), torch.tensor([2, 1, 0, 2, 1, 0])
    with pytest.warns(UserWarning, match=r"microbatch: aten\.\w+(\.\w+)? writes along the batch axis at positions an "
                                         r"index tensor holds"):
        got = df.jit(T.microbatch(fn, num=2, in_axes=(0, 0)))(x, index)
    assert not torch.allclose(got, fn(x, index))                # what the warning is about


def test_micro_batching_twice_studies_the_inner_function_on_the_whole_batch(no_microbatch_warnings):
    """The outer body is the inner micro-batched function: its slices and merge are no rows picked and
    no batch size read."""
    fn, params = df.pure(MLP())
    twice = T.microbatch(T.microbatch(fn, num=2, in_axes=(None, 0)), num=2, in_axes=(None, 0))
    x = torch.randn(7, 32)
    torch.testing.assert_close(df.jit(twice)(params, x), fn(params, x))
    torch.testing.assert_close(twice(params, x), fn(params, x))


def test_micro_batching_twice_a_function_whose_rows_interact_warns():
    centered = lambda x: x - x.mean(0)   # noqa: E731
    with pytest.warns(UserWarning, match=r"microbatch: aten\.sub\.Tensor combines a value mixed across the batch"):
        df.jit(T.microbatch(T.microbatch(centered, num=2), num=2))(torch.randn(8, 3))


def _placed_by_index(x, index):
    out = torch.zeros(x.shape[0], x.shape[1])
    out[index] = x
    return out


@pytest.mark.parametrize("fn", [
    _placed_by_index,
    lambda x, index: torch.zeros(x.shape[0], x.shape[1]).scatter(0, index[:, None].expand_as(x), x),
    lambda x, index: x.new_zeros(x.shape).index_copy(0, index, x),
], ids=["index_put", "scatter", "index_copy"])
def test_rows_written_into_a_tensor_the_function_makes_at_positions_an_index_holds_warn(fn):
    """`out = zeros(b, d); out[index] = x`: each micro-batch makes its own `out` and places its rows at
    positions numbered for the whole batch. A write at the rows' positions into an input (a KV cache
    at the rows' slots) stays quiet: every micro-batch writes the one cache."""
    x, index = torch.randn(6, 4), torch.tensor([2, 1, 0, 1, 0, 2])
    with pytest.warns(UserWarning, match=r"microbatch: out is reduced over the batch rows \(by aten\.\w+"):
        got = df.jit(T.microbatch(fn, num=2, in_axes=(0, 0)))(x, index)
    assert not torch.allclose(got, fn(x, index))


def test_an_in_place_update_of_a_shared_input_warns():
    def count(calls, x):
        calls.add_(1)
        return x * 2

    with pytest.warns(UserWarning, match=r"updates calls in place; micro-batched, the update runs once per "
                                         r"micro-batch"):
        df.trace(T.microbatch(count, num=2, in_axes=(None, 0)), torch.zeros(()), torch.randn(4))


def test_gradient_accumulation_with_a_mean_loss_does_not_warn():
    fn, params = df.pure(Block())

    def loss_fn(params, x):
        return fn(params, x).square().mean()

    x = torch.randn(4, 8, 32)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loss, grads = df.jit(T.microbatch(df.value_and_grad(loss_fn), num=2, in_axes=(None, 0), out_axes="mean"))(params, x)
        assert _microbatch_warnings(record) == []
        # the same gradients concatenated instead of averaged are reduced values merged wrongly
        df.trace(T.microbatch(df.value_and_grad(loss_fn), num=2, in_axes=(None, 0), out_axes=("mean", 0)), params, x)
    assert any("out[1]['mlp.0.weight'] is reduced over the batch rows" in text for text in _microbatch_warnings(record))
    full_loss, full_grads = df.value_and_grad(loss_fn)(params, x)
    torch.testing.assert_close(loss, full_loss)
    for name in full_grads:
        torch.testing.assert_close(grads[name], full_grads[name])


@pytest.mark.parametrize("batch", [8, 7])
def test_mse_gradient_accumulation_equals_the_full_batch_gradients_and_does_not_warn(batch, no_microbatch_warnings):
    fn, params = df.pure(MLP())
    params = {k: v.detach() for k, v in params.items()}

    def loss_fn(params, x, y):
        return nn.functional.mse_loss(fn(params, x), y)

    step = T.microbatch(df.value_and_grad(loss_fn), num=4, in_axes=(None, 0, 0), out_axes="mean")
    x, y = torch.randn(batch, 32), torch.randn(batch, 16)
    loss, grads = df.jit(step)(params, x, y)
    full_loss, full_grads = df.value_and_grad(loss_fn)(params, x, y)
    torch.testing.assert_close(loss, full_loss)
    for name in full_grads:
        torch.testing.assert_close(grads[name], full_grads[name])


def _token_model():
    fn, params = df.pure(nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32)))
    ids, labels = torch.randint(0, 32, (4, 6)), torch.randint(0, 32, (4, 6))
    labels[2:, 1:] = -100                                  # rows 2 and 3 are mostly padding
    return fn, {k: v.detach() for k, v in params.items()}, ids, labels


def test_accumulating_a_mean_over_targets_with_a_row_weighted_mean_warns_and_the_summed_recipe_is_exact():
    fn, params, ids, labels = _token_model()

    def mean_loss(params, ids, labels):                    # cross-entropy's default: a mean over counted targets
        return nn.functional.cross_entropy(fn(params, ids).flatten(0, 1), labels.flatten())

    accumulate = T.microbatch(df.value_and_grad(mean_loss), num=2, in_axes=(None, 0, 0), out_axes="mean")
    with pytest.warns(UserWarning, match=r"the loss averages over its targets, not its rows \(aten\.nll_loss_forward"):
        df.jit(accumulate)(params, ids, labels)

    def summed_loss(params, ids, labels, counted):         # the warning's recipe
        return nn.functional.cross_entropy(fn(params, ids).flatten(0, 1), labels.flatten(), reduction="sum") / counted

    counted = (labels != -100).sum()
    accumulate = T.microbatch(df.value_and_grad(summed_loss), num=2, in_axes=(None, 0, 0, None), out_axes="sum")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loss, grads = df.jit(accumulate)(params, ids, labels, counted)
    assert _microbatch_warnings(record) == []
    full_loss, full_grads = df.value_and_grad(mean_loss)(params, ids, labels)
    torch.testing.assert_close((loss, grads), (full_loss, full_grads))


@pytest.mark.parametrize("fn, out_axes, message", [
    (lambda x: x / x.shape[0], 0, r"aten\.div\.Tensor reads the batch size as a number \(2 at a batch of 2 rows, 6 at 6\)"),
    (lambda x: x.sum() / x.shape[0], "sum", r"aten\.div\.Tensor reads the batch size as a number"),
    (lambda x: x + torch.ones(x.shape[0]).sum(), 0, r"aten\.sum reduces or indexes rows that the graph makes"),
    (lambda x: x.repeat(1, x.shape[0]).sum(-1), 0, r"the batch size in dimensions \[0, 1\]"),
], ids=["divided-by-rows", "summed-then-divided", "made-rows-summed", "repeat-then-sum"])
def test_a_body_that_reads_its_batch_size_warns_that_each_micro_batch_reads_its_own(fn, out_axes, message):
    """Each micro-batch of 2 rows computes with 2 where the unsplit call of 6 computes with 6."""
    x = torch.randn(6, 3)
    with pytest.warns(UserWarning, match=message):
        got = df.jit(T.microbatch(fn, num=3, out_axes=out_axes))(x)
    assert not torch.allclose(got, fn(x))                  # what the warning is about


_TABLE = torch.randn(6, 3)


@pytest.mark.parametrize("fn, message", [
    (lambda x: x + torch.arange(x.shape[0])[:, None], r"aten\.add\.Tensor uses the numbers of its rows"),
    (lambda x: x + _TABLE[torch.arange(x.shape[0])], r"uses the numbers of its rows \(from aten\.index\.Tensor\)"),
    (lambda x: (x * 2, torch.arange(x.shape[0])), r"it returns the numbers of its rows"),
], ids=["added-to-the-rows", "reading-a-table", "returned"])
def test_a_body_that_numbers_its_rows_warns_that_each_micro_batch_numbers_its_own_from_0(fn, message):
    x = torch.randn(6, 3)
    with pytest.warns(UserWarning, match=message):
        got = df.jit(T.microbatch(fn, num=3))(x)
    assert not all(torch.equal(g, e) for g, e in zip(optree.tree_leaves(got), optree.tree_leaves(fn(x))))


def test_rows_read_by_their_own_numbers_split_exactly_without_a_warning():
    def fn(x):                                             # as transformers' masks and Mixtral's experts index
        rows = torch.arange(x.shape[0])
        return torch.zeros_like(x).index_put((rows,), x[rows] * 2) + torch.arange(x.shape[1])

    x = torch.randn(6, 3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = df.jit(T.microbatch(fn, num=3))(x)
    assert _microbatch_warnings(record) == []
    torch.testing.assert_close(got, fn(x))


def test_an_embedding_bag_whose_offsets_number_the_rows_splits_exactly_without_a_warning():
    fn, params = df.pure(nn.EmbeddingBag(10, 4, mode="mean"))   # its offsets: arange(0, rows * 3, 3)
    ids = torch.randint(0, 10, (6, 3))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = df.jit(T.microbatch(fn, num=3, in_axes=(None, 0)))(params, ids)
    assert _microbatch_warnings(record) == []
    torch.testing.assert_close(got, fn(params, ids))


@pytest.mark.parametrize("fn", [lambda x: x.max(0).values, lambda x: nn.functional.cross_entropy(x, x.argmax(1))],
                         ids=["max-over-rows", "cross-entropy"])
def test_an_output_that_reads_the_rows_kept_from_the_first_micro_batch_warns(fn):
    x = torch.randn(6, 4)
    with pytest.warns(UserWarning, match=r"out reads the batch rows, but out_axes None keeps the first micro-batch"):
        got = df.jit(T.microbatch(fn, num=2, out_axes=None))(x)
    assert not torch.allclose(got, fn(x))


@pytest.mark.parametrize("fn, out_axes, match", [
    (lambda x: x.var(0), "mean", r"by aten\.var\.correction, which is not a sum or mean over them"),
    (lambda x: x.max(0).values, "mean", r"by aten\.max\.dim, which is not a sum or mean"),
    (lambda x: x[0] * 2, "mean", r"by aten\.select\.int, which is not a sum or mean"),
    (lambda x: x.norm(), "sum", r"by aten\.linalg_vector_norm, which is not a sum or mean"),
    (lambda x: x.pow(2).sum().sqrt(), "sum", r"by aten\.sum, then passed through aten\.sqrt"),
    (lambda x: x.sum() / (x > 0).sum(), "mean", r"then passed through aten\.div\.Tensor, which is not linear"),
    (lambda x: x.mean(0), "sum", r"out averages over the batch rows \(by aten\.mean\.dim\), but out_axes \"sum\""),
    (lambda x: x.flip(1).amax(0), "mean", r"by aten\.amax, which is not a sum or mean"),
    (lambda x: nn.functional.mse_loss(x, x * 2), "sum", r"averages over the batch rows \(by aten\.mse_loss\)"),
    (lambda x: x.pow(2).sum(), "mean", r"out adds up the batch rows \(by aten\.sum\), but out_axes \"mean\" averages"),
    (lambda x: nn.functional.mse_loss(x, x * 2, reduction="sum"), "mean", r"out adds up the batch rows"),
], ids=["variance", "max", "first-row", "norm", "root-of-sum", "ratio-of-sums", "mean-summed", "mean-loss-summed",
        "max-after-a-flip", "sum-averaged", "sum-loss-averaged"])
def test_a_reduction_other_than_a_sum_of_rows_merged_by_sum_or_mean_warns(fn, out_axes, match):
    """The micro-batches' variances, maxima or norms do not add up, nor average, to the batch's."""
    x = torch.randn(6, 3)
    with pytest.warns(UserWarning, match=match):
        got = df.jit(T.microbatch(fn, num=2, out_axes=out_axes))(x)
    assert not torch.allclose(got, fn(x))


@pytest.mark.parametrize("fn, out_axes", [
    (lambda x: x.mean(0) * 2 + 1, "mean"), (lambda x: x.T @ x, "sum"),
    (lambda x: (x.sum(0) - x.abs().sum(0) / 3).view(3, 1).T, "sum"),
], ids=["scaled-mean", "gram", "difference-of-sums"])
def test_sums_and_means_through_linear_ops_merge_exactly_without_a_warning(fn, out_axes, no_microbatch_warnings):
    x = torch.randn(6, 3)
    torch.testing.assert_close(df.jit(T.microbatch(fn, num=2, out_axes=out_axes))(x), fn(x))


@pytest.mark.parametrize("weight", [
    lambda w: w.tanh(), lambda w: w.softmax(-1), lambda w: nn.functional.normalize(w, dim=1),
    lambda w: nn.functional.layer_norm(w, (8,)),
], ids=["tanh", "softmax", "normalized", "layer-norm"])
def test_gradients_through_functions_of_the_weights_alone_accumulate_exactly_without_a_warning(
        weight, no_microbatch_warnings):
    """A weight's gradient is a sum over the rows passed through backward ops linear in it
    (tanh_backward, ...): the micro-batches' gradients add up to the batch's."""
    step = df.value_and_grad(lambda p, x: (x @ weight(p["w"])).pow(2).sum())
    params, x = {"w": torch.randn(8, 8)}, torch.randn(6, 8)
    got = df.jit(T.microbatch(step, num=2, in_axes=(None, 0), out_axes="sum"))(params, x)
    torch.testing.assert_close(got, step(params, x), rtol=1e-4, atol=1e-4)


def test_attention_across_the_batch_rows_warns_and_attention_beside_them_does_not():
    mha = nn.MultiheadAttention(4, 2).eval()               # sequence first: given (rows, 4), the rows are the sequence
    fn = lambda x: mha(x, x, x, need_weights=False)[0]     # noqa: E731
    with torch.no_grad(), pytest.warns(UserWarning, match=r"attends across the batch rows"):
        df.jit(T.microbatch(fn, num=2))(torch.randn(6, 4))
    x = torch.randn(5, 6, 4)                               # (sequence, batch, 4): split along the batch
    with torch.no_grad(), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = df.jit(T.microbatch(fn, num=2, in_axes=1, out_axes=1))(x)
    assert _microbatch_warnings(record) == []
    torch.testing.assert_close(got, fn(x))


def test_a_reduction_merged_against_its_kind_warns_when_called_eagerly_too():
    """Called without df.jit, the micro-batches run one after another: their merge is as wrong there."""
    x = torch.randn(6, 3)
    with pytest.warns(UserWarning, match=r"out averages over the batch rows \(by aten\.mean\.dim\)"):
        got = T.microbatch(lambda x: x.mean(0), num=2, out_axes="sum")(x)
    assert not torch.allclose(got, x.mean(0))


@pytest.mark.parametrize("loss", [nn.functional.mse_loss, nn.functional.smooth_l1_loss, nn.functional.huber_loss,
                                  nn.functional.soft_margin_loss],
                         ids=["mse", "smooth-l1", "huber", "soft-margin"])
def test_gradients_of_a_loss_averaged_inside_its_backward_kernel_accumulate_by_mean_and_warn_summed(loss):
    """`mse_loss_backward(reduction="mean")` divides by the element count inside the kernel: its
    gradients are means over the rows, though no `div` by the batch size shows in the graph."""
    step = df.value_and_grad(lambda p, x, y: loss(x @ p["w"], y))
    params, x, y = {"w": torch.randn(8, 4)}, torch.randn(6, 8), torch.randn(6, 4).sign()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = df.jit(T.microbatch(step, num=2, in_axes=(None, 0, 0), out_axes="mean"))(params, x, y)
    assert _microbatch_warnings(record) == []
    torch.testing.assert_close(got, step(params, x, y))
    with pytest.warns(UserWarning, match=r"_loss_backward divides by its element count, which counts the batch rows"):
        df.jit(T.microbatch(step, num=2, in_axes=(None, 0, 0), out_axes="sum"))(params, x, y)


def test_a_sum_divided_by_the_micro_batchs_rows_and_merged_by_mean_is_the_batch_mean_without_a_warning():
    fn = lambda x: x.pow(2).sum() / x.shape[0]             # noqa: E731
    x = torch.randn(6, 3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = df.jit(T.microbatch(fn, num=3, out_axes="mean"))(x)
    assert _microbatch_warnings(record) == []
    torch.testing.assert_close(got, fn(x))


def test_a_term_that_reads_no_batch_row_added_to_a_summed_loss_warns_that_sum_counts_it_per_micro_batch():
    def penalized(params, x):                              # a summed loss plus a penalty on the weights
        return (x @ params["w"]).pow(2).sum() + params["w"].pow(2).sum() + params["s"].pow(2).sum()

    params, x = {"w": torch.randn(3, 2), "s": torch.randn(2)}, torch.randn(6, 3)
    accumulate = T.microbatch(df.value_and_grad(penalized), num=3, in_axes=(None, 0), out_axes="sum")
    with pytest.warns(UserWarning, match=r"out\[0\] \(at aten\.add\.Tensor\), out\[1\]\['w'\] \(at aten\.add\.Tensor\) "
                                         r"add a term that reads no batch row .* counted 3 times"):
        loss, grads = df.jit(accumulate)(params, x)
    parts = [df.value_and_grad(penalized)(params, part) for part in x.split(2)]
    torch.testing.assert_close(loss, sum(part[0] for part in parts))   # what the warning says: the penalty 3 times
    torch.testing.assert_close(grads["s"], df.grad(penalized)(params, x)["s"])   # ... but "s" once

    def summed(params, x, rows):                           # the penalty outside: nothing to warn about
        return (x @ params["w"]).pow(2).sum() / rows

    accumulate = T.microbatch(df.value_and_grad(summed), num=3, in_axes=(None, 0, None), out_axes="sum")
    rows = torch.tensor(6.0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = df.jit(accumulate)(params, x, rows)
    assert _microbatch_warnings(record) == []
    torch.testing.assert_close(got, df.value_and_grad(summed)(params, x, rows))


@pytest.mark.parametrize("name", ["mlp", "block", "two-branch", "llama"])
def test_the_models_the_suite_micro_batches_do_not_warn(name, no_microbatch_warnings):
    if name == "llama":
        fn, params = llama_logits(tiny_llama())
        args = (torch.randint(0, 128, (4, 10)),)
    else:
        model = {"mlp": MLP, "block": Block, "two-branch": TwoBranch}[name]()
        fn, params = df.pure(model)
        args = {"mlp": (torch.randn(6, 32),), "block": (torch.randn(4, 8, 32),),
                "two-branch": (torch.randn(6, 32), torch.randn(6, 32))}[name]
    step = T.microbatch(fn, num=2, in_axes=(None,) + (0,) * len(args))
    torch.testing.assert_close(df.jit(step)(params, *args), fn(params, *args))


# --- 4. keyword tensors ------------------------------------------------------------------------------


def test_keyword_tensors_split_along_axis_0():
    def f(x, bias):
        return x + bias

    x, bias = torch.randn(6, 3), torch.randn(6, 3)
    for name, got in {"eager": T.microbatch(f, num=2)(x, bias=bias),
                      "jit": df.jit(T.microbatch(f, num=2))(x, bias=bias)}.items():
        torch.testing.assert_close(got, x + bias, msg=name)


def test_a_keyword_tensor_that_is_not_batched_says_pass_it_positionally():
    def f(x, mask):
        return x * mask

    with pytest.raises(df.TransformError, match=r"x along axis 0 \(size 6\), mask along axis 0 \(size 3\)\. mask is "
                                                 r"passed by keyword.*pass it positionally with an in_axes entry"):
        df.trace(T.microbatch(f, num=2), torch.randn(6, 3), mask=torch.randn(3))
    with pytest.raises(df.TransformError, match=r"mask is passed by keyword and has no dimensions.*positionally"):
        df.trace(T.microbatch(f, num=2), torch.randn(6, 3), mask=torch.randn(()))
    x, mask = torch.randn(6, 3), torch.randn(3)
    torch.testing.assert_close(T.microbatch(f, num=2, in_axes=(0, None))(x, mask), x * mask)


# --- 5. the docstring ---------------------------------------------------------------------------------


def test_help_explains_the_conventions():
    doc = " ".join(T.microbatch.__doc__.split())
    for phrase in ["in_axes=(None, 0)", "nn.Parameter", "passed by keyword are split along axis 0", '"mean"',
                   "torch.tensor_split", "reads no split input", "eval mode", ">>> step = T.microbatch("]:
        assert phrase in doc, phrase


@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_adding_up_outputs_whose_shapes_differ_between_uneven_micro_batches_is_a_transform_error(reduce):
    step = T.microbatch(lambda x: x * 2, num=2, in_axes=0, out_axes=reduce)      # per-row output, 3 rows: 2 + 1
    with pytest.raises(df.TransformError, match=rf"out_axes \"{reduce}\" adds up out across micro-batches, but its "
                                                r"shapes differ between them \(\[1, 3\], \[2, 3\]\)"):
        step(torch.randn(3, 3))
