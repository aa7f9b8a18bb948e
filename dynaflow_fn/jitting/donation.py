"""`donate_argnums`: which output each donated tensor input is overwritten with.

A donated input is updated in place when an output has its shape, strides and dtype; lowering then
writes that output into the input's memory and returns the input as it."""

from __future__ import annotations

import torch

from ..errors import warn
from ..ir.program import Program
from ..ir.tree import TensorSpec
from .inputs import TensorInputs


def match_donations(program: Program, inputs: TensorInputs) -> dict[int, int]:
    """Pair each donated tensor input with an output of the same shape, strides and dtype: the output at
    the same place (`params, state = step(params, state, ...)` pairs out[0][k] with argument 0's [k]),
    else the first unclaimed one in order. Returns {output index: input index}."""
    if not inputs.donated:
        return {}
    placeholders = program.placeholders()
    outputs = list(program.output_node().args[0])
    output_places = {spec.path[len("out"):]: spec.tensor_index for spec in program.outputs
                     if spec.tensor_index is not None}
    claimed: dict[int, int] = {}

    def fits(out_index: int | None, wanted: torch.Tensor) -> bool:
        value = outputs[out_index].meta.get("val") if out_index is not None else None
        return out_index not in claimed and isinstance(value, torch.Tensor) and (
            TensorSpec.of(value) == TensorSpec.of(wanted))

    for in_index in sorted(inputs.donated):
        node = placeholders[in_index]
        if node in outputs:
            warn(f"donated input {inputs.names[in_index]} is returned unchanged, so nothing updates it "
                 f"in place; check that the function returns its new value, or do not donate it")
        wanted = node.meta["val"]
        same_place = output_places.get(inputs.places[in_index])
        candidates = [same_place] if fits(same_place, wanted) else [j for j in range(len(outputs)) if fits(j, wanted)]
        if candidates:
            claimed[candidates[0]] = in_index
        else:
            warn(f"donated input {inputs.names[in_index]} matches no output of the same shape, strides and "
                 f"dtype, so nothing is written into it")
    return claimed
