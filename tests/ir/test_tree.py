"""ir/tree.py: leaves get the paths a user would write (`params['fc.weight']`, `out['a'][0]`), those
paths name the offending leaf in errors, and static values are exactly the hashable, value-compared ones."""

import dataclasses
import enum
import keyword

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dynaflow_fn as df
from dynaflow_fn.ir import tree
from models import MLP


def test_program_inputs_and_outputs_carry_user_paths():
    program = df.trace(lambda x, cfg, *rest, scale=1: {"a": (x * scale, rest[0]), "n": cfg},
                       torch.randn(2), 3, torch.randn(1), scale=torch.randn(2))
    assert [spec.path for spec in program.inputs] == ["x", "cfg", "arg2", "scale"]
    assert [spec.is_tensor for spec in program.inputs] == [True, False, True, True]
    assert program.inputs[1].static_value == 3
    assert [spec.path for spec in program.outputs] == ["out['a'][0]", "out['a'][1]", "out['n']"]
    assert program.outputs[2].tensor_index is None and program.outputs[2].static_value == 3


def test_parameter_paths_and_placeholder_names_come_from_the_module_names():
    fn, params = df.pure(MLP())
    program = df.trace(fn, params, torch.randn(2, 32))
    paths = {spec.path: spec.node_name for spec in program.inputs}
    for name in params:
        assert paths[f"params[{name!r}]"] == tree.identifier(f"params[{name!r}]")
    assert paths["params['layers.0.weight']"] == "layers_0_weight"
    assert {p.name for p in program.placeholders()} == set(paths.values())


@pytest.mark.parametrize("leaf, hint", [
    (np.ones(2), "torch.as_tensor"),
    (object(), "frozen dataclass"),
    (torch.randn(2, 2).to_sparse(), "to_dense"),
])
def test_errors_name_the_path_of_the_offending_leaf(leaf, hint):
    with pytest.raises(df.InputError, match=r"argument batch\['inner'\]\[1\] is a") as caught:
        df.trace(lambda batch: batch["x"] * 2, {"x": torch.randn(2), "inner": [torch.randn(1), leaf]})
    assert hint in str(caught.value)


@dataclasses.dataclass(frozen=True)
class Config:
    width: int
    name: str = "a"


@dataclasses.dataclass(frozen=True)
class HoldsTensor:
    inner: Config
    weights: torch.Tensor


class Colour(enum.Enum):
    RED = 1


def test_static_leaves_are_hashable_values_compared_by_value():
    for leaf in (1, 2.5, True, "s", None, torch.float16, torch.device("cpu"), Colour.RED, Config(3)):
        assert tree.is_static_leaf(leaf), leaf
    for leaf in (object(), [1], {"a": 1}, dataclasses.make_dataclass("Loose", ["x"])(1)):
        assert not tree.is_static_leaf(leaf), leaf


def test_a_dataclass_holding_a_tensor_is_refused_with_the_field_path():
    with pytest.raises(df.InputError, match=r"cfg\.weights"):
        df.trace(lambda x, cfg: x * 2, torch.randn(2), HoldsTensor(Config(1), torch.randn(1)))


def test_path_rendering():
    names = ["params", "x"]
    assert tree.path_to_str((0, 0, "fc.weight"), names) == "params['fc.weight']"
    assert tree.path_to_str((0, 1), names) == "x"
    assert tree.path_to_str((0, 5, 2), names) == "args[5][2]"
    assert tree.path_to_str((1, "mask", 0), names) == "mask[0]"
    assert tree.path_to_str((), names) == "<root>"
    assert tree.output_path_to_str((0, "logits")) == "out[0]['logits']"
    assert tree.argument_names(lambda a, b, *rest, c=1: None, 4) == ["a", "b", "arg2", "arg3"]


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=20))
def test_identifiers_are_always_valid_python_names(text):
    name = tree.identifier(text)
    assert name.isidentifier() and not keyword.iskeyword(name)


def test_flatten_keeps_none_as_structure_and_paths_match_leaves():
    paths, leaves, spec = tree.flatten(((1, None, {"b": 2, "a": [3]}), {"k": 4}))
    assert leaves == [1, 3, 2, 4]
    assert len(paths) == len(leaves)
    assert tree.path_to_str(paths[1], ["p", "q", "r"]) == "r['a'][0]"
    assert spec.num_leaves == 4
