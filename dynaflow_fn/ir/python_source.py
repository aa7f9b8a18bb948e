"""`Program.python`: a Program as Python source that runs without dynaflow_fn, as Lightning Thunder
writes its traces.

The source is the printed program made executable: the same header comments, then one function
named after the program, one statement per node, each calling its aten overload by its full path
(`torch.ops.aten.mm.default`), and a return of the flat list of output tensors. Reading it shows
exactly what a call computes; running it checks that reading.

Tensors the program holds rather than receives cannot be spelled as literals: the tensors the
function closes over (closed-over inputs) and the graph's own constants (a literal `torch.tensor`
inside the function). They become keyword-only parameters with the names the program prints, and
`Program.constants()` gives their values, so `fn(*tensor_inputs, **program.constants())` computes
what `program(*args)` does, reading closed-over tensors as they are then, as the Program does.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..errors import TransformError
from .formatting import format_arg, format_call, op_name
from .ops import op_info
from .tree import identifier

if TYPE_CHECKING:
    from .program import Program

_SPELLED_BY_REPR = (bool, int, float, str, type(None), torch.dtype, torch.layout, torch.memory_format)
"""Argument values whose `repr` is Python that evaluates back to them (given `import torch`)."""


def python_source(program: Program, header: Sequence[str]) -> str:
    """The source of `program` as one function, under the comment lines `header`."""
    closed_over = program.closed_over_placeholders()
    inputs = [p.name for p in program.placeholders() if p not in closed_over]
    constants = list(program.constants())
    parameters = inputs + (["*", *constants] if constants else [])
    signature = ", ".join(parameters)
    if len(signature) > 80:
        signature = "\n" + "".join(f"    {p},\n" for p in parameters)
    lines = [*header, "import torch", "", "", f"def {identifier(program.name)}({signature}):"]
    for node in program.graph.nodes:
        if node.op == "call_function":
            lines.append(f"    {node.name} = {format_call(node, _qualified_op, _python_literal)}")
        elif node.op == "output":
            lines.append(f"    return {format_arg(list(node.args[0]), _python_literal)}")
    return "\n".join(lines) + "\n"


def _qualified_op(target: Any) -> str:
    """`torch.ops.aten.add.Tensor`: the overload itself, so the source runs the very kernel the node names."""
    info = op_info(target)
    if info is None:
        raise TransformError(f"Program.python writes aten ops only, and this program calls {op_name(target)}, a "
                             f"Python callable (a pass compiled it). Write the source of the program before "
                             f"that pass runs.")
    return info.path


def _python_literal(value: Any) -> str:
    """`value` as a Python expression: `repr` where that is code, the spellings below where it is not."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({repr(value)!r})"     # float('-inf'): repr alone writes the name -inf
    if isinstance(value, torch.device):
        return f"torch.device({str(value)!r})"
    if isinstance(value, _SPELLED_BY_REPR):
        return repr(value)
    raise TransformError(f"Program.python cannot spell the argument {value!r} (a {type(value).__name__}) as Python "
                         f"source; the program's printed form shows where it is used.")
