"""The tensor inputs of a plan, as a call passes them: where each sits among the call's leaves, its
name for messages, and which of them `donate_argnums` and `persistent_argnums` name; and which output
each donated input is overwritten with.

A donated input is updated in place when an output has its shape, strides and dtype; lowering then
writes that output into the input's memory and returns the input as it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import optree
import torch

from ..errors import InputError, warn
from ..ir import tree
from ..ir.program import Program
from ..ir.tree import TensorSpec


@dataclass(frozen=True)
class TensorInputs:
    """The argument tensors of one input signature, in the order the plan takes them.

    `positions` index the call's flat leaves; `names` are their paths as messages print them
    (`params['w']`); `places` are their paths inside their own argument (`['w']`), which pair a
    donated tensor with the output at the same place. `donated` and `persistent` index `positions`."""

    positions: tuple[int, ...]
    names: tuple[str, ...]
    places: tuple[str, ...]
    donated: frozenset[int]
    persistent: frozenset[int]

    @classmethod
    def of(cls, fn: Callable[..., Any], flat: tree.Flat, donate_argnums: Sequence[int],
           persistent_argnums: Sequence[int]) -> "TensorInputs":
        """The tensor inputs of a call of `fn`; raises if an option names no tensor argument."""
        args, paths, leaves = flat.args, flat.paths, flat.leaves
        arg_names = tree.argument_names(fn, len(args))
        positions = tree.classify_leaves(paths, leaves, arg_names).tensor_positions
        tensor_paths = [paths[i] for i in positions]

        def named_by(option_argnums: Sequence[int], option: str) -> frozenset[int]:
            for index in option_argnums:
                _check_names_tensors(index, option, args, arg_names, tensor_paths)
            return frozenset(k for k, path in enumerate(tensor_paths)
                             if path and path[0] == 0 and path[1] in option_argnums)

        return cls(positions=tuple(positions),
                   names=tuple(tree.path_to_str(path, arg_names) for path in tensor_paths),
                   places=tuple(_place(path[1:]) for path in tensor_paths),
                   donated=named_by(donate_argnums, "donate_argnums"),
                   persistent=named_by(persistent_argnums, "persistent_argnums"))


def _check_names_tensors(index: int, option: str, args: tuple, arg_names: Sequence[str],
                         tensor_paths: Sequence[tuple]) -> None:
    """Raise unless positional argument `index` exists and holds a tensor, or is an empty container
    (the state of an optimizer that keeps none, `df.optim.sgd(lr)`'s `{}`: nothing to donate)."""
    if not 0 <= index < len(args):
        raise InputError(f"{option} names argument {index}, but the call passes {len(args)} positional arguments")
    empty = isinstance(args[index], (tuple, list, dict)) and not optree.tree_leaves(args[index])
    if not empty and not any(path[:2] == (0, index) for path in tensor_paths):
        name = arg_names[index] if index < len(arg_names) else f"args[{index}]"
        raise InputError(f"{option} names argument {index} ({name}), which holds no tensor "
                         f"(it is a {type(args[index]).__name__}); {option} applies to tensors only")


def match_donations(program: Program, inputs: TensorInputs) -> dict[int, int]:
    """Pair each donated tensor input with an output of the same shape, strides and dtype
    (`pair_donations`), warning about a donated input nothing is written into. Returns {output index:
    input index}."""
    if not inputs.donated:
        return {}
    placeholders = program.placeholders()
    outputs = list(program.output_node().args[0])
    place_of = {spec.tensor_index: spec.path[len("out"):] for spec in program.outputs if spec.tensor_index is not None}
    claimed = pair_donations(
        [(k, inputs.places[k], TensorSpec.of(placeholders[k].meta["val"])) for k in sorted(inputs.donated)],
        [(place_of.get(j), _spec(node.meta.get("val"))) for j, node in enumerate(outputs)])
    for in_index in sorted(inputs.donated):
        if placeholders[in_index] in outputs:
            warn(f"donated input {inputs.names[in_index]} is returned unchanged, so nothing updates it "
                 f"in place; check that the function returns its new value, or do not donate it")
        elif in_index not in claimed.values():
            warn(f"donated input {inputs.names[in_index]} matches no output of the same shape, strides and "
                 f"dtype, so nothing is written into it")
    return claimed


def pair_donations(donated: Sequence[tuple[int, str, TensorSpec]],
                   outputs: Sequence[tuple[str | None, TensorSpec | None]]) -> dict[int, int]:
    """Pair each donated input (its index, its place inside its argument, its layout) with an output
    (its place in the result, its layout or None) of the same layout: the output at the same place
    (`params, state = step(params, state, ...)` pairs out[0][k] with argument 0's [k]), else the first
    unclaimed one in order. Returns {output index: input index}."""
    at_place = {place: j for j, (place, _) in enumerate(outputs) if place is not None}
    claimed: dict[int, int] = {}

    def fits(out_index: int | None, wanted: TensorSpec) -> bool:
        return out_index is not None and out_index not in claimed and outputs[out_index][1] == wanted

    for in_index, place, wanted in donated:
        same_place = at_place.get(place)
        candidates = [same_place] if fits(same_place, wanted) else [j for j in range(len(outputs)) if fits(j, wanted)]
        if candidates:
            claimed[candidates[0]] = in_index
    return claimed


def written_into_donated(fn: Callable[..., Any], args: tuple, kwargs: dict, result: Any,
                         donate_argnums: Sequence[int]) -> Any:
    """`result` of `fn(*args, **kwargs)` with each output that a plan would write into a donated
    argument written into it and replaced by it: what a call of the plan does, for a jitted function
    inlined into another one's trace (whose caller may rely on the update in place)."""
    flat = tree.Flat.of(args, kwargs)
    inputs = TensorInputs.of(fn, flat, donate_argnums, ())
    paths, leaves, treedef = optree.tree_flatten_with_path(result, none_is_leaf=True)
    targets = {k: flat.leaves[inputs.positions[k]] for k in inputs.donated}
    pairs = pair_donations([(k, inputs.places[k], TensorSpec.of(targets[k])) for k in sorted(inputs.donated)],
                           [(_place(path), _spec(leaf)) for path, leaf in zip(paths, leaves)])
    for out_index, in_index in pairs.items():
        if leaves[out_index] is not targets[in_index]:
            targets[in_index].copy_(leaves[out_index])
            leaves[out_index] = targets[in_index]
    return optree.tree_unflatten(treedef, leaves)


def _place(keys: Sequence[Any]) -> str:
    """A path of pytree keys as output paths print it after `out`: `[0]['w']`."""
    return "".join(f"[{key!r}]" for key in keys)


def _spec(value: Any) -> TensorSpec | None:
    return TensorSpec.of(value) if isinstance(value, torch.Tensor) else None
