"""Trace-time refusals of what a Plan cannot replay: seeding the global generator or drawing from a
generator of its own, changing an argument's layout in place, rebinding a tensor attribute, keeping a
tensor of the trace in Python state, reading the value of a tensor the function does not receive.
Each is compared with eager PyTorch where the function is fine, and the caller's state is checked to
be left as it was where it is refused. Python state changed while being traced warns."""

import dataclasses
import re
import warnings

import numpy
import pytest
import torch

import dynaflow_fn as df
from dynaflow_fn.tracing import reseeding


_OTHER_STATE = torch.Generator().manual_seed(99).get_state()


@pytest.mark.parametrize("seed_inside, seen_by", [
    (lambda: torch.manual_seed(1234), "seed"),
    (lambda: torch.manual_seed(torch.initial_seed()), "state"),
    (lambda: torch.set_rng_state(_OTHER_STATE), "state"),
], ids=["new-seed", "same-seed", "set-state"])
def test_a_function_that_seeds_the_global_generator_is_refused_and_the_generator_left_alone(seed_inside, seen_by):
    """A plan cannot replay torch.manual_seed: only the first call would be seeded, the rest would
    draw other numbers than eager PyTorch does. A new seed is always seen; a state set back to what
    another seed gave only while no other thread runs (one might draw numbers meanwhile)."""
    if seen_by == "state" and reseeding._other_threads():
        pytest.skip(f"other threads run ({', '.join(t.name for t in reseeding._other_threads())}): the generator's "
                    f"state is not compared then")

    def noisy(x):
        seed_inside()
        return x + torch.rand(x.shape)

    x = torch.randn(3)
    state = torch.get_rng_state()
    with pytest.raises(df.errors.TraceError, match=r"noisy sets torch's global random generator.*Seed before"):
        df.jit(noisy)(x)
    assert torch.equal(torch.get_rng_state(), state)


def test_random_ops_without_seeding_still_trace_and_draw_fresh_numbers():
    fast = df.jit(lambda x: x + torch.rand(x.shape))
    x = torch.randn(3)
    assert not torch.equal(fast(x), fast(x))


@pytest.mark.parametrize("change", [
    lambda t: t.t_(), lambda t: t.unsqueeze_(0), lambda t: t.transpose_(0, 1), lambda t: t.resize_(6),
    lambda t: t.as_strided_((3,), (1,)),
])
def test_changing_the_layout_of_an_argument_in_place_is_a_trace_error_naming_it(change):
    def relayout(x):
        change(x)
        return x * 2

    with pytest.raises(df.errors.TraceError, match=r"relayout changes the shape or strides of its argument x in "
                                                   r"place \(aten\.\w+_.*use the out-of-place op"):
        df.jit(relayout)(torch.randn(2, 3))


def test_layout_ops_on_the_functions_own_tensors_or_leaving_the_layout_as_it_was_still_run():
    def fine(x):
        y = (x * 2).t_()
        return y.unsqueeze_(0) + x.squeeze_().sum()

    x = torch.randn(2, 3)
    torch.testing.assert_close(df.jit(fine)(x.clone()), fine(x.clone()))


class _Stepping(torch.nn.Module):
    """Rebinds a buffer and a plain tensor attribute in forward, as stateful model code may."""

    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))
        self.hidden = torch.zeros(3)

    def forward(self, x):
        self.steps = self.steps + 1
        self.hidden = self.hidden * 0.5 + x
        return self.hidden * self.steps


def test_assigning_a_new_tensor_to_a_module_attribute_is_refused_and_the_module_left_as_it_was():
    module = _Stepping()
    steps, hidden = module.steps, module.hidden
    with pytest.raises(df.errors.TraceError, match=r"assigns a tensor .* to _Stepping\.hidden, _Stepping\.steps"
                                                   r".*in place instead"):
        df.jit(module)(torch.randn(3))
    assert module.steps is steps and module.hidden is hidden
    x = torch.randn(3)
    torch.testing.assert_close(module(x), x)                 # eager use afterwards sees real tensors


def test_updating_module_state_in_place_still_runs():
    class InPlace(_Stepping):
        def forward(self, x):
            self.steps.add_(1)
            self.hidden.mul_(0.5).add_(x)
            return self.hidden * self.steps

    eager, jitted = InPlace(), InPlace()
    fast = df.jit(jitted)
    for _ in range(3):
        x = torch.randn(3)
        torch.testing.assert_close(fast(x), eager(x))


def test_a_jitted_method_assigning_a_new_tensor_to_its_instance_is_refused():
    class Accumulator:
        def __init__(self):
            self.total = torch.zeros(2)

        @df.jit
        def add(self, x):
            self.total = self.total + x
            return self.total * 1

    acc = Accumulator()
    total = acc.total
    with pytest.raises(df.errors.TraceError, match=r"add assigns a tensor .* to Accumulator\.total"):
        acc.add(torch.randn(2))
    assert acc.total is total


