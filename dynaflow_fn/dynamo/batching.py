"""Where a Dynamo graph holds the batch, for `df.compile_backend(buckets=...)`.

Once torch.compile has seen the batch size change, Dynamo captures one graph whose batch size is a
symbol (`s0`): an input of its own, and dimension 0 of the tensors the model was called with. With
buckets, the backend pads that dimension instead of planning every size: the batched inputs are the
tensors passed by the caller (never model state, `backend._passed_by_the_caller`) whose dimension 0
is the symbol, the size inputs equal to it are bound to the padded size, and the outputs whose
dimension 0 is the symbol are cut back.

That is exact only when the symbol means "rows" everywhere it appears. A graph in which it appears
otherwise (a flattened `[s0 * 128, 64]` input or output, an output of `s0 + 1` rows, a state tensor
of `s0` rows) cannot be padded by cutting dimension 0: `find_batch` says why, and the backend plans
it per size, as without buckets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import fx

from ..jitting.state import is_state

_NAME = re.compile(r"[A-Za-z_]\w*")


@dataclass(frozen=True)
class Batch:
    """The batch of one graph: `symbol` (its size, as Dynamo names it), the graph inputs padded along
    dimension 0 (`tensors`) and bound to the padded size (`sizes`), by position, and each output's
    batch axis (`out_axes`: 0, or None for an output without the batch)."""

    symbol: str
    tensors: frozenset[int]
    sizes: frozenset[int]
    out_axes: tuple[int | None, ...]


def find_batch(graph_module: fx.GraphModule, example_inputs: Sequence[Any],
               passed: Sequence[bool | None]) -> Batch | str | None:
    """The graph's `Batch`; None if no tensor the caller passed has a symbolic dimension 0 (nothing to
    pad); or why the symbol found there cannot be padded."""
    placeholders = [node for node in graph_module.graph.nodes if node.op == "placeholder"]
    values = [node.meta.get("example_value") for node in placeholders]
    candidates = [i for i, (value, example) in enumerate(zip(values, example_inputs))
                  if i < len(passed) and passed[i] is True and isinstance(value, torch.Tensor) and value.dim()
                  and not is_state(example) and _NAME.fullmatch(str(value.shape[0]))]
    if not candidates:
        return None
    symbol = str(values[candidates[0]].shape[0])
    tensors = frozenset(i for i in candidates if str(values[i].shape[0]) == symbol)
    sizes = frozenset(i for i, value in enumerate(values) if isinstance(value, torch.SymInt) and str(value) == symbol)
    for i, (node, value) in enumerate(zip(placeholders, values)):
        shown = list(value.shape) if isinstance(value, torch.Tensor) else value
        if i not in tensors | sizes and _mentions(value, symbol, skip_first=False):
            return f"input {node.name} ({shown}) has the batch size {symbol} in it but is not padded along dimension 0"
        if i in tensors and _mentions(value, symbol, skip_first=True):
            return f"input {node.name} has the batch size {symbol} in another dimension too ({shown})"
    (output,) = [node for node in graph_module.graph.nodes if node.op == "output"]
    out_axes = []
    for index, result in enumerate(output.args[0]):
        value = result.meta.get("example_value") if isinstance(result, fx.Node) else result
        batched = isinstance(value, torch.Tensor) and value.dim() and str(value.shape[0]) == symbol
        if _mentions(value, symbol, skip_first=bool(batched)):
            shown = list(value.shape) if isinstance(value, torch.Tensor) else value
            return f"output {index} ({shown}) has the batch size {symbol} in it other than as its dimension 0"
        out_axes.append(0 if batched else None)
    return Batch(symbol, tensors, sizes, tuple(out_axes))


def _mentions(value: Any, symbol: str, skip_first: bool) -> bool:
    """Whether a tensor's shape (from dimension 1 with `skip_first`) or a size mentions `symbol`."""
    sizes = list(value.shape)[1 if skip_first else 0:] if isinstance(value, torch.Tensor) else [value]
    return any(symbol in _NAME.findall(str(size)) for size in sizes if isinstance(size, torch.SymInt))
