"""The per-call check of df.jit refuses every change a full cache lookup would see, in its C++ form
(torch's guard manager) and in its Python form, and admits what the plan computes the same for."""

import collections
import dataclasses
import math

import optree
import pytest
import torch
from torch import nn

import dynaflow_fn as df
from dynaflow_fn.jitting import guard as guard_module
from dynaflow_fn.jitting.call import DictNodes
from dynaflow_fn.jitting.guard import Guard, call_state


@pytest.fixture(params=["native", "python"])
def check_path(request, monkeypatch):
    """Every guard built in the test checks in C++ ("native") or in Python ("python")."""
    if request.param == "python":
        monkeypatch.setenv(guard_module.PYTHON_GUARD_ENV, "1")
    else:
        monkeypatch.delenv(guard_module.PYTHON_GUARD_ENV, raising=False)
    return request.param


def _guard(*args, modules=(), closed_over=()):
    leaves, treedef = optree.tree_flatten((args, {}))
    return Guard(treedef, leaves, call_state(), modules, closed_over)


def _admits(guard, *args):
    leaves, treedef = optree.tree_flatten((args, {}))
    return guard.admits(treedef, leaves, call_state())


def test_this_torch_checks_in_cpp():
    check = guard_module.native_check([torch.randn(2), 3, 0.0], [nn.Dropout()], [torch.randn(2)])
    assert check is not None and check.python_positions == (2,)


def test_tensors_of_the_same_layout_are_admitted_whatever_their_values_or_identity(check_path):
    weight, x = nn.Parameter(torch.randn(4, 4)), torch.randn(2, 4)
    guard = _guard(weight, x)
    assert _admits(guard, weight, torch.randn(2, 4))
    with torch.no_grad():
        weight.add_(1)                                           # a new version, the same layout
    assert _admits(guard, weight, x)
    assert _admits(guard, nn.Parameter(weight.detach().clone()), x)   # the executable checks addresses


REPLACEMENTS = {   # another leaf in the place of a (4, 4) float tensor
    "shape": lambda: torch.randn(4, 2),
    "strides": lambda: torch.randn(4, 4).t(),
    "dtype": lambda: torch.randn(4, 4, dtype=torch.float64),
    "device": lambda: torch.empty(4, 4, device="meta"),
    "a static leaf": lambda: 4,
}
IN_PLACE = {       # the same tensor object, in another layout
    "resize_": lambda w: w.resize_(16),
    "t_": lambda w: w.t_(),
    "unsqueeze_": lambda w: w.unsqueeze_(0),
    "data = its own memory transposed": lambda w: setattr(w, "data", w.data.t()),
    "data = its own memory as int32": lambda w: setattr(w, "data", w.data.view(torch.int32)),
    "data = a new shape": lambda w: setattr(w, "data", torch.randn(16)),
}


@pytest.mark.parametrize("change", REPLACEMENTS)
def test_a_leaf_of_another_layout_is_refused(check_path, change):
    weight, x = torch.randn(4, 4), torch.randn(2, 4)
    guard = _guard(weight, x)
    assert not _admits(guard, REPLACEMENTS[change](), x)


@pytest.mark.parametrize("change", IN_PLACE)
def test_a_tensor_leaf_changed_in_layout_in_place_is_refused(check_path, change):
    weight, x = torch.randn(4, 4), torch.randn(2, 4)
    guard = _guard(weight, x)
    IN_PLACE[change](weight)
    assert not _admits(guard, weight, x)


@pytest.mark.parametrize("change", IN_PLACE)
def test_a_closed_over_tensor_changed_in_layout_is_refused(check_path, change):
    weight, x = torch.randn(4, 4), torch.randn(2, 4)
    guard = _guard(x, closed_over=[weight])
    IN_PLACE[change](weight)
    assert not _admits(guard, x)


def test_a_closed_over_tensor_with_new_values_or_memory_in_the_same_layout_is_admitted(check_path):
    weight, x = torch.randn(4, 4), torch.randn(2, 4)
    guard = _guard(x, closed_over=[weight])
    weight.add_(1)
    assert _admits(guard, x)
    weight.data = torch.randn(4, 4)
    assert _admits(guard, x)