captured_by_hook = []


@pytest.mark.parametrize("hooked, kept, what, shape", [
    (lambda model: model[1], lambda args, out: out, r"the result of aten\.relu", "3, 4"),
    (lambda model: model, lambda args, out: out, r"the result of aten\.addmm", "3, 2"),
], ids=["inner-output", "whole-model-output"])
def test_a_forward_hook_that_keeps_activations_is_refused_naming_the_op_and_the_holder(hooked, kept, what, shape):
    """Activation capture through a hook: on later calls a plan would append nothing, and the first
    call would leave a placeholder without data in the list. A hook on the whole model keeps the
    function's own output, which the trace keeps too."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    handle = hooked(model).register_forward_hook(lambda module, args, out: captured_by_hook.append(kept(args, out)))
    try:
        fn, params = df.pure(model)
        with pytest.raises(df.errors.TraceError, match=rf"keeps a tensor outside itself.*"
                                                       rf"{what} \(float32\[{shape}\]\).*held by a list"):
            df.jit(fn, progress=False)(params, torch.randn(3, 4))
        assert captured_by_hook == []                          # the placeholder taken out again
    finally:
        handle.remove()
        captured_by_hook.clear()


class Store:
    pass


@pytest.mark.parametrize("keep, holder", [
    (lambda kept, h: kept["list"].append(h), r"a list `kept_list`"),
    (lambda kept, h: kept["dict"].update(last=h), r"a dict `kept_dict`"),
    (lambda kept, h: setattr(kept["object"], "last", h), r"attribute 'last' of a Store `kept_object`"),
], ids=["list", "dict", "attribute"])
def test_a_function_that_keeps_an_intermediate_tensor_is_refused_naming_where(keep, holder):
    kept_list, kept_dict, kept_object = [], {}, Store()

    def leaky(x):
        h = x * 2
        keep({"list": kept_list, "dict": kept_dict, "object": kept_object}, h)
        return h + 1

    def keeps_its_argument(x):
        keep({"list": kept_list, "dict": kept_dict, "object": kept_object}, x)
        return x + 1

    with pytest.raises(df.errors.TraceError, match=rf"leaky keeps .*the result of aten\.mul.*held by {holder}"):
        df.jit(leaky, progress=False)(torch.randn(3))
    assert kept_list == [] and kept_dict == {}                 # lists and dicts are put back as they were
    with pytest.raises(df.errors.TraceError, match=rf"keeps_its_argument keeps .*its argument x .*held by {holder}"):
        df.jit(keeps_its_argument, progress=False)(torch.randn(3))


def test_outputs_that_view_intermediates_and_tensors_kept_only_by_the_trace_are_no_escape():
    def f(x, w):
        h = x @ w
        return h.view(-1), h.t(), (x * 2).detach()[0]

    x, w = torch.randn(3, 4), torch.randn(4, 4)
    for actual, expected in zip(df.jit(f, progress=False)(x, w), f(x, w)):
        torch.testing.assert_close(actual, expected)


def test_a_generator_of_the_functions_own_is_refused_with_what_to_do_instead():
    closed_over = torch.Generator().manual_seed(0)

    def noisy(x):
        return x + torch.rand(x.shape, generator=closed_over)

    def noisy_from(x, generator):
        return x + torch.rand(x.shape, generator=generator)

    state = closed_over.get_state()
    with pytest.raises(df.errors.TraceError, match=r"noisy draws random numbers from a torch.Generator of its own "
                                                   r"\(aten.rand.generator.*Seed the global generator"):
        df.jit(noisy, progress=False)(torch.randn(3))
    assert torch.equal(closed_over.get_state(), state)
    with pytest.raises(df.errors.InputError, match=r"argument generator is a Generator.*draw the random tensors "
                                                   r"outside the function"):
        df.jit(noisy_from, progress=False)(torch.randn(3), closed_over)



@dataclasses.dataclass(frozen=True)
class _Frozen:
    value: torch.Tensor


def _model_output(tensor):
    from transformers.modeling_outputs import BaseModelOutput

    return BaseModelOutput(last_hidden_state=tensor)


@pytest.mark.parametrize("wrap, returned, advice", [
    (_model_output, "BaseModelOutput", "`dict(result)`"),
    (lambda t: {"out": _Frozen(t)}, "_Frozen", "its tensor fields"),   # hashable: it looked like a static value
], ids=["model-output", "frozen-dataclass"])
def test_returning_a_container_that_is_no_pytree_is_a_trace_error_saying_what_to_return(wrap, returned, advice):
    with pytest.raises(df.errors.TraceError, match=f"returned a {returned} at .* Return {re.escape(advice)}"):
        df.jit(lambda x: wrap(x * 2))(torch.randn(3))


def test_a_model_outputs_fields_returned_as_a_dict_come_back_as_eagers():
    x = torch.randn(3)
    torch.testing.assert_close(df.jit(lambda x: dict(_model_output(x * 2)))(x), {"last_hidden_state": x * 2})


_OUTSIDE = torch.tensor(3.0)


@pytest.mark.parametrize("read", [
    lambda x: x * float(_OUTSIDE), lambda x: x * (_OUTSIDE * 2).item(), lambda x: x * 2 if _OUTSIDE else x,
    lambda x: x * _OUTSIDE.tolist(), lambda x: x * int(_OUTSIDE), lambda x: x[:_OUTSIDE.long()],
    lambda x: x + torch.arange(_OUTSIDE.long()).sum(), lambda x: x * torch.from_numpy(numpy.asarray(_OUTSIDE)),
    lambda x: torch.nn.functional.leaky_relu(x, _OUTSIDE),
], ids=["float", "item-of-a-product", "bool", "tolist", "int", "slice-end", "arange-size", "numpy", "scalar-argument"])
def test_reading_the_value_of_a_tensor_the_function_does_not_receive_is_refused(read):
    """The trace would keep the value the tensor had while being traced; eager reads it on every call."""
    with pytest.raises(df.TraceError, match=r"reads the value of a tensor it does not receive as an argument"):
        df.jit(read)(torch.ones(2))


def test_reading_the_value_of_its_own_literal_or_using_an_outside_tensor_as_a_tensor_still_runs():
    fast = df.jit(lambda x: x * torch.tensor(3.0).item() + _OUTSIDE)
    torch.testing.assert_close(fast(torch.ones(2)), torch.full((2,), 6.0))


class _Cache(torch.nn.Module):
    """A KV cache whose write position is a buffer the caller advances."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.zeros(4))
        self.register_buffer("pos", torch.tensor(0))

    def forward(self, x):
        self.k[self.pos] = x
        return self.k * 1


