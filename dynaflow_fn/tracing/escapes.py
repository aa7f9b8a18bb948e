"""Refusing a function that keeps a tensor of its trace somewhere outside itself while it is traced.

A Plan replays the aten ops a trace recorded; Python code around them runs once, at trace time. A
function (or a forward hook of one of its modules) that stores an intermediate tensor in Python
state, as activation capture does (`acts.append(out)`), stores a fake tensor there on the first
call, and nothing on any later call: the caller's list holds a placeholder without data, and no
error says why. So the fake tensors ops return during a trace are followed weakly, and any that is
still alive once the trace is done, other than the ones the trace itself keeps (its inputs, its
outputs, the graph's recorded values), was kept by the function; so is an argument the function
saw, or an output, held by more than the trace. The trace is refused, naming the op that made the
tensor (or the argument) and what holds it.
"""

from __future__ import annotations

import gc
import sys
import types
import weakref
from collections import Counter
from typing import Any, Callable, Sequence

import optree
import torch
from torch import fx

from ..errors import TraceError
from ..ir.formatting import op_name
from .closure import closure_variables


def refuse_escaped_tensors(produced: Sequence[tuple[weakref.ref, Any]], graph: fx.Graph, inputs: Sequence[Any],
                           outputs: list[Any], fn: Callable[..., Any], fn_name: str) -> None:
    """Raise a TraceError if a tensor recorded in `produced` outlived the trace of `fn` in Python state.
    Each is recorded with the op that made it, or with words that say what it is (an argument).

    The trace keeps its fake `inputs`, the list of the function's `outputs` and the graph's recorded
    values. An output that the function (a hook on the whole model, say) also stored somewhere has
    more references than that list's: those are checked like the rest. A tensor kept alive only from
    C++ (the base of an output that is a view of it, a tensor autograd saved) is no one's Python state
    and escapes nothing."""
    ours = {id(leaf) for node in graph.nodes for leaf in optree.tree_leaves(node.meta.get("val"))}
    ours |= {id(tensor) for tensor in inputs}
    listed = Counter(id(leaf) for leaf in outputs)
    for probe in [object()]:                # what getrefcount counts besides the list, on this interpreter
        own = sys.getrefcount(probe) - 1
    for leaf in outputs:
        if isinstance(leaf, torch.Tensor) and sys.getrefcount(leaf) <= listed[id(leaf)] + own:
            ours.add(id(leaf))
    # One tensor may be recorded by several ops: an op's decomposition returns its last result as the
    # op's own (addmm's meta kernel, run cold, records add before addmm). Name the outermost, the last.
    candidates = list({id(ref()): (ref, op) for ref, op in produced if ref() is not None and id(ref()) not in ours}
                      .values())
    if not candidates:
        return
    gc.collect()                            # a reference cycle (a traceback, a frame) may hold one for a while
    suspects, ops = [], []
    for ref, op in candidates:
        tensor = ref()
        if tensor is not None:
            suspects.append(tensor)
            ops.append(op)
    held = [(holder, index) for holder in gc.get_referrers(*suspects)
            if holder is not suspects and holder is not outputs and not isinstance(holder, types.FrameType)
            for index, tensor in enumerate(suspects) if _holds(holder, tensor)]
    if not held:
        return
    first, index = held[0]
    tensor, where = suspects[index], _describe(first, suspects[index], fn)
    for holder, kept_index in held:
        _take_out(holder, suspects[kept_index])
    raise TraceError(
        f"{fn_name} keeps a tensor outside itself while it is traced: {_what(ops[index])} "
        f"({_type_text(tensor)}) is held by {where}. A jitted function "
        f"replays only tensor ops, so that holder would keep a placeholder without data, and later calls "
        f"would store nothing there. Return the tensor from the function instead (for activations a hook "
        f"collects, return them from the function, or run the model without df.jit while capturing).")


def _take_out(holder: Any, tensor: torch.Tensor) -> None:
    """Put a list or dict back as it was before the trace added `tensor` (other holders stay as they are)."""
    if type(holder) is list:
        holder[:] = [item for item in holder if item is not tensor]
    elif type(holder) is dict:
        for key in [key for key, value in holder.items() if value is tensor]:
            del holder[key]


def _what(made_by: Any) -> str:
    return made_by if isinstance(made_by, str) else f"the result of {op_name(made_by)}"


def _type_text(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"


def _holds(holder: Any, tensor: torch.Tensor) -> bool:
    if isinstance(holder, dict):
        return any(value is tensor for value in holder.values())
    if isinstance(holder, (list, tuple, set, frozenset)):
        return any(item is tensor for item in holder)
    if isinstance(holder, types.CellType):
        return _filled(holder) and holder.cell_contents is tensor
    return True                             # another object that refers to it (a deque, a user class)


def _describe(holder: Any, tensor: torch.Tensor, fn: Callable[..., Any]) -> str:
    """`holder` in words: by the name `fn` gives it (`closure.closure_variables`: its closure cells and
    the globals it names), an attribute by its owner's type, else by its type."""
    if type(holder) is dict:                # an object's __dict__, where Python keeps one apart
        owner = next((o for o in gc.get_referrers(holder) if getattr(o, "__dict__", None) is holder), None)
        if owner is not None:
            holder = owner
    name = next((name for name, value in closure_variables(fn) if value is holder and name), None)
    attributes = getattr(holder, "__dict__", None)
    attribute = _key_of(attributes, tensor) if isinstance(attributes, dict) else None
    if attribute is not None:
        owner = f"a {type(holder).__name__}" + (f" `{name}`" if name else "")
        return f"attribute {attribute!r} of {owner}"
    kind = {list: "a list", dict: "a dict", set: "a set", tuple: "a tuple",
            types.CellType: "a variable of an enclosing function"}.get(type(holder), f"a {type(holder).__name__}")
    return f"{kind} `{name}`" if name else kind


def _key_of(mapping: dict, value: Any) -> Any | None:
    for key, item in mapping.items():
        if item is value:
            return key
    return None


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True