@dataclasses.dataclass(frozen=True)
class Config:
    scale: float


STATIC_LEAVES = [  # (built with, called with, admitted)
    (2, 2, True), (2, 3, False), (True, 1, False), (1, True, False), (True, True, True),
    (float("1.5"), float("1.5"), True), (1.5, 2.5, False), (1.5, 1, False), (math.inf, float("inf"), True),
    (0.0, float("0.0"), True), (0.0, -0.0, False), (-0.0, 0.0, False), (float("nan"), float("nan"), True),
    (complex(0.0, 1.0), complex(-0.0, 1.0), False), (complex(1.0, 2.0), complex(1.0, 2.0), True),
    ("mean", "mean", True), ("mean", "sum", False), (b"a", b"b", False),
    (torch.float32, torch.float32, True), (torch.float32, torch.float16, False),
    (torch.device("cpu"), torch.device("cpu"), True), (torch.device("cpu"), torch.device("meta"), False),
    (Config(0.0), Config(0.0), True), (Config(0.0), Config(-0.0), False), (Config(1.0), Config(2.0), False),
]


@pytest.mark.parametrize("built, called, admitted", STATIC_LEAVES, ids=[repr(case[:2]) for case in STATIC_LEAVES])
def test_static_leaves_are_compared_by_key(check_path, built, called, admitted):
    x = torch.randn(3)
    guard = _guard(x, built)
    assert _admits(guard, x, called) is admitted


def test_a_switched_module_mode_is_refused_and_switching_back_admitted(check_path):
    model, x = nn.Dropout(), torch.randn(3)
    guard = _guard(x, modules=[model])
    assert _admits(guard, x)
    model.eval()
    assert not _admits(guard, x)
    model.train()
    assert _admits(guard, x)


def test_another_structure_or_call_state_is_refused(check_path):
    x = torch.randn(3)
    guard = _guard(x, 2)
    assert not _admits(guard, x)
    assert not _admits(guard, (x,), 2)
    leaves, treedef = optree.tree_flatten(((x, 2), {}))
    assert guard.admits(treedef, leaves, call_state())
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert not guard.admits(treedef, leaves, call_state())
    finally:
        torch.set_default_dtype(previous)


# --- end to end, against eager PyTorch --------------------------------------------------------------


def test_a_parameter_given_another_layout_of_its_own_memory_is_traced_again(check_path):
    model = nn.Linear(4, 4, bias=False)
    fn, params = df.pure(model)
    fast = df.jit(fn)
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(fast(params, x), model(x), rtol=0, atol=0)
        model.weight.data = model.weight.data.t()                 # same memory, transposed
        torch.testing.assert_close(fast(params, x), model(x), rtol=0, atol=0)
    assert fast.cache_info().misses == 2


def test_calls_with_static_zeros_of_either_sign_match_eager(check_path):
    x = torch.randn(4)
    by_float = df.jit(lambda x, scale: x / scale)
    by_field = df.jit(lambda x, c: x / c.scale)
    for scale in (0.0, -0.0, 0.0, 2.0, -0.0):
        torch.testing.assert_close(by_float(x, scale), x / scale, rtol=0, atol=0)
        torch.testing.assert_close(by_field(x, Config(scale)), x / scale, rtol=0, atol=0)
    assert by_float.cache_info().misses == by_field.cache_info().misses == 3


@pytest.mark.cuda
def test_a_parameter_given_another_layout_of_its_own_memory_is_seen_by_the_cuda_graph(check_path):
    model = nn.Linear(64, 64, bias=False).cuda()
    fn, params = df.pure(model)
    fast = df.jit(fn, backend="cudagraph")
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(fast(params, x), model(x))
        model.weight.data = model.weight.data.t()                 # read in place: same address, new strides
        torch.testing.assert_close(fast(params, x), model(x))
    assert fast.cache_info().misses == 2


# --- the key order of dict arguments --------------------------------------------------------------------


def _in_order(params, x):
    """Depends on the order of `params`: each entry scales what came before."""
    for weight in params.values():
        x = x * 2 + weight
    return x


def _reordered(params):
    return dict(reversed(list(params.items())))


