"""Mixture-of-experts token dispatch sorts the batch's tokens by expert and puts the results back:
micro-batched or padded, each token's result is its own, and neither warns. What reads the sorted
order itself warns, as any op along the batch axis does."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import dynaflow_fn as df
from dynaflow_fn import transforms as T
from models import tiny_moe

EXPERTS, TOP, WIDTH, OUT = 4, 2, 8, 8


def _route(x, router):
    weights, ids = (x @ router).softmax(-1).topk(TOP, dim=-1)
    return weights.reshape(-1), ids.reshape(-1)


def _grouped(x, router, experts, ids_sort=torch.sort, histc_min=0):
    """transformers' grouped-mm experts: sort the (token, expert) pairs by expert, one grouped product."""
    weights, ids = _route(x, router)
    sorted_ids, order = ids_sort(ids)
    picked = x[order // TOP]
    counts = torch.histc(sorted_ids.float(), bins=EXPERTS, min=histc_min, max=EXPERTS - 1)
    out = F.grouped_mm(picked, experts, offs=torch.cumsum(counts, 0, dtype=torch.int32))
    return out * weights[order][:, None], order


def _inverse_by_numbers(x, router, experts):
    out, order = _grouped(x, router, experts)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return out[inverse].view(-1, TOP, OUT).sum(1)


def _inverse_by_argsort(x, router, experts):
    out, order = _grouped(x, router, experts)
    return out[order.argsort()].view(-1, TOP, OUT).sum(1)


def _added_back_per_token(x, router, experts):
    out, order = _grouped(x, router, experts)
    return torch.zeros(x.shape[0], OUT).index_add(0, order // TOP, out)


def _written_back(x, router, experts):
    out, order = _grouped(x, router, experts)
    back = torch.empty_like(out)
    back[order] = out
    return back.view(-1, TOP, OUT).sum(1)


def _copied_back_by_a_floor_division(x, router, experts):
    out, order = _grouped(x, router, experts)
    back = torch.zeros_like(out).index_copy(0, order, out)
    return back.view(-1, TOP, OUT).sum(1) + torch.zeros(x.shape[0], OUT).index_add(
        0, torch.div(order, TOP, rounding_mode="floor"), out)


def _inputs(rows):
    return torch.randn(rows, WIDTH), torch.randn(WIDTH, EXPERTS), torch.randn(EXPERTS, WIDTH, OUT)


def _sort_warnings(record):
    return [str(w.message) for w in record if "aten.sort" in str(w.message)]


@pytest.mark.parametrize("fn", [_inverse_by_numbers, _inverse_by_argsort, _added_back_per_token, _written_back,
                                _copied_back_by_a_floor_division])
def test_a_dispatch_that_puts_the_rows_back_microbatches_and_pads_exactly_without_a_warning(fn):
    split = df.jit(T.microbatch(fn, num=2, in_axes=(0, None, None)), progress=False)
    padded = df.jit(fn, buckets=(4, 8), in_axes=(0, None, None), progress=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for rows in (6, 3, 5):
            args = _inputs(rows)
            expected = fn(*args)
            if rows % 2 == 0:
                torch.testing.assert_close(split(*args), expected)
            torch.testing.assert_close(padded(*args), expected)
    assert _sort_warnings(record) == []


def _layer_normed_after(x, router, experts):
    """The layer norm's backward runs first and hands the dispatch's backward its rows."""
    return F.layer_norm(_inverse_by_numbers(x, router, experts), (OUT,))


@pytest.mark.parametrize("fn", [_inverse_by_numbers, _inverse_by_argsort, _added_back_per_token, _written_back,
                                _layer_normed_after])
def test_the_gradients_of_a_dispatch_microbatch_exactly_without_a_warning(fn):
    def loss(params, x):
        return fn(x, *params).square().mean()

    x, *params = _inputs(8)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        step = df.jit(T.microbatch(df.value_and_grad(loss), num=2, in_axes=(None, 0), out_axes="mean"), progress=False)
        got = step(params, x)
    torch.testing.assert_close(got, df.value_and_grad(loss)(params, x))
    assert _sort_warnings(record) == []


def _summed_in_sorted_order(x, router, experts):
    out, _ = _grouped(x, router, experts)
    return out.view(-1, TOP, OUT).sum(1)                               # never put back


def _numbered_by_sorted_position(x, router, experts):
    out, order = _grouped(x, router, experts)
    out = out * torch.arange(order.numel())[:, None]
    return out[order.argsort()].view(-1, TOP, OUT).sum(1)


def _summed_along_the_sorted_rows(x, router, experts):
    out, order = _grouped(x, router, experts)
    return out.cumsum(0)[order.argsort()].view(-1, TOP, OUT).sum(1)


@pytest.mark.parametrize("fn", [_summed_in_sorted_order, _numbered_by_sorted_position, _summed_along_the_sorted_rows])
def test_values_that_depend_on_the_sorted_order_warn_and_do_differ_when_split(fn):
    args = _inputs(8)
    with pytest.warns(UserWarning, match=r"microbatch: aten\.sort works along the batch axis"):
        got = df.jit(T.microbatch(fn, num=2, in_axes=(0, None, None)), progress=False)(*args)
    assert not torch.allclose(got, fn(*args))
    with pytest.warns(UserWarning, match=r"with buckets: aten\.sort works along the batch axis"):
        df.jit(fn, buckets=(4, 8), in_axes=(0, None, None), progress=False)(*_inputs(3))


@pytest.mark.parametrize("ids_sort, histc_min", [
    (lambda ids: torch.sort(ids, descending=True), 0),      # the groups count up, the rows go down
    (torch.sort, 1),                                         # expert 0 falls under the bins and shifts them
], ids=["descending", "values-under-the-bins"])
def test_groups_that_need_not_follow_each_row_own_value_warn(ids_sort, histc_min):
    def fn(x, router, experts):
        out, order = _grouped(x, router, experts, ids_sort, histc_min)
        return out[order.argsort()].view(-1, TOP, OUT).sum(1)

    with pytest.warns(UserWarning, match=r"microbatch: aten\.sort works along the batch axis"):
        df.jit(T.microbatch(fn, num=2, in_axes=(0, None, None)), progress=False)(*_inputs(8))


def test_rows_gathered_in_an_order_other_than_their_own_sort_warn():
    def fn(x, router, experts):
        out, order = _grouped(x, router, experts)
        _, other = torch.sort(x[:, 0].repeat_interleave(TOP))          # a second sort, of other values
        return out[other.argsort()].view(-1, TOP, OUT).sum(1)

    args = _inputs(8)
    with pytest.warns(UserWarning, match=r"microbatch: aten\.sort works along the batch axis"):
        got = df.jit(T.microbatch(fn, num=2, in_axes=(0, None, None)), progress=False)(*args)
    assert not torch.allclose(got, fn(*args))


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_transformers_moe_models_microbatch_and_pad_without_a_warning(name):
    fn, params = df.pure(tiny_moe(name))
    logits = lambda p, ids: fn(p, ids, use_cache=False).logits          # noqa: E731
    split = df.jit(T.microbatch(logits, num=2, in_axes=(None, 0)), progress=False)
    padded = df.jit(logits, buckets=(4, 8), in_axes=(None, 0), progress=False)
    with warnings.catch_warnings(record=True) as record, torch.no_grad():
        warnings.simplefilter("always")
        for rows in (4, 3):
            ids = torch.randint(0, 128, (rows, 8))
            expected = logits(params, ids)
            if rows % 2 == 0:
                torch.testing.assert_close(split(params, ids), expected)
            torch.testing.assert_close(padded(params, ids), expected)
    assert [str(w.message) for w in record if "batch axis" in str(w.message)] == []


def test_rows_returned_in_the_sorted_order_warn_and_do_differ_when_split():
    def fn(x, router, experts):
        out, _ = _grouped(x, router, experts)
        return out

    args = _inputs(8)
    with pytest.warns(UserWarning, match=r"microbatch: aten\.sort works along the batch axis"):
        got = df.jit(T.microbatch(fn, num=2, in_axes=(0, None, None)), progress=False)(*args)
    assert not torch.allclose(got, fn(*args))


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_transformers_moe_models_train_microbatched_without_a_warning(name):
    """Their backward passes too: attention's and the rotary slices' gradients keep the rows, and the
    dispatch's gradients are put back as its forward puts the rows back."""
    fn, params = df.pure(tiny_moe(name).train())

    def loss(p, ids):
        return fn(p, ids, use_cache=False).logits.square().mean()

    ids = torch.randint(0, 128, (4, 8))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        step = df.jit(T.microbatch(df.value_and_grad(loss), num=2, in_axes=(None, 0), out_axes="mean"), progress=False)
        got = step(params, ids)
    torch.testing.assert_close(got, df.value_and_grad(loss)(params, ids))
    assert [str(w.message) for w in record if str(w.message).startswith("microbatch")] == []


def _put_back_by(inverse_of, into_of):
    def fn(x, router, experts):
        out, order = _grouped(x, router, experts)
        return into_of(x).index_add(0, inverse_of(order), out)
    return fn


@pytest.mark.parametrize("fn", [
    _put_back_by(lambda order: order // TOP, lambda x: torch.arange(x.shape[0] * OUT, dtype=x.dtype).view(-1, OUT)),
], ids=["into-numbered-rows"])
def test_sorted_rows_added_into_a_tensor_that_numbers_the_rows_warn(fn):
    """Each part of the batch numbers its rows from 0: what the rows are added to differs."""
    args = _inputs(8)
    with pytest.warns(UserWarning, match=r"microbatch: aten\.sort works along the batch axis"):
        got = df.jit(T.microbatch(fn, num=2, in_axes=(0, None, None)), progress=False)(*args)
    assert not torch.allclose(got, fn(*args))


def test_an_order_sorted_descending_is_no_inverse_and_warns():
    def fn(x, router, experts):
        out, order = _grouped(x, router, experts)
        return out[order.argsort(descending=True)].view(-1, TOP, OUT).sum(1)

    args = _inputs(8)
    with pytest.warns(UserWarning, match=r"microbatch: aten\.sort works along the batch axis"):
        got = df.jit(T.microbatch(fn, num=2, in_axes=(0, None, None)), progress=False)(*args)
    assert not torch.allclose(got, fn(*args))


def test_expert_ids_cast_to_a_type_that_wraps_them_count_other_groups_and_warn():
    many = 260                                                          # ids 256..259 wrap to 0..3 in uint8

    def fn(x, router, experts, bias):
        weights, ids = (x @ router + bias).softmax(-1).topk(TOP, dim=-1)
        sorted_ids, order = torch.sort(ids.reshape(-1))
        counts = torch.histc(sorted_ids.to(torch.uint8).float(), bins=many, min=0, max=many - 1)
        out = F.grouped_mm(x[order // TOP], experts, offs=torch.cumsum(counts, 0, dtype=torch.int32))
        return (out * weights.reshape(-1)[order][:, None])[order.argsort()].view(-1, TOP, OUT).sum(1)

    bias = torch.zeros(many)
    bias[-4:] = 100.0                                                   # every token picks among the last four
    args = torch.randn(8, WIDTH), torch.randn(WIDTH, many), torch.randn(many, WIDTH, OUT), bias
    with pytest.warns(UserWarning, match=r"microbatch: aten\.sort works along the batch axis"):
        df.jit(T.microbatch(fn, num=2, in_axes=(0, None, None, None)), progress=False)(*args)