def test_a_cache_written_at_a_position_held_in_a_buffer_is_refused_not_written_at_the_traced_position():
    """The plan would write every step at position 0, the position it saw while being traced."""
    cache = _Cache()
    with pytest.raises(df.TraceError, match=r"at .*test_refusals\.py:\d+: `self\.k\[self\.pos\] = x` \(as a Python"):
        df.jit(cache)(torch.tensor(1.0))
    assert torch.equal(cache.k, torch.zeros(4)) and cache.pos.item() == 0


def test_batch_norm_with_a_cumulative_average_is_refused_not_left_with_stale_statistics():
    """momentum=None divides by float(num_batches_tracked): the trace saw the count before its own
    increment (a division by zero at first), and a plan would keep that count on every call."""
    bn = torch.nn.BatchNorm1d(4, momentum=None)
    with pytest.raises(df.TraceError, match=r"reads the value of a tensor it does not receive.*as a Python number"):
        df.jit(bn)(torch.randn(8, 4))
    assert bn.num_batches_tracked.item() == 0 and torch.equal(bn.running_mean, torch.zeros(4))


class _Counting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.calls, self.seen = 0, []

    def forward(self, x):
        self.calls += 1
        self.seen.append(x.shape)
        return x * self.calls


def test_changing_python_state_while_being_traced_warns_that_later_calls_will_not_change_it():
    """A plan replays tensor ops only: eager returns x * 2 on the second call, the plan x * 1."""
    counting, eager = _Counting(), _Counting()
    fast, x = df.jit(counting), torch.ones(2)
    with pytest.warns(UserWarning, match=r"changes _Counting\.calls, _Counting\.seen while being traced"):
        fast(x)
    eager(x)
    assert not torch.equal(fast(x), eager(x))              # what the warning is about


def test_reading_python_state_without_changing_it_does_not_warn():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.5), torch.nn.LayerNorm(3)).eval()
    model.names, model.scale = ["a"], 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        torch.testing.assert_close(df.jit(model)(torch.ones(2, 3)), model(torch.ones(2, 3)))


def test_a_lazy_module_not_yet_initialized_is_refused_saying_to_call_it_once_eagerly():
    lazy = torch.nn.Sequential(torch.nn.LazyLinear(3), torch.nn.ReLU())
    with pytest.raises(df.TraceError, match=r"calls LazyLinear, whose parameters are not initialized yet"):
        df.jit(lazy)(torch.randn(2, 4))
    lazy(torch.randn(2, 4))
    x = torch.randn(2, 4)
    torch.testing.assert_close(df.jit(lazy)(x), lazy(x))
