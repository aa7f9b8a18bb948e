"""The donate pairs of `df.lower(program, donate=...)`: `df.jit(donate_argnums=...)` lets an output
be written into the storage of an input the caller gives up. This checks the pairs before lowering
relies on them; the outputs sub-pass then writes each donated output into its input.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..errors import InputError
from ..ir.formatting import dtype_name
from ..ir.program import Program
from ..ir.tree import TensorSpec


def checked_donation(program: Program, donate: Mapping[int, int] | None) -> dict[int, int]:
    """`donate` as a dict, after checking that every pair names an output and a tensor input of the same
    shape, strides, dtype and device, and that no input receives two outputs."""
    if donate is None:
        return {}
    if not isinstance(donate, Mapping):
        raise InputError(f"donate maps output indices to input indices, e.g. donate={{0: 0}}; got {donate!r}")
    outputs = list(program.output_node().args[0])
    placeholders = program.placeholders()
    output_paths = {spec.tensor_index: spec.path for spec in program.outputs if spec.tensor_index is not None}
    input_paths = {spec.node_name: spec.path for spec in program.inputs if spec.is_tensor}
    output_name = lambda i: f"output {i} ({output_paths.get(i, outputs[i].name)})"
    input_name = lambda i: f"input {i} ({input_paths.get(placeholders[i].name, placeholders[i].name)})"
    receiver: dict[int, int] = {}
    for out_index, in_index in donate.items():
        pair = f"donate={{{out_index!r}: {in_index!r}}}"
        if type(out_index) is not int or type(in_index) is not int:
            raise InputError(f"{pair}: donate maps a flat output index (an int) to a flat tensor-input index (an int)")
        if not 0 <= out_index < len(outputs):
            raise InputError(f"{pair} names output {out_index}, but {program.name} returns {len(outputs)} tensors")
        if not 0 <= in_index < len(placeholders):
            raise InputError(f"{pair} names input {in_index}, but {program.name} takes {len(placeholders)} tensors")
        if in_index in receiver:
            raise InputError(f"donate writes {output_name(receiver[in_index])} and {output_name(out_index)} both into "
                             f"{input_name(in_index)}; an input can receive one output")
        receiver[in_index] = out_index
        value, wanted = outputs[out_index].meta.get("val"), placeholders[in_index].meta["val"]
        if not isinstance(value, torch.Tensor) or TensorSpec.of(value) != TensorSpec.of(wanted):
            raise InputError(f"{pair}: {output_name(out_index)} is {_layout_text(value)} but {input_name(in_index)} is "
                             f"{_layout_text(wanted)}; an output is donated only to an input of the same shape, "
                             f"strides, dtype and device")
    return dict(donate)


def _layout_text(value: Any) -> str:
    if not isinstance(value, torch.Tensor):
        return f"not a tensor: {type(value).__name__}"
    spec = TensorSpec.of(value)
    return f"{dtype_name(spec.dtype)}{list(spec.shape)} strides {spec.stride} on {spec.device}"
