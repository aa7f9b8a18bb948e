"""Refusing a function that changes the shape or strides of a caller's tensor in place.

`x.t_()`, `x.unsqueeze_(0)`, `x.resize_(n)` or `x.set_(y)` on an argument (or a tensor the function
closes over) change that tensor object's layout, not its values. A Plan writes values back into the
caller's tensors (`Mutation`), but no layout: the trace would carry on with the new layout while
the caller's tensor kept the old one, and lowering had no input to write the change to. The trace
is refused naming the tensor and the op, with the out-of-place form to use instead. The same ops on
a tensor the function made itself, or one that leaves the layout as it was, are fine.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import fx

from ..errors import TraceError
from ..ir.formatting import op_name


def refuse_layout_writes(graph: fx.Graph, fn_name: str, argument_names: Sequence[str]) -> None:
    """Raise a TraceError if an op tagged `inplace_view` (t_, unsqueeze_, resize_, set_, ...) takes an
    argument placeholder (named by `argument_names`, in order) or a closed-over tensor as its self."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    names = dict(zip(placeholders, argument_names))
    for node in graph.nodes:
        tags = getattr(node.target, "tags", ())
        if node.op != "call_function" or torch.Tag.inplace_view not in tags or not node.args:
            continue
        target = node.args[0]
        if not isinstance(target, fx.Node) or target.op not in ("placeholder", "get_attr") or _unchanged(node, target):
            continue
        what = f"its argument {names[target]}" if target in names else "a tensor it closes over"
        raise TraceError(
            f"{fn_name} changes the shape or strides of {what} in place ({op_name(node.target)}). A jitted "
            f"function writes new values into the caller's tensors but cannot change their layout: use the "
            f"out-of-place op and its result instead (x = x.t(), x = x.unsqueeze(0), x = x.reshape(...)), "
            f"and return it if the caller needs it.")


def _unchanged(node: fx.Node, target: fx.Node) -> bool:
    """Whether the op left the layout as it was (`squeeze_()` of a tensor with no size-1 dimension)."""
    before, after = target.meta.get("val"), node.meta.get("val")
    return (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and before.shape == after.shape
            and before.stride() == after.stride() and before.storage_offset() == after.storage_offset())
