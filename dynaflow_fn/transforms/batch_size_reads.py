"""What a function does with its batch size, read off its traces at two batch sizes.

A function run on other rows than the caller's batch, padded to a bucket (`df.jit(buckets=...)`) or
split into micro-batches (`T.microbatch`), is traced at that other size, so wherever it reads the batch
size, it reads the bucket's or the micro-batch's. Where the size shapes tensors (`view(b, -1)`,
`zeros(b, d)`, the end of `arange(b)`) or counts all the rows (`x[:b]`, `x[b:]`), that is right: those
are the rows the function runs on, merged or cut back later. Anywhere else the rows get another
value than the caller's batch would give them. The row analysis (`transforms.batch_rows`) follows the
rows the caller passed and cannot see these reads, since in one trace the batch size is only a
number. Two traces at different sizes show them, op by op:

* ops that differ: the function takes another path at another batch size (`if x.shape[0] > 4:`);
* a number argument that differs, where the op reads it as a value (`x * b`, a fill value,
  `offsets + b`) or as the position of one row (`x[b - 1]`), or a tensor constant that differs
  (`torch.tensor(b)`);
* a dimension whose size differs holds the batch: `transforms.made_rows` finds, from those, the rows
  the graph makes itself (`torch.ones(b)`, `arange(b)`) and mixes before they meet the passed rows.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import optree
import torch
from torch import fx

from ..compat import OpOverload, op_schema, outside_current_trace
from ..ir.program import Program
from ..ir.tree import tensors_in
from .made_rows import made_rows_mixed
from .row_states import describe

_SIZE_TYPE = re.compile(r"(?<![A-Za-z])int(?![A-Za-z])")
"""A schema type that takes sizes and positions (`int`, `List[int]`, `Optional[int]`; SymInt prints
as int), not values (`number`, `Tensor`)."""

_ARANGE = torch.ops.aten.arange

_COUNTS = {"arange": {"end"}}
"""Arguments typed as values that count rows: `arange(b)` numbers the padded batch's rows."""

_SPREAD_OVER = {"linspace": {"steps"}, "logspace": {"steps"}}
"""Arguments typed as sizes that also set the values: `linspace(0, 1, b)` spaces its values by the count."""

_ROW_POSITIONS = {"select": {"index"}, "select_scatter": {"index"}, "narrow": {"start"}, "slice": {"start", "end"},
                  "slice_scatter": {"start", "end"}}
"""Arguments typed as sizes that name the position of rows: the batch size itself there bounds all
the rows (`x[:b]`, `x[b:]`), anything computed from it (`x[b - 1]`) picks rows by the traced count."""


@dataclass(frozen=True)
class SizeReads:
    """What two traces show of a function's reads of its batch size, each in the words of a finding:
    `changes` give the rows another value whatever is done with them later (another path, rows made
    from the size and mixed); `numbers` read the size as a value, each with the op that reads it, whose
    results may still come out right (a sum over the rows divided by their count is their mean)."""

    changes: tuple[str, ...] = ()
    numbers: tuple[tuple[fx.Node, str], ...] = ()
    row_numbers: frozenset[fx.Node] = frozenset()
    """The rows' numbers the function makes (`torch.arange(b)`, and what is computed from them alone):
    padded, the real rows keep theirs; split, each micro-batch numbers its rows from 0."""
    batched: frozenset[fx.Node] = frozenset()
    """The values with a dimension that follows the batch size."""

    def texts(self) -> list[str]:
        return [*self.changes, *(text for _, text in self.numbers)]


def returned_numbers(program: Program) -> dict[str, Any]:
    """The values a function returns that are no tensors and may come from its batch size (ints,
    floats, bools, a `torch.Size`), by output path: what two traces at two sizes compare."""
    return {o.path: o.static_value for o in program.outputs
            if o.tensor_index is None and not isinstance(o.static_value, (str, type(None)))}


def same_number(value: Any, again: Any) -> bool:
    """Whether two traces' values of one number are the same, a NaN counting as the same as a NaN
    (it differs from itself): values that differ were computed from the batch size."""
    return value == again or (value != value and again != again)