@pytest.mark.parametrize("buckets", [None, (4,)])
def test_a_dict_argument_in_another_key_order_gets_a_plan_of_its_own(check_path, buckets):
    options = {} if buckets is None else dict(buckets=buckets, in_axes=(None, 0))
    fast = df.jit(_in_order, progress=False, **options)
    params = {"a": torch.randn(3), "b": torch.randn(3), "c": torch.randn(3)}
    x = torch.randn(2, 3)
    for call in (params, _reordered(params), params, _reordered(params)):
        torch.testing.assert_close(fast(call, x), _in_order(call, x))
    assert fast.cache_info().misses == 2


def test_the_order_of_a_dict_below_another_kind_of_pytree_node_is_checked_too():
    Weights = collections.namedtuple("Weights", "named")
    fast = df.jit(lambda weights, x: _in_order(weights.named, x), progress=False)
    named = {"a": torch.randn(3), "b": torch.randn(3)}
    x = torch.randn(3)
    for call in (named, _reordered(named), named):
        torch.testing.assert_close(fast(Weights(call), x), _in_order(call, x))
    assert fast.cache_info().misses == 2


def test_dict_nodes_record_each_dicts_type_and_key_order():
    tree = (({"b": 1, "a": 2}, collections.OrderedDict(b=1, a=2)), {})
    dicts = DictNodes.of(tree)
    assert dicts.nodes == (((0, 0), dict, ("b", "a")), ((0, 1), collections.OrderedDict, ("b", "a")), ((1,), dict, ()))
    assert dicts.match((({"b": 5, "a": 6}, collections.OrderedDict(b=7, a=8)), {}))
    assert not dicts.match((({"a": 2, "b": 1}, collections.OrderedDict(b=1, a=2)), {}))
    assert not dicts.match(((collections.OrderedDict(b=1, a=2), collections.OrderedDict(b=1, a=2)), {}))


def test_a_call_flattened_by_the_last_structure_still_refuses_another_kind_of_dict(check_path):
    """`flatten_up_to`, the per-call flatten, takes an OrderedDict where a dict was traced."""
    seen = []

    def kind_of(params, x):
        seen.append(type(params))
        return x + params["a"]

    fast = df.jit(kind_of, progress=False)
    x = torch.randn(3)
    params = {"a": torch.randn(3), "b": torch.randn(3)}
    for call in (params, collections.OrderedDict(params), params):
        torch.testing.assert_close(fast(call, x), kind_of(call, x))
    assert fast.cache_info().misses == 2 and seen.count(collections.OrderedDict) == 2   # traced once, called once


def test_a_call_with_a_container_where_a_tensor_was_is_flattened_anew(check_path):
    fast = df.jit(lambda params, x: x + sum(optree.tree_leaves(params)), progress=False)
    x = torch.randn(3)
    flat = {"a": torch.randn(3), "b": torch.randn(3)}
    nested = {"a": (torch.randn(3), torch.randn(3)), "b": torch.randn(3)}
    for call in (flat, nested, flat):
        torch.testing.assert_close(fast(call, x), x + sum(optree.tree_leaves(call)))
    assert fast.cache_info().misses == 2


def test_written_bytes_refuse_exactly_the_other_inputs_that_overlap_a_written_one():
    cache, other = torch.zeros(8, 4), torch.zeros(8)
    written = guard_module.WrittenBytes([cache, cache[:, 0], other], written=[0], others=[1, 2], executable=None)
    names = ["cache", "x", "y"]
    for x in (cache[:, 0], cache.view(-1)[31:], cache[7]):              # a column, the last element, a row
        with pytest.raises(df.InputError, match="cache and x share memory"):
            written.check([cache, x, other], names)
    for x in (torch.zeros(8), torch.zeros(0), cache[:0]):              # other memory, or no bytes at all
        written.check([cache, x, other], names)
    half = torch.zeros(2, 8)
    left = guard_module.WrittenBytes([half[0], half[1]], written=[0], others=[1], executable=None)
    left.check([half[0], half[1]], ["a", "b"])                          # the other half of one storage
    with pytest.raises(df.InputError, match="a and b share memory"):
        left.check([half[0], half.view(-1)[7:9]], ["a", "b"])
