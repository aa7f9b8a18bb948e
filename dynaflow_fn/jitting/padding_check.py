"""Whether padding a function's batch keeps the results of its real rows.

Padding is exact when every output row depends on its own input row and nothing else of the batch:
then the padded rows change nothing, and cutting them off the outputs gives what the function
computes on the real rows. That is the question micro-batching asks too, and `transforms.batch_rows`
answers it for both: it follows the batch rows through the traced function and reports every op that
mixes them (a batch mean used again with the rows, batch norm in train mode, a product of rows with
rows). What padding adds, read off the same analysis:

* an output reduced over the batch (a sum over the rows) takes in the padded rows, whatever `out_axes`
  says of it;
* an output returned whole (`out_axes` None) that reads the batch rows holds the padded ones too;
* an output that reads no batch row is not padded, so `out_axes` must not cut it; one whose size
  along its out axis does not follow the batch size (traced at two sizes) is refused, since at a
  bucket of that size it would be cut without a word;
* a number the function returns (not a tensor: `x.shape[0]`, `x.shape`) is baked into the trace of the padded
  batch, so a value computed from the batch size would be the bucket's; such a function is refused
  (`refuse_unpaddable_outputs`), since the outputs cannot be cut back to the real one;
* the batch size read as a number (`x * x.shape[0]`), a path taken by it, or rows the function makes
  from it and mixes (`torch.ones(b).sum()`) are the bucket's once padded: `transforms.batch_size_reads` compares
  the trace with a second one at another batch size;
* an input the function updates in place from the rows (a KV cache written at the rows' slots) is
  written by the padded rows too, at the place their pad values name: zeros unless `pad_value` says
  otherwise, so by default they write slot 0.

A batched input that the function updates in place cannot be padded at all: the update would land in
the padded copy, not the caller's tensor. That one is an error; the others warn, as micro-batching
warns, since the analysis cannot always tell (an op it does not model stops it quietly).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import optree
import torch

from ..compat import op_schema
from ..errors import PaddedUpdateError, TraceError, UnpaddableError
from ..ir import ops
from ..ir.program import Program
from ..transforms.batch_rows import follow_rows
from ..transforms.batch_size_reads import returned_numbers, same_number, size_reads
from ..transforms.row_states import Finding, Reduced, Rows, describe
from .buckets import BatchLayout, OutputAxes

_COPY_ = torch.ops.aten.copy_.default


def padding_warnings(program: Program, layout: BatchLayout, leaves: Sequence[Any], out_axes: OutputAxes,
                     pad_value_given: bool, traced_at: Callable[[int], Program], microbatched: bool = False
                     ) -> list[str]:
    """Why padding `program` (traced on `leaves`, a call padded to a bucket) may change its real rows'
    results, as warning texts; raises InputError for a batched input it updates in place and for
    outputs padding would return wrong (`refuse_unpaddable_outputs`). `traced_at(rows)` traces the
    function at another batch size, for what two traces show (`transforms.batch_size_reads`).
    `microbatched`: the function splits its batch with T.microbatch (`program` holds its body on the
    whole batch), so padding moves where it splits, and rows that read the rows before them
    (`cumsum`, `x - x[0]`) read other ones."""
    rows = layout.rows(leaves)
    batch_axes = {program.inputs[b.position].node_name: b.axis % leaves[b.position].dim() for b in layout.batched}
    updates = {node.args[0].name: node.args[1] for node in program.ops()
               if node.target is _COPY_ and node.args[0].op == "placeholder"}
    padded_updates = [spec.path for spec in program.inputs
                      if spec.node_name in updates and spec.node_name in batch_axes]
    if padded_updates:
        raise PaddedUpdateError(f"{program.name} updates {', '.join(padded_updates)} in place, and in_axes pads it: "
                                f"the update would land in the padded copy, not in your tensor. Give it None in in_axes "
                                f"(a KV cache indexed by the rows' slots is not batched), or update it outside the "
                                f"function", padded_updates)
    if rows < 2:                                   # with one row, any axis of size 1 could hold it
        return []
    flow = follow_rows(program.graph, batch_axes, rows)
    texts = _finding_texts(flow.findings, microbatched)
    returned = program.output_node().args[0]
    specs = list(program.outputs)
    axes = out_axes.axes(program.out_tree, optree.tree_unflatten(program.out_tree, specs))
    states = [flow.states.get(returned[spec.tensor_index]) if spec.tensor_index is not None else None for spec in specs]
    texts += _output_texts(specs, axes, states)
    again = _traced_again(traced_at, rows)
    if isinstance(again, str):
        texts.append(again)
    else:
        again_rows, again_program = again
        refuse_unpaddable_outputs(program, again_program, rows, again_rows, specs, axes, states)
        texts += [f"{finding}. Padded to a bucket, the function reads the bucket's size there, not the real batch's, "
                  f"so the real rows' results change: compute such values outside the function from the real batch "
                  f"and pass them in as tensors" for finding in size_reads(program, again_program, rows, again_rows).texts()]
    random = next((node for node in program.ops() if _draws_random_numbers(node)), None)
    if random is not None:
        texts.append(f"{describe(random)} draws random numbers for the padded rows too, so torch's generator "
                     f"advances as for the bucket's rows, not the real batch's: later random numbers differ from "
                     f"an unpadded call's (the real rows' draws of this call may too). Pass random values in as "
                     f"tensors drawn for the real batch, or call without buckets where eager's random stream matters")
    if not pad_value_given:
        written = [spec.path for spec in program.inputs
                   if spec.node_name in updates and flow.states.get(updates[spec.node_name]) is not None]
        texts += [f"{program.name} updates {path} in place from the batch rows, so padded rows write it too, with "
                  f"their pad values (zeros, by default: slot or index 0). Give pad_value= values that make them "
                  f"write where no real row reads (a dummy cache slot, as serving engines do)" for path in written]
    return texts


def _finding_texts(findings: Sequence[Finding], microbatched: bool) -> list[str]:
    """The row analysis's findings that padding changes: all but the causal ones (padding appends rows
    after the real ones), and those too where T.microbatch splits the padded batch elsewhere."""
    texts = [f"{finding}. Padded rows join the batch, so the real rows' results would depend on them. Pad only "
             f"functions whose rows are independent (BatchNorm in eval mode), or call this one at bucket sizes"
             for finding in findings if not finding.causal]
    if microbatched:
        texts += [f"{finding}, and T.microbatch splits the padded batch elsewhere than the real one, so the real rows' "
                  f"micro-batches change: pad only functions whose rows are independent, or call this one at "
                  f"bucket sizes" for finding in findings if finding.causal]
    return texts


def _output_texts(specs: Sequence[Any], axes: Sequence[Any], states: Sequence[Any]) -> list[str]:
    """Outputs that cutting the padded rows off does not give right: one reduced over the rows (not
    `x[0]`, the real row 0 padded or not), one that holds no rows but is cut, one that holds rows but
    is returned whole."""
    texts = []
    for spec, axis, state in zip(specs, axes, states):
        if isinstance(state, Reduced) and not state.picked:
            texts.append(f"{spec.path} is reduced over the batch rows (by {state.by}), so the padded rows enter it "
                         f"and cutting the outputs cannot take them out: compute it outside the padded function")
        elif spec.tensor_index is not None and state is None and axis is not None:
            texts.append(f"{spec.path} reads no batch row, but out_axes gives it axis {axis}, so it would be cut "
                         f"to the batch size: give it None in out_axes")
        elif isinstance(state, Rows) and axis is None:
            texts.append(f"{spec.path} has the batch rows along axis {state.axis}, but out_axes None returns it as "
                         f"computed on the padded batch, padded rows included: give it out_axes={state.axis}")
    return texts


def _draws_random_numbers(node: Any) -> bool:
    """Whether an op draws from torch's generator: attention kernels are tagged random for their
    dropout, which draws nothing at dropout_p 0, and native_dropout draws nothing in eval mode."""
    if not ops.is_random(node.target):
        return False
    defaults = {argument.name: argument.default_value for argument in op_schema(node.target).arguments
                if argument.has_default_value()}
    bound = {**defaults, **ops.bind_arguments(node.target, node.args, node.kwargs)}
    return bound.get("dropout_p", 1) != 0 and bound.get("train", True) is not False


def _traced_again(traced_at: Callable[[int], Program], rows: int) -> tuple[int, Program] | str:
    """The function traced at another batch size than `rows`: one row more, or twice as many for a
    function whose rows must come in pairs; why it could not be, as a warning text."""
    sizes = (rows + 1, 2 * rows)
    errors = []
    for size in sizes:
        try:
            return size, traced_at(size)
        except TraceError as error:
            errors.append(error)
    return (f"its reads of the batch size could not be checked: tracing at {sizes[0]} and at {sizes[1]} rows failed "
            f"({errors[0]}). A number computed from the batch size would be the bucket's, and an output whose out "
            f"axis holds no batch rows would be cut")


def refuse_unpaddable_outputs(program: Program, again: Program, rows: int, again_rows: int, specs: Sequence[Any],
                              axes: Sequence[Any], states: Sequence[Any]) -> None:
    """Raise UnpaddableError (an InputError) for an output that no cutting makes right, seen in `again`,
    the function traced at `again_rows` rows:

    * a number computed from the batch size (`x.shape[0]`, `x.shape`): baked in as the bucket's;
    * a tensor that out_axes cuts along an axis whose size does not follow the batch (a KV cache
      returned whole) where the row analysis does not prove it holds the rows: at a bucket of its size
      it would be cut to the real rows, silently."""
    numbers = returned_numbers(program)
    returned = program.output_node().args[0]
    unproven = {spec.path: (axis, returned[spec.tensor_index].meta["val"].shape)
                for spec, axis, state in zip(specs, axes, states)
                if spec.tensor_index is not None and isinstance(axis, int) and not isinstance(axis, bool)
                and not (isinstance(state, Rows) and state.axis == axis % len(returned[spec.tensor_index].meta["val"].shape))}
    again_returned = again.output_node().args[0]
    for spec in again.outputs:
        seen = numbers.get(spec.path)
        if spec.path in numbers and not same_number(seen, spec.static_value):
            reason = (f"{program.name} returns {spec.path} = {numbers[spec.path]!r} at a batch of {rows} rows and "
                      f"{spec.static_value!r} at {again_rows}: a number computed from the batch size, baked into each "
                      f"bucket's plan at the padded size, so a padded call would return the bucket's value, not the "
                      f"real batch's")
            raise UnpaddableError(f"{reason}. Compute it outside the function from the real batch, or call it without "
                                  f"buckets", reason)
        if spec.path in unproven and spec.tensor_index is not None:
            axis, shape = unproven[spec.path]
            sizes = _size(shape, axis), _size(again_returned[spec.tensor_index].meta["val"].shape, axis)
            if sizes != (rows, again_rows):
                reason = (f"out_axes gives axis {axis} for {spec.path}, but its size along it ({sizes[0]} at a batch "
                          f"of {rows}, {sizes[1]} at {again_rows}) does not follow the batch size, so it holds no "
                          f"batch rows and cutting it to the real rows would drop real values")
                raise UnpaddableError(f"{reason}: give it None in out_axes (returned as it is), or the axis that holds "
                                      f"its batch rows", reason)


def _size(shape: Sequence[int], axis: int) -> int | None:
    return shape[axis] if -len(shape) <= axis < len(shape) else None