def size_reads(at: Program, again: Program, rows: int, again_rows: int, same_layouts: bool = True) -> SizeReads:
    """The function's reads of its batch size that give its rows another value at another batch size,
    from its traces at `rows` rows (`at`) and at `again_rows` (`again`). Traces that differ in their ops
    are another path, where the two were traced on inputs of the same layouts; otherwise (a slice of a
    later axis, not contiguous, beside a whole tensor) a view may have become a copy, and nothing is
    said."""
    nodes, others = list(at.graph.nodes), list(again.graph.nodes)
    if len(nodes) != len(others) or any(_differ(node, other) for node, other in zip(nodes, others)):
        if not same_layouts:
            return SizeReads()
        first = next((node for node, other in zip(nodes, others) if _differ(node, other)), nodes[-1])
        return SizeReads(changes=(f"its trace at a batch of {rows} rows differs from its trace at {again_rows} (from "
                                  f"{describe(first)} on): it takes another path at another batch size",))
    counterpart = dict(zip(nodes, others))
    with outside_current_trace():                      # the constants are real tensors, compared as such
        constants, constants_again = at.constants(), again.constants()
        numbers = [(user, f"{describe(user)} reads the batch size in a tensor constant "
                          f"({constants[node.name].tolist()} at a batch of {rows} rows, "
                          f"{constants_again[other.name].tolist()} at {again_rows})")
                   for node, other in counterpart.items() if node.op == "get_attr"
                   and not _same_values(constants[node.name], constants_again[other.name])
                   for user in list(node.users)[:1]]
    numbers += [(node, f"{describe(node)} reads the batch size as a number ({value} at a batch of {rows} rows, "
                       f"{value_again} at {again_rows})")
                for node in nodes for value, value_again in _value_reads(node, counterpart[node], rows, again_rows)]

    def batch_axes(node: fx.Node) -> list[list[int]]:
        return [[axis for axis, (size, size_again) in enumerate(zip(tensor.shape, tensor_again.shape))
                 if size != size_again]
                for tensor, tensor_again in zip(tensors_in(node.meta.get("val")),
                                                tensors_in(counterpart[node].meta.get("val")))]

    made = made_rows_mixed(at.graph, batch_axes, describe)
    return SizeReads(changes=(made,) if made is not None else (), numbers=tuple(numbers),
                     row_numbers=_row_numbers(nodes, batch_axes),
                     batched=frozenset(node for node in nodes if any(batch_axes(node))))


def _row_numbers(nodes: list[fx.Node], batch_axes: Callable[[fx.Node], list[list[int]]]) -> frozenset[fx.Node]:
    numbered: set[fx.Node] = set()
    for node in nodes:
        if node.op != "call_function" or not any(batch_axes(node)):
            continue
        sources = [argument for argument in node.all_input_nodes if any(batch_axes(argument))]
        if getattr(node.target, "overloadpacket", None) is _ARANGE or (sources and set(sources) <= numbered):
            numbered.add(node)
    return frozenset(numbered)


def _differ(node: fx.Node, other: fx.Node) -> bool:
    if (node.op, node.target) != (other.op, other.target):
        return True
    return _used_ranks(node) != _used_ranks(other)


def _used_ranks(node: fx.Node) -> list[tuple[int, int]]:
    """The ranks of the tensors a node gives that are read: of the results its users pick, for an op
    that gives several (`x.unbind(0)[0]`, where how many it gives follows the batch size), else all."""
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)) and node.users and all(user.target is operator.getitem for user in node.users):
        return sorted((index, value[index].dim()) for index in {user.args[1] for user in node.users}
                      if isinstance(value[index], torch.Tensor))
    return list(enumerate(tensor.dim() for tensor in tensors_in(value)))


def _value_reads(node: fx.Node, other: fx.Node, rows: int, again_rows: int) -> Iterator[tuple[Any, Any]]:
    """The numbers `node` takes that differ in `other` (the same op at another batch size) where it
    reads them as values or as the positions of single rows (module docstring)."""
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        return
    schema = op_schema(node.target).arguments
    name = node.target.overloadpacket.__name__
    named = {argument.name: argument for argument in schema}
    pairs = [(schema[i], value, other.args[i]) for i, value in enumerate(node.args) if i < len(schema)]
    pairs += [(named[key], value, other.kwargs.get(key)) for key, value in node.kwargs.items() if key in named]
    for argument, value, value_again in pairs:
        if argument.name in _COUNTS.get(name, ()):
            continue
        sized = bool(_SIZE_TYPE.search(str(argument.type)))
        positions = argument.name in _ROW_POSITIONS.get(name, ())
        for number, number_again in zip(optree.tree_leaves(value), optree.tree_leaves(value_again)):
            if not _is_number(number) or same_number(number, number_again):
                continue
            if (not sized or argument.name in _SPREAD_OVER.get(name, ())
                    or (positions and (number, number_again) != (rows, again_rows))):
                yield number, number_again


def _same_values(constant: torch.Tensor, again: torch.Tensor) -> bool:
    """Whether two constants hold the same values (NaN where the other has NaN counts as the same)."""
    if constant.shape != again.shape or constant.dtype != again.dtype:
        return False
    return bool(((constant == again) | (constant.isnan() & again.isnan()) if constant.is_floating_point()
                 else constant == again).all())


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(value, bool)
