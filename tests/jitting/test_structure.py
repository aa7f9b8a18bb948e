"""A flattener written for one call's structure returns what optree's flatten returns for every call
of that structure, dicts in the same insertion order, and None for every other call."""

import collections

import optree
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dynaflow_fn as df
from dynaflow_fn.jitting.call import DictNodes, flattener

LEAVES = st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=3), st.builds(torch.zeros, st.integers(0, 3)))
KEYS = st.one_of(st.text(max_size=3), st.integers(-3, 3))
TREES = st.recursive(
    st.one_of(LEAVES, st.none()),
    lambda children: st.one_of(st.lists(children, max_size=4), st.lists(children, max_size=4).map(tuple),
                               st.dictionaries(st.text(max_size=3), children, max_size=4),
                               st.dictionaries(KEYS, children, max_size=3)),
    max_leaves=12)


def _same_leaves(a, b):
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


@settings(max_examples=300, deadline=None)
@given(TREES, TREES)
def test_a_flattener_agrees_with_optree_and_refuses_what_a_full_check_refuses(tree, other):
    flatten, source = flattener(tree)
    assert _same_leaves(flatten(tree), optree.tree_leaves(tree)), source
    leaves = flatten(other)
    same_structure = (optree.tree_structure(other) == optree.tree_structure(tree)
                      and DictNodes.of(other) == DictNodes.of(tree))
    if same_structure:
        assert _same_leaves(leaves, optree.tree_leaves(other)), source
    elif leaves is not None:       # a container where a leaf was: what flatten_up_to returns too
        assert _same_leaves(leaves, optree.tree_structure(tree).flatten_up_to(other)), source


def test_a_dict_in_another_insertion_order_or_of_another_type_is_refused():
    params = {"b": torch.zeros(1), "a": torch.ones(1)}
    flatten, _ = flattener(((params, torch.zeros(2)), {}))
    assert _same_leaves(flatten((({"b": params["b"], "a": params["a"]}, params["a"]), {})),
                        [params["a"], params["b"], params["a"]])
    assert flatten((({"a": params["a"], "b": params["b"]}, params["a"]), {})) is None
    assert flatten(((collections.OrderedDict(params), params["a"]), {})) is None
    assert flatten(((params, params["a"]), {"k": 1})) is None
    assert flatten(([params, params["a"]], {})) is None


def test_structures_with_other_containers_get_no_flattener():
    Point = collections.namedtuple("Point", "x y")
    assert flattener(((Point(1, 2),), {})) is None
    assert flattener(((collections.OrderedDict(a=1),), {})) is None
    assert flattener(((collections.defaultdict(int, a=1),), {})) is None


def test_a_jitted_call_of_a_reordered_dict_traces_again():
    fast = df.jit(lambda params, x: x + sum(params.values()) * list(params.values())[0], progress=False)
    x = torch.randn(3)
    params = {"a": torch.randn(3), "b": torch.randn(3)}
    reordered = {"b": params["b"], "a": params["a"]}
    for call in (params, params, reordered, reordered, params):
        torch.testing.assert_close(fast(call, x), x + sum(call.values()) * list(call.values())[0])
    assert fast.cache_info().misses == 2 and fast.cache_info().hits == 3
